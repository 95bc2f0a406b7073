"""Issue 34, finding 6: torchft's Lighthouse (no authentication, a kill endpoint) reachable only by the
run. On its host it listens in a network namespace of its own, behind a door only its uid may use;
on each site the relay client and the host's loopback relay admit only the run's uid. Another local
user is a real one here: a forked child that calls setuid(65534) (nobody)."""

from __future__ import annotations

import ctypes
import encodings.idna  # noqa: F401 - loaded before a fork: nobody may not read the interpreter's stdlib
import errno
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dilococtl import run_ca
from trainer.transport import Identity
from trainer.transport.relay import LocalRelay, RelayClient, RelayServer, _proc_addr, open_target, peer_uid

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534
GET = b"GET / HTTP/1.1\r\nHost: lighthouse\r\nConnection: close\r\n\r\n"
KILL = b"POST /replica/s1/kill HTTP/1.1\r\nHost: lighthouse\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="another uid (setuid to nobody) and a network namespace "
                                                           "need root; CI runs as root")


def ident(ids, site) -> Identity:
    i = ids[site]
    return Identity(site=site, cert=str(i.cert), key=str(i.key), ca=str(i.ca))


def request(addr: tuple[str, int] | str, data: bytes = GET) -> bytes:
    """Send `data` to addr (TCP, or a Unix socket path), return all that comes back until it closes;
    b"ERR:<errno name>" when it cannot connect."""
    try:
        if isinstance(addr, str):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(3)
            s.connect(addr)
        else:
            s = socket.create_connection(addr, timeout=3)
    except OSError as e:
        return f"ERR:{errno.errorcode.get(e.errno, e.errno)}".encode()
    with s:
        try:
            s.sendall(data)
            got = b""
            while chunk := s.recv(65536):
                got += chunk
        except OSError:
            pass
        return got


def as_uid(uid: int, fn, *args) -> bytes:
    """fn(*args) -> bytes, run in a forked child that first became `uid` (no way back to root)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the parent
            out = f"EXC:{type(e).__name__}: {e}".encode()
        os.write(w, out)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


@pytest.fixture(scope="module")
def lighthouse():
    """(door path, the Lighthouse's own port): `python -m trainer.service.lighthouse --door`, as launch starts it."""
    proc = subprocess.Popen([sys.executable, "-m", "trainer.service.lighthouse", "--min_replicas", "1", "--bind",
                             "127.0.0.1:0", "--join_timeout_ms", "100", "--door"], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        first, second = proc.stdout.readline(), proc.stdout.readline()
        door = re.fullmatch(r"lighthouse door (/\S+)\n", first)
        assert door and second.startswith("lighthouse listening on "), (first, second)
        yield door.group(1), int(second.rsplit(":", 1)[1])
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def relays(tmp_path_factory, lighthouse):
    """(relay server, relay client of site s1, the host's loopback relay), all in front of the door."""
    ids = run_ca.ensure(tmp_path_factory.mktemp("run"), "access", ["lh", "s1"])
    door, _ = lighthouse
    with RelayServer(ident(ids, "lh"), target=door, bind="127.0.0.1", allowed={"s1"}) as srv, \
            RelayClient(ident(ids, "s1"), server=("127.0.0.1", srv.port), expect="lh") as cli, \
            LocalRelay(target=door) as local:
        yield srv, cli, local


@needs_root
def test_the_relay_client_lets_the_runs_uid_reach_the_lighthouse_and_refuses_another_uid_at_accept(relays, caplog):
    _, cli, _ = relays
    assert request(("127.0.0.1", cli.port)).startswith(b"HTTP/1.1 200 OK")
    before = (cli.refused, cli.accepted)
    assert as_uid(NOBODY, request, ("127.0.0.1", cli.port)) == b""  # closed before one byte went on
    assert as_uid(NOBODY, request, ("127.0.0.1", cli.port), KILL) == b""
    assert (cli.refused, cli.accepted) == (before[0] + 2, before[1])
    assert f"refused a local connection from uid {NOBODY}" in caplog.text


@needs_root
def test_the_lighthouses_port_is_out_of_reach_on_its_host_and_its_door_admits_only_its_uid(lighthouse):
    door, port = lighthouse
    # its port exists only in its own network namespace: nobody, and even root, finds nothing there
    assert as_uid(NOBODY, request, ("127.0.0.1", port)) == b"ERR:ECONNREFUSED"
    assert request(("127.0.0.1", port)) == b"ERR:ECONNREFUSED"
    st = os.stat(os.path.dirname(door))
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert as_uid(NOBODY, request, door) == b"ERR:EACCES"
    with open_target(door) as c:  # the run's uid is handed a connection made inside the namespace
        c.sendall(GET)
        assert c.recv(64).startswith(b"HTTP/1.1 200 OK")


@needs_root
def test_the_door_itself_refuses_another_uid_when_its_directory_is_opened(lighthouse):
    door, _ = lighthouse
    assert stat.S_IMODE(os.stat(door).st_mode) == 0o600
    # as if the modes were loosened: the door's own uid check (SO_PEERCRED) still holds
    os.chmod(os.path.dirname(door), 0o711)
    os.chmod(door, 0o666)
    try:
        got = as_uid(NOBODY, lambda: (open_target(door), b"handed a connection")[1])
    finally:
        os.chmod(door, 0o600)
        os.chmod(os.path.dirname(door), 0o700)
    assert got == f"EXC:OSError: the door {door} handed back no connection".encode()


@needs_root
def test_the_hosts_loopback_relay_admits_only_the_runs_uid(relays):
    _, _, local = relays
    assert request(("127.0.0.1", local.port)).startswith(b"HTTP/1.1 200 OK")
    assert as_uid(NOBODY, request, ("127.0.0.1", local.port), KILL) == b""
    assert local.refused >= 1


def test_proc_net_tcp_addresses_read_as_getpeername_gives_them():
    assert _proc_addr("0100007F:1F90") == ("127.0.0.1", 8080)
    assert _proc_addr("0000000000000000FFFF00000100007F:0050") == ("127.0.0.1", 80)  # IPv4-mapped
    assert _proc_addr("00000000000000000000000001000000:0050") == ("::1", 80)
    with socket.create_server(("127.0.0.1", 0)) as srv, socket.create_connection(srv.getsockname()) as c:
        conn, _ = srv.accept()
        with conn:
            assert peer_uid(conn) == os.getuid()
        assert c.getsockname()[1] > 0


@needs_root
def test_an_unprivileged_lighthouse_gets_its_private_network_from_a_user_namespace():
    """The run's uid need not be root: unshare(CLONE_NEWUSER | CLONE_NEWNET) gives the namespace too."""
    from trainer.service.lighthouse import private_network

    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.close(go_w)
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: as a user who logged in, not one setuid made
            why = private_network()
            srv = socket.create_server(("127.0.0.1", 0)) if not why else None
            os.write(w, (why or f"port {srv.getsockname()[1]}").encode())
            os.read(go_r, 1)  # listening until the parent has tried
        finally:
            os._exit(0)
    os.close(w)
    os.close(go_r)
    try:
        got = os.read(r, 4096).decode()
        if not got.startswith("port "):
            pytest.skip(f"this kernel lends no user namespace to an unprivileged user: {got}")
        assert request(("127.0.0.1", int(got.split()[1]))) == b"ERR:ECONNREFUSED"  # not on the host's loopback
    finally:
        os.write(go_w, b"x")
        os.waitpid(pid, 0)

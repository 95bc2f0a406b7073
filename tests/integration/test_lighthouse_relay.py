"""torchft's Lighthouse behind the relay as launch runs it (`python -m trainer.transport.relay`), on
loopback: a site's certificate reaches the quorum; a connection with no certificate, with a
certificate of another run's CA, or in plaintext is refused before one byte reaches the Lighthouse."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from dilococtl import run_ca
from tests.ports import free_port
from trainer.transport import Identity
from trainer.transport.relay import RelayClient

ROOT = Path(__file__).resolve().parents[2]


def ident(ids, site):
    i = ids[site]
    return Identity(site=site, cert=str(i.cert), key=str(i.key), ca=str(i.ca))


class Tap:
    """A loopback TCP forwarder in front of the Lighthouse that counts the connections and bytes that
    reach it: whatever the relay lets through passes here."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.bytes_in = 0  # towards the Lighthouse
        self.bytes_out = 0  # from the Lighthouse
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            up = socket.create_connection(self.target)
            threading.Thread(target=self._pipe, args=(c, up, "bytes_in"), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, c, "bytes_out"), daemon=True).start()

    def _pipe(self, src, dst, counter):
        try:
            while data := src.recv(65536):
                setattr(self, counter, getattr(self, counter) + len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def relayed(tmp_path_factory):
    """(run identities, other run's identities, relay port, tap, relay process): the Lighthouse on
    loopback, the relay launch starts in front of it showing site s0's identity, admitting s0 and s1."""
    from torchft.coordination import LighthouseServer

    d = tmp_path_factory.mktemp("relay")
    ids = run_ca.ensure(d / "run", "run", ["s0", "s1"])
    other = run_ca.ensure(d / "other", "other", ["s0", "s1"])
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=100)
    tap = Tap(("127.0.0.1", int(lh.address().rsplit(":", 1)[1])))
    port = free_port()
    i = ids["s0"]
    proc = subprocess.Popen([sys.executable, "-m", "trainer.transport.relay", "--bind", f"127.0.0.1:{port}",
                             "--target", f"127.0.0.1:{tap.port}", "--site", "s0", "--cert", str(i.cert),
                             "--key", str(i.key), "--ca", str(i.ca), "--allow", "s0,s1"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "relay listening on" in proc.stdout.readline()
        yield ids, other, port, tap, proc
    finally:
        proc.terminate()
        proc.wait(10)
        tap.close()
        lh.shutdown()


def attempt(port: int, ctx: ssl.SSLContext | None) -> bytes | None:
    """Connect (over TLS with `ctx`, or plaintext), send the start of an HTTP/2 (gRPC) exchange, return
    what came back (None: the connection failed)."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            s = ctx.wrap_socket(raw) if ctx else raw
            s.sendall(preface)
            s.settimeout(3)
            got = b""
            try:
                while chunk := s.recv(4096):
                    got += chunk
            except TimeoutError:
                pass
            return got
    except (OSError, ssl.SSLError):
        return None


def client_ctx(cert=None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # a stranger does not care who answers
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert), str(cert.key))
    return ctx


def test_a_site_certificate_reaches_the_quorum(relayed):
    from torchft.coordination import LighthouseClient

    ids, _, port, tap, _ = relayed
    before = tap.connections
    with RelayClient(ident(ids, "s1"), server=("127.0.0.1", port), expect="s0") as cli:
        client = LighthouseClient(f"http://127.0.0.1:{cli.port}", connect_timeout=timedelta(seconds=5))
        q = client.quorum(replica_id="s1", timeout=timedelta(seconds=10), address="a", store_address="b", step=7,
                          world_size=1, shrink_only=False)
    assert [p.replica_id for p in q.participants] == ["s1"] and q.participants[0].step == 7
    assert tap.connections > before and tap.bytes_out > 0


@pytest.mark.parametrize("who", ["no certificate", "another run's CA", "plaintext gRPC", "a site not admitted"])
def test_a_stranger_is_refused_before_any_lighthouse_byte(relayed, who):
    ids, other, port, tap, proc = relayed
    if who == "a site not admitted":  # a certificate of this run whose name the relay does not admit
        ids = run_ca.ensure(Path(ids["s0"].ca).parent, "run", ["s0", "s1", "s9"])
    ctx = {"no certificate": lambda: client_ctx(),
           "another run's CA": lambda: client_ctx(other["s1"]),
           "plaintext gRPC": lambda: None,
           "a site not admitted": lambda: client_ctx(ids["s9"])}[who]()
    before = tap.connections
    got = attempt(port, ctx)
    time.sleep(0.3)
    assert not got or got[0] == 0x15  # at most a TLS alert record, never an HTTP/2 frame
    assert tap.connections == before  # no connection to the Lighthouse was even opened: not one byte crossed
    assert proc.poll() is None  # the relay lives on


def test_the_site_client_refuses_a_relay_of_another_run(relayed):
    """A stranger posing as the Lighthouse (its own relay, another run's CA) gets no quorum request."""
    from torchft.coordination import LighthouseClient

    ids, other, _, tap, _ = relayed
    o = other["s0"]
    port = free_port()
    fake = subprocess.Popen([sys.executable, "-m", "trainer.transport.relay", "--bind", f"127.0.0.1:{port}",
                             "--target", f"127.0.0.1:{tap.port}", "--site", "s0", "--cert", str(o.cert),
                             "--key", str(o.key), "--ca", str(o.ca)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "relay listening on" in fake.stdout.readline()
        before = tap.connections
        with RelayClient(ident(ids, "s1"), server=("127.0.0.1", port), expect="s0") as cli:
            client = LighthouseClient(f"http://127.0.0.1:{cli.port}", connect_timeout=timedelta(seconds=2))
            with pytest.raises(Exception, match="."):
                client.quorum(replica_id="s1", timeout=timedelta(seconds=3))
            assert cli.refused >= 1 and cli.accepted == 0
        assert tap.connections == before
    finally:
        fake.terminate()
        fake.wait(10)


def test_the_relay_entry_point_refuses_a_bad_key_with_one_line(tmp_path):
    ids = run_ca.ensure(tmp_path / "run", "run", ["s0"])
    i = ids["s0"]
    i.key.chmod(0o644)
    r = subprocess.run([sys.executable, "-m", "trainer.transport.relay", "--bind", "127.0.0.1:0", "--target",
                        "127.0.0.1:1", "--site", "s0", "--cert", str(i.cert), "--key", str(i.key), "--ca", str(i.ca)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "readable by others" in r.stdout and len(r.stdout.strip().splitlines()) == 1

"""The run's CA (dilococtl.run_ca) and who the transport lets in: only the expected site of this run."""

import os
import socket
import ssl
import stat
import threading
import time

import pytest
import torch
from cryptography import x509
from cryptography.x509.oid import NameOID

import trainer.transport.mesh as mesh_mod
from dilococtl import run_ca
from dilococtl.errors import BadInput
from trainer.transport import Identity, Listener, PeerRefused, TransportError, connect
from trainer.transport.mesh import HELLO, MAGIC_HELLO, VERSION
from trainer.transport.wire import pack_header

SESSION = b"s" * 16


def ident(ids, site) -> Identity:
    i = ids[site]
    return Identity(site=site, cert=str(i.cert), key=str(i.key), ca=str(i.ca))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_ca.ensure(tmp_path_factory.mktemp("run"), "run-a", ["s0", "s1", "s2"])


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    # another run's CA issuing the very same site names
    return run_ca.ensure(tmp_path_factory.mktemp("other"), "run-b", ["s0", "s1", "s2"])


# -- the CA ---------------------------------------------------------------------------------------


def test_ensure_makes_private_keys_and_certificates_naming_each_site(tmp_path):
    ids = run_ca.ensure(tmp_path / "ca", "r", ["paris", "tokyo.dc-2"])
    d = tmp_path / "ca"
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(d / "ca.key").st_mode) == 0o600
    ca = x509.load_pem_x509_certificate((d / "ca.crt").read_bytes())
    for site, i in ids.items():
        assert stat.S_IMODE(os.stat(i.key).st_mode) == 0o600
        cert = x509.load_pem_x509_certificate(i.cert.read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == site
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.DNSName) == [site]
        cert.verify_directly_issued_by(ca)
        assert b"PRIVATE KEY" not in i.cert.read_bytes()


def test_ensure_reuses_valid_identities_and_reissues_a_broken_one(tmp_path):
    ids = run_ca.ensure(tmp_path, "r", ["a", "b"])
    before = {s: (i.cert.read_bytes(), i.key.read_bytes()) for s, i in ids.items()}
    ca_before = (tmp_path / "ca.crt").read_bytes()
    ids["b"].key.unlink()
    again = run_ca.ensure(tmp_path, "r", ["a", "b", "c"])
    assert (tmp_path / "ca.crt").read_bytes() == ca_before
    assert (again["a"].cert.read_bytes(), again["a"].key.read_bytes()) == before["a"]
    assert again["b"].cert.read_bytes() != before["b"][0]  # a new key needs a new certificate
    assert again["c"].key.exists()


def test_a_lost_ca_key_reissues_every_site(tmp_path):
    ids = run_ca.ensure(tmp_path, "r", ["a"])
    old = ids["a"].cert.read_bytes()
    (tmp_path / "ca.key").unlink()
    assert run_ca.ensure(tmp_path, "r", ["a"])["a"].cert.read_bytes() != old


@pytest.mark.parametrize("name", ["", "a/b", "a b", "a\nb", "x" * 300, "-lead", ".hidden", "é", "../up"])
def test_site_names_that_cannot_name_a_certificate_are_refused(tmp_path, name):
    with pytest.raises(BadInput, match="cannot name a certificate"):
        run_ca.ensure(tmp_path, "r", ["ok", name])
    assert not (tmp_path / "sites").exists()  # names are checked before anything is written


def test_duplicate_site_names_are_refused(tmp_path):
    with pytest.raises(BadInput, match="unique"):
        run_ca.ensure(tmp_path, "r", ["a", "a"])


def test_a_key_readable_by_others_is_refused(tmp_path):
    ids = run_ca.ensure(tmp_path, "r", ["a"])
    os.chmod(ids["a"].key, 0o644)
    with pytest.raises(TransportError, match="chmod 600"):
        Listener(ident(ids, "a"), host="127.0.0.1")


# -- who gets in ----------------------------------------------------------------------------------


class Recorder:
    """Counts what the listener reads from connections (mesh.recv_bytes)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = mesh_mod.recv_bytes

        def counting(sock, n):
            self.calls += 1
            return real(sock, n)

        monkeypatch.setattr(mesh_mod, "recv_bytes", counting)


def rogue_dial(port, rogue: Identity, *, frm=1, to=0, streams=1, size=2, payload=True, clear=0):
    """Dial as `rogue`, send a hello and a chunk at once; True if the listener answered anything."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the rogue does not care who it talks to
    ctx.load_cert_chain(rogue.cert, rogue.key)
    raw = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s = ctx.wrap_socket(raw)
        s.sendall(HELLO.pack(MAGIC_HELLO, VERSION, SESSION, frm, to, 0, streams, size, clear))
        if payload:
            s.sendall(pack_header(1, torch.float32, 0, 1, 0, 0, 1 << 16, 1 << 17) + b"\x00" * (1 << 18))
        return len(s.recv(HELLO.size)) > 0
    except (OSError, ssl.SSLError):
        return False
    finally:
        raw.close()


def two_site_mesh(run, rogue_fn, timeout_s=10.0):
    """s0 waits for s1 while `rogue_fn(port)` runs first, then the real s1 joins; both comms' fates."""
    lst = [Listener(ident(run, s), host="127.0.0.1") for s in ("s0", "s1")]
    addrs = [("127.0.0.1", x.port) for x in lst]
    out = [None, None]

    def member(r):
        try:
            c = connect(lst[r], rank=r, sites=["s0", "s1"], addrs=addrs, streams=1, session=SESSION,
                        timeout_s=timeout_s)
            t = torch.full((4,), float(r + 1))
            c.allreduce_sum(t)
            c.close()
            out[r] = t.tolist()
        except BaseException as e:  # noqa: BLE001
            out[r] = e

    th0 = threading.Thread(target=member, args=(0,))
    th0.start()
    rogue_result = rogue_fn(lst[0].port)
    th1 = threading.Thread(target=member, args=(1,))
    th1.start()
    th0.join(30)
    th1.join(30)
    refused = lst[0].refused
    for x in lst:
        x.close()
    return rogue_result, out, refused


def test_a_peer_with_a_certificate_from_another_ca_is_refused_in_the_handshake(run, other, monkeypatch):
    rec = Recorder(monkeypatch)
    answered, out, refused = two_site_mesh(run, lambda port: rogue_dial(port, ident(other, "s1")))
    assert answered is False
    assert refused == 1
    assert out == [[3.0] * 4, [3.0] * 4]  # the real s1 then got in: the rogue changed nothing
    # only the real s1's hellos were read (one per connection: 2 directions x 1 stream); the rogue's none
    assert rec.calls == 2 * 2


def test_a_run_certificate_for_another_site_is_refused_before_anything_is_read(run, monkeypatch):
    rec = Recorder(monkeypatch)
    # s2 holds a valid certificate of this run, but rank 1 of this group is s1
    answered, out, refused = two_site_mesh(run, lambda port: rogue_dial(port, ident(run, "s2")))
    assert answered is False and refused == 1
    assert out == [[3.0] * 4, [3.0] * 4]
    assert rec.calls == 2 * 2


def test_a_hello_with_an_unknown_clear_flag_is_refused(run):
    # the right site, session and shape, but a clear flag that means nothing: refused, and the real
    # s1 then gets in
    answered, out, refused = two_site_mesh(run, lambda port: rogue_dial(port, ident(run, "s1"), payload=False, clear=2))
    assert answered is False and refused == 1
    assert out == [[3.0] * 4, [3.0] * 4]


def test_a_site_that_claims_another_rank_is_refused(tmp_path):
    ids = run_ca.ensure(tmp_path, "r", ["s0", "s1", "s2"])
    lst = Listener(ident(ids, "s0"), host="127.0.0.1")
    try:
        errs = []

        def member():
            try:
                connect(lst, rank=0, sites=["s0", "s1", "s2"], addrs=[("127.0.0.1", lst.port)] * 3, streams=1,
                        session=SESSION, timeout_s=2.0)
            except TransportError as e:
                errs.append(e)

        th = threading.Thread(target=member)
        th.start()
        # s2 is in the group, but says it is rank 1 (s1's place)
        assert rogue_dial(lst.port, ident(ids, "s2"), frm=1, size=3, payload=False) is False
        th.join(10)
        assert lst.refused == 1 and errs and "did not arrive in time" in str(errs[0])
    finally:
        lst.close()


def _hello_as_s1(run, hello: bytes):
    """A dialer with the real s1's identity that sends `hello`: whether the listener answered it."""
    def dial(port):
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.load_verify_locations(str(run["s1"].ca))
        ctx.load_cert_chain(str(run["s1"].cert), str(run["s1"].key))
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, ctx.wrap_socket(raw) as s:
            s.sendall(hello)
            try:
                return len(s.recv(HELLO.size)) > 0
            except (OSError, ssl.SSLError):
                return False
    return dial


def test_a_stale_session_is_refused(run):
    # the real s1's identity, but a hello for another quorum
    answered, out, refused = two_site_mesh(run, _hello_as_s1(run, HELLO.pack(MAGIC_HELLO, VERSION, b"o" * 16, 1, 0, 0, 1, 2, 0)))
    assert answered is False and refused == 1
    assert out == [[3.0] * 4, [3.0] * 4]


def test_a_peer_of_another_transport_version_is_refused_at_the_hello_by_name(run, caplog):
    # the real s1, running a trainer of the version before (its chunks on other streams) that cannot share this ring
    older = _hello_as_s1(run, HELLO.pack(MAGIC_HELLO, VERSION - 1, SESSION, 1, 0, 0, 1, 2, 0))
    with caplog.at_level("WARNING", logger="trainer.transport.mesh"):
        answered, out, refused = two_site_mesh(run, older)
    assert answered is False and refused == 1
    assert f"site s1 speaks transport version {VERSION - 1}, this one {VERSION}" in caplog.text
    assert out == [[3.0] * 4, [3.0] * 4]


def test_a_client_without_certificate_or_below_tls13_is_refused(run):
    def plain(port):
        results = []
        for tls12 in (False, True):
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            if tls12:
                ctx.maximum_version = ssl.TLSVersion.TLSv1_2
                ctx.load_cert_chain(str(run["s1"].cert), str(run["s1"].key))
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                try:
                    with ctx.wrap_socket(raw) as s:
                        s.sendall(HELLO.pack(MAGIC_HELLO, VERSION, SESSION, 1, 0, 0, 1, 2, 0))
                        results.append(len(s.recv(HELLO.size)) > 0)
                except (OSError, ssl.SSLError):
                    results.append(False)
        return results

    answered, out, refused = two_site_mesh(run, plain)
    assert answered == [False, False] and refused == 2
    assert out == [[3.0] * 4, [3.0] * 4]


def test_a_dialer_refuses_a_listener_from_another_run(run, other):
    impostor = Listener(ident(other, "s0"), host="127.0.0.1")  # answers at s0's address
    real = Listener(ident(run, "s1"), host="127.0.0.1")
    accepted = []

    def serve():
        try:
            raw, _ = impostor.sock.accept()
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(str(other["s0"].cert), str(other["s0"].key))
            with ctx.wrap_socket(raw, server_side=True) as s:
                accepted.append(s.recv(10))
        except (OSError, ssl.SSLError):
            accepted.append(None)

    th = threading.Thread(target=serve)
    th.start()
    try:
        with pytest.raises((PeerRefused, TransportError)):
            connect(real, rank=1, sites=["s0", "s1"], addrs=[("127.0.0.1", impostor.port), ("127.0.0.1", real.port)],
                    streams=1, session=SESSION, timeout_s=3.0)
        th.join(10)
        assert accepted in ([None], [b""])  # the dialer hung up: it sent the impostor no hello
    finally:
        impostor.close()
        real.close()


# -- the pre-run handshake check (trainer.transport.check) ---------------------------------------


def _check_args(ids, site, expect):
    i = ids[site]
    return ["--ca", str(i.ca), "--cert", str(i.cert), "--key", str(i.key), "--site", site, "--expect", expect]


def _listen_in_thread(ids, site, expect, wait_s=5.0):
    from trainer.transport import check

    ready, out = threading.Event(), {}

    def serve():
        try:
            out["res"] = check.listen(ident(ids, site), port=0, expect=expect, wait_s=wait_s, bind="127.0.0.1",
                                      ready=lambda p: (out.__setitem__("port", p), ready.set()))
        except TransportError as e:
            out["err"] = str(e)
            ready.set()

    th = threading.Thread(target=serve)
    th.start()
    ready.wait(10)
    return th, out


def test_check_handshakes_with_the_expected_site(run, capsys):
    from trainer.transport import check

    th, out = _listen_in_thread(run, "s0", expect="s1")
    code = check.main(["dial", *_check_args(run, "s1", "s0"), "--addr", f"127.0.0.1:{out['port']}"])
    th.join(10)
    line = capsys.readouterr().out.strip()
    assert code == 0 and '"peer": "s0"' in line and '"handshake_s"' in line
    assert out["res"]["peer"] == "s1"


def test_check_names_a_listener_of_another_run_or_site(run, other, capsys):
    from trainer.transport import check

    th, out = _listen_in_thread(other, "s0", expect="s1", wait_s=1.5)  # another run's s0
    code = check.main(["dial", *_check_args(run, "s1", "s0"), "--addr", f"127.0.0.1:{out['port']}"])
    th.join(10)
    line = capsys.readouterr().out.strip()
    assert code == 1 and '"ok": false' in line and "certificate verify failed" in line
    assert "no handshake from site s1" in out["err"] and "refused" in out["err"]

    th, out = _listen_in_thread(run, "s2", expect="s1", wait_s=1.5)  # this run, but site s2 answers
    code = check.main(["dial", *_check_args(run, "s1", "s0"), "--addr", f"127.0.0.1:{out['port']}"])
    th.join(10)
    assert code == 1 and "peer certificate is for site 's2', expected s0" in capsys.readouterr().out
    assert check.main(["dial", *_check_args(run, "s1", "s0"), "--addr", "nohostport"]) == 2
    assert "--addr must be HOST:PORT" in capsys.readouterr().out


def test_a_stranger_stalling_its_handshake_does_not_hold_up_the_members(run):
    stalled = []

    def stall(port):
        for _ in range(3):  # connect, say nothing, keep the connection open
            stalled.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        return None

    t0 = time.monotonic()
    _, out, _ = two_site_mesh(run, stall, timeout_s=5.0)
    took = time.monotonic() - t0
    for s in stalled:
        s.close()
    assert out == [[3.0] * 4, [3.0] * 4]
    assert took < 5.0  # a serial accept would have waited out each stalled handshake (10 s apiece)

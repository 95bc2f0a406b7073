"""`doctor`'s check of the TLS transport: a real mutual TLS 1.3 handshake between site leaders
(trainer.transport.check on the nodes), and one named failure each for a refused port, a
listener that never answers, and a certificate of another CA."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from dilococtl import doctor_tls, run_ca
from dilococtl.doctor import DoctorReport
from dilococtl.doctor_tls import TLS_PURPOSE, check_transport, dial_tls
from dilococtl.errors import EXIT_FAILED, EXIT_OK
from dilococtl.nodes import LocalNode, NodePool
from dilococtl.spec_types import RunSection, RunSpec, SiteSection

pytestmark = pytest.mark.slow


def _spec(tmp_path: Path, names=("a", "b")) -> RunSpec:
    return RunSpec(path=str(tmp_path / "spec.toml"), run=RunSection(name="t"),
                   sites=[SiteSection(name=n, hosts=["local"], work_dir=str(tmp_path / n)) for n in names])


def _files(ident) -> dict[str, str]:
    return {"ca": str(ident.ca), "cert": str(ident.cert), "key": str(ident.key)}


def test_each_site_leader_shakes_hands_with_every_other(tmp_path):
    spec = _spec(tmp_path, ("a", "b", "c"))
    with NodePool(spec.ssh) as pool:
        rows = check_transport(spec, pool, {"local": sys.executable})
    assert sorted((x.src_site, x.dst_site) for x in rows) == [
        ("a", "b"), ("a", "c"), ("b", "a"), ("b", "c"), ("c", "a"), ("c", "b")]
    for x in rows:
        assert x.purpose == TLS_PURPOSE and x.status == "ok", x.detail
        assert 0 < x.port < 65536 and x.detail.startswith(f"TLS 1.3 handshake with {x.dst_site} at 127.0.0.1:{x.port}")
    assert DoctorReport(nodes=[], links=rows).exit_code == EXIT_OK
    # the throwaway CA and the port/stop files are gone
    assert not list(tmp_path.glob("*/.dilococtl/doctor-tls-*"))


def test_a_certificate_of_another_ca_is_named(tmp_path):
    spec = _spec(tmp_path)
    ours = run_ca.ensure(tmp_path / "ca1", "r1", ["a", "b"])
    theirs = run_ca.ensure(tmp_path / "ca2", "r2", ["a", "b"])
    with NodePool(spec.ssh) as pool:
        rows = check_transport(spec, pool, {"local": sys.executable}, identities={"a": ours["a"], "b": theirs["b"]})
    assert [(x.src_site, x.dst_site, x.status) for x in rows] == [("b", "a", "fail"), ("a", "b", "fail")]
    for x in rows:
        assert x.detail.startswith(f"TLS handshake with {x.dst_site} at 127.0.0.1:{x.port}: wrong CA ("), x.detail
        assert "\n" not in x.detail
    assert DoctorReport(nodes=[], links=rows).exit_code == EXIT_FAILED


def test_a_refused_port_is_named(tmp_path):
    ids = run_ca.ensure(tmp_path / "ca", "r", ["a", "b"])
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    status, detail = dial_tls(LocalNode(), sys.executable, "a", _files(ids["a"]), "127.0.0.1", port, "b")
    assert status == "fail"
    assert detail.startswith(f"TLS handshake with b at 127.0.0.1:{port}: refused ("), detail


def test_a_listener_that_never_answers_times_out(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor_tls, "TLS_DIAL_S", 1.0)
    ids = run_ca.ensure(tmp_path / "ca", "r", ["a", "b"])
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (the backlog does) and says nothing
        port = silent.getsockname()[1]
        status, detail = dial_tls(LocalNode(), sys.executable, "a", _files(ids["a"]), "127.0.0.1", port, "b")
    assert status == "fail"
    assert detail.startswith(f"TLS handshake with b at 127.0.0.1:{port}: timeout ("), detail


def test_the_gloo_transport_and_async_mode_need_no_tls_check(tmp_path):
    spec = _spec(tmp_path)
    assert doctor_tls.uses_tls_transport(spec)  # "auto": launch gives every site an identity
    spec.diloco.transport = "gloo"
    assert not doctor_tls.uses_tls_transport(spec)
    spec.diloco.transport, spec.diloco.mode = "auto", "async"
    assert not doctor_tls.uses_tls_transport(spec)

"""The async outer service: dampening math, version/staleness accounting, codecs, auth, TLS, keys, plan."""

from __future__ import annotations

import math
import os
import socket
import stat
import threading

import httpx
import pytest
import torch

from dilococtl import service_keys
from trainer.codecs.compression import Compressor
from trainer.rules.codec_spec import wire_plan
from trainer.rules.config import from_dict
from trainer.rules.diloco_config import DilocoConfig
from trainer.rules.tables import ConfigError
from trainer.service.outer_service import (
    OuterService,
    ServiceError,
    dampening,
    encode_delta,
    flat_bytes,
    make_server,
    read_token,
)
from trainer.service.service_client import ServiceClient, ServiceRefused, ServiceUnavailable


def cfg(**kw) -> DilocoConfig:
    base = {"sites": 2, "outer_lr": 0.8, "outer_momentum": 0.0, "mode": "async", "async_alpha": 0.5}
    return DilocoConfig(**{**base, **kw})


def push_raw(svc: OuterService, site: str, base: int, deltas: list[torch.Tensor]):
    phases, _ = encode_delta(Compressor(spec=svc.cfg.compression, error_feedback=False), deltas)
    return svc.push(site, base, phases)


# --- math -----------------------------------------------------------------------------------------

def test_dampening_matches_hand_computed_values():
    assert [dampening(g, 0.5) for g in (0, 1, 2, 4)] == pytest.approx([1.0, 2 / 3, 0.5, 1 / 3])
    assert dampening(3, 2.0) == pytest.approx(1 / 7)
    assert dampening(5, 0.0) == 1.0  # α = 0: no dampening
    assert [dampening(g, 0.5, "sqrt") for g in (0, 3, 8)] == pytest.approx([1.0, 0.5, 1 / 3])
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        dampening(-1, 0.5)
    with pytest.raises(ValueError, match="dampening must be one of"):
        dampening(1, 0.5, "linear")


def test_versions_staleness_and_dampened_steps_without_momentum():
    # lr per push = 0.8 * 1/2 (elastic: one site of two); no momentum: θ -= 0.4 * ψ(γ) * Δ
    svc = OuterService(cfg())
    assert svc.init([torch.tensor([1.0, 2.0])]) is True
    assert svc.init([torch.tensor([9.0, 9.0])]) is False  # the second site's θ_0 is not taken
    a = push_raw(svc, "a", 0, [torch.tensor([1.0, 0.0])])
    assert (a.version, a.staleness, a.scale, a.lr) == (1, 0, 1.0, pytest.approx(0.4))
    b = push_raw(svc, "b", 0, [torch.tensor([0.0, 3.0])])  # computed on version 0, applied at 1
    assert (b.version, b.staleness) == (2, 1)
    assert b.scale == pytest.approx(2 / 3)
    c = push_raw(svc, "a", 1, [torch.tensor([1.5, 0.0])])  # base 1, applied at 2
    assert (c.version, c.staleness, c.scale) == (3, 1, pytest.approx(2 / 3))
    d = push_raw(svc, "c", 0, [torch.tensor([0.0, 1.0])])  # very stale: γ = 3, ψ = 1/2.5 (a third site:
    # b pushed from version 0 already, and may not again: tests/unit/test_service_trust.py)
    assert (d.version, d.staleness, d.scale) == (4, 3, pytest.approx(0.4))
    version, data = svc.params()
    theta = torch.frombuffer(bytearray(data), dtype=torch.float32)
    # x: 1 - 0.4*1 - 0.4*(2/3)*1.5 = 0.2 ; y: 2 - 0.4*(2/3)*3 - 0.4*0.4*1 = 1.04
    assert version == 4
    assert theta.tolist() == pytest.approx([0.2, 1.04], abs=1e-6)
    st = svc.state()
    assert st["pushes"] == st["version"] == 4
    assert st["per_site"] == {"a": {"pushes": 2, "staleness_sum": 1, "staleness_max": 1},
                              "b": {"pushes": 1, "staleness_sum": 1, "staleness_max": 1},
                              "c": {"pushes": 1, "staleness_sum": 3, "staleness_max": 3}}


def test_nesterov_momentum_applies_the_dampened_gradient():
    # torch SGD nesterov: b = μb + g; θ -= lr (g + μ b); lr = 0.7 * 1/2, μ = 0.9
    svc = OuterService(cfg(outer_lr=0.7, outer_momentum=0.9, async_dampening="sqrt"))
    svc.init([torch.tensor([0.0])])
    push_raw(svc, "a", 0, [torch.tensor([1.0])])  # g1 = 1 -> b = 1, θ = -0.35 * 1.9 = -0.665
    r = push_raw(svc, "b", 0, [torch.tensor([2.0])])  # γ = 1, ψ = 1/√2: g2 = √2, b = 0.9 + √2
    assert r.scale == pytest.approx(1 / math.sqrt(2))
    g2 = 2.0 / math.sqrt(2)
    b2 = 0.9 + g2
    want = -0.665 - 0.35 * (g2 + 0.9 * b2)
    theta = torch.frombuffer(bytearray(svc.params()[1]), dtype=torch.float32)
    assert float(theta[0]) == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize("spec", ["int8", "powersgd:2+int8", "topk:0.25"])
def test_encoded_push_applies_what_the_site_decodes(spec):
    torch.manual_seed(0)
    params = [torch.randn(12, 6), torch.randn(6)]
    svc = OuterService(cfg(compression=spec, outer_lr=1.0, elastic_lr=False))
    svc.init(params)
    site = Compressor(spec=spec, error_feedback=True)
    deltas = [torch.randn_like(p) * 0.01 for p in params]
    phases, decoded = encode_delta(site, deltas)
    assert sum(map(len, phases)) < 4 * sum(p.numel() for p in params)  # compressed on the wire
    res = svc.push("a", 0, phases, spec)
    theta = torch.frombuffer(bytearray(svc.params()[1]), dtype=torch.float32)
    want = torch.cat([(p - dd).reshape(-1) for p, dd in zip(params, decoded, strict=True)])
    assert res.version == 1
    assert torch.allclose(theta, want, atol=1e-6)
    assert not torch.allclose(theta, torch.cat([(p - dd).reshape(-1) for p, dd in zip(params, deltas, strict=True)]),
                              atol=1e-7)  # lossy: the codec's decode, not the raw Δ, was applied


def test_refused_pushes_change_nothing():
    svc = OuterService(cfg())
    with pytest.raises(ServiceError, match="not initialized"):
        push_raw(svc, "a", 0, [torch.zeros(2)])
    svc.init([torch.zeros(2)])
    with pytest.raises(ServiceError, match=r"base version 3 is not in \[0, 0\]") as e:
        push_raw(svc, "a", 3, [torch.ones(2)])
    assert e.value.status == 409
    with pytest.raises(ServiceError, match="encoded with 'int8'"):
        svc.push("a", 0, [flat_bytes([torch.ones(2)]) + b"\0\0\0\0"], "int8")
    phases, _ = encode_delta(Compressor(spec="none", error_feedback=False), [torch.zeros(2)])
    raw = bytearray(phases[0])  # a NaN the site's own check would have stopped: the service checks too
    off = wire_plan("none", [(2,)]).phases[0].field(0, "raw").offset
    raw[off:off + 4] = torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(ServiceError, match="NaN"):
        svc.push("a", 0, [bytes(raw)])
    assert svc.version == 0


def test_a_push_is_bounded_by_the_recent_pushes_and_the_configured_limit():
    svc = OuterService(cfg(outer_lr=1.0, elastic_lr=False, async_alpha=0.0, guard_norm_ratio=3.0))
    svc.init([torch.zeros(4)])
    for _ in range(2):  # two honest pushes of norm 1 set the reference
        assert push_raw(svc, "a", svc.version, [torch.full((4,), 0.5)]).clip == 1.0
    before = torch.frombuffer(bytearray(svc.params()[1]), dtype=torch.float32).clone()
    res = push_raw(svc, "b", svc.version, [torch.full((4,), 500.0)])  # norm 1000: clipped to 3 x median 1
    after = torch.frombuffer(bytearray(svc.params()[1]), dtype=torch.float32)
    assert res.clip == pytest.approx(3 / 1000) and float((after - before).norm()) == pytest.approx(3.0, rel=1e-5)
    assert svc.state()["per_site"]["b"]["clipped"] == 1
    # the divisor of the codec's average is in the push: a weight field of 1e-30 decoded to 1e30 x Δ
    # (θ moved by 3.5e28), inf to 0 x Δ (a version spent on nothing): a site pushes with weight 1
    before = after.clone()
    phases, _ = encode_delta(Compressor(spec="none", error_feedback=False), [torch.full((4,), 0.5)])
    off = wire_plan("none", [(4,)]).phases[0].field(-1, "weight").offset
    for w in (1e-30, float("inf"), 2.0):
        raw = bytearray(phases[0])
        raw[off:off + 4] = torch.tensor([w]).numpy().tobytes()
        with pytest.raises(ServiceError, match="weight field") as e:
            svc.push("b", svc.version, [bytes(raw)])
        assert e.value.status == 400
    assert svc.version == 3 and torch.equal(torch.frombuffer(bytearray(svc.params()[1]), dtype=torch.float32), before)
    res = push_raw(svc, "b", svc.version, [torch.full((4,), 3e38)])  # finite fp32, passed the NaN check
    moved = float((torch.frombuffer(bytearray(svc.params()[1]), dtype=torch.float32) - before).norm())
    assert res.clip < 1e-37 and moved <= 3.0 * (1 + 1e-5)  # 3 x the median (1) of 1, 1, 3
    # an absolute bound holds from the first push on
    svc2 = OuterService(cfg(outer_lr=1.0, elastic_lr=False, guard_max_norm=0.5))
    svc2.init([torch.zeros(4)])
    assert push_raw(svc2, "a", 0, [torch.full((4,), 0.5)]).clip == pytest.approx(0.5)


def test_a_replayed_push_is_refused():
    svc = OuterService(cfg())
    svc.init([torch.zeros(2)])
    phases, _ = encode_delta(Compressor(spec="none", error_feedback=False), [torch.ones(2)])
    svc.push("a", 0, phases, push_id="0123456789abcdef")
    with pytest.raises(ServiceError, match="replayed push") as e:
        svc.push("a", 0, phases, push_id="0123456789abcdef")
    assert e.value.status == 409 and svc.version == 1


def test_service_checkpoint_round_trip(tmp_path):
    svc = OuterService(cfg(outer_momentum=0.9), state_dir=tmp_path, checkpoint_every=2)
    svc.init([torch.zeros(3)])
    for i in range(5):
        push_raw(svc, "ab"[i % 2], max(0, svc.version - 1), [torch.ones(3) * (i + 1)])
    files = sorted(p.name for p in tmp_path.glob("round-*"))  # signed round directories (issue 35)
    assert files == ["round-000002", "round-000004"]
    again = OuterService(cfg(outer_momentum=0.9), state_dir=tmp_path)
    assert again.version == 4
    assert again.state()["pushes"] == 4
    # the momentum came back too: the same next push gives the same θ as on a service that never stopped
    ref = OuterService(cfg(outer_momentum=0.9))
    ref.init([torch.zeros(3)])
    for i in range(4):
        push_raw(ref, "ab"[i % 2], max(0, ref.version - 1), [torch.ones(3) * (i + 1)])
    push_raw(ref, "a", 4, [torch.ones(3)])
    push_raw(again, "a", 4, [torch.ones(3)])
    assert again.params()[1] == ref.params()[1]


# --- HTTP, TLS and auth -------------------------------------------------------------------------

@pytest.fixture
def served(tmp_path):
    keys = service_keys.ensure(tmp_path / "keys", ["127.0.0.1"])
    svc = OuterService(cfg())
    server = make_server(svc, "127.0.0.1", 0, cert=keys.cert, key=keys.key, token=read_token(keys.token))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield svc, f"https://127.0.0.1:{server.server_address[1]}", keys
    server.shutdown()
    server.server_close()


def test_client_push_pull_over_tls(served):
    svc, url, keys = served
    c = ServiceClient(url, cert=str(keys.cert), token_file=str(keys.token), retry_s=2)
    params = [torch.ones(4, 2), torch.zeros(3)]
    shapes = [(4, 2), (3,)]
    assert c.init(params, "a") == (True, 44)
    assert c.init(params, "b") == (False, 44)
    assert c.state()["joined"] == ["a", "b"] and c.wait_joined(2, timeout_s=0) == 2
    version, theta, nbytes = c.pull(shapes)
    assert version == 0 and nbytes == 44 and torch.equal(theta[0], params[0])
    comp = Compressor(spec="none")
    ans1, sent = c.push("a", 0, "none", encode_delta(comp, [torch.ones(4, 2), torch.ones(3)])[0])
    ans2, _ = c.push("b", 0, "none", encode_delta(comp, [torch.ones(4, 2), torch.ones(3)])[0])
    assert sent == 44 + 4  # fp32 values + the codec's weight field
    assert (ans1["version"], ans1["staleness"], ans2["version"], ans2["staleness"]) == (1, 0, 2, 1)
    assert c.state()["version"] == 2 == c.pull(shapes)[0]
    with pytest.raises(ServiceRefused, match="HTTP 409.*base version 5"):
        c.push("a", 5, "none", encode_delta(comp, [torch.ones(4, 2), torch.ones(3)])[0])
    c.close()


def test_the_same_push_request_sent_twice_is_applied_once(served):
    svc, url, keys = served
    svc.init([torch.zeros(2)])
    pinned = httpx.Client(verify=__import__("ssl").create_default_context(cafile=str(keys.cert)))
    headers = {"Authorization": f"Bearer {read_token(keys.token)}", "X-Base-Version": "0", "X-Site": "a"}
    body = flat_bytes([torch.ones(2)]) + torch.tensor([1.0]).numpy().tobytes()
    assert pinned.post(f"{url}/push", content=body, headers=headers).status_code == 400  # no push id
    headers["X-Push-Id"] = "feedc0de" * 4
    assert pinned.post(f"{url}/push", content=body, headers=headers).status_code == 200
    r = pinned.post(f"{url}/push", content=body, headers=headers)
    assert r.status_code == 409 and "replayed" in r.json()["error"] and svc.version == 1
    pinned.close()


def test_auth_refused_without_or_with_a_wrong_token(served, tmp_path):
    svc, url, keys = served
    svc.init([torch.zeros(2)])
    pinned = httpx.Client(verify=__import__("ssl").create_default_context(cafile=str(keys.cert)))
    assert pinned.get(f"{url}/healthz").json()["version"] == 0  # health needs no token
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": read_token(keys.token)}):
        r = pinned.post(f"{url}/push", content=flat_bytes([torch.ones(2)]) + b"\0" * 4,
                        headers={**headers, "X-Base-Version": "0", "X-Site": "x"})
        assert r.status_code == 401
        assert "token" in r.json()["error"]
        assert pinned.get(f"{url}/params", headers=headers).status_code == 401
    assert svc.version == 0  # nothing applied
    bad = tmp_path / "bad-token"
    bad.write_text("not-the-token\n")
    c = ServiceClient(url, cert=str(keys.cert), token_file=str(bad), retry_s=2)
    with pytest.raises(ServiceRefused, match="HTTP 401"):
        c.pull([(2,)])
    c.close()
    pinned.close()


def test_with_the_run_ca_a_site_is_known_by_its_certificate(tmp_path):
    from dilococtl import run_ca

    keys = service_keys.ensure(tmp_path / "keys", ["127.0.0.1"])
    ids = run_ca.ensure(tmp_path / "ca", "R1", ["dc-a", "dc-b"])
    other = run_ca.ensure(tmp_path / "ca-other", "R2", ["dc-a"])  # another run's CA, same site name
    svc = OuterService(cfg())
    server = make_server(svc, "127.0.0.1", 0, cert=keys.cert, key=keys.key, token=read_token(keys.token),
                         client_ca=ids["dc-a"].ca)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{server.server_address[1]}"

    def client(ident):
        return ServiceClient(url, cert=str(keys.cert), token_file=str(keys.token), retry_s=1,
                             identity=(str(ident.cert), str(ident.key)) if ident else None)
    try:
        a = client(ids["dc-a"])
        a.init([torch.zeros(2)], "dc-a")
        comp = Compressor(spec="none")
        a.push("dc-a", 0, "none", encode_delta(comp, [torch.ones(2)])[0])
        with pytest.raises(ServiceRefused, match="HTTP 403.*X-Site 'dc-b'"):  # dc-a cannot push as dc-b
            a.push("dc-b", 1, "none", encode_delta(comp, [torch.ones(2)])[0])
        assert set(a.state()["per_site"]) == {"dc-a"} and svc.version == 1
        a.close()
        for ident in (None, other["dc-a"]):  # no certificate, or one from another run: no TLS session
            c = client(ident)
            with pytest.raises(Exception, match="unreachable"):
                c.state()
            c.close()
        assert svc.version == 1
    finally:
        server.shutdown()
        server.server_close()


def test_tls_is_required_and_the_certificate_pinned(served, tmp_path):
    svc, url, keys = served
    port = url.rsplit(":", 1)[1]
    with pytest.raises(httpx.HTTPError):  # plain HTTP gets no answer
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{url}/healthz", timeout=5)  # the system's CAs do not vouch for it
    other = service_keys.ensure(tmp_path / "other", ["127.0.0.1"])
    c = ServiceClient(url, cert=str(other.cert), token_file=str(keys.token), retry_s=0)
    with pytest.raises(ServiceUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
        c.health()  # another run's certificate is not this service's
    c.close()
    assert svc.version == 0


def test_unreachable_service_fails_after_bounded_retries(tmp_path):
    keys = service_keys.ensure(tmp_path / "keys", ["127.0.0.1"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = ServiceClient(f"https://127.0.0.1:{port}", cert=str(keys.cert), token_file=str(keys.token), retry_s=1.2)
    with pytest.raises(ServiceUnavailable) as e:
        c.health()
    msg = str(e.value)
    assert "\n" not in msg and "unreachable after 2 tries over 1s: ConnectError" in msg
    c.close()


def test_client_config_errors_name_the_key(tmp_path):
    keys = service_keys.ensure(tmp_path / "keys", ["127.0.0.1"])
    with pytest.raises(ConfigError, match="run.service_url: must be an https"):
        ServiceClient("http://127.0.0.1:1", cert=str(keys.cert), token_file=str(keys.token))
    with pytest.raises(ConfigError, match="run.service_cert: cannot load"):
        ServiceClient("https://127.0.0.1:1", cert=str(tmp_path / "nope.crt"), token_file=str(keys.token))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="run.service_token_file: token file .*empty is empty"):
        ServiceClient("https://127.0.0.1:1", cert=str(keys.cert), token_file=str(tmp_path / "empty"))


# --- keys, config, plan --------------------------------------------------------------------------

def test_service_keys_are_private_reused_and_cover_the_host(tmp_path):
    from cryptography import x509

    k1 = service_keys.ensure(tmp_path / "k", ["10.1.2.3", "node-a"])
    assert stat.S_IMODE(os.stat(k1.key).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(k1.token).st_mode) == 0o600
    assert len(read_token(k1.token)) >= 40
    san = x509.load_pem_x509_certificate(k1.cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert {str(i) for i in san.get_values_for_type(x509.IPAddress)} == {"10.1.2.3", "127.0.0.1"}
    assert set(san.get_values_for_type(x509.DNSName)) == {"node-a", "localhost"}
    token, cert = k1.token.read_text(), k1.cert.read_bytes()
    service_keys.ensure(tmp_path / "k", ["10.1.2.3"])  # covered: reused (a resumed run keeps trusting)
    assert (k1.token.read_text(), k1.cert.read_bytes()) == (token, cert)
    service_keys.ensure(tmp_path / "k", ["10.9.9.9"])  # a new host: remade
    assert k1.cert.read_bytes() != cert


def _trainer_dict(**diloco) -> dict:
    return {"diloco": {"sites": 2, "mode": "async", **diloco},
            "run": {"site": "s0", "site_index": 0}}


def test_config_accepts_async_and_checks_its_knobs():
    c = from_dict(_trainer_dict(async_alpha=1.5, async_dampening="sqrt"))
    assert (c.diloco.mode, c.diloco.async_alpha, c.diloco.async_dampening) == ("async", 1.5, "sqrt")
    with pytest.raises(ConfigError, match="diloco.async_alpha: must be >= 0"):
        from_dict(_trainer_dict(async_alpha=-1.0))
    with pytest.raises(ConfigError, match="diloco.async_dampening: expected 'inverse', 'sqrt'"):
        from_dict(_trainer_dict(async_dampening="linear"))
    with pytest.raises(ConfigError, match="diloco.mode: 'async' runs plain data-parallel sites only"):
        from_dict({**_trainer_dict(), "parallel": {"tp": 2}})
    with pytest.raises(ConfigError, match="diloco.h: 'auto' needs rounds in lockstep"):
        from_dict(_trainer_dict(h="auto"))
    with pytest.raises(ConfigError, match="run.service_url: must be an https://"):
        from_dict({**_trainer_dict(), "run": {"service_url": "http://x:1"}})


def test_async_plan_starts_the_service_in_the_lighthouse_place(tmp_path):
    import tomllib

    from dilococtl import plan as plan_mod
    from dilococtl.spec import spec_from_dict

    data = {"run": {"name": "a1", "lighthouse_port": 29555},
            "diloco": {"mode": "async", "compression": "int8", "async_alpha": 0.25, "rounds": 2},
            "sites": [{"name": "x", "hosts": ["local"], "work_dir": str(tmp_path / "w")},
                      {"name": "y", "hosts": ["local"], "work_dir": str(tmp_path / "w")}]}
    plan = plan_mod.build(spec_from_dict(data, "a1.toml"), "RID")
    svc = plan.lighthouse
    assert svc.kind == "outer_service" and svc.url == "https://127.0.0.1:29555"
    assert "-m trainer.service.outer_service --bind 127.0.0.1:29555" in svc.command
    # the service runs with the sites' own config, not with flags translated from it
    assert f"--config {svc.config_path}" in svc.command and "--alpha" not in svc.command
    served = tomllib.loads(svc.config_toml)["diloco"]
    site_cfg = tomllib.loads(plan.nodes[0].config_toml)["diloco"]
    assert served == site_cfg and served["compression"] == "int8" and served["async_alpha"] == 0.25
    assert served["sites"] == 2
    keys = plan_mod.service_keys_dir("RID")
    token = read_token(keys / "token")
    assert token not in svc.command and all(token not in n.command and token not in n.config_toml
                                            for n in plan.nodes)
    run = tomllib.loads(plan.nodes[0].config_toml)["run"]
    assert run["service_url"] == svc.url
    assert run["service_cert"] == str(keys / "service.crt") and run["service_token_file"] == str(keys / "token")
    # sync runs keep the Lighthouse
    data["diloco"]["mode"] = "sync"
    assert plan_mod.build(spec_from_dict(data, "a1.toml"), "RID2").lighthouse.kind == "lighthouse"


def test_async_plan_copies_the_keys_to_remote_nodes():
    import tomllib

    from dilococtl import plan as plan_mod
    from dilococtl.spec import spec_from_dict

    data = {"run": {"name": "a2"}, "diloco": {"mode": "async"},
            "sites": [{"name": "x", "hosts": ["10.0.0.1"], "work_dir": "/tmp/dilococtl"},
                      {"name": "y", "hosts": ["10.0.0.2", "10.0.0.3"], "nproc_per_node": 1, "work_dir": "/tmp/dilococtl"}]}
    data["sites"][0]["nproc_per_node"] = 2
    plan = plan_mod.build(spec_from_dict(data, "a2.toml"), "RID")
    keys = plan_mod.service_keys_dir("RID")
    svc = plan.lighthouse
    assert svc.url == "https://10.0.0.1:29510" and "/tmp/dilococtl/runs/RID/_keys/service.key" in svc.command
    copies = {(h, r): src for h, r, src in plan.files}
    run_dir = "/tmp/dilococtl/runs/RID"
    # the service host gets cert, key and token; every trainer node the cert and the token, never the key
    assert copies[("10.0.0.1", f"{run_dir}/_keys/service.key")] == keys / "service.key"
    for host in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        assert copies[(host, f"{run_dir}/_keys/token")] == keys / "token"
        assert copies[(host, f"{run_dir}/_keys/service.crt")] == keys / "service.crt"
    assert not any(h != "10.0.0.1" and r.endswith("service.key") for h, r in copies)
    assert len(plan.files) == len(copies)  # no file copied twice
    run = tomllib.loads(plan.nodes[1].config_toml)["run"]
    assert run["service_cert"] == f"{run_dir}/_keys/service.crt" and run["service_token_file"] == f"{run_dir}/_keys/token"
    token = read_token(keys / "token")
    assert all(token not in n.command and token not in n.config_toml for n in plan.nodes)


def test_a_dry_run_makes_no_keys():
    from dilococtl import plan as plan_mod
    from dilococtl.spec import spec_from_dict

    data = {"run": {"name": "a3"}, "diloco": {"mode": "async"},
            "sites": [{"name": "x", "hosts": ["10.0.0.1"]}, {"name": "y", "hosts": ["10.0.0.2"]}]}
    plan_mod.build(spec_from_dict(data, "a3.toml"), "DRY", make_keys=False)
    assert not plan_mod.service_keys_dir("DRY").exists()

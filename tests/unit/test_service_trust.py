"""The async outer service against a participant that lies and a peer that floods (issue 34: 3, 5, 11).

Real OuterService, real HTTP/TLS server on 127.0.0.1, real sockets; no mocks.
"""

from __future__ import annotations

import math
import select
import socket
import ssl
import threading
import time

import pytest
import torch

from dilococtl import service_keys
from trainer.codecs.compression import Compressor
from trainer.rules.config import TrainConfig
from trainer.rules.diloco_config import DilocoConfig
from trainer.service.outer_service import (
    MAX_PREAUTH,
    OuterService,
    ServiceError,
    encode_delta,
    make_server,
    read_token,
)
from trainer.service.service_client import ServiceClient

N = 8
U = torch.ones(N) / math.sqrt(N)  # the honest direction: honest Δ = -U, so θ·U grows by 1 a push


def cfg(**kw) -> DilocoConfig:
    base = {"sites": 3, "outer_lr": 1.0, "outer_momentum": 0.0, "elastic_lr": False, "mode": "async",
            "async_alpha": 0.0, "guard_norm_ratio": 3.0}
    return DilocoConfig(**{**base, **kw})


def push(svc: OuterService, site: str, delta: torch.Tensor, base: int | None = None):
    phases, _ = encode_delta(Compressor(spec="none", error_feedback=False), [delta])
    return svc.push(site, svc.version if base is None else base, phases)


def along(svc: OuterService) -> float:
    theta = torch.frombuffer(bytearray(svc.params()[1]), dtype=torch.float32)
    return float(theta @ U)


# --- finding 3: the push-norm limit ---------------------------------------------------------------

def _ratchet_attack(svc: OuterService, liars: list[str], honest: list[str], pushes: int = 60) -> list[float]:
    """Each liar pushes +U (against the honest direction) at 2.9x the norm its last push was applied
    with, always from the current version (no dampening), many times per honest push. Returns the
    norms the liars' pushes were applied with."""
    for _ in range(2):
        for h in honest:
            push(svc, h, -U)
    applied, last = [], 1.0
    for i in range(pushes):
        liar = liars[i % len(liars)]
        g = 2.9 * last
        res = push(svc, liar, g * U)
        last = g * res.clip
        applied.append(last)
        if i % 10 == 9:  # the honest sites are ten times slower
            for h in honest:
                push(svc, h, -U)
    return applied


def test_one_site_cannot_ratchet_its_own_bound():
    # before issue 34: one window for all sites; the liar became the median and its bound grew
    # 2.9x a push (3 -> 5570 in 60 pushes), θ went to -16,670 along the honest direction
    svc = OuterService(cfg())
    svc.init([torch.zeros(N)])
    applied = _ratchet_attack(svc, ["liar"], ["b", "c"])
    assert max(applied) <= 3.0 * (1 + 1e-5)  # 3 x the honest sites' median (1), every time
    assert applied[-1] == pytest.approx(3.0, rel=1e-5)  # the 60th as bounded as the first
    # honest: 2 x 2 + 6 x 2 pushes of +1; the liar: 60 of at most -3
    assert along(svc) >= 16 - 60 * 3.0 * (1 + 1e-5)
    assert svc.reference_norm("liar") == pytest.approx(1.0) and svc.reference_norm("b") > 1.0


def test_two_colluding_sites_of_five_cannot_raise_each_others_bound():
    svc = OuterService(cfg(sites=5))
    svc.init([torch.zeros(N)])
    applied = _ratchet_attack(svc, ["liar1", "liar2"], ["b", "c", "e"])
    # each liar's reference is the median of 4 sites' medians, 3 of them honest: 1
    assert max(applied) <= 3.0 * (1 + 1e-5)


def test_a_site_pushes_once_per_version():
    svc = OuterService(cfg())
    svc.init([torch.zeros(N)])
    assert push(svc, "a", -U, base=0).version == 1
    before = svc.params()
    with pytest.raises(ServiceError, match=r"site 'a' already pushed: its last push made version 1, so its next "
                                           r"push must start from version 1 or later, not 0 \(one push per site "
                                           r"per version\)") as e:
        push(svc, "a", -U, base=0)  # the same Δ again, or a second one from the same θ
    assert e.value.status == 409 and svc.params() == before
    assert push(svc, "b", -U, base=0).staleness == 1  # another site's stale push is fine
    assert push(svc, "a", -U, base=1).version == 3  # a's next push, from the θ its push made
    with pytest.raises(ServiceError, match="one push per site per version"):
        push(svc, "a", -U, base=2)  # older than its last push's version 3
    assert svc.version == 3


def test_the_limits_survive_a_service_restart(tmp_path):
    svc = OuterService(cfg(), state_dir=tmp_path, checkpoint_every=1)
    svc.init([torch.zeros(N)])
    for site in ("b", "c", "b", "c"):
        push(svc, site, -U)
    again = OuterService(cfg(), state_dir=tmp_path)
    assert again.version == 4 and again.reference_norm("liar") == pytest.approx(1.0)
    assert push(again, "liar", 100 * U).clip == pytest.approx(0.03)  # still 3 x the others' median
    with pytest.raises(ServiceError, match="one push per site per version"):
        push(again, "c", -U, base=3)


def test_a_single_site_is_bounded_by_the_cap_its_optimizer_allows():
    # cap = 2 (margin) x H x lr x (sqrt(N) + wd x |θ_0|) = 2 x 10 x 1e-3 x (10 + 0.1 x 10) = 0.22
    train = TrainConfig(lr=1e-3, weight_decay=0.1)
    svc = OuterService(cfg(sites=1, h=10), train=train)
    svc.init([torch.ones(100)])
    assert svc.absolute_cap() == pytest.approx(0.22)
    res = push(svc, "solo", torch.full((100,), 1000.0))  # norm 10^4
    assert res.clip == pytest.approx(0.22 / 1e4) and res.bound == pytest.approx(0.22)
    moved = float((torch.frombuffer(bytearray(svc.params()[1]), dtype=torch.float32) - 1).norm())
    assert moved == pytest.approx(0.22, rel=1e-4)
    assert push(svc, "solo", torch.full((100,), 0.01)).clip == 1.0  # within the cap: as sent
    # a lossy codec's error feedback carries up to 1/(1 - decay) rounds: the cap widens by that
    lossy = OuterService(cfg(sites=1, h=10, compression="int8", error_feedback_decay=0.5), train=train)
    lossy.init([torch.ones(100)])
    assert lossy.absolute_cap() == pytest.approx(0.44)


def test_real_adamw_rounds_stay_under_the_cap():
    # the cap is derived, so check it against the optimizer it is derived from: H AdamW steps on a
    # model, with spiky gradients, never move θ further than push_norm_cap
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    train = TrainConfig(lr=3e-3, weight_decay=0.1)
    d = cfg(sites=1, h=40)
    svc = OuterService(d, train=train)
    svc.init([p.detach() for p in model.parameters()])
    opt = torch.optim.AdamW(model.parameters(), lr=train.lr, betas=(train.beta1, train.beta2),
                            weight_decay=train.weight_decay)
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(d.h):
        x = torch.randn(64, 16) * (100.0 if step % 7 == 0 else 1.0)  # a spike every 7 steps
        loss = (model(x) - torch.randn(64, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    delta = math.sqrt(sum(float((s - p.detach()).pow(2).sum()) for s, p in zip(start, model.parameters(),
                                                                                  strict=True)))
    assert 0 < delta < svc.absolute_cap()


# --- HTTP: finding 5 (/init reads no body it will refuse) and 11 (pre-auth connections) -------------

@pytest.fixture
def served(tmp_path):
    keys = service_keys.ensure(tmp_path / "keys", ["127.0.0.1"])
    svc = OuterService(cfg())
    server = make_server(svc, "127.0.0.1", 0, cert=keys.cert, key=keys.key, token=read_token(keys.token))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield svc, server, keys
    server.shutdown()
    server.server_close()


def _raw_request(server, keys, head: str, timeout: float = 3.0) -> bytes:
    """Send only a request's head over TLS (no body byte) and read the reply until the server closes."""
    ctx = ssl.create_default_context(cafile=str(keys.cert))
    with socket.create_connection(server.server_address, timeout=timeout) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        tls.sendall(head.encode())
        out = b""
        while b"\r\n\r\n" not in out or len(out.split(b"\r\n\r\n", 1)[1]) < _length(out):
            chunk = tls.recv(65536)  # a server waiting for the body times out here
            if not chunk:
                break
            out += chunk
        return out


def _length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def _init_head(keys, shapes: str, length: int) -> str:
    return (f"POST /init HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {read_token(keys.token)}\r\n"
            f"X-Shapes: {shapes}\r\nX-Site: b\r\nContent-Length: {length}\r\n\r\n")


def test_init_refuses_a_declared_size_before_reading_the_body(served):
    svc, server, keys = served
    # before θ exists: more than INIT_MAX_BYTES declared (32 GiB) is refused, no body sent or read
    reply = _raw_request(server, keys, _init_head(keys, "[[8589934592]]", 1 << 35))
    assert reply.startswith(b"HTTP/1.1 413") and b"more than 17179869184 bytes" in reply
    svc.init([torch.zeros(N)], "a")
    # after: 768 MiB declared under other shapes (this raised the service from 331 MB to 2.69 GB)
    t0 = time.monotonic()
    reply = _raw_request(server, keys, _init_head(keys, "[[201326592]]", 768 << 20))
    assert reply.startswith(b"HTTP/1.1 409") and b"other shapes than the 1 declared" in reply
    assert b"body not read" in reply and time.monotonic() - t0 < 2.0
    # the right shapes with a body length that is not theirs: refused before reading too
    reply = _raw_request(server, keys, _init_head(keys, f"[[{N}]]", 768 << 20))
    assert reply.startswith(b"HTTP/1.1 413") and b"32 expected" in reply
    reply = _raw_request(server, keys, _init_head(keys, '[[8, "x"]]', 0))
    assert reply.startswith(b"HTTP/1.1 400") and b"X-Shapes" in reply
    assert svc.shapes == [(N,)] and svc.version == 0


def test_unauthenticated_connections_are_bounded_and_a_site_still_gets_in(served):
    svc, server, keys = served
    base = threading.active_count()
    idle = [socket.create_connection(server.server_address) for _ in range(MAX_PREAUTH + 10)]
    try:
        time.sleep(0.3)  # let the server accept them all
        threads = threading.active_count() - base
        assert threads <= MAX_PREAUTH, threads  # one thread each for the first MAX_PREAUTH, none for more
        readable, _, _ = select.select(idle, [], [], 0.5)
        closed = 0
        for s in readable:
            try:
                closed += s.recv(1) == b""
            except ConnectionResetError:
                closed += 1
        assert closed == 10  # over the cap: closed at once, without a handshake
        t0 = time.monotonic()
        c = ServiceClient(f"https://127.0.0.1:{server.server_address[1]}", cert=str(keys.cert),
                          token_file=str(keys.token), retry_s=10)
        assert c.state()["version"] == 0  # idle connections older than the grace give way
        assert time.monotonic() - t0 < 3.0
        c.close()
        assert threading.active_count() - base <= MAX_PREAUTH + 1
    finally:
        for s in idle:
            s.close()

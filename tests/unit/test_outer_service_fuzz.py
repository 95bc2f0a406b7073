"""Fuzz of the async outer service's HTTP endpoints: requests with at least one defect (token, route,
method, headers, body length, values, codec) are refused with a 4xx, the service keeps answering,
and θ and its version are unchanged."""

from __future__ import annotations

import os
import re
import ssl
import string
import threading

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dilococtl import service_keys
from trainer.rules.diloco_config import DilocoConfig
from trainer.service.outer_service import OuterService, flat_bytes, make_server, read_token

SHAPES = [(4, 2), (3,)]
PAYLOAD = 4 * (8 + 3) + 4  # fp32 values + the codec's weight field (codec "none")
DEFECTS = ["token", "route", "method", "short", "long", "nan", "inf", "base", "push_id", "codec"]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    keys = service_keys.ensure(tmp_path_factory.mktemp("keys"), ["127.0.0.1"])
    svc = OuterService(DilocoConfig(sites=2, outer_lr=0.8, outer_momentum=0.0, mode="async"))
    svc.init([torch.zeros(s) for s in SHAPES], "a")
    server = make_server(svc, "127.0.0.1", 0, cert=keys.cert, key=keys.key, token=read_token(keys.token))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = httpx.Client(verify=ssl.create_default_context(cafile=str(keys.cert)), timeout=20)
    yield svc, f"https://127.0.0.1:{server.server_address[1]}", read_token(keys.token), client
    client.close()
    server.shutdown()
    server.server_close()


header_text = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=80)


@st.composite
def bad_requests(draw, token: str):
    """(method, path, headers, body) of a push that would be valid but for at least one defect."""
    defects = set(draw(st.lists(st.sampled_from(DEFECTS), min_size=1, max_size=3)))
    method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH"])) if "method" in defects else "POST"
    path = draw(st.sampled_from(["/pushh", "/push/", "/push%00", "/PUSH", "/", "/push/x"])) \
        if "route" in defects else "/push"
    values = draw(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=11, max_size=11))
    if "nan" in defects:
        values[draw(st.integers(0, 10))] = float("nan")
    if "inf" in defects:
        values[draw(st.integers(0, 10))] = draw(st.sampled_from([float("inf"), float("-inf")]))
    body = flat_bytes([torch.tensor(values[:8]).reshape(4, 2), torch.tensor(values[8:])]) \
        + torch.tensor([1.0]).numpy().tobytes()
    if "short" in defects:
        body = body[:draw(st.integers(0, len(body) - 1))]
    if "long" in defects:
        body = body + draw(st.binary(min_size=1, max_size=64))
    headers = {
        "Authorization": draw(st.sampled_from(["", "Bearer", f"Bearer {token}x", token, f"bearer {token[:-1]}"]))
        if "token" in defects else f"Bearer {token}",
        "X-Site": draw(header_text),
        "X-Base-Version": draw(st.one_of(st.sampled_from(["", "x", "1e3", "0x10", "99999999999999999999", "inf"]),
                                         st.integers(10_000, 2**70).map(str))) if "base" in defects else "0",
        "X-Push-Id": draw(st.one_of(st.text(string.printable, max_size=15), st.text(string.ascii_letters, min_size=65,
                                                                                   max_size=80),
                                    st.sampled_from(["a" * 15 + "-", "é" * 20])))
        if "push_id" in defects else draw(st.text(string.ascii_letters + string.digits, min_size=16, max_size=64)),
    }
    if "codec" in defects:
        headers["X-Codec"] = draw(st.sampled_from(["int8", "fp8", "topk:0.01", "powersgd:4", "zip", "int8+int8"]))
    headers = {k: v for k, v in headers.items() if v != "" or k == "Authorization"}
    return method, path, headers, body, sorted(defects)


FUZZ = settings(max_examples=int(os.environ.get("DILOCOCTL_FUZZ_EXAMPLES", "40")), deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(data=st.data())
def test_every_bad_request_is_refused_and_theta_is_unchanged(service, data):
    svc, url, token, client = service
    version, theta = svc.params()
    method, path, headers, body, defects = data.draw(bad_requests(token))
    # header bytes as HTTP allows them (latin-1, no control characters, no edge spaces): the client
    # library refuses the rest before sending
    raw = {k: re.sub(r"[\x00-\x1f\x7f]", "", v).strip().encode("latin-1") for k, v in headers.items()}
    r = client.request(method, url + path, headers=raw, content=body if method == "POST" else None)
    assert r.status_code != 200, (defects, headers, r.text[:300])  # an infinite value too: refused as NaN is
    if r.status_code == 501:  # a method http.server does not serve at all (PUT, DELETE, PATCH): refused
        assert method in ("PUT", "DELETE", "PATCH"), (defects, r.text[:300])
    else:
        assert 400 <= r.status_code < 500, (defects, headers, r.status_code, r.text[:300])
        assert "error" in r.json(), r.text[:300]
    assert svc.params() == (version, theta), defects  # nothing applied
    assert client.get(url + "/healthz").status_code == 200  # still answers

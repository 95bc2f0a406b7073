"""trainer.probes.probe between two local processes on loopback, and `dilococtl tune-h` on a local spec."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dilococtl.cli import app
from dilococtl.store import Store
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _probe(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.probes.probe", *args], capture_output=True, text=True,
                          timeout=timeout)


def _server(port: int, token: str = "tok", **kw) -> subprocess.Popen:
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    return subprocess.Popen([sys.executable, "-m", "trainer.probes.probe", "serve", "--bind", "127.0.0.1", "--port",
                             str(port), "--token", token, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_client_and_server_measure_both_directions():
    port = free_port(1)
    srv = _server(port, timeout=60)
    try:
        t0 = time.monotonic()
        r = _probe("client", "--host", "127.0.0.1", "--port", str(port), "--token", "tok", "--streams", "3",
                   "--warmup", "0.3", "--duration", "0.7", "--rtt-count", "10")
        took = time.monotonic() - t0
        out, _ = srv.communicate(timeout=30)
    finally:
        srv.kill()
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert json.loads(out) == {"served": ["echo", "sink", "source"]}
    assert got["rtt_ms"]["n"] == 10 and 0 < got["rtt_ms"]["min"] <= got["rtt_ms"]["median"] < 20
    for d in ("forward", "reverse"):
        m = got[d]
        assert m["streams"] == 3 and m["counter"] == "tcp_info"
        # the receiver's window: ~0.7 s, and bytes / seconds is the figure reported
        assert 0.6 <= m["seconds"] <= 1.2
        assert m["mbit"] == pytest.approx(m["bytes"] * 8 / m["seconds"] / 1e6, rel=1e-3)
        assert m["mbit"] > 100  # loopback
        assert m["segs_out"] > 0 and 0 <= m["retrans"] <= m["segs_out"]
        # what an exchange after a round's idle meets: this host's congestion control and idle restart
        cc = Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
        idle = Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle").read_text().strip() != "0"
        assert m["mss"] > 0 and m["cc"] == cc and m["restarts_idle"] == (idle and not cc.startswith("bbr"))
    # two directions of 0.3 + 0.7 s, and the receiver's close stops the sender at once: far from the
    # server's 60 s timeout. The rest is the client's start, 5 s when the suite keeps every core busy
    assert took < 2 * 1.0 + 10.0


def test_both_senders_use_the_exchanges_congestion_control_and_a_refused_one_is_named():
    idle = Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle").read_text().strip() != "0"
    port = free_port(1)
    srv = _server(port, timeout=60)
    try:  # the host's default here is BBR; the exchange's streams run reno (and restart after idle)
        r = _probe("client", "--host", "127.0.0.1", "--port", str(port), "--token", "tok", "--streams", "2",
                   "--warmup", "0.2", "--duration", "0.3", "--rtt-count", "3", "--congestion", "reno")
        srv.communicate(timeout=30)
    finally:
        srv.kill()
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert [(got[d]["cc"], got[d]["restarts_idle"]) for d in ("forward", "reverse")] == [("reno", idle)] * 2

    port = free_port(1)
    srv = _server(port, timeout=30)
    try:
        r = _probe("client", "--host", "127.0.0.1", "--port", str(port), "--token", "tok", "--streams", "1",
                   "--warmup", "0.2", "--duration", "0.3", "--rtt-count", "3", "--congestion", "no_such_cc")
    finally:
        srv.kill()
    assert r.returncode != 0 and "TCP congestion control 'no_such_cc' refused" in json.loads(r.stdout)["message"]


def test_a_port_in_use_is_reported_by_both_ends():
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        port = other.getsockname()[1]
        r = _probe("serve", "--bind", "127.0.0.1", "--port", str(port), "--token", "tok")
        assert r.returncode == 3
        assert json.loads(r.stdout)["error"] == "busy" and f"port {port} is in use" in json.loads(r.stdout)["message"]
        # the client does not take the stranger for a probe server
        c = _probe("client", "--host", "127.0.0.1", "--port", str(port), "--token", "tok", "--window", "1")
        assert c.returncode == 1
        assert "answered by something that is not this probe" in json.loads(c.stdout)["message"]


def test_the_server_ignores_a_wrong_token_and_gives_up_on_time():
    port = free_port(1)
    srv = _server(port, "right", accept_timeout=2)
    try:
        c = _probe("client", "--host", "127.0.0.1", "--port", str(port), "--token", "wrong", "--window", "3")
        out, _ = srv.communicate(timeout=30)
    finally:
        srv.kill()
    assert c.returncode == 1 and srv.returncode == 1
    assert "timed out waiting for the client" in json.loads(out)["message"]


SPEC = """# local sites on loopback
[run]
name = "probe-local"

[model]
preset = "tiny"  # tiny CPU model

[data]
batch_size = 2
seq_len = 32

[train]
threads = 1
device = "cpu"

[diloco]
h = 5  # rewritten by tune-h --write
compression = "int8"

[[sites]]
name = "a"
hosts = ["local"]
work_dir = "{root}/a"

[[sites]]
name = "b"
hosts = ["local"]
work_dir = "{root}/b"
"""


def test_tune_h_on_a_local_spec_measures_writes_and_records(tmp_path: Path):
    p = tmp_path / "spec.toml"
    p.write_text(SPEC.format(root=tmp_path))
    port = free_port(1)
    r = CliRunner().invoke(app, ["tune-h", str(p), "--duration", "0.5", "--warmup", "0.2", "--port", str(port),
                                 "--write", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert [(x["src"], x["dst"]) for x in res["links"]] == [("a", "b"), ("b", "a")]
    assert all(x["mbit"] > 100 and x["rtt_ms"] < 20 for x in res["links"])
    assert res["steps"]["source"] == "bench" and set(res["steps"]["per_site"]) == {"a", "b"}
    assert all(v > 0 for v in res["steps"]["per_site"].values())
    # benchmarked with the one thread per process its trainers get on CPU, not torch's default
    assert [res["steps"]["bench"][s]["threads"] for s in ("a", "b")] == [1, 1]
    assert res["phases"][0][0] == "gather"  # int8 contributions are gathered whole (the guard decodes each site's bytes)
    h = res["h"]
    assert h % 10 == 0 and res["within_max"] and res["written"]
    text = p.read_text()
    assert f"h = {h}  # rewritten by tune-h --write" in text and "# tiny CPU model" in text
    # the TLS transport (the spec's default) between two sites on this host: its streams leave TLS
    # after the hello and a collective uses one of them, so one stream is probed and nothing derived
    assert (res["transport"], res["streams"], res["streams_derived"]) == ("tls", 1, False)
    assert all(not x["sweep"] for x in res["links"]) and "transport_streams" not in tomllib.loads(text)["diloco"]
    # probed with the streams' own congestion control (auto: loss-based, not this host's BBR), so an
    # idle round's slow-start restart is charged where the host restarts idle connections
    idle = Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle").read_text().strip() != "0"
    assert all(x["restarts_idle"] == idle for x in res["links"]), res["links"]
    with Store.open() as store:
        (t,) = store.tunes()
    assert t.id == res["tune_id"] and t.h == h and t.spec_path == str(p.resolve())
    assert t.payload_bytes == res["payload_bytes"] and len(t.links) == 2
    assert t.prediction["sync_share"] == pytest.approx(1 - res["choice"]["efficiency"])


def test_tune_h_reports_a_probe_port_in_use(tmp_path: Path):
    p = tmp_path / "spec.toml"
    p.write_text(SPEC.format(root=tmp_path))
    before = p.read_text()
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        port = other.getsockname()[1]
        t0 = time.monotonic()
        r = CliRunner().invoke(app, ["tune-h", str(p), "--port", str(port), "--write"])
        took = time.monotonic() - t0
    assert r.exit_code == 1, r.output
    errors = [x for x in r.stderr.splitlines() if x.startswith("error")]
    assert errors == [f"error: local (b): probe port {port} is already in use (choose another with --port)"]
    assert took < 10  # reported when the server fails, not after the client's retries
    assert p.read_text() == before
    with Store.open() as store:
        assert store.tunes() == []

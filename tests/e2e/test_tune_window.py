"""tune-h on WAN hosts as they come, with the TCP settings of a default Linux install:

- buffers smaller than the link's bandwidth-delay product: each connection gets buffer/RTT, whatever
  the link could carry. tune-h measures one stream and then doubles them until the link is full,
  derives the TLS transport's S from that (the spec sets none) and models S striped streams, so
  its prediction holds for the run;
- slow start after idle (with a loss-based congestion control): every round's exchange starts from
  a 10-segment window after the compute left the connections idle. The probe reports the senders'
  setting and tune-h charges the restart."""

from __future__ import annotations

import json
import statistics
import subprocess

import pytest
import tomlkit

from dilococtl.tune.choose import derive_streams
from dilococtl.tune.measure import Link
from tests.e2e.conftest import cli, dctl, lab_up, tune_then_run

pytestmark = [pytest.mark.e2e, pytest.mark.timed, pytest.mark.slow]
RATE_MBIT = 50


@pytest.fixture
def lab_window(tmp_path_factory):
    # 50 Mbit/s x 80 ms = 500 kB in flight to fill the link; 128 kB buffers let one connection carry
    # ~8 Mbit/s (measured 7.2-8.0), four ~32: as Linux's 4-6 MB defaults on a 1 Gbit/s, 80 ms WAN
    yield from lab_up(tmp_path_factory, "labwin", "--sites", "2", "--rate", f"{RATE_MBIT}mbit", "--rtt", "80ms",
                      "--tcp-buffer", "128k", runs=("lab-window",))


def test_tune_h_measures_what_one_connection_gets_and_predicts_the_run(lab_window):
    home, spec = lab_window
    launched_untuned_with_what_doctor_measured(home, spec)
    # a loose budget keeps H (and the test) short: the check is the exchange against the prediction
    tuned, summary, exchange = tune_then_run(home, spec, "lab-window", 0.3, rounds=4)
    assert tuned["transport"] == "tls" and tuned["streams_derived"]
    assert all(x["stream_mbit"] < 0.4 * RATE_MBIT for x in tuned["links"]), tuned["links"]  # window-limited
    assert all(x["sweep"][-1][1] > 2.5 * x["stream_mbit"] for x in tuned["links"]), tuned["links"]  # streams add up
    assert tuned["streams"] >= 4  # ~50 / 8 Mbit/s: the bandwidth-delay product over one window
    # the tiny model's round (~0.5 MB) is one bandwidth-delay product: the streams' windows hold it,
    # and pacing them would slow it (tune.derive_link_pace; 0.5 MiB here: 0.197 s unpaced, 0.253 s paced)
    assert tuned["pace_mbit"] == 0 and tuned["link_pace"] == {} and not tuned["pace_derived"]
    want = tuned["choice"]["sync_s"]
    print(f"\nwindow-limited: one stream {[round(x['stream_mbit'], 1) for x in tuned['links']]} Mbit/s, sweep "
          f"{[x['sweep'] for x in tuned['links']]}, S = {tuned['streams']}; exchange median "
          f"{statistics.median(exchange):.3f}s vs predicted {want:.3f}s ({exchange})")
    # gloo, one connection per pair measured with four streams, ran 1.68x its prediction (0.76 vs
    # 0.455 s); measured as the run uses it (one stream), within 30%. TLS: S streams, as measured
    assert 0.7 * want <= statistics.median(exchange) <= 1.3 * want, (exchange, want)


@pytest.fixture
def lab_idle(tmp_path_factory):
    yield from lab_up(tmp_path_factory, "labidle", "--sites", "2", "--rate", f"{RATE_MBIT}mbit", "--rtt", "80ms",
                      runs=("lab-idle",))


def test_tune_h_charges_the_slow_start_after_each_rounds_idle(lab_idle):
    home, spec = lab_idle
    # the lab's nodes are WAN-tuned (no slow start after idle; BBR here); make them default
    # hosts: Reno (CUBIC is not allowed in namespaces here) and slow start after idle
    st = json.loads(dctl(home, "status", "--json").stdout)
    for node in st["nodes"]:
        subprocess.run(["ip", "netns", "exec", node["netns"], "sysctl", "-qw", "net.ipv4.tcp_congestion_control=reno",
                        "net.ipv4.tcp_slow_start_after_idle=1"], check=True)
    # budget 0.1: rounds of ~5 s of compute, many RTOs of idle: the window restarts from 10 segments
    # (at 0.3 the TLS exchange left ~0.7 s of compute, 2-3 RTOs, and kept part of its window)
    tuned, summary, exchange = tune_then_run(home, spec, "lab-idle", 0.1, rounds=4)
    assert all(x["restarts_idle"] and x["mss"] == 1448 for x in tuned["links"]), tuned["links"]
    want, restart = tuned["choice"]["sync_s"], tuned["choice"]["breakdown"]["restart_s"]
    warm = want - restart
    print(f"\nidle restart: exchange median {statistics.median(exchange):.3f}s vs predicted {want:.3f}s "
          f"({restart:.3f}s of it the restart; {warm:.3f}s without)")
    # measured in the lab: 0.57-0.65 s against 0.54 s predicted, 0.27 s without the restart term: the
    # restart is real and charged. The prediction assumes a loss-free ramp from 10 segments; when the
    # first round's slow start overshoots the tbf queue (its ~500 kB is about one bandwidth-delay
    # product, so some runs lose packets there and some do not), ssthresh stays at half that window and
    # every later restart ramps past it linearly: 0.75-0.77 s, 1.41x of the 0.536 s predicted then, 1.56x of
    # the 0.495 s predicted since the replay stopped charging the weight all-gather twice (BENCHMARKS.md,
    # "tune-h against the run it tuned"). Hence 1.7x above: which ramp a run gets is not predictable.
    assert 0.7 * want <= statistics.median(exchange) <= 1.7 * want, (exchange, want)
    assert statistics.median(exchange) >= 1.15 * warm, (exchange, warm)


def launched_untuned_with_what_doctor_measured(home, spec):
    """`doctor --links` records the links; a launch of the untuned spec (no streams, no pacing) runs
    with the streams derived from them, says so, and records it; the spec file stays as it was."""
    untuned = spec.with_name("untuned.toml")
    doc = tomlkit.parse(spec.read_text())
    doc["run"]["name"] = "lab-untuned"
    doc["diloco"]["rounds"] = 2
    untuned.write_text(tomlkit.dumps(doc))
    r = cli(home, "doctor", str(untuned), "--links", "--json", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    bw = json.loads(r.stdout)["bandwidth"]
    assert sorted((x["src"], x["dst"]) for x in bw) == [("site0", "site1"), ("site1", "site0")], bw
    assert all(x["stream_mbit"] < 0.4 * RATE_MBIT and x["sweep"][-1][1] > 2.5 * x["stream_mbit"] for x in bw), bw
    r = cli(home, "launch", str(untuned), "--wait", "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "derived from the links doctor measured" in r.stderr, r.stderr[-2000:]
    run = json.loads(r.stdout)["id"]
    want = derive_streams([Link(**x) for x in bw])
    assert want > 4, bw  # not the default's 4: ~50 / 8 Mbit/s, the bandwidth-delay product over one window
    # the tiny model's round is about one bandwidth-delay product: derived unpaced (tune.derive_link_pace)
    logs = cli(home, "logs", run, "--all", "--grep", "transport tls").stdout
    assert logs.count(f"transport tls, {want} streams per peer and direction; unpaced") == 2, logs
    assert "transport_streams" not in untuned.read_text()

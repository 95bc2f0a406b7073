"""`dilococtl tune-h` end to end on a `dilococtl lab`: links at 10, 50 and 200 Mbit/s with different
RTTs, measured from the nodes themselves over SSH, as a user types the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.e2e.conftest import E2E_MAX_H, lab_up

pytestmark = [pytest.mark.e2e, pytest.mark.timed, pytest.mark.slow, pytest.mark.timeout(240)]

# ordered pair -> (configured rate Mbit/s, configured RTT ms); every pair is shaped both ways
LINKS = {("site0", "site1"): (10, 20), ("site1", "site2"): (200, 40), ("site0", "site2"): (50, 80)}
TBF_GOODPUT = 0.96  # tbf counts Ethernet frames: TCP goodput is ~96% of the configured rate (DESIGN.md)


@pytest.fixture(scope="module")
def lab3(tmp_path_factory):
    """3 sites x 1 node with three different links; always torn down."""
    yield from lab_up(tmp_path_factory, "tunelab", "--sites", "3", "--nodes-per-site", "1", "--rate", "50mbit",
                      "--rtt", "20ms", *[a for (s, d), (r, t) in LINKS.items() for a in ("--link", f"{s}-{d}={r}mbit/{t}ms")],
                      "--json")


def _tune(home: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    env = {**os.environ, "DILOCOCTL_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "dilococtl", "tune-h", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_tune_h_measures_the_lab_links_and_writes_h(lab3):
    home, spec = lab3
    before = spec.read_text()
    # 8 s windows: the receiver's byte counter advances in jumps when a retransmission fills a hole
    # (tbf drops), so a window boundary inside a recovery can be off by up to a BDP per stream; 8 s
    # keeps that under ~5% even on the 80 ms link
    # --max-h: the 10 Mbit link with a fast CPU step can need H > 1000 (see E2E_MAX_H)
    # --streams 1: one stream per direction, what the rates below are checked against (without it
    # the TLS transport's sweep probes 2, 4, ... streams too: test_tune_window.py covers that)
    r = _tune(home, str(spec), "--duration", "8", "--budget", "0.1", "--max-h", str(E2E_MAX_H), "--write", "--json",
              "--streams", "1", "--accept-new-host-keys")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)

    got = {(x["src"], x["dst"]): x for x in res["links"]}
    assert len(got) == 6
    for (a, b), (rate, rtt) in LINKS.items():
        for pair in ((a, b), (b, a)):
            x = got[pair]
            want = TBF_GOODPUT * rate
            assert abs(x["mbit"] - want) <= 0.10 * want, f"{pair}: {x['mbit']:.2f} Mbit/s, want ~{want:.1f}"
            assert abs(x["rtt_ms"] - rtt) <= 5, f"{pair}: RTT {x['rtt_ms']:.1f} ms, configured {rtt}"
            assert x["segs_out"] > 0

    # the choice follows from what was measured (the same model the unit tests check by hand)
    from dilococtl.spec import load_spec
    from dilococtl.tune.choose import plan
    from dilococtl.tune.measure import Link

    links = [Link(**x) for x in res["links"]]
    again = plan(load_spec(spec), links, res["steps"], budget=0.1, max_h=E2E_MAX_H)
    assert res["h"] == again.choice.h and res["choice"]["sync_s"] == pytest.approx(again.choice.sync_s)
    # codec "none": one all-gather of the fp32 payload per round (the guard decodes every site's own
    # bytes), then of the 32-byte digest of the average every site decoded
    n = res["payload_bytes"] - 32
    assert res["phases"] == [["gather", n], ["gather", 32]]
    # the ring's slowest edge is the 10 Mbit link: K-1 = 2 steps of the whole payload cannot be faster
    assert res["choice"]["breakdown"]["payload_s"] >= 2 * n * 8 / (10 * 1e6)

    assert res["written"]
    after = spec.read_text()
    assert tomllib.loads(after)["diloco"]["h"] == res["h"]
    assert after.splitlines()[0] == before.splitlines()[0]  # the lab's header comment is kept

"""tune-h's model of the TLS transport against the run it tuned, on three sites joined by links of
different rates and round trips: the ring's edges differ, so the slowest edge and the pipelining
of the chunks over the others both show in a round's exchange."""

from __future__ import annotations

import statistics

import pytest

from tests.e2e.conftest import lab_up, tune_then_run

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
# ring order site0 -> site1 -> site2 -> site0: 20 Mbit/s at 40 ms, 100 at 120, 50 at 80
LINKS = ("site0-site1=20mbit/40ms", "site1-site2=100mbit/120ms")
TOLERANCE = 0.10  # the bound, on the exchange the model describes: one with the CPU it needs
# The transport forwards every chunk through Python threads at every hop, so a round whose
# exchange found the cores taken runs longer than the model: on this 2-core machine shared with
# other labs (load 5-8), rounds ran 0.94-1.64x the prediction while the run's step time was 2.5-4x
# its benchmark; on a quieter one 0.94-1.04x but one (BENCHMARKS.md, "tune-h against the run it
# tuned"). So: the fastest round within TOLERANCE, none faster than the prediction allows, and the
# median within CONTENDED of it.
CONTENDED = 1.5


@pytest.fixture
def lab_asym(tmp_path_factory):
    yield from lab_up(tmp_path_factory, "labasym", "--sites", "3", "--rate", "50mbit", "--rtt", "80ms",
                      *[a for x in LINKS for a in ("--link", x)], runs=("lab-asym",))


def test_each_rounds_exchange_is_what_tune_h_predicted_for_the_tls_transport(lab_asym):
    home, spec = lab_asym
    tuned, summary, exchange = tune_then_run(home, spec, "lab-asym", 0.3, rounds=6, by_round=True)
    assert tuned["transport"] == "tls" and tuned["streams"] >= 1
    want = tuned["choice"]["sync_s"]
    br = tuned["choice"]["breakdown"]
    print(f"\nasymmetric 3 sites, S = {tuned['streams']} ({'derived' if tuned['streams_derived'] else 'spec'}), "
          f"H = {summary['h']}: predicted {want:.3f}s (quorum {br['quorum_s']:.3f}, weight {br['weight_s']:.3f}, "
          f"payload {br['payload_s']:.3f}); rounds 2-: {[round(x, 3) for x in exchange]} "
          f"(median {statistics.median(exchange):.3f}s, {statistics.median(exchange) / want:.2f}x)")
    assert len(exchange) == 5
    assert abs(min(exchange) - want) <= TOLERANCE * want, (exchange, want)  # the model's exchange
    for i, x in enumerate(exchange, start=2):  # contention only adds time: no round may beat the model
        assert x >= (1 - TOLERANCE) * want, f"round {i}: exchange {x:.3f}s vs predicted {want:.3f}s ({exchange})"
    assert statistics.median(exchange) <= CONTENDED * want, (exchange, want)

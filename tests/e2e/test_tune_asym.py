"""tune-h's model of the TLS transport against the run it tuned, on three sites joined by links of
different rates and round trips: the ring's edges differ, so the slowest edge and the pipelining
of the chunks over the others both show in a round's exchange."""

from __future__ import annotations

import statistics

import pytest

from tests.e2e.conftest import cli, lab_up, tune_then_run

pytestmark = [pytest.mark.e2e, pytest.mark.timed, pytest.mark.slow, pytest.mark.timeout(900)]
# ring order site0 -> site1 -> site2 -> site0: 20 Mbit/s at 40 ms, 100 at 120, 50 at 80
LINKS = ("site0-site1=20mbit/40ms", "site1-site2=100mbit/120ms")
TOLERANCE = 0.10  # the bound, on the median round against tune-h's round
LAST_SITE_TOLERANCE = 0.20  # the median round against the round tune-h predicts for the site that arrived
# last (tls_model.tls_last_site) and against each round replayed from how the sites arrived
# (dilococtl.tune.history.rounds_against_model). A quiet machine keeps both within 0.10; on CI's shared cores every
# round where site1 arrived last paid 0.05-0.17 s more payload than its replay (1.17x median, while tune-h's
# own round held at 1.08x): the guard decodes and screens three contributions on the CPU the model does not carry.
ROUND_TOLERANCE = 0.20  # each round against tune-h's round (the farthest site last). A round where two sites
# arrive within a request's flight to the Lighthouse waits longer than either's clean last arrival; replayed
# from the arrivals, every round of a quiet run came within 1.01-1.03x (BENCHMARKS.md, "The TLS transport's
# model"), but shared cores stretch single rounds.
# The streams run the transport's default congestion control, loss-based (trainer/transport/tcp_cc.py: why not BBR).


@pytest.fixture
def lab_asym(tmp_path_factory):
    yield from lab_up(tmp_path_factory, "labasym", "--sites", "3", "--rate", "50mbit", "--rtt", "80ms",
                      *[a for x in LINKS for a in ("--link", x)], runs=("lab-asym",))


def test_each_rounds_exchange_is_what_tune_h_predicted_for_the_tls_transport(lab_asym):
    home, spec = lab_asym
    tuned, summary, exchange = tune_then_run(home, spec, "lab-asym", 0.3, rounds=8, by_round=True)
    assert tuned["transport"] == "tls" and tuned["streams"] >= 1
    # a round moves its ~0.67 MB over the 20 Mbit/s x 40 ms link (BDP 0.1 MB) several times over: that link
    # is paced at its own rate; the round fits in the others' bandwidth-delay products: unpaced
    assert tuned["pace_derived"] and set(tuned["link_pace"]) == {"site0->site1", "site1->site0"}, tuned["link_pace"]
    assert all(18 <= v <= 22 for v in tuned["link_pace"].values()), tuned["link_pace"]
    want = tuned["choice"]["sync_s"]
    br = tuned["choice"]["breakdown"]
    print(f"\nasymmetric 3 sites, S = {tuned['streams']} ({'derived' if tuned['streams_derived'] else 'spec'}), "
          f"H = {summary['h']}: predicted {want:.3f}s (quorum {br['quorum_s']:.3f}, weight {br['weight_s']:.3f}, "
          f"payload {br['payload_s']:.3f}); rounds 2-: {[round(x, 3) for x in exchange]} "
          f"(median {statistics.median(exchange):.3f}s, {statistics.median(exchange) / want:.2f}x)")
    per_last = [tuned["choice"]["last_site"][s] for s in summary["last_site"]]
    print("per round, the last site and its prediction: " + ", ".join(
        f"{s} {x:.3f}/{p:.3f} ({x / p:.2f}x)" for s, x, p in zip(summary["last_site"], exchange, per_last, strict=True)))
    assert len(exchange) == 7
    paced = cli(home, "logs", "lab-asym", "--site", "site0", "--grep", "paced to", timeout=60).stdout
    assert f"paced to site1 {tuned['link_pace']['site0->site1']:g} Mbit/s, other sites unpaced" in paced, paced
    assert all(q > 0 and w > 0 and x > 0 for q, w, x in summary["last_parts"]), summary["last_parts"]
    replay = summary["replay"]  # each round replayed in tune-h's model from how the sites arrived
    assert [g["round"] for g in replay] == list(range(2, 9))
    assert abs(statistics.median(g["sync_s"] / g["predicted_s"] for g in replay) - 1) <= LAST_SITE_TOLERANCE, replay
    assert abs(statistics.median(exchange) - want) <= TOLERANCE * want, (exchange, want)
    ratios = [x / p for x, p in zip(exchange, per_last, strict=True)]
    assert abs(statistics.median(ratios) - 1) <= LAST_SITE_TOLERANCE, ratios
    for i, x in enumerate(exchange, start=2):
        assert abs(x - want) <= ROUND_TOLERANCE * want, f"round {i}: exchange {x:.3f}s vs predicted {want:.3f}s ({exchange})"

"""trainer.service.lighthouse_status on a real torchft Lighthouse's page and on pages that must not end a run."""

from __future__ import annotations

import threading
import time
import urllib.request
from datetime import timedelta
from types import SimpleNamespace

import pytest

from trainer.service.lighthouse_status import ended_without, parse_status


@pytest.fixture(scope="module")
def page_after_the_end() -> str:
    """The status page of a real Lighthouse after site0 and site2 finished the run (trainer.modes.ft.announce_end's
    heartbeat, after their replicas' own) while site1 never came."""
    from torchft.coordination import LighthouseClient, LighthouseServer

    from trainer.modes.ft import announce_end

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100)
    try:
        c = LighthouseClient(lh.address(), connect_timeout=timedelta(seconds=5))
        for site in ("site0", "site2"):
            c.heartbeat(f"{site}:0b1c")
            announce_end(SimpleNamespace(_dilococtl_lighthouse=lh.address()), site)
        time.sleep(0.3)
        with urllib.request.urlopen(lh.address().rstrip("/") + "/status", timeout=5) as r:
            return r.read().decode()
    finally:
        lh.shutdown()


def test_the_page_parses(page_after_the_end):
    st = parse_status(page_after_the_end)
    assert st.ended == {"site0", "site2"}
    assert set(st.seen_s) == {"site0", "site2"} and all(0 <= s < 5 for s in st.seen_s.values()), st.seen_s


def test_the_run_ends_only_once_the_others_are_gone(page_after_the_end):
    page = page_after_the_end
    assert ended_without(page, "site1") is None  # they heartbeated moments ago
    why = ended_without(page, "site1", gone_s=0.0)
    assert why == "the run ended without this site: site0, site2 finished its last round and no other site is left"
    assert ended_without(page.replace("dilococtl-ended", "x"), "site1", gone_s=0.0) is None  # nobody announced
    assert "site2 finished" in ended_without(page, "site0", gone_s=0.0)  # its own announcement is not news


def test_one_live_site_keeps_the_run_going():
    beat = '<li class="heartbeat">{}: seen {} ago</li>'
    page = "<h2>Heartbeats</h2><ul>" + "".join(beat.format(r, a) for r, a in [
        ("site0:ab", "12.5s"), ("site0:dilococtl-ended", "12.4s"), ("site2:cd", "250ms"), ("site1:ef", "10ms")])
    assert parse_status(page).seen_s == {"site0": 12.5, "site2": 0.25, "site1": 0.01}
    assert ended_without(page, "site1") is None  # site2 still runs: it may yet need this site
    assert ended_without(page.replace("250ms", "1m 3s"), "site1") is not None
    assert ended_without(page.replace("250ms", "a while"), "site1") is None  # an age it cannot read: alive
    restarted = page.replace("site2:cd", "site0:new")  # a replica of site0 started again after its end
    assert parse_status(restarted).seen_s["site0"] == 0.25 and ended_without(restarted, "site1") is None


@pytest.mark.parametrize("page", [
    "", "not a status page", "<h2>Heartbeats</h2><ul></ul>",
    '<li class="heartbeat">site0:dilococtl-ended: seen 50s ago</li>',  # outside the heartbeats section
])
def test_pages_that_say_nothing_end_nothing(page):
    assert ended_without(page, "site1", gone_s=0.0) is None


def test_a_sites_other_ranks_stop_waiting_when_rank_0_finds_the_run_over():
    """Rank 0 reads the page and writes the verdict to the site's store; a rank waiting on its quorum RPC
    (here: one that never returns) reads it there and raises RunEnded instead of waiting on."""
    from torch.distributed import TCPStore

    from trainer.modes.ft import RUN_ENDED_KEY, RunEnded, _QuorumWatch

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    watch = _QuorumWatch("", None, site="site1", store=store)
    never = threading.Event()
    threading.Timer(0.5, store.set, args=(RUN_ENDED_KEY, "the run ended without this site: site0 left")).start()
    t0 = time.monotonic()
    with pytest.raises(RunEnded, match="site0 left"):
        watch.wait(never.wait, step=4)
    assert time.monotonic() - t0 < 5
    fresh = _QuorumWatch("", None, site="site1")
    assert fresh.wait(lambda: 7, step=4) == 7  # a quorum that returns is handed through, and its error too
    with pytest.raises(ZeroDivisionError):
        fresh.wait(lambda: 1 / 0, step=4)

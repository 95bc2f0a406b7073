"""trainer.lighthouse_status on a real torchft Lighthouse's page and on pages that must not end a run."""

from __future__ import annotations

import threading
import time
import urllib.request
from datetime import timedelta

import pytest

from trainer.lighthouse_status import ended_without, parse_status


@pytest.fixture(scope="module")
def page_after_final_quorum() -> str:
    """The status page of a Lighthouse whose last quorum was site0 and site2 at step 6."""
    from torchft.coordination import LighthouseClient, LighthouseServer

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100)
    try:
        def ask(site: str) -> None:
            c = LighthouseClient(lh.address(), connect_timeout=timedelta(seconds=5))
            c.quorum(replica_id=f"{site}:0b1c", timeout=timedelta(seconds=10), address="a", store_address="b",
                     step=6, world_size=1, shrink_only=False)

        threads = [threading.Thread(target=ask, args=(s,)) for s in ("site0", "site2")]
        [t.start() for t in threads]
        [t.join() for t in threads]
        time.sleep(0.3)
        with urllib.request.urlopen(lh.address().rstrip("/") + "/status", timeout=5) as r:
            return r.read().decode()
    finally:
        lh.shutdown()


def test_the_page_parses(page_after_final_quorum):
    st = parse_status(page_after_final_quorum)
    assert st.previous == {"site0": 6, "site2": 6}
    assert set(st.seen_s) == {"site0", "site2"} and all(0 <= s < 5 for s in st.seen_s.values()), st.seen_s


def test_the_run_ends_only_once_the_others_are_gone(page_after_final_quorum):
    page = page_after_final_quorum
    assert ended_without(page, "site1", final_step=6) is None  # they heartbeated moments ago
    why = ended_without(page, "site1", final_step=6, gone_s=0.0)
    assert why == "the run ended without this site: site0, site2 committed its last round at step 6 and left"
    assert ended_without(page, "site1", final_step=7, gone_s=0.0) is None  # not the last round yet
    assert ended_without(page, "site0", final_step=6, gone_s=0.0) is None  # this site was in it


def test_stale_heartbeats_read_as_gone():
    page = ('<h3>Previous Quorum</h3> <b>site0:ab</b> <br/>\n  Step: 12 <br/> <h2>Heartbeats</h2><ul>'
            '<li class="heartbeat\n  ">\n    site0:ab: seen 12.5s ago\n  </li>'
            '<li class="heartbeat">site0:new: seen 250ms ago</li></ul>')
    assert parse_status(page).seen_s == {"site0": 0.25}  # a restarted replica of the same site: the newest
    assert ended_without(page, "site1", 12) is None
    assert ended_without(page.replace("site0:new: seen 250ms ago", ""), "site1", 12) is not None


@pytest.mark.parametrize("page", [
    "", "not a status page", "<h3>Previous Quorum</h3>\n<h2>Heartbeats</h2>",  # no previous quorum
    "<h3>Previous Quorum</h3><b>site0:x</b><br/>Step: -3<br/>",  # no step it can parse
    "<h3>Previous Quorum</h3><b>site0:x</b><br/>Step: 99999999999999999999<br/><b>site2:y</b><br/>Step: 1<br/>",
    "<b>site0:x</b><br/>Step: 50<br/>",  # a member outside the previous quorum's section
])
def test_pages_that_say_nothing_end_nothing(page):
    assert ended_without(page, "site1", final_step=6, gone_s=0.0) is None


def test_a_sites_other_ranks_stop_waiting_when_rank_0_finds_the_run_over():
    """Rank 0 reads the page and writes the verdict to the site's store; a rank waiting on its quorum RPC
    (here: one that never returns) reads it there and raises RunEnded instead of waiting on."""
    from torch.distributed import TCPStore

    from trainer.ft import RUN_ENDED_KEY, RunEnded, _QuorumWatch

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    watch = _QuorumWatch("", None, site="site1", final_step=6, store=store)
    never = threading.Event()
    threading.Timer(0.5, store.set, args=(RUN_ENDED_KEY, "the run ended without this site: site0 left")).start()
    t0 = time.monotonic()
    with pytest.raises(RunEnded, match="site0 left"), watch.watching(step=4):
        watch.wait(never.wait)
    assert time.monotonic() - t0 < 5
    fresh = _QuorumWatch("", None, site="site1", final_step=6)
    assert fresh.wait(lambda: 7) == 7  # a quorum that returns is handed through, and its error too
    with pytest.raises(ZeroDivisionError):
        fresh.wait(lambda: 1 / 0)

"""Issue 41's pure parts: when a run counts as stalled on its coordinator, and which ports listen."""

from __future__ import annotations

import socket
import time

import pytest

from dilococtl import ports, queries
from dilococtl.nodes import LocalNode
from dilococtl.spec import spec_from_dict
from dilococtl.store import Store


def _run(store: Store, tmp_path):
    spec = spec_from_dict({"run": {"name": "st", "lighthouse_port": 29999, "base_port": 29990},
                           "diloco": {"h": 2, "rounds": 3},
                           "sites": [{"name": "a", "hosts": ["local"], "work_dir": str(tmp_path / "w")},
                                     {"name": "b", "hosts": ["local"], "work_dir": str(tmp_path / "w")}]},
                          str(tmp_path / "spec.toml"))
    return spec, store.create_run(spec)


def test_a_site_stalls_from_unreachable_until_back(tmp_path):
    with Store.open() as store:
        _, run = _run(store, tmp_path)
        assert queries.stall(store, run.id) is None
        store.add_event(run.id, "coordinator_unreachable", "cannot reach the Lighthouse (refused) since 10:00:00",
                        site="a", detail={"since": 1000.0}, t=1001.0)
        store.add_event(run.id, "coordinator_unreachable", "cannot reach the Lighthouse (refused) since 10:00:02",
                        site="b", detail={"since": 1002.0}, t=1003.0)
        st = queries.stall(store, run.id)
        assert st == {"since": 1000.0, "cause": "cannot reach the Lighthouse (refused) since 10:00:00",
                      "sites": ["a", "b"], "by_site": {"a": 1000.0, "b": 1002.0}}
        store.add_event(run.id, "coordinator_back", "answers again", site="a", t=1010.0)
        assert queries.stall(store, run.id)["sites"] == ["b"]
        store.add_event(run.id, "coordinator_back", "answers again", site="b", t=1011.0)
        assert queries.stall(store, run.id) is None
        # a later outage stalls again
        store.add_event(run.id, "coordinator_unreachable", "again", site="b", detail={"since": 1100.0}, t=1101.0)
        assert queries.stall(store, run.id) == {"since": 1100.0, "cause": "again", "sites": ["b"], "by_site": {"b": 1100.0}}


def test_run_ports_and_which_listen(tmp_path):
    with Store.open() as store:
        spec, _ = _run(store, tmp_path)
    assert ports.run_ports(spec) == {"local": {29999: "the Lighthouse's TLS relay",
                                               29990: "a's torchrun rendezvous", 29991: "b's torchrun rendezvous"}}
    text = ("  sl  local_address rem_address   st\n"
            "   0: 0100007F:7530 00000000:0000 0A 00000000:00000000\n"  # 127.0.0.1:30000 listening
            "   1: 0100007F:7531 0100007F:9C40 01 00000000:00000000\n")  # 30001: a connection, not a listener
    assert ports.listening(text) == {30000}
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
        assert port in ports.listening_on(LocalNode())
        found = [(h, p) for h, p, _ in ports.taken(spec, lambda h: LocalNode())]
        assert (("local", port) in found) is (port in (29999, 29990, 29991))
    msg = ports.refusal([("local", 29999, "the Lighthouse's TLS relay"), ("local", 29990, "a's torchrun rendezvous")])
    assert msg.startswith("port local:29999 is already in use (the run needs it for the Lighthouse's TLS relay)")
    assert "(and 1 more: local:29990)" in msg


def test_a_site_reports_an_outer_service_that_stops_answering_once_per_outage(tmp_path, monkeypatch):
    import threading
    import time

    from dilococtl import service_keys
    from trainer.rules.diloco_config import DilocoConfig
    from trainer.service import service_client
    from trainer.service.outer_service import OuterService, make_server, read_token

    keys = service_keys.ensure(tmp_path / "keys", ["127.0.0.1"])
    svc = OuterService(DilocoConfig(mode="async", sites=2))

    def serve(port: int):
        server = make_server(svc, "127.0.0.1", port, cert=keys.cert, key=keys.key, token=read_token(keys.token))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    first = serve(0)
    port = first.server_address[1]
    first.shutdown()
    first.server_close()  # the service is gone; it comes back at the same address 0.4 s later
    monkeypatch.setattr(service_client, "RETRY_BACKOFF_S", (0.05,))
    c = service_client.ServiceClient(f"https://127.0.0.1:{port}", cert=str(keys.cert), token_file=str(keys.token),
                                     retry_s=5)
    events = []
    c.on_event = lambda kind, msg, **d: events.append((kind, msg, d))
    t0 = time.time()
    timer = threading.Timer(0.4, lambda: holder.append(serve(port)))
    holder: list = []
    timer.start()
    try:
        assert c.health()["version"] == 0
        assert c.health()["version"] == 0  # no outage: nothing more reported
    finally:
        timer.join()
        for s in holder:
            s.shutdown()
            s.server_close()
    assert [k for k, _, _ in events] == ["coordinator_unreachable", "coordinator_back"]
    assert events[0][1].startswith("cannot reach the outer service (") and t0 <= events[0][2]["since"] < t0 + 0.2
    assert events[1][1].startswith("the outer service answers again after")


def test_a_coordinator_is_moved_only_when_most_training_sites_stalled_long_enough(tmp_path):
    from dilococtl import supervise

    with Store.open() as store:
        spec = spec_from_dict({"run": {"name": "mv", "lighthouse_port": 29999, "base_port": 29990},
                               "diloco": {"h": 2, "rounds": 3, "sites": 3},
                               "sites": [{"name": n, "hosts": ["local"], "work_dir": str(tmp_path / "w")}
                                         for n in ("a", "b", "c")]}, str(tmp_path / "spec.toml"))
        run = store.create_run(spec)
        for n in ("a", "b", "c"):
            store.set_site_state(run.id, n, "running")
        store.set_lighthouse(run.id, {"host": "h0", "pid": 1})
        move_after = supervise.MOVE_AFTER_S

        def stranded(now: float) -> list[str]:
            return supervise.stranded(store.get_run(run.id), store, now=now)[1]

        store.add_event(run.id, "coordinator_unreachable", "cannot reach (timed out)", site="b",
                        detail={"since": 1000.0}, t=1001.0)
        assert stranded(2000.0) == []  # one of three: the coordinator's own side may be the one cut off
        store.add_event(run.id, "coordinator_unreachable", "cannot reach (timed out)", site="c",
                        detail={"since": 1010.0}, t=1011.0)
        assert stranded(1010.0 + move_after - 1) == []  # not long enough for c yet
        why, stuck = supervise.stranded(store.get_run(run.id), store, now=1010.0 + move_after)
        assert stuck == ["b", "c"] and "b, c of 3 training sites" in why and "on h0" in why
        # a site that no longer trains does not count either way: c dead leaves b alone of a, b
        store.set_site_state(run.id, "c", "failed")
        assert stranded(5000.0) == []
        store.set_site_state(run.id, "c", "running")
        # outages from before the coordinator's last (re)start do not count: the relaunched sites have not
        # reported a round yet
        store.set_lighthouse(run.id, {"host": "h1", "pid": 2, "restarted_at": 1500.0})
        assert stranded(5000.0) == []
        store.add_event(run.id, "coordinator_unreachable", "again", site="b", detail={"since": 1600.0}, t=1601.0)
        store.add_event(run.id, "coordinator_unreachable", "again", site="c", detail={"since": 1600.0}, t=1601.0)
        assert stranded(1600.0 + move_after) == ["b", "c"]


def test_a_host_that_did_not_answer_fails_fast_for_a_while(monkeypatch):
    """One pass over a run asks a lost node several things: each would wait out the SSH connect timeout."""
    from dilococtl import nodes
    from dilococtl.errors import Unreachable
    from dilococtl.spec_types import SSHSection

    tries = []

    def connect(host, ssh, accept_new=False):
        tries.append(host)
        raise Unreachable(f"{host}: unreachable: timed out")

    monkeypatch.setattr(nodes, "connect", connect)
    clock = [100.0]
    monkeypatch.setattr(nodes.time, "monotonic", lambda: clock[0])
    pool = nodes.NodePool(SSHSection())
    for _ in range(3):
        with pytest.raises(Unreachable, match="10.9.0.1: unreachable: timed out"):
            pool.get("10.9.0.1")
    assert tries == ["10.9.0.1"]  # asked once
    clock[0] += nodes.UNREACHABLE_TTL_S + 1
    with pytest.raises(Unreachable):
        pool.get("10.9.0.1")
    assert tries == ["10.9.0.1", "10.9.0.1"]  # and again once the while is over


def test_after_a_move_a_site_relaunched_since_is_left_alone(tmp_path):
    from dilococtl import supervise

    with Store.open() as store:
        _, run = _run(store, tmp_path)
        store.add_launch(run.id, "a", started=900.0)
        store.add_launch(run.id, "a", reason="resume", started=1100.0)  # the operator's resume after the move
        store.set_lighthouse(run.id, {"host": "h1", "pid": 2, "moved_at": 1000.0, "behind": ["a"], "abandoned": []})
        relaunched = []
        run = supervise._after_move(store.get_run(run.id), store=store, pool=None, progress=lambda m: None,
                                    relaunch=lambda *a, **k: relaunched.append(k["sites"]))
        assert relaunched == [] and run.lighthouse["behind"] == [] and run.lighthouse["looked_at"] > 0


@pytest.mark.parametrize("since", [float("nan"), float("inf"), -1e300, 5e9, "soon", None])
def test_a_site_s_word_on_when_its_outage_began_is_checked(tmp_path, since):
    """`since` comes from the site's metrics (a number from the wire): NaN, inf, a time after the event or not
    a number at all fall back to the event's own time; a far past one stays (it is only the site's claim)."""
    with Store.open() as store:
        _, run = _run(store, tmp_path)
        store.add_event(run.id, "coordinator_unreachable", "cannot reach", site="b", detail={"since": since}, t=1001.0)
        st = queries.stall(store, run.id)
    want = -1e300 if since == -1e300 else 1001.0
    assert st["since"] == want and st["by_site"] == {"b": want}


@pytest.mark.parametrize("state, restarted", [("running", True), ("stopped", False), ("finished", False)])
def test_a_run_stopped_while_a_pass_looked_is_not_given_a_new_coordinator(tmp_path, monkeypatch, state, restarted):
    """`stop` during `launch --wait`: the collector's pass read the run as running, then found its Lighthouse
    gone (stop had ended it) and started a new one, which held the run's port for the next launch."""
    from dilococtl import supervise

    calls = []
    monkeypatch.setattr(supervise, "health", lambda run, pool: "its Lighthouse is gone")
    monkeypatch.setattr(supervise, "restart", lambda run, **k: calls.append(run.id) or run)
    with Store.open() as store:
        _, run = _run(store, tmp_path)
        store.set_run_state(run.id, "running")
        store.set_lighthouse(run.id, {"host": "h0", "pid": 1})
        looked = store.get_run(run.id)  # what the pass read before `stop` came
        store.set_run_state(run.id, state)
        supervise.check(looked, store=store, pool=None)
    assert calls == ([run.id] if restarted else [])


def test_one_process_at_a_time_restarts_a_run_s_coordinator(tmp_path):
    """lab chaos relaunched a killed site (runs.launch) while the collector restarted the same dead Lighthouse:
    the second relay found the port taken, ten restarts failed, and the site failed. Both now take this lock."""
    import subprocess
    import sys

    from dilococtl import supervise

    holder = ("import sys, time\nfrom dilococtl.supervise import CoordinatorLock\n"
              "with CoordinatorLock('r1', wait=True):\n    print('held', flush=True)\n    time.sleep(float(sys.argv[1]))\n")
    other = subprocess.Popen([sys.executable, "-c", holder, "1.5"], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        with supervise.CoordinatorLock("r1") as mine:
            assert not mine  # a collector's pass leaves it to whoever holds it
        t0 = time.monotonic()
        with supervise.CoordinatorLock("r1", wait=True) as mine:
            assert mine and time.monotonic() - t0 > 0.5  # a relaunch waits for it
            with supervise.CoordinatorLock("r1") as again:
                assert again  # this process already holds it (a move relaunching the sites)
        with supervise.CoordinatorLock("r2") as mine:
            assert mine  # another run's is another lock
    finally:
        other.wait(10)


@pytest.mark.parametrize("own_host_answers", [True, False])
def test_stranded_sites_with_nowhere_to_move_get_their_coordinator_restarted_in_place(tmp_path, monkeypatch,
                                                                                       own_host_answers):
    """CI: two local sites waited 3 minutes on a Lighthouse whose relay reset every connection; with every site
    on the coordinator's host there was nowhere to move it, and the run only logged 'not moved'."""
    from dilococtl import supervise

    calls = []
    monkeypatch.setattr(supervise, "_new_host", lambda run, store, pool, stuck: "")
    monkeypatch.setattr(supervise, "_answers", lambda pool, host: own_host_answers)
    monkeypatch.setattr(supervise, "restart", lambda run, **k: calls.append(k["why"]) or run)
    with Store.open() as store:
        _, run = _run(store, tmp_path)
        store.set_run_state(run.id, "running")
        store.set_lighthouse(run.id, {"host": "local", "pid": 1})
        supervise.move(store.get_run(run.id), store=store, pool=None, why="a, b of 2 training sites stalled",
                       stuck=["a", "b"], relaunch=lambda *a, **k: None)
        errors = [e.message for e in store.events(run.id, kinds=["error"])]
    if own_host_answers:
        assert calls == ["a, b of 2 training sites stalled; no other host to move it to"] and errors == []
    else:
        assert calls == [] and errors == ["a, b of 2 training sites stalled; no other host of a stalled site "
                                          "answers: not moved"]

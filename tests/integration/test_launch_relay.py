"""launch's Lighthouse relay as processes: the Lighthouse on loopback, the relay on the public port,
both recorded, both ended by stop; a relay that cannot start fails the launch and leaves nothing."""

from __future__ import annotations

import socket
import time

import pytest

from dilococtl import procs, runs
from dilococtl.errors import DilocoError
from dilococtl.nodes import LocalNode
from dilococtl.spec import spec_from_dict
from dilococtl.states import RunState
from dilococtl.store import Store
from tests.ports import free_port
from tests.run_procs import marked


def _spec(tmp_path, port: int, transport: str = "tls"):
    # rounds/h tiny: the trainers are started too, but these tests look at the Lighthouse's pair only
    return spec_from_dict({"run": {"name": "relay", "lighthouse_port": port, "base_port": free_port()},
                           "diloco": {"h": 2, "rounds": 1, "transport": transport},
                           "sites": [{"name": "a", "hosts": ["local"], "work_dir": str(tmp_path / "w")},
                                     {"name": "b", "hosts": ["local"], "work_dir": str(tmp_path / "w")}]},
                          str(tmp_path / "spec.toml"))


def _alive(pid: int, run_id: str) -> bool:
    return procs.identify(LocalNode(), pid, run_id) == "ours"


def test_the_lighthouse_listens_on_loopback_behind_the_relay_and_stop_ends_both(tmp_path):
    port = free_port()
    with Store.open(tmp_path / "state.db") as store:
        res = runs.launch(_spec(tmp_path, port), store=store)
        run = res.run
        try:
            lh = run.lighthouse
            assert lh["url"] == f"http://127.0.0.1:{port}" and lh["relay_pid"] and lh["pid"] != lh["relay_pid"]
            assert _alive(lh["pid"], run.id) and _alive(lh["relay_pid"], run.id)
            log = open(lh["log_path"]).read()
            inner = int(log.split("lighthouse listening on ", 1)[1].split()[0].rsplit(":", 1)[1])
            assert inner != port
            relay_log = open(lh["relay_log_path"]).read()
            door = log.split("lighthouse door ", 1)[1].split()[0]  # the Lighthouse's only way in (trainer.service.lighthouse)
            assert (f"relay listening on 127.0.0.1:{port} for unix:{door} as a; local 127.0.0.1:{lh['loopback_port']}"
                    in relay_log)
            # a plaintext client on the public port gets no gRPC answer (the Lighthouse's would be HTTP/2)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                c.settimeout(5)
                try:
                    got = c.recv(100)
                except OSError:
                    got = b""
            assert not got or got[0] == 0x15  # nothing, or a TLS alert
        finally:
            run = runs.stop(run, store=store, grace_s=5)
        deadline = time.monotonic() + 10
        while (_alive(lh["pid"], run.id) or _alive(lh["relay_pid"], run.id)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(lh["pid"], run.id) and not _alive(lh["relay_pid"], run.id)
        assert run.state == RunState.STOPPED


def test_a_relay_that_cannot_listen_fails_the_launch_and_leaves_no_lighthouse(tmp_path):
    port = free_port()
    # someone else holds the public port, bound but not listening: launch's port check (dilococtl.ports)
    # sees only listeners, so the relay itself meets it
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port))
    try:
        with Store.open(tmp_path / "state.db") as store:
            with pytest.raises(DilocoError, match=r"the Lighthouse's relay on local exited at start: relay: cannot "
                                                  r"listen on 127\.0\.0\.1:\d+: .*Address already in use"):
                runs.launch(_spec(tmp_path, port), store=store)
            (rec,) = store.list_runs()
    finally:
        squatter.close()
    assert rec.state == RunState.FAILED and "relay" in rec.exit_reason
    deadline = time.monotonic() + 5
    while marked(rec.id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marked(rec.id) == []  # the Lighthouse it had started was killed again


def test_gloo_keeps_the_plaintext_lighthouse_on_its_port(tmp_path):
    port = free_port()
    with Store.open(tmp_path / "state.db") as store:
        run = runs.launch(_spec(tmp_path, port, transport="gloo"), store=store).run
        try:
            assert "relay_pid" not in run.lighthouse
            # torchft's own "Lighthouse listening on:" INFO line may come first (its logger and ours share the file)
            ours = [x for x in open(run.lighthouse["log_path"]).read().splitlines()
                    if x.startswith("lighthouse listening on ")]
            assert len(ours) == 1 and ours[0].startswith("lighthouse listening on http://") and \
                ours[0].endswith(f":{port}"), ours
        finally:
            runs.stop(run, store=store, grace_s=5)

"""`dilococtl resume` on local sites, as a user types it: a preempted site comes back and heals,
a corrupt newest checkpoint is passed over for the previous one, a stopped run restarts as a whole
from the newest round every site has, and SIGTERM lands a checkpoint within the grace period."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from dilococtl.resume import CKPT_PROBE
from dilococtl.store import Store
from tests.integration.test_cli_runs import cli
from tests.integration.test_cli_runs import write_spec as _write_spec
from trainer.records import parse_line

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def write_spec(tmp_path: Path, name: str, rounds: int, h: int = 3) -> Path:
    """Two local sites; `h` inner steps per round on a slightly bigger batch, so rounds take long
    enough that a survivor is still training when a restarted site is back."""
    spec = _write_spec(tmp_path, name=name, rounds=rounds)
    text = spec.read_text().replace("h = 3\n", f"h = {h}\n").replace("batch_size = 4", "batch_size = 8")
    spec.write_text(text)
    return spec


def site_records(tmp_path: Path, run_id: str, site: str, kind: str) -> list:
    path = tmp_path / "work" / "runs" / run_id / site / "metrics.jsonl"
    if not path.exists():
        return []
    recs = [parse_line(line) for line in path.read_text().splitlines()]
    return [r for r in recs if r is not None and r.kind == kind]


def wait_for(what, timeout: float, why) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, why()
        time.sleep(0.2)


def wait_finished(run_id: str, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = cli("status", run_id, "--json")
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        if st["state"] not in ("launching", "running"):
            return st
        assert time.monotonic() < deadline, st
        time.sleep(1)


def launch(spec: Path) -> str:
    r = cli("launch", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["id"]


def corrupt_newest(ckpt_root: Path) -> tuple[int, str]:
    """Flip bytes in the middle of the newest complete checkpoint's biggest data file."""
    newest = max(p for p in ckpt_root.iterdir() if (p / "manifest.json").exists())
    data = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 16] = bytes(b ^ 0xFF for b in raw[mid:mid + 16])
    data.write_bytes(bytes(raw))
    return int(newest.name.split("-")[1]), data.name


def test_sigterm_checkpoint_then_resume_heals_and_skips_a_corrupt_checkpoint(tmp_path):
    rounds, h = 100, 6
    spec = write_spec(tmp_path, name="rs", rounds=rounds, h=h)
    run_id = launch(spec)
    try:
        wait_for(lambda: len(site_records(tmp_path, run_id, "site-b", "round")) >= 4, 120,
                 lambda: cli("logs", run_id).stdout[-3000:])
        with Store.open() as store:
            node_b = store.nodes(run_id, "site-b")[0]
        # a spot preemption: SIGTERM to the whole job of site-b (wrapper, torchrun, trainer)
        t_term = time.time()
        os.killpg(node_b.pid, signal.SIGTERM)
        exit_file = tmp_path / "work" / "runs" / run_id / "site-b" / "node0.exit"
        wait_for(exit_file.exists, 60, lambda: "site-b never wrote its exit code")
        events = site_records(tmp_path, run_id, "site-b", "event")
        pre = [e for e in events if e.event == "preempted"]
        assert len(pre) == 1, ([(e.event, e.message[:200]) for e in events[-6:]],
                               (tmp_path / "work" / "runs" / run_id / "site-b" / "node0.log").read_text()[-3000:]
                               if (tmp_path / "work" / "runs" / run_id / "site-b" / "node0.log").exists() else "")
        ckpt_done = [e for e in events if e.event == "checkpoint" and e.t >= t_term]
        assert ckpt_done, [e.event for e in events]
        sigterm_to_ckpt = ckpt_done[-1].t - t_term
        print(f"\nSIGTERM -> checkpoint complete: {sigterm_to_ckpt:.2f}s (grace 30s); "
              f"-> exit code written: {exit_file.stat().st_mtime - t_term:.2f}s")
        assert 0 < sigterm_to_ckpt < 30.0  # run.grace_s of the spec (default)
        assert exit_file.read_text().strip() == "143"  # the wrapper records a preemption, not a failure
        last_round_b = site_records(tmp_path, run_id, "site-b", "round")[-1].round
        ckpt_rounds = [e.round for e in events if e.event == "checkpoint"]
        assert ckpt_rounds[-1] == last_round_b  # the preemption checkpoint is of the round it was in

        # site-a goes on alone: K_active 1 and the elastic outer lr
        wait_for(lambda: any(r.k_active == 1 and r.committed
                             for r in site_records(tmp_path, run_id, "site-a", "round")), 60,
                 lambda: cli("logs", run_id, "--site", "site-a").stdout[-3000:])
        solo = next(r for r in site_records(tmp_path, run_id, "site-a", "round") if r.k_active == 1)
        assert solo.outer_lr == pytest.approx(0.7 / 2)
        r = cli("status", run_id, "--json")
        st = json.loads(r.stdout)
        assert st["state"] == "running"
        assert {s["site"]: s["state"] for s in st["sites"]} == {"site-a": "running", "site-b": "preempted"}

        # break site-b's newest checkpoint: resume must take the previous one, and say so
        bad_round, bad_file = corrupt_newest(tmp_path / "work" / "runs" / run_id / "site-b" / "checkpoints")
        r = cli("resume", run_id, "--json")
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert not res["whole_run"] and res["resume_round"] is None
        (b,) = res["relaunched"]
        assert b["site"] == "site-b" and b["attempt"] == 2 and "preempted" in b["why"]
        assert b["round"] == bad_round - 1
        assert [(c["round"], "checksum mismatch" in c["why"] and bad_file in c["why"]) for c in b["skipped"]] \
            == [(bad_round, True)]
        with Store.open() as store:
            (ev,) = store.events(run_id, kinds=["resume"])
            assert ev.site == "site-b" and f"skipped round {bad_round}" in ev.message
            assert f"round {bad_round - 1}" in ev.message
            launches = store.launches(run_id, site="site-b")
            assert [(x.attempt, x.reason, x.ok) for x in launches] == [(1, "launch", True), (2, "resume", True)]

        # nothing else is dead: a second resume relaunches nothing
        r = cli("resume", run_id)
        assert r.returncode == 0 and "nothing to resume" in r.stdout
        r = cli("resume", run_id, "--site", "nope")
        assert r.returncode == 2 and "has no site 'nope'" in r.stderr
        st = wait_finished(run_id)
    finally:
        cli("stop", run_id, "--grace", "10")
    assert st["state"] == "finished", cli("logs", run_id, "--site", "site-b").stdout[-3000:]
    assert [s["round"] for s in st["sites"]] == [rounds, rounds]
    events = site_records(tmp_path, run_id, "site-b", "event")
    start = [e for e in events if e.event == "start"][-1]
    assert start.detail["resumed_from"] == bad_round - 1
    skipped = [e for e in events if e.event == "checkpoint_skipped"]
    assert skipped and skipped[-1].round == bad_round  # the trainer passed over it too
    assert any(e.event == "heal" for e in events)
    rb = site_records(tmp_path, run_id, "site-b", "round")
    back = [x for x in rb if x.t > start.t]
    assert back and all(x.k_active == 2 for x in back[-3:])
    steps = [s.step for s in site_records(tmp_path, run_id, "site-b", "step")]
    assert steps[-1] == rounds * h  # step numbers continue after the restart and heal
    for args in ([], ["--auto"]):  # both agree: a finished run has nothing to resume, and that is no error
        r = cli("resume", run_id, *args)
        assert r.returncode == 0 and r.stdout.strip() == f"nothing to resume: run {run_id} finished", r.stderr


def test_stopped_run_restarts_as_a_whole_from_the_newest_common_round(tmp_path):
    rounds = 14
    spec = write_spec(tmp_path, name="whole", rounds=rounds)
    run_id = launch(spec)
    root = tmp_path / "work" / "runs" / run_id
    try:
        wait_for(lambda: all(len(site_records(tmp_path, run_id, s, "round")) >= 4 for s in ("site-a", "site-b")),
                 120, lambda: cli("logs", run_id).stdout[-3000:])
        r = cli("stop", run_id, "--grace", "30", "--json")  # every site saves on SIGTERM, the Lighthouse stops
        assert r.returncode == 0 and json.loads(r.stdout)["state"] == "stopped", r.stderr
        newest = {s: max(int(p.name.split("-")[1]) for p in (root / s / "checkpoints").iterdir()
                         if (p / "manifest.json").exists()) for s in ("site-a", "site-b")}
        bad_round, _ = corrupt_newest(root / "site-b" / "checkpoints")
        assert bad_round == newest["site-b"]
        common = min(newest["site-a"], bad_round - 1)

        r = cli("resume", run_id, "--json")
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        assert res["whole_run"] and res["resume_round"] == common
        assert sorted(x["site"] for x in res["relaunched"]) == ["site-a", "site-b"]
        assert all(x["round"] == common for x in res["relaunched"])
        with Store.open() as store:
            run = store.get_run(run_id)
            assert run.state == "running" and run.lighthouse["pid"]
            msgs = [e.message for e in store.events(run_id, kinds=["resume"]) if e.site == ""]
            assert any(f"restarts from round {common}" in m for m in msgs), msgs
        st = wait_finished(run_id)
    finally:
        cli("stop", run_id, "--grace", "10")
    assert st["state"] == "finished", cli("logs", run_id).stdout[-3000:]
    assert [s["round"] for s in st["sites"]] == [rounds, rounds]
    for site in ("site-a", "site-b"):
        start = [e for e in site_records(tmp_path, run_id, site, "event") if e.event == "start"][-1]
        assert start.detail["resumed_from"] == common
        after = [x for x in site_records(tmp_path, run_id, site, "round") if x.t > start.t]
        # both waited for each other: every round after the restart had both sites in it
        assert after[0].round == common + 1 and all(x.k_active == 2 for x in after)


def test_checkpoint_probe_agrees_with_the_trainer(tmp_path):
    """The control plane's stdlib probe gives the trainer's own verdicts (trainer.checkpoints.checkpoint_trust.verify)."""
    import subprocess
    import sys

    import torch

    from trainer.checkpoints.checkpoint import Checkpointer
    from trainer.checkpoints.checkpoint_trust import verify

    ck = Checkpointer(tmp_path / "ck", keep=5, async_save=False)
    for rnd in (1, 2, 3, 4):
        ck.save(rnd, {"w": torch.arange(1000, dtype=torch.float32) * rnd, "meta": {"round": rnd}})
    (tmp_path / "ck" / "round-000003" / "manifest.json").unlink()  # a save that did not finish
    corrupt_newest(tmp_path / "ck")  # round 4: flipped bytes
    data = next((tmp_path / "ck" / "round-000002").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-7])  # round 2: truncated
    out = subprocess.run([sys.executable, "-c", CKPT_PROBE, str(tmp_path / "ck")], capture_output=True,
                         text=True, check=True).stdout
    got = {c["round"]: c["why"] for c in json.loads(out)}
    want = {r: verify(tmp_path / "ck" / f"round-{r:06d}") for r in (1, 2, 3, 4)}
    assert got == want
    assert want[1] == "" and all(want[r] for r in (2, 3, 4))
    assert [c["round"] for c in json.loads(out)] == [4, 3, 2, 1]

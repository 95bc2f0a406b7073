"""Issue 35 in async mode: a local 2-site async run with an S3 store (SeaweedFS) survives losing every machine.

The outer service uploads its own signed rounds (θ, outer momentum, version) beside the sites' rounds.
The run is stopped mid-way, every work_dir is deleted, and `dilococtl resume RUN` brings it back: the
service restores its newest stored version (not θ_0 from a site), the sites join at that version or
later, and the run finishes with a val ppl no worse than before the stop (within 10%).
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.integration.test_cli_runs import cli
from tests.integration.test_resume import launch, site_records, wait_finished, wait_for
from tests.integration.test_resume import write_spec as _write_spec
from tests.seaweed import argv_with

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROUNDS, KEEP = 60, 2  # async rounds of H = 3 are short: enough of them that `stop` lands mid-run (with 24,
# CI's loaded run had finished them all before the service's first upload was done)
SITES = ("site-a", "site-b")


def write_spec(tmp_path: Path, name: str, store: str) -> Path:
    spec = _write_spec(tmp_path, name=name, rounds=ROUNDS, h=3)
    text = spec.read_text().replace("[diloco]\n", '[diloco]\nmode = "async"\nasync_checkpoint_every = 1\n', 1)
    text = text.replace("[checkpoint]\n", f'[checkpoint]\nstore = "{store}"\nkeep = {KEEP}\nreplicas = 1\n')
    spec.write_text(text)
    return spec


def service_log(tmp_path: Path, run_id: str) -> str:
    path = tmp_path / "work" / "runs" / run_id / "outer_service.log"
    return path.read_text() if path.exists() else ""


def service_alive(run_id: str) -> str:
    """The outer service's process, if it still runs: what a failed stop left behind."""
    import subprocess

    ps = subprocess.run(["ps", "-eo", "pid,stat,etime,args"], capture_output=True, text=True).stdout
    return "\n".join(line for line in ps.splitlines() if "trainer.service.outer_service" in line and run_id in line)


def test_async_run_recovers_service_and_sites_from_the_store(tmp_path, seaweed, monkeypatch):
    for k, v in seaweed.env().items():  # the AWS chain of this shell: the local sites and service inherit it
        monkeypatch.setenv(k, v)
    bucket = seaweed.make_bucket("async-e2e")
    run_id = launch(write_spec(tmp_path, "adur", store=f"s3://{bucket}/ckpt"))
    work = tmp_path / "work"
    try:
        wait_for(lambda: all(len(site_records(tmp_path, run_id, s, "round")) >= 2 for s in SITES)
                 and "uploaded to" in service_log(tmp_path, run_id),
                 120, lambda: cli("logs", run_id).stdout[-3000:] + service_log(tmp_path, run_id)[-2000:])
        assert argv_with(seaweed.secret_key) == []  # while the service and the trainers run
        r = cli("stop", run_id, "--grace", "30", "--json")
        assert r.returncode == 0, r.stderr
        log = service_log(tmp_path, run_id)
        stopped = re.search(r"outer service stopped at version (\d+); saved (\S+)", log)
        assert stopped, (r.stderr[-1000:], log[-2000:], service_alive(run_id))
        stopped_version = int(stopped[1])
        pre_ppl = json.loads(cli("status", run_id, "--json").stdout)["final_val_ppl"]
        assert pre_ppl is not None and math.isfinite(pre_ppl)
        last = {s: site_records(tmp_path, run_id, s, "round")[-1].round for s in SITES}
        assert all(0 < n < ROUNDS for n in last.values()), last

        r = cli("checkpoints", run_id, "--json")
        assert r.returncode == 0, r.stderr
        listed = {s["site"]: s["stores"][0]["rounds"] for s in json.loads(r.stdout)["sites"]}
        assert set(listed) == {*SITES, "_outer_service"}, listed
        service_rounds = listed["_outer_service"]
        assert 0 < len(service_rounds) <= KEEP and all(x["verified"] and x["bytes"] > 0 for x in service_rounds)
        stored = service_rounds[0]["round"]
        # the SIGTERM round went up, unless the log says its upload outlasted the grace (a loaded machine)
        assert stored == stopped_version if "not finished within" not in log else stored < stopped_version, \
            (service_rounds, stopped_version, log[-2000:])
        r = cli("checkpoints", run_id)
        assert r.returncode == 0 and "_outer_service" in r.stdout and "verified" in r.stdout, r.stdout

        shutil.rmtree(work)  # every machine lost: nothing local is left, the service's rounds neither
        t0 = time.monotonic()
        r = cli("resume", run_id, "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["whole_run"], r.stdout
        st = wait_finished(run_id, timeout=240)
        print(f"\nasync resume from the store -> finished in {time.monotonic() - t0:.1f} s")
    finally:
        cli("stop", run_id, "--grace", "10")
    assert st["state"] == "finished", cli("logs", run_id).stdout[-3000:]
    assert [s["round"] for s in st["sites"]] == [ROUNDS, ROUNDS]
    log = service_log(tmp_path, run_id)
    restored = re.search(r"outer service: restored version (\d+) from the checkpoint store", log)
    resumed = re.search(r"outer service listening on .*, resumed at version (\d+) from ", log)
    assert restored and resumed, log[-2000:]
    assert int(restored[1]) == int(resumed[1]) >= stored
    for site in SITES:  # each site came back at the restored θ's version or later, not at θ_0
        joins = [e for e in site_records(tmp_path, run_id, site, "event") if e.event == "quorum"]
        got = re.search(r"joined the outer service at version (\d+)", joins[0].message)
        assert got and int(got[1]) >= stored, joins[0].message
    post_ppl = json.loads(cli("status", run_id, "--json").stdout)["final_val_ppl"]
    print(f"service: stopped at version {stopped_version}, stored {stored}, restored {restored[1]}; "
          f"val ppl before the stop {pre_ppl:.4f}, after the resume from the store {post_ppl:.4f}")
    assert math.isfinite(post_ppl) and post_ppl <= pre_ppl * 1.10
    assert argv_with(seaweed.secret_key) == []

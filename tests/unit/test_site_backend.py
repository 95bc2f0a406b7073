"""Slurm sites wired into the run commands, without a cluster: plan.build's jobs, the store's job rows,
launch's submission, refresh's job states, stop's scancel, the logs a job adds, provision's and doctor's
hosts (a login node standing in for Slurm answers as 22.05 does)."""

from __future__ import annotations

import json
import shlex
import tomllib
from pathlib import Path

import pytest

from dilococtl import doctor, doctor_links, plan, provision
from dilococtl.nodes import CmdResult
from dilococtl.site_backend import job_log_paths, refresh_jobs, stop_jobs, submit_jobs
from dilococtl.spec import load_spec
from dilococtl.states import SiteState
from dilococtl.store import Store

PLAYBOOK = Path(__file__).resolve().parents[2] / "playbooks" / "h100-slurm.toml"


class FakeLogin:
    """A login node whose sbatch/squeue/scancel keep jobs in a dict (squeue --json as 22.05 prints it)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.files: dict[str, str] = {}
        self.jobs: dict[str, dict] = {}
        self.cmds: list[str] = []
        self.on_term = {"job_state": "FAILED", "exit_code": 143 << 8}  # the trainer checkpointed and left

    def write_text(self, remote: str, text: str) -> None:
        self.files[remote] = text

    def run(self, cmd: str, timeout: float = 60, env: dict | None = None) -> CmdResult:
        self.cmds.append(cmd)
        argv = shlex.split(cmd)
        if argv[0] == "sbatch":
            jid = str(100 + len(self.jobs) + 1)
            self.jobs[jid] = {"job_id": int(jid), "job_state": "PENDING", "state_reason": "Resources", "nodes": "",
                              "name": "x", "partition": "h100", "restart_cnt": 0, "exit_code": 0}
            return CmdResult(0, f"{jid}\n", "")
        if argv[:2] == ["squeue", "--json"]:
            return CmdResult(0, json.dumps({"errors": [], "jobs": list(self.jobs.values())}), "")
        if argv[0] == "scancel":
            jid = argv[-1]
            if jid in self.jobs:
                self.jobs[jid].update(self.on_term if "TERM" in argv else {"job_state": "CANCELLED"})
            return CmdResult(0, "", "")
        return CmdResult(1, "", f"{argv[0]}: not here")


class FakePool:
    def __init__(self, *logins: FakeLogin) -> None:
        self.nodes = {n.host: n for n in logins}

    def get(self, host: str) -> FakeLogin:
        return self.nodes[host]


def test_plan_builds_one_job_per_slurm_site_with_its_files_through_the_login_node():
    spec = load_spec(PLAYBOOK)
    p = plan.build(spec, "r1", make_keys=False)
    slurm = [s for s in spec.sites if s.scheduler == "slurm"]
    assert [j.site for j in p.jobs] == [s.name for s in slurm] and slurm
    assert {n.site for n in p.nodes} == {s.name for s in spec.sites if s.scheduler == "ssh"}
    us = p.jobs[0]
    assert (us.login, us.nnodes, us.launch.nproc_per_node, us.launch.rdzv_port, us.launch.grace_s) == \
        ("login.use.example.net", 8, 8, spec.run.base_port, 120.0)
    assert us.launch.run_dir == "/shared/dilococtl/work/runs/r1"
    assert us.launch.python == "/shared/dilococtl/venv/bin/python"  # the venv provision makes on the shared fs
    assert us.launch.config_path == "/shared/dilococtl/work/runs/r1/us-east/config.toml"
    assert us.log_paths[0] == "/shared/dilococtl/work/runs/r1/us-east/node0.log" and len(us.log_paths) == 8
    cfg = tomllib.loads(us.launch.config_toml)
    assert (cfg["run"]["site"], cfg["run"]["site_index"], cfg["diloco"]["sites"]) == ("us-east", 0, len(spec.sites))
    # nodes of a Slurm site publish their own host names: never the login node's
    assert cfg["run"].get("transport_host", "") == ""
    assert us.launch.env["TORCHFT_LIGHTHOUSE"] == spec_lighthouse(spec)
    key = us.launch.env["DILOCO_CHECKPOINT_KEY"]
    assert key == "/shared/dilococtl/work/runs/r1/_keys/checkpoint.key" and cfg["run"]["tls_cert"].startswith(
        "/shared/dilococtl/work/runs/r1/_keys/")
    # the keys reach the cluster's shared filesystem through its login node, once
    to_login = sorted(remote for h, remote, _ in p.files if h == "login.use.example.net")
    assert key in to_login and cfg["run"]["tls_key"] in to_login and len(to_login) == len(set(to_login))


def spec_lighthouse(spec) -> str:
    from dilococtl.spec_sites import lighthouse_url

    return lighthouse_url(spec)


@pytest.fixture
def recorded(tmp_path):
    """A run of the playbook recorded in a fresh store, its us-east job submitted through a fake login."""
    spec = load_spec(PLAYBOOK)
    store = Store.open(tmp_path / "s.db")
    run = store.create_run(spec)
    login = FakeLogin("login.use.example.net")
    pool = FakePool(login)
    p = plan.build(spec, run.id, make_keys=False)
    said: list[str] = []
    out = submit_jobs(p.jobs[:1], spec=spec, store=store, pool=pool, run_id=run.id, progress=said.append)
    yield spec, store, run, login, pool, out, said
    store.close()


def test_launch_submits_and_records_the_job(recorded):
    spec, store, run, login, pool, out, said = recorded
    assert out == [("us-east", "login.use.example.net", "101")]
    job = store.site_jobs(run.id)["us-east"]
    assert (job["job_id"], job["login"], job["submits"], job["scheduler"]) == ("101", "login.use.example.net", 1, "slurm")
    node = store.nodes(run.id, "us-east")
    assert [(n.host, n.rank, n.pid, n.state) for n in node] == [("login.use.example.net", 0, None, SiteState.STARTING)]
    assert node[0].log_path.endswith("/runs/" + run.id + "/us-east/node0.log")
    run_dir = f"/shared/dilococtl/work/runs/{run.id}"
    assert login.files[f"{run_dir}/us-east/config.toml"].startswith("[")
    sbatch = login.files[f"{run_dir}/us-east/job.sbatch"]
    assert "#SBATCH --partition=h100" in sbatch and "#SBATCH --requeue" in sbatch
    assert f"sbatch --parsable {run_dir}/us-east/job.sbatch" in login.cmds
    assert "us-east: Slurm job 101" in said


def test_refresh_takes_the_jobs_state_pending_reason_and_nodes(recorded):
    spec, store, run, login, pool, *_ = recorded
    st = refresh_jobs(run, store=store, pool=pool)
    assert st["us-east"].state is SiteState.STARTING
    assert store.site_jobs(run.id)["us-east"]["detail"] == "job 101 pending (Resources)"
    login.jobs["101"].update(job_state="RUNNING", state_reason="None", nodes="gpu[01-08]")
    refresh_jobs(run, store=store, pool=pool)
    job = store.site_jobs(run.id)["us-east"]
    assert (job["detail"], job["nodes"]) == ("job 101 running on gpu[01-08]", "gpu[01-08]")
    assert store.nodes(run.id, "us-east")[0].state is SiteState.RUNNING
    # a requeue: back in the queue, still alive; then preempted for good: dead, resume --auto's to resubmit
    login.jobs["101"].update(job_state="PENDING", state_reason="BeginTime", nodes="", restart_cnt=1)
    refresh_jobs(run, store=store, pool=pool)
    assert store.nodes(run.id, "us-east")[0].state is SiteState.STARTING
    login.jobs["101"].update(job_state="NODE_FAIL", state_reason="NodeDown", exit_code=0)
    assert refresh_jobs(run, store=store, pool=pool)["us-east"].resubmit
    assert store.nodes(run.id, "us-east")[0].state is SiteState.FAILED
    from dilococtl.resume import _dead_nodes

    dead = [(n.site, n.host) for n in _dead_nodes(run, store) if n.site == "us-east"]
    assert dead == [("us-east", "login.use.example.net")]  # resume --auto resubmits it
    assert [e.message for e in store.events(run.id, kinds=["job"])] == [
        "job 101 pending (Resources)", "job 101 running on gpu[01-08]", "job 101 pending (BeginTime) restarts 1",
        "job 101 node_fail (NodeDown) restarts 1 exit 0"]
    # an ended job is not asked about again
    n = len(login.cmds)
    refresh_jobs(run, store=store, pool=pool)
    assert len(login.cmds) == n


def test_resubmission_cancels_the_old_job_and_counts(recorded):
    spec, store, run, login, pool, *_ = recorded
    p = plan.build(spec, run.id, make_keys=False)
    out = submit_jobs(p.jobs[:1], spec=spec, store=store, pool=pool, run_id=run.id, progress=lambda _m: None)
    assert out == [("us-east", "login.use.example.net", "102")]
    assert "scancel 101" in login.cmds and login.jobs["101"]["job_state"] == "CANCELLED"
    job = store.site_jobs(run.id)["us-east"]
    assert (job["job_id"], job["submits"], job["detail"]) == ("102", 2, "")
    assert len(store.nodes(run.id, "us-east")) == 1


def test_stop_sends_term_first_and_records_the_end(recorded):
    spec, store, run, login, pool, *_ = recorded
    login.jobs["101"].update(job_state="RUNNING", state_reason="None", nodes="gpu[01-08]")
    refresh_jobs(run, store=store, pool=pool)
    said: list[str] = []
    stop_jobs(run, store=store, pool=pool, grace_s=5, progress=said.append)
    assert [c for c in login.cmds if c.startswith("scancel")] == ["scancel -s TERM 101"]  # it ended within the grace
    assert store.site_jobs(run.id)["us-east"]["detail"] == "job 101 failed on gpu[01-08] exit 143"
    assert said[0] == "scancel -s TERM us-east's job 101 (kill after 5s)"


def test_logs_merge_every_nodes_output_and_the_batch_shells(recorded):
    spec, store, run, *_ = recorded
    paths = job_log_paths(run, store)
    d = f"/shared/dilococtl/work/runs/{run.id}/us-east"
    assert paths[0] == ("us-east", 0, "login.use.example.net", f"{d}/node0.log")
    assert [p[1] for p in paths] == list(range(8)) + [None]
    assert paths[-1][3] == f"{d}/slurm-101.out"
    from dilococtl.logs import RunLogs

    files = [(f.site, f.node, f.path) for f in RunLogs(run, store).files if f.site == "us-east"]
    assert files == [(s, n, p) for s, n, _, p in paths]  # the login node's row is not read twice


def test_provision_and_doctor_go_through_the_login_node_once_per_cluster():
    spec = load_spec(PLAYBOOK)
    hosts = {s.name: provision._hosts(s) for s in spec.sites}
    assert hosts["us-east"] == ["login.use.example.net"]
    assert all(doctor.checked_hosts(s) == hosts[s.name] for s in spec.sites)
    ssh = [s for s in spec.sites if s.scheduler == "ssh"][0]
    assert doctor.checked_hosts(ssh) == ssh.hosts
    # the port checks between leaders leave Slurm sites out (their nodes are known once the job runs)
    targets = doctor_links.link_targets(spec)
    assert {t.site for t in targets} <= {ssh.name, ""} and all(h in ssh.hosts for t in targets for _, h in t.sources)
    assert doctor.coordinator_targets(spec) == [(ssh.hosts[0], spec.run.lighthouse_port, "Lighthouse relay")]


def test_launch_plan_names_the_slurm_job_and_the_batch_shell_stamps_its_lines(recorded):
    spec, store, *_ = recorded
    from dilococtl.logs import classify
    from dilococtl.runs import plan_summary
    from dilococtl.site_backend import dry_run_script

    sites = {s["name"]: s["hosts"] for s in plan_summary(spec, store)["sites"]}
    assert sites["us-east"] == ["Slurm job of 8 node(s) via login.use.example.net"]
    text = dry_run_script(spec, plan.build(spec, "RUN_ID", make_keys=False).jobs[0])
    assert 'echo "$(date "+%F %T") dilococtl: job $SLURM_JOB_ID start' in text
    assert classify("2026-12-05 13:33:08 dilococtl: job 2 start 0 on n[0-1], rendezvous n0")[2] is not None

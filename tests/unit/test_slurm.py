"""dilococtl.slurm without a cluster: the sbatch script, the parsers on output captured from a real
Slurm 22.05.8 (tests/unit/slurm_data/, see DESIGN.md's measured facts), state mapping, doctor's checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from dilococtl.doctor_check import FAIL, OK, WARN
from dilococtl.errors import BadInput, DilocoError
from dilococtl.slurm import config, doctor, parse, script, states
from dilococtl.states import SiteState

DATA = Path(__file__).parent / "slurm_data"


def _site(**kw) -> config.SlurmSite:
    base = dict(name="site1", login="login.example", partition="gpu", account="proj", nodes=2, gpus_per_node=2,
                time_limit="30")
    return config.SlurmSite(**{**base, **kw})


def _job(**kw) -> script.SiteJob:
    base = dict(run_id="r1", run_dir="/shared/runs/r1", python="/shared/venv/bin/python",
                config_path="/shared/runs/r1/site1/config.toml", nproc_per_node=4, rdzv_port=29601, grace_s=30.0,
                env={"TORCHFT_LIGHTHOUSE": "http://10.0.0.2:29510"})
    return script.SiteJob(**{**base, **kw})


def test_script_asks_for_the_site_and_requeues_with_the_trainers_grace():
    text = script.batch_script(_site(qos="high", constraint="h100&ib", sbatch_args=["--exclusive"]), _job(grace_s=45))
    sb = [ln.removeprefix("#SBATCH ") for ln in text.splitlines() if ln.startswith("#SBATCH ")]
    assert sb[:3] == ["--job-name=dilococtl-r1-site1", "--nodes=2", "--ntasks-per-node=1"]
    for opt in ("--partition=gpu", "--account=proj", "--qos=high", "--gpus-per-node=2", "--time=30",
                "--constraint=h100&ib", "--requeue", "--signal=B:USR1@75", "--exclusive",
                "--output=/shared/runs/r1/site1/slurm-%j.out"):
        assert opt in sb
    assert sb[-1] == "--exclusive"  # the site's own arguments last
    assert text.startswith("#!/bin/bash\n")
    # the batch shell relays TERM (the trainer's checkpoint signal) to the tasks and requeues after it
    assert "trap 'timelimit=1; scancel -s TERM \"$SLURM_JOB_ID\"' USR1" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    # torchrun: c10d rendezvous on the first node, a fresh id per (re)start
    assert "--rdzv_backend=c10d" in text and '--rdzv_endpoint="$DILOCOCTL_HEAD:29601"' in text
    assert '--rdzv_id="$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"' in text
    assert "--nnodes=2 --nproc_per_node=4" in text and "/shared/venv/bin/python -m torch.distributed.run" in text
    assert "TORCHFT_LIGHTHOUSE=http://10.0.0.2:29510" in text


def test_script_leaves_out_what_the_site_does_not_ask():
    sb = script.sbatch_options(_site(partition="", account="", gpus_per_node=0, time_limit=""), _job())
    joined = " ".join(sb)
    for absent in ("--partition", "--account", "--qos", "--gpus-per-node", "--time", "--constraint"):
        assert absent not in joined
    assert script.signal_lead_s(0.5) == 1 + script.SIGNAL_MARGIN_S


@pytest.mark.parametrize("text,minutes", [("30", 30), ("1:30", 2), ("2:00:00", 120), ("1-0", 1440),
                                          ("1-02:30", 1590), ("1-00:00:01", 1441), ("UNLIMITED", -1),
                                          ("infinite", -1)])
def test_time_limit_syntax(text, minutes):
    assert config.parse_time_limit(text) == minutes


@pytest.mark.parametrize("kw,where", [
    (dict(login=""), "login"), (dict(partition="gpu;rm"), "partition"), (dict(nodes=0), "nodes"),
    (dict(time_limit="2h"), "time_limit"), (dict(time_limit="0"), "time_limit"), (dict(constraint="a b"), "constraint"),
    (dict(sbatch_args=["--time=5"]), "sbatch_args[0]"), (dict(sbatch_args=["exclusive"]), "sbatch_args[0]"),
    (dict(sbatch_args=["-A", "x"]), "sbatch_args[0]"), (dict(gpus_per_node=-1), "gpus_per_node")])
def test_validate_names_the_bad_key(kw, where):
    with pytest.raises(BadInput) as e:
        config.validate(_site(**kw), "sites[1]")
    assert str(e.value).startswith(f"sites[1].{where}: ")


def test_squeue_json_captured_from_22_05():
    jobs = {j.job_id: j for j in parse.parse_squeue_json((DATA / "squeue.json").read_text())}
    assert len(jobs) == 9
    assert (jobs["13"].state, jobs["13"].nodes, jobs["13"].restarts) == ("RUNNING", "vm", 1)  # requeued once
    assert (jobs["14"].state, jobs["14"].reason) == ("PENDING", "PartitionNodeLimit")
    assert (jobs["11"].state, jobs["11"].exit_code) == ("COMPLETED", 0)
    assert jobs["12"].exit_code is None  # cancelled: its code means nothing
    only = parse.parse_squeue_json((DATA / "squeue.json").read_text(), {"14", "99"})
    assert [j.job_id for j in only] == ["14"]


def test_squeue_text_and_sinfo_captured_from_22_05():
    jobs = {j.job_id: j for j in parse.parse_squeue_text((DATA / "squeue.txt").read_text())}
    assert (jobs["14"].state, jobs["14"].reason, jobs["14"].partition) == ("PENDING", "PartitionNodeLimit", "gpu")
    assert jobs["4"].reason == "PartitionTimeLimit" and jobs["11"].nodes == "vm"
    assert jobs["12"].name == "job2.sh"
    (node,) = parse.parse_sinfo_nodes_text((DATA / "sinfo.txt").read_text())
    assert (node.name, node.partitions, node.gpus, node.state) == ("vm", ["gpu"], 2, "idle")
    (node,) = parse.parse_sinfo_nodes_json((DATA / "sinfo.json").read_text())
    assert (node.name, node.partitions, node.gpus) == ("vm", ["gpu"], 2)


def test_partitions_captured_from_22_05():
    (part,) = parse.parse_partitions((DATA / "partition.txt").read_text()).values()
    assert (part.name, part.state, part.max_time_min, part.default, part.total_nodes) == ("gpu", "UP", 60, True, 1)
    assert part.allow_accounts == ["ALL"] and part.deny_qos == []


def test_sacct_parsable_and_gres():
    text = "101|COMPLETED|None|n[1-2]|0:0|dilococtl-r1-s|gpu\n101.batch|COMPLETED||n1|0:0|batch|\n" \
           "102|CANCELLED by 0|None|None assigned|0:0|x|gpu\n103|FAILED|NonZeroExitCode|n3|143:0|y|gpu\n"
    jobs = {j.job_id: j for j in parse.parse_sacct_parsable(text)}
    assert set(jobs) == {"101", "102", "103"}
    assert jobs["102"].state == "CANCELLED" and jobs["102"].nodes == ""
    assert states.site_state(jobs["103"]) is SiteState.PREEMPTED  # the trainer's 143: checkpoint saved
    assert parse.gres_gpus("gpu:h100:8(S:0-1),gpu:a100:2,nic:1") == 10
    assert parse.gres_gpus("(null)") == 0
    with pytest.raises(DilocoError, match="squeue --json: nope"):
        parse.parse_squeue_json('{"errors": [{"error": "nope"}], "jobs": []}')


@pytest.mark.parametrize("state,code,want", [
    ("PENDING", None, SiteState.STARTING), ("REQUEUED", None, SiteState.STARTING), ("RUNNING", None, SiteState.RUNNING),
    ("COMPLETING", None, SiteState.RUNNING), ("COMPLETED", 0, SiteState.FINISHED), ("CANCELLED", None, SiteState.STOPPED),
    ("TIMEOUT", 0, SiteState.PREEMPTED), ("PREEMPTED", 0, SiteState.PREEMPTED), ("NODE_FAIL", 1, SiteState.FAILED),
    ("FAILED", 1, SiteState.FAILED), ("SUSPENDED", None, SiteState.LOST), ("WHATEVER", None, SiteState.FAILED)])
def test_state_mapping(state, code, want):
    assert states.site_state(parse.JobInfo(job_id="1", state=state, exit_code=code)) is want


def test_detail_line():
    job = parse.JobInfo(job_id="7", state="PENDING", reason="Resources", restarts=2)
    assert states.detail(job) == "job 7 pending (Resources) restarts 2"


def test_doctor_checks_on_captured_partition_and_nodes():
    parts = parse.parse_partitions((DATA / "partition.txt").read_text())
    nodes = parse.parse_sinfo_nodes_json((DATA / "sinfo.json").read_text())
    check, part = doctor.check_partition(_site(partition="cpu"), parts)
    assert (check.status, check.detail) == (FAIL, "partition 'cpu' does not exist (partitions: gpu)") and part is None
    check, part = doctor.check_partition(_site(partition=""), parts)  # the default partition
    assert check.status == OK and part is not None and part.name == "gpu"
    assert doctor.check_gpus(_site(nodes=1, gpus_per_node=2), part, nodes).status == OK
    bad = doctor.check_gpus(_site(nodes=1, gpus_per_node=4), part, nodes)
    assert bad.status == FAIL and "0 nodes with 4 GPUs per node" in bad.detail and "at most 2" in bad.detail
    assert doctor.check_time(_site(time_limit="59:00"), part).status == OK
    bad = doctor.check_time(_site(time_limit="1-0"), part)
    assert bad.status == FAIL and "MaxTime 01:00:00" in bad.detail and "\n" not in bad.detail
    # shorter than the checkpoint signal's lead + Slurm's early margin + a first round: the job would fail, not chain
    short = doctor.check_time(_site(time_limit="1"), part, grace_s=5)
    assert short.status == FAIL and "35 s before the limit" in short.detail and "at least 3 min" in short.detail
    assert doctor.check_time(_site(time_limit="2"), part, grace_s=5).status == WARN  # the lab's e2e: it chained
    assert doctor.check_time(_site(time_limit="3"), part, grace_s=5).status == OK
    assert doctor.check_time(_site(time_limit="3"), part, grace_s=120).status == FAIL
    part.allow_accounts, part.deny_qos = ["ops"], ["low"]
    lines = doctor.check_lists(_site(account="proj", qos="low"), part)
    assert [(c.name, c.status) for c in lines] == [("account", FAIL), ("qos", FAIL)]


def test_backend_status_of_a_job_slurm_no_longer_shows_is_lost():
    from dilococtl.site_backend import SlurmBackend

    backend = SlurmBackend(login=None, site=_site())  # _status reads no cluster
    gone = backend._status("42", None)
    assert gone.state is SiteState.LOST and gone.detail == "job 42: Slurm no longer shows it"
    timed_out = backend._status("7", parse.JobInfo(job_id="7", state="TIMEOUT", nodes="n[1-2]", exit_code=0))
    assert (timed_out.state, timed_out.resubmit, timed_out.nodes) == (SiteState.PREEMPTED, True, "n[1-2]")
    done = backend._status("8", parse.JobInfo(job_id="8", state="COMPLETED", exit_code=0))
    assert done.state is SiteState.FINISHED and not done.resubmit


def test_kill_wait_against_the_trainers_grace():
    text = "Configuration data as of 2026-12-05T06:20:08\nKillOnBadExit           = 0\nKillWait                = 30 sec\n"
    assert doctor.check_kill_wait(text, 30.0).status == OK
    short = doctor.check_kill_wait(text, 120.0)
    assert short.status == "warn" and short.detail.startswith("KillWait 30s < run.grace_s 120s")


def test_reach_lines_name_the_nodes_that_cannot_connect():
    out = "n1 10.0.0.2 29510 ok\nn2 10.0.0.2 29510 ok\nn1 10.0.0.2 29511 fail\nn2 10.0.0.2 29511 ok\nsrun: noise\n"
    checks = doctor.judge_reach(out, [("10.0.0.2", 29510, "lighthouse"), ("10.0.0.2", 29511, "relay"),
                                      ("10.0.0.3", 8443, "outer service")])
    assert [(c.status, c.detail) for c in checks] == [
        (OK, "2 compute nodes reach lighthouse 10.0.0.2:29510"),
        (FAIL, "compute nodes n1 cannot reach relay 10.0.0.2:29511"),
        (FAIL, "no compute node reported on outer service 10.0.0.3:8443")]
    cmd = doctor.reach_command(_site(qos="high"), [("10.0.0.2", 29510)])
    assert cmd.startswith("srun --immediate=30 --nodes=2 --ntasks-per-node=1 --time=2 ") and "--qos=high" in cmd


@pytest.mark.parametrize(("grace", "timeout"), [(30.0, 45), (120.0, 135), (5.0, 30), (0.5, 30)])
def test_torchrun_waits_out_the_trainers_grace_before_its_sigkill(tmp_path, monkeypatch, grace, timeout):
    """torchrun SIGKILLs its workers 30 s after forwarding a TERM unless told otherwise: a grace of 120 s
    (a large checkpoint) would lose its final checkpoint. Never less than 30 s: a trainer finishes its round
    before it checkpoints (CI: with 20 s a Slurm site's trainer was killed first and its job not requeued)."""
    from dilococtl import plan as plan_mod
    from dilococtl.spec import spec_from_dict

    assert f"--shutdown-timeout={timeout} " in script.batch_script(_site(), _job(grace_s=grace))
    assert timeout < script.signal_lead_s(grace)  # torchrun is done before Slurm's time limit ends the job
    monkeypatch.setenv("DILOCOCTL_HOME", str(tmp_path / "home"))
    data = {"run": {"name": "g", "grace_s": grace},
            "sites": [{"name": s, "hosts": ["local"], "work_dir": str(tmp_path / s)} for s in ("x", "y")]}
    plan = plan_mod.build(spec_from_dict(data, "g.toml"), "RID")
    assert all(f"--shutdown-timeout={timeout} " in n.command for n in plan.nodes)

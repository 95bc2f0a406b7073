"""`dilococtl logs`: rounds and events merged by time across sites, library chatter hidden, filters,
`--json`, and `-f` that ends with the run."""

from __future__ import annotations

import json
import threading
import time

import pytest
from typer.testing import CliRunner

from dilococtl import logs as logs_mod
from dilococtl.cli import app
from dilococtl.errors import BadInput
from dilococtl.store import Store
from tests.tui.fixtures import ROUND_S, T0, make_run
from trainer.records import RoundRecord

TORCHFT_INFO = "[default0]:2026-01-01T00:00:05.000 [INFO] [torchft::manager] - [Replica site-a] Start quorum for group_rank 0"
TORCHFT_WARN = "[default0]:2026-01-01T00:00:06.000 [WARN] [torchft::manager] - [Replica site-a] quorum timed out"
FLIGHT = "[default0]:[site-a:1234/0 - step 0] Unable to reset NCCL flight recorder recording so traces will be incorrect."
ACCESS = '[default0]:::ffff:127.0.0.1 - - [01/Jan/2026 00:00:07] "GET /checkpoint/5/full HTTP/1.1" 200 -'
LIB_WARNING = ("[default0]:/venv/lib/python3.11/site-packages/torch/distributed/_serialization.py:63: UserWarning: "
               "The given buffer is not writable")
LIB_WARNING_SRC = "[default0]:  storage = torch.frombuffer("
OURS = "[default0]:[site-a] model tiny: 803,968 parameters; payload 3,215,876 bytes/round"


def local_stamp(t: float) -> str:
    """t as torchft writes it (local time, no zone)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t)) + ".000"


@pytest.mark.parametrize("line, noise", [
    (TORCHFT_INFO, True), (TORCHFT_WARN, False), (FLIGHT, True), (ACCESS, True), (OURS, False),
    ("[default0]:Traceback (most recent call last):", False), ("[default0]:RuntimeError: boom", False),
    ("W0101 00:00:01.123000 4242 torch/distributed/run.py:792] *****", True),
    ("E0101 00:00:01.123000 4242 torch/distributed/elastic/multiprocessing/api.py:869] failed", False),
    ("", True),
])
def test_classify_tells_library_chatter_from_what_an_operator_reads(line, noise):
    assert logs_mod.classify(line)[3] is noise


def test_classify_strips_torchrun_prefix_and_reads_torchft_stamps():
    text, rank, t, _ = logs_mod.classify(TORCHFT_INFO.replace("default0", "default3"))
    assert rank == 3 and text.startswith("2026-01-01T00:00:05.000 [INFO]")
    assert t == pytest.approx(time.mktime((2026, 1, 1, 0, 0, 5, 0, 0, -1)))


def test_parse_chunk_keeps_partial_lines_and_places_unstamped_lines_by_the_stamps_around_them():
    f = logs_mod._File(site="site-a", node=0, host="local", path="x")
    a, b = local_stamp(T0 + 10), local_stamp(T0 + 20)
    data = (f"{OURS}\n[default0]:{a} [INFO] [torchft::manager] - q\n[default0]:Traceback (most recent call last):\n"
            f"[default0]:{b} [ERROR] [torchft::manager] - lost\n[default1]:half").encode()
    got = logs_mod.parse_chunk(f, data[:40]) + logs_mod.parse_chunk(f, data[40:])
    assert [ln.text[:12] for ln in got] == [OURS[11:23], a[:12], "Traceback (m", b[:12]]
    assert [ln.t for ln in got] == [pytest.approx(T0 + 10)] * 3 + [pytest.approx(T0 + 20)]
    assert f.partial == b"[default1]:half"
    (last,) = logs_mod.parse_chunk(f, b"", final=True)
    assert last.text == "[rank 1] half" and last.t == pytest.approx(T0 + 20)


def test_a_library_warning_and_its_source_line_are_noise():
    f = logs_mod._File(site="site-a", node=0, host="local", path="x")
    data = f"{LIB_WARNING}\n{LIB_WARNING_SRC}\n{OURS}\n[default0]:  indented but ours\n".encode()
    assert logs_mod.parse_chunk(f, data) == []  # no stamp yet: they wait to be placed
    assert [ln.noise for ln in f.pending] == [True, True, False, False]


@pytest.mark.parametrize("value, expected", [
    ("90s", T0 - 90), ("10m", T0 - 600), ("2h", T0 - 7200), ("1d", T0 - 86400), ("1.5h", T0 - 5400),
])
def test_since_takes_durations(value, expected):
    assert logs_mod.parse_since(value, now=T0) == pytest.approx(expected)


def test_since_takes_times():
    assert logs_mod.parse_since("2026-01-01T00:10", now=T0) == pytest.approx(
        time.mktime((2026, 1, 1, 0, 10, 0, 0, 0, -1)))
    day = time.localtime(T0)
    assert logs_mod.parse_since("9:30", now=T0) == pytest.approx(
        time.mktime((day.tm_year, day.tm_mon, day.tm_mday, 9, 30, 0, 0, 0, -1)))


@pytest.mark.parametrize("value", ["yesterday", "-5m", "10 parsecs", "25:99"])
def test_since_refuses_what_it_cannot_read(value):
    with pytest.raises(BadInput, match="--since"):
        logs_mod.parse_since(value)


def test_grep_refuses_a_bad_pattern():
    with pytest.raises(BadInput, match="not a regular expression"):
        logs_mod.compile_grep("round [")


# --- the command, over a recorded run with log files on this machine ------------------------------

@pytest.fixture
def run_with_logs(tmp_path, monkeypatch):
    """A finished 4-round run of two sites in the default store, with chatty trainer logs."""
    home = tmp_path / "home"
    monkeypatch.setenv("DILOCOCTL_HOME", str(home))
    home.mkdir()
    logs_dir = tmp_path / "logs"
    logs_dir.mkdir()
    with Store.open(home / "state.db") as store:
        run = make_run(store, state="finished", rounds=4, log_dir=logs_dir)
    for site in ("site-a", "site-b"):
        lines = [OURS.replace("site-a", site)]
        for r in range(1, 5):
            for k in range(20):  # torchft's per-step chatter, as in the demo's logs
                lines.append(f"[default0]:{local_stamp(T0 + ROUND_S * r - 5 + k * 0.1)} [INFO] "
                             f"[torchft::manager] - [Replica {site}] should_commit completed")
            lines.append(FLIGHT)
        lines.append(f"[default0]:{site} done")
        (logs_dir / f"{site}.log").write_text("\n".join(lines) + "\n")
    return run, logs_dir


def invoke(*args):
    return CliRunner().invoke(app, ["logs", *args])


def test_logs_merges_rounds_across_sites_by_time_and_hides_chatter(run_with_logs):
    r = invoke()
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    rounds = [ln for ln in lines if "  round " in ln]
    # both sites' 4 rounds, interleaved by time: round 1 of both before round 2 of either
    assert [ln.split()[1] + ":" + ln.split()[3] for ln in rounds] == [
        f"{s}:{n}" for n in range(1, 5) for s in ("site-a", "site-b")]
    assert "loss " in rounds[0] and "val ppl " in rounds[0] and "sync 1.50s" in rounds[0] and "K 2/2" in rounds[0]
    assert "sync 2.50s" in rounds[1]
    assert not any("torchft::manager" in ln or "flight recorder" in ln for ln in lines)
    assert sum("model tiny" in ln for ln in lines) == 2 and sum(" done" in ln for ln in lines) == 2
    stamps = [ln.split()[0] for ln in lines]
    assert stamps == sorted(stamps)  # one timeline (same day)
    full = invoke("--all").stdout.splitlines()
    assert sum("torchft::manager" in ln for ln in full) == 2 * 4 * 20
    assert sum("flight recorder" in ln for ln in full) == 2 * 4


def test_logs_filters(run_with_logs):
    run, _ = run_with_logs
    only_b = invoke(run.id, "--site", "site-b").stdout.splitlines()
    assert only_b and all(" site-b" in ln for ln in only_b)
    tail = invoke("--tail", "3").stdout.splitlines()
    assert tail == invoke().stdout.splitlines()[-3:]
    assert invoke("-n", "0").stdout == ""
    grep = invoke("--grep", r"ROUND [34]  STEP").stdout.splitlines()
    assert len(grep) == 4 and all(" round 3 " in ln or " round 4 " in ln for ln in grep)
    since = invoke("--since", time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(T0 + ROUND_S * 4 - 1)))
    assert [ln.split()[3] for ln in since.stdout.splitlines() if "  round " in ln] == ["4", "4"]


def test_logs_json_is_one_object_a_line(run_with_logs):
    r = invoke("--json", "--grep", "round 2")
    objs = [json.loads(ln) for ln in r.stdout.splitlines()]
    rounds = [o for o in objs if o["kind"] == "round"]
    assert {o["site"] for o in rounds} == {"site-a", "site-b"}
    assert all(o["record"]["round"] == 2 and o["record"]["k_active"] == 2 for o in rounds)
    assert rounds[0]["t"] == pytest.approx(T0 + ROUND_S * 2)


def test_logs_bad_input_is_one_line_exit_2(run_with_logs):
    for args, msg in ((["--site", "site-c"], "has no site 'site-c' (sites: site-a, site-b)"),
                      (["nosuch"], "no run with id or name 'nosuch'"),
                      (["--since", "soon"], "--since 'soon'"),
                      (["--tail", "-1"], "--tail must be >= 0")):
        r = invoke(*args)
        assert r.exit_code == 2 and r.stderr.count("\n") == 1 and msg in r.stderr, (args, r.stderr)


def test_follow_on_a_finished_run_ends(run_with_logs):
    t0 = time.monotonic()
    r = invoke("-f")
    assert r.exit_code == 0 and time.monotonic() - t0 < 10
    assert r.stdout == invoke().stdout
    assert "finished" in r.stderr


def test_follow_prints_new_lines_and_ends_when_the_run_ends(tmp_path, monkeypatch):
    monkeypatch.setenv("DILOCOCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("dilococtl.cli.logs.FOLLOW_S", 0.1)
    (tmp_path / "home").mkdir()
    db = tmp_path / "home" / "state.db"
    with Store.open(db) as store:
        run = make_run(store, state="running", rounds=2, log_dir=tmp_path)
    (tmp_path / "site-a.log").write_text(f"{OURS}\n")

    def later():  # the run goes on, then ends, while `logs -f` follows it
        time.sleep(0.5)
        with open(tmp_path / "site-a.log", "a") as f:
            f.write("[default0]:late line\n")
        with Store.open(db) as other:
            from tests.tui.fixtures import add_rounds

            add_rounds(other, run.id, "site-b", 3, 3)
            time.sleep(0.3)
            for site in ("site-a", "site-b"):
                other.set_node(run.id, site, "local", state="finished")
                other.set_site_state(run.id, site, "finished")
            other.set_run_state(run.id, "finished")

    th = threading.Thread(target=later)
    th.start()
    r = invoke("-f", "--no-refresh")
    th.join()
    assert r.exit_code == 0, r.output
    out = r.stdout.splitlines()
    assert out[-1].endswith("late line") or any(ln.endswith("late line") for ln in out)
    assert sum("  round 3 " in ln for ln in out) == 1
    assert f"run {run.id} finished" in r.stderr


def test_a_reader_that_stops_early_gets_no_traceback(run_with_logs):
    """`dilococtl logs | head -1`: the closed pipe ends the command quietly (exit 1, click's way)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    _, logs_dir = run_with_logs
    with open(logs_dir / "site-a.log", "a") as f:
        f.writelines(f"[default0]:line {i} of a long log\n" for i in range(50_000))
    root = Path(__file__).resolve().parents[2]
    p = subprocess.Popen([sys.executable, "-m", "dilococtl", "logs"], cwd=root, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=dict(os.environ))
    first = p.stdout.readline()
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 1 and first
    assert "Traceback" not in err and "error" not in err, err


def test_a_round_line_splits_its_exchange_where_the_trainer_measured_the_parts():
    base = dict(round=3, step=60, h=20, compute_s=2.0, sync_s=0.452, bytes_sent=1, bytes_recv=1, k_active=3,
                k_nominal=3, outer_lr=0.7, committed=True)
    split = logs_mod.round_line(RoundRecord(**base, quorum_s=0.043, weight_s=0.102, payload_s=0.301))
    assert "sync 0.45s  (quorum 0.043 weight 0.102 payload 0.301)  K 3/3" in split.text
    assert (split.record["quorum_s"], split.record["payload_s"]) == (0.043, 0.301)
    plain = logs_mod.round_line(RoundRecord(**base))  # async, ddp, or a store from before the parts
    assert "sync 0.45s  K 3/3" in plain.text and plain.record["weight_s"] is None

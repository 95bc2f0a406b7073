"""Goodput under chaos (issue 36, "What it must show" 1-3): every arm on one 3-site lab, same seed, with
and without a schedule of faults, side by side.

    sudo .venv/bin/python bench/chaos_goodput.py [--chaos playbooks/chaos-standard.toml | --no-chaos]
        [--arms policy,overlap,async,sync,ddp] [--rate 50mbit] [--rtt 80ms] [--rounds 60] [--h 400]
        [--ddp-h 10] [--cpus-per-node 0.6] [--seed 0] [--src HEAD] [--lock FILE] [--name chaos_goodput]
    sudo .venv/bin/python bench/chaos_goodput.py --slow-site [--slow-factor 2]   # point 3

What a user does, through the real CLI only (`python -m dilococtl ...` in subprocesses, a fresh
DILOCOCTL_HOME): `lab up --sites 3 --rate R --rtt T --spec-out SPEC`, `doctor`, `provision`; then per
arm a spec derived from the lab's (tiny preset, --rounds, --h, train.seed and data.seed fixed, the arm's
[diloco] knobs; `provision` only with --src worktree: a snapshot runs through its wrapper), checked with `spec check` (an arm whose knobs this code refuses is recorded as skipped,
with the refusal), started with `launch SPEC --wait`; with a scenario, `lab chaos SCENARIO --run RUN_ID
--seed N --json` starts as soon as `runs --json` knows the run id. Both are waited for and their exit
codes kept. Each arm runs twice, with the scenario and without (its twin: same spec, same seed), the
twin first. `lab down` always runs at the end.

Arms (ARMS): policy = sync with POLICY_KNOBS (h_policy "time", token-weighted merging, the default
merge_weighting), overlap, async, sync (plain, no policy), ddp (gradients averaged every step: --ddp-h
steps a round, so its per-step exchange over the lab's WAN fits the same wall time as the others; its
ppl is compared with its own twin only). --slow-site (point 3): a scenario of one `slow` fault, factor
--slow-factor on site1 from the start for longer than the run (`lab chaos` ends it when the run
finishes; the harness SIGTERMs it 30 s after that if it has not, which restores the site too), arms steps (h_policy "steps") and time (h_policy "time")
against the equal-speed run (the time arm without the fault).

Figures from `status RUN --json` (dilococtl/goodput.py): metrics.goodput, metrics.lost_s by cause,
metrics.goodput_sites; final val ppl; tokens (the newest round record of each site, from `logs --json`);
the faults' `chaos` events. "The ledger adds up" (point 2), per site: useful_s + sum(lost_s) against
wall_s within 2%. A site's wall time in the ledger is the run's (launch to end: `runs.created` to
`runs.finished`); `other` is what no cause claims (start-up, evaluations, checkpoints, the tail), never
below 0, so the check fails only when causes overlap (time counted twice); the table also gives
`other` and the ledger's wall against the harness's own clock (launch start to `launch --wait`'s exit).
goodput_after_startup leaves out each site's first start-up (launch to its first round's start), which
this 2-core lab spends a minute or more on and a real run amortises over days.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from contextlib import ExitStack
from pathlib import Path

import tomlkit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lab_modes import Cli, edit_spec, held, log, snapshot  # noqa: E402

# arm -> its [diloco] knobs; the policy arm's come from --policy (POLICY_KNOBS by default)
POLICY_KNOBS = 'h_policy = "time"'
ARMS: dict[str, dict] = {"policy": {"mode": "sync"}, "overlap": {"mode": "overlap"}, "async": {"mode": "async"},
                         "sync": {"mode": "sync"}, "ddp": {"algorithm": "ddp", "mode": "sync"}}
SLOW_ARMS: dict[str, dict] = {"steps": {"mode": "sync"},  # h_policy's default
                              "time": {"mode": "sync", "h_policy": "time"}}
CAUSES = ("exchange", "straggler", "failure_detection", "restart", "discarded", "other")
LEDGER_TOL = 0.02  # point 2: useful + lost within 2% of wall, per site
SLOW_SITE = "site1"


def knobs(text: str) -> dict:
    """`h_policy = "time", min_quorum = 2` (TOML keys and values) -> a dict; ValueError in one line."""
    try:
        return tomllib.loads("x = {" + text + "}")["x"] if text.strip() else {}
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--policy: not TOML key = value pairs ({e}): {text!r}") from None


def arm_spec(base: Path, dst: Path, name: str, diloco: dict, args) -> None:
    """dst = the lab spec with this arm's name, size, seeds and [diloco] knobs (comments kept)."""
    h = args.ddp_h if diloco.get("algorithm") == "ddp" else args.h
    edit_spec(base, dst, {"run": {"name": name}, "model": {"preset": "tiny"},
                          "diloco": {"rounds": args.rounds, "h": h, "compression": args.compression, **diloco},
                          "train": {"seed": args.seed, "eval_every": args.eval_every},
                          "data": {"seed": 1234 + args.seed},
                          "checkpoint": {"every_rounds": args.checkpoint_every}})


def scenario_span(cli: Cli, scenario: Path, seed: int) -> float:
    """Seconds from the run's start to the scenario's last fault's planned end (`lab chaos --dry-run`)."""
    plan = cli.json("lab", "chaos", str(scenario), "--dry-run", "--seed", str(seed), timeout=60)
    return max((f["planned_at"] + (f.get("for") or 0.0) for f in plan["faults"]), default=0.0)


def run_id(cli: Cli, name: str, launch: subprocess.Popen, timeout: float = 180) -> str | None:
    """The id `runs --json` gives the run named `name`, polled until launch has recorded it."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and launch.poll() is None:
        r = cli("runs", "--name", name, "--json", timeout=60, check=False)
        if r.returncode == 0 and (rows := json.loads(r.stdout)):
            return rows[0]["id"]
        time.sleep(1)
    r = cli("runs", "--name", name, "--json", timeout=60, check=False)
    rows = json.loads(r.stdout) if r.returncode == 0 else []
    return rows[0]["id"] if rows else None


def launch_arm(cli: Cli, spec: Path, name: str, scenario: Path | None, args, span_s: float) -> dict:
    """`launch SPEC --wait` (and `lab chaos` on it): exit codes, the harness's wall clock, chaos's JSON."""
    out: dict = {"launch_exit": None, "chaos_exit": None, "chaos": None, "chaos_stopped_by_harness": False}
    cmd = [sys.executable, "-m", "dilococtl", "launch", str(spec), "--wait", "--yes", "--force", "--json",
           "--accept-new-host-keys"]
    logdir = Path(cli.env["DILOCOCTL_HOME"]) / "bench-logs"
    logdir.mkdir(exist_ok=True)
    t0 = time.monotonic()
    with ExitStack() as files:
        lout, lerr = (files.enter_context(open(logdir / f"{name}.launch.{x}", "w")) for x in ("out", "err"))
        launch = subprocess.Popen(cmd, cwd=cli.src, env=cli.env, stdin=subprocess.DEVNULL, stdout=lout, stderr=lerr)
        chaos = None
        try:
            rid = run_id(cli, name, launch)
            out["id"] = rid
            if scenario is not None and rid is not None:
                cout, cerr = (files.enter_context(open(logdir / f"{name}.chaos.{x}", "w")) for x in ("out", "err"))
                chaos = subprocess.Popen([sys.executable, "-m", "dilococtl", "lab", "chaos", str(scenario), "--run", rid,
                                          "--seed", str(args.chaos_seed), "--json"], cwd=cli.src, env=cli.env,
                                         stdin=subprocess.DEVNULL, stdout=cout, stderr=cerr)
                log(f"{name}: chaos on run {rid} ({time.monotonic() - t0:.0f} s after launch)")
            try:
                out["launch_exit"] = launch.wait(timeout=args.run_timeout)
            except subprocess.TimeoutExpired:
                log(f"{name}: still running after {args.run_timeout:.0f} s: stop")
                cli("stop", name, "--grace", "10", timeout=120, check=False)
                out["launch_exit"] = launch.wait(timeout=120)
                out["timed_out"] = True
            out["harness_wall_s"] = time.monotonic() - t0
            if chaos is not None:
                # the scenario returns when its last fault has ended (or the run has, ending what still
                # holds); one still going past that is stopped with SIGTERM, which restores (exit 143)
                left = max(30.0, span_s - (time.monotonic() - t0) + 90.0) if not args.slow_site else 30.0
                try:
                    out["chaos_exit"] = chaos.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    out["chaos_stopped_by_harness"] = True
                    chaos.send_signal(signal.SIGTERM)
                    out["chaos_exit"] = chaos.wait(timeout=120)
        finally:  # interrupted: chaos restores what it changed on SIGTERM; the run is stopped
            if chaos is not None and chaos.poll() is None:
                chaos.send_signal(signal.SIGTERM)
                try:
                    chaos.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    chaos.kill()
            if launch.poll() is None:
                cli("stop", name, "--grace", "5", timeout=120, check=False)
                launch.kill()
                launch.wait()
    if chaos is not None:
        text = (logdir / f"{name}.chaos.out").read_text()
        try:
            out["chaos"] = json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            out["chaos"] = {"unparsed": text[-2000:]}
        if out["chaos_exit"] not in (0, None):
            out["chaos_stderr"] = (logdir / f"{name}.chaos.err").read_text()[-1500:]
    if out["launch_exit"] != 0:
        out["launch_stderr"] = (logdir / f"{name}.launch.err").read_text()[-1500:]
    return out


def read_back(cli: Cli, name: str) -> dict:
    """The run's figures from `status --json` and `logs --json`, and the ledger checks (module docstring)."""
    st = cli.json("status", name, "--no-refresh")
    m = st["metrics"]
    last: dict[str, dict] = {}
    first_start: dict[str, float] = {}
    chaos_events = []
    # exit 3 when a node's trainer log cannot be fetched: the records are local and still printed
    for line in cli("logs", name, "--json", check=False, timeout=300).stdout.splitlines():
        rec = json.loads(line)
        x = rec.get("record") or {}
        if rec.get("kind") == "round":
            site = rec["site"]
            if x.get("round", 0) >= last.get(site, {}).get("round", 0):
                last[site] = x
            began = rec["t"] - (x.get("compute_s") or 0.0) - (x.get("sync_s") or 0.0)
            first_start[site] = min(first_start.get(site, began), began)
        elif rec.get("kind") == "event" and x.get("event") == "chaos":
            chaos_events.append({"t": rec["t"] - st["created"], "site": rec["site"], "text": rec["text"]})
    sites = {}
    for site, g in (m.get("goodput_sites") or {}).items():
        total = g["useful_s"] + sum(g["lost_s"].values())
        err = abs(total - g["wall_s"]) / g["wall_s"] if g["wall_s"] else None
        start = first_start.get(site, st["created"]) - st["created"]
        sites[site] = {**g, "accounted_s": total, "ledger_error": err,
                       "ledger_ok": err is not None and err <= LEDGER_TOL,
                       "startup_s": start, "tokens": (last.get(site) or {}).get("tokens"),
                       "rounds": (last.get(site) or {}).get("round")}
    useful = sum(s["useful_s"] for s in sites.values())
    after = sum(s["wall_s"] - s["startup_s"] for s in sites.values())
    return {"id": st["id"], "state": st["state"], "reason": st["reason"], "rounds_planned": st["rounds_planned"],
            "h": st["h"], "final_val_ppl": st["final_val_ppl"], "wall_s": m["wall_s"], "goodput": m.get("goodput"),
            "goodput_after_startup": useful / after if after > 0 else None, "lost_s": m.get("lost_s"),
            "tokens": sum(s["tokens"] or 0 for s in sites.values()), "sites": sites,
            "ledger_ok": bool(sites) and all(s["ledger_ok"] for s in sites.values()),
            "chaos_events": chaos_events}


def fits(rec: dict) -> bool | None:
    """Whether every fault was applied and ended (a kill: its site relaunched) before the run ended:
    a fault after the run's end measured nothing, and the arm needs more rounds or a larger H."""
    faults = (rec.get("chaos") or {}).get("faults")
    if not faults or rec.get("wall_s") is None:
        return None
    return all(f["applied_at"] is not None and f["ended_at"] is not None and f["ended_at"] < rec["wall_s"]
               and (f["kind"] != "kill" or (f.get("detail") or {}).get("relaunched") is not False) for f in faults)


def slow_scenario(path: Path, factor: float, for_s: float) -> Path:
    """Point 3's scenario: SLOW_SITE `factor` times slower from the run's start for `for_s` seconds."""
    path.write_text(f'description = "{SLOW_SITE} {factor:g}x slower for the whole run (bench/chaos_goodput.py)"\n'
                    f'[[fault]]\nat = "0s"\nkind = "slow"\ntarget = "{SLOW_SITE}"\nfactor = {factor}\n'
                    f'for = "{for_s:.0f}s"\n')
    return path


def fmt(v, spec: str = ".3f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def table(arms: list[dict]) -> None:
    """Markdown table: one row per run."""
    print("\n| arm | chaos | goodput | after start-up | lost s: " + " / ".join(CAUSES) + " | val ppl | vs twin |"
          " tokens | wall s | ledger (max err) | exit launch/chaos | faults inside the run |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | --- |")
    for a in arms:
        if a.get("skipped"):
            print(f"| {a['arm']} | {a['scenario'] or 'none'} | skipped: {a['skipped']} ||||||||||")
            continue
        lost = " / ".join(fmt((a.get("lost_s") or {}).get(c), ".0f") for c in CAUSES)
        errs = [s["ledger_error"] for s in a.get("sites", {}).values() if s["ledger_error"] is not None]
        led = ("ok" if a.get("ledger_ok") else "FAIL") + (f" ({max(errs):.2%})" if errs else "")
        print(f"| {a['arm']} | {a['scenario'] or 'none'} | {fmt(a.get('goodput'), '.1%')} | "
              f"{fmt(a.get('goodput_after_startup'), '.1%')} | {lost} | {fmt(a.get('final_val_ppl'))} | "
              f"{fmt(a.get('ppl_vs_twin'), '+.2%')} | {a.get('tokens', '-')} | {fmt(a.get('wall_s'), '.0f')} | {led} | "
              f"{a.get('launch_exit')}/{'-' if a.get('chaos_exit') is None else a['chaos_exit']} | "
              f"{ {True: 'yes', False: 'NO', None: '-'}[a.get('scenario_fits')]} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_chaos = ROOT / "playbooks" / "chaos-standard.toml"
    ap.add_argument("--chaos", default=str(default_chaos) if default_chaos.exists() else "",
                    help="scenario TOML (default playbooks/chaos-standard.toml when it exists)")
    ap.add_argument("--no-chaos", action="store_true", help="only the arms' no-chaos runs")
    ap.add_argument("--no-twins", action="store_true", help="only the chaos runs (no no-chaos twin)")
    ap.add_argument("--arms", default=None, help=f"comma list of {', '.join(ARMS)}"
                    f" (--slow-site: {', '.join([*SLOW_ARMS, 'equal'])})")
    ap.add_argument("--slow-site", action="store_true", help=f"point 3: {SLOW_SITE} slower for the whole run")
    ap.add_argument("--slow-factor", type=float, default=2.0, help="--slow-site: the compute slow-down")
    ap.add_argument("--policy", default=POLICY_KNOBS, help="the policy arm's [diloco] knobs, TOML key = value pairs")
    ap.add_argument("--grace", type=float, default=0.0, help="adds the arm grace: the policy arm's knobs and "
                    "diloco.grace = G, whose spec is tuned first (tune-h --write); every arm then runs at the H "
                    "tune-h chose, with its rounds scaled to keep --rounds x --h inner steps (one grace run: "
                    "--no-twins or --no-chaos)")
    ap.add_argument("--rate", default="50mbit", help="every inter-site link, each direction")
    ap.add_argument("--rtt", default="80ms", help="round trip between the sites")
    ap.add_argument("--cpus-per-node", type=float, default=0.0, help="lab up --cpus-per-node (0: no cap): with a "
                    "cap, a killed site does not speed the others up nor a returning one slow them down")
    ap.add_argument("--rounds", type=int, default=60, help="outer rounds of every arm")
    ap.add_argument("--h", type=int, default=400, help="inner steps a round (DiLoCo arms); 400: ~6 s a round "
                    "on this lab, so chaos-standard's last fault (near 5m15s) ends inside 60 rounds")
    ap.add_argument("--ddp-h", type=int, default=10, help="steps a round of the ddp arm (one exchange each)")
    ap.add_argument("--compression", default="int8", help="diloco.compression of every arm")
    ap.add_argument("--eval-every", type=int, default=5, help="train.eval_every (rounds between validations)")
    ap.add_argument("--checkpoint-every", type=int, default=1, help="checkpoint.every_rounds (a killed site "
                    "resumes from its newest)")
    ap.add_argument("--seed", type=int, default=0, help="train.seed of every arm (data.seed = 1234 + seed)")
    ap.add_argument("--chaos-seed", type=int, default=None, help="lab chaos --seed (default: --seed)")
    ap.add_argument("--run-timeout", type=float, default=1800, help="seconds before an arm is stopped")
    ap.add_argument("--src", default="HEAD", help="git revision the runs use, or 'worktree'")
    ap.add_argument("--lock", default="", help="flock file held while anything is measured")
    ap.add_argument("--name", default="", help="results name: bench/results/NAME.json (default chaos_goodput"
                    "[_slow])")
    ap.add_argument("--out", default=None, help="results path ('' for none; default from --name)")
    args = ap.parse_args(argv)
    args.chaos_seed = args.seed if args.chaos_seed is None else args.chaos_seed
    known = [*SLOW_ARMS, "equal"] if args.slow_site else list(ARMS)
    arms = known if args.arms is None else [a.strip() for a in args.arms.split(",") if a.strip()]
    if bad := [a for a in arms if a not in known]:
        print(f"error: --arms: unknown {', '.join(bad)} (known: {', '.join(known)})", file=sys.stderr)
        return 2
    if args.grace and (args.slow_site or not (args.no_twins or args.no_chaos) or not 0 < args.grace <= 100):
        print("error: --grace: in (0, 100], with one grace run (--no-twins or --no-chaos), not --slow-site",
              file=sys.stderr)
        return 2
    if min(args.rounds, args.h, args.ddp_h) < 1 or args.slow_factor <= 1:
        print("error: --rounds, --h and --ddp-h must be >= 1 and --slow-factor > 1", file=sys.stderr)
        return 2
    scenario = None if args.no_chaos or args.slow_site else (Path(args.chaos).resolve() if args.chaos else None)
    if scenario is not None and not scenario.is_file():
        print(f"error: --chaos: no scenario at {scenario}", file=sys.stderr)
        return 2
    try:
        policy = knobs(args.policy)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("error: `dilococtl lab up` needs root", file=sys.stderr)
        return 2
    name = args.name or ("chaos_goodput_slow" if args.slow_site else "chaos_goodput")
    out_path = args.out if args.out is not None else str(ROOT / "bench" / "results" / f"{name}.json")
    command = ".venv/bin/python bench/chaos_goodput.py " + shlex.join(sys.argv[1:] if argv is None else argv)

    home = Path(tempfile.mkdtemp(prefix="chaos-goodput-"))
    src, commit, python = snapshot(args.src, home)
    cli = Cli(home, src)
    stamp = time.strftime("%H%M%S")
    spec = home / "lab.toml"
    out: dict = {"benchmark": "chaos_goodput", "date": datetime.date.today().isoformat(), "command": command.rstrip(),
                 "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}",
                 "commit": commit, "home": str(home), "link": {"rate": args.rate, "rtt": args.rtt},
                 "cpus_per_node": args.cpus_per_node,
                 "rounds": args.rounds, "h": args.h, "ddp_h": args.ddp_h, "seed": args.seed,
                 "chaos_seed": args.chaos_seed, "compression": args.compression, "policy": policy,
                 "scenario": str(scenario.relative_to(ROOT)) if scenario and scenario.is_relative_to(ROOT) else
                 (str(scenario) if scenario else None), "slow_site": args.slow_site, "arms": []}
    t_start = time.monotonic()
    try:
        with held(args.lock, "the lab and every arm"):
            log(f"lab up: 3 sites, {args.rate}, {args.rtt} (home {home})")
            cap = ["--cpus-per-node", f"{args.cpus_per_node:g}"] if args.cpus_per_node else []
            cli("lab", "up", "--sites", "3", "--rate", args.rate, "--rtt", args.rtt, *cap, "--spec-out", str(spec),
                timeout=300)
            if python:  # the nodes share this filesystem: they run the snapshot through its wrapper
                doc = tomlkit.parse(spec.read_text())
                for site in doc["sites"]:
                    site["python"] = python
                spec.write_text(tomlkit.dumps(doc))
            cli("doctor", str(spec), "--accept-new-host-keys", timeout=300)
            if not python:  # a snapshot is its own install (the wrapper); provision refuses a second copy
                cli("provision", str(spec), timeout=600)
            span = scenario_span(cli, scenario, args.chaos_seed) if scenario else 0.0
            out["scenario_span_s"] = span if scenario else None
            if args.slow_site:
                runs = [("equal", {**SLOW_ARMS["time"]}, None)] if "equal" in arms else []
                runs += [(a, SLOW_ARMS[a], "slow") for a in arms if a in SLOW_ARMS]
            else:
                runs = []
                # --grace: the policy arm once more, its join window from tune-h's prediction
                named = [(a, {**ARMS[a], **(policy if a == "policy" else {})}) for a in arms]
                named += [("grace", {**ARMS["policy"], **policy, "grace": args.grace})] if args.grace else []
                for a, diloco in named:
                    runs += ([] if args.no_twins and scenario else [(a, diloco, None)])
                    runs += [(a, diloco, "chaos")] if scenario else []
            if args.grace:  # the grace arm's window is relative to tune-h's prediction for its spec and H
                tuned = next(r for r in runs if r[0] == "grace")
                rname = f"cg-grace-{tuned[2] or 'calm'}-{stamp}"
                arm_spec(spec, home / f"{rname}.toml", rname, tuned[1], args)
                log(f"tune-h {rname} --write")
                t = cli.json("tune-h", str(home / f"{rname}.toml"), "--write", timeout=900)
                steps = args.rounds * args.h
                args.h, args.rounds = int(t["h"]), max(1, round(steps / int(t["h"])))
                out.update(h=args.h, rounds=args.rounds, tune={"h": args.h, "sync_s": t["choice"]["sync_s"],
                                                               "sync_share": t["choice"]["sync_share"]})
                log(f"every arm at the tuned H {args.h}, {args.rounds} rounds; predicted exchange "
                    f"{t['choice']['sync_s']:.2f} s")
            for arm, diloco, kind in runs:
                rname = f"cg-{arm}-{kind or 'calm'}-{stamp}"
                s = home / f"{rname}.toml"
                arm_spec(spec, s, rname, diloco, args)
                rec: dict = {"arm": arm, "run": rname, "diloco": diloco, "scenario": None}
                check = cli("spec", "check", str(s), timeout=60, check=False)
                if check.returncode != 0:  # this code refuses the arm's knobs (not landed yet)
                    rec["skipped"] = (check.stderr.strip() or check.stdout.strip()).splitlines()[-1][:300]
                    log(f"{rname}: skipped: {rec['skipped']}")
                    out["arms"].append(rec)
                    continue
                sc = scenario if kind == "chaos" else None  # the twin runs without it
                if kind == "slow":
                    # longer than the slowest arm can take: the harness stops it when the run ends
                    equal = next((a for a in out["arms"] if a["arm"] == "equal" and a.get("wall_s")), None)
                    for_s = max(600.0, 3 * args.slow_factor * equal["wall_s"]) if equal else args.run_timeout
                    sc = slow_scenario(home / f"{rname}.chaos.toml", args.slow_factor, for_s)
                rec["scenario"] = ("slow" if kind == "slow" else out["scenario"]) if kind else None
                log(f"launch {rname}" + (f" with {rec['scenario']}" if kind else ""))
                rec.update(launch_arm(cli, s, rname, sc, args, span))
                if rec.get("id"):
                    rec.update(read_back(cli, rname))
                rec["scenario_fits"] = fits(rec) if kind == "chaos" else None
                out["arms"].append(rec)
                log(f"{rname}: launch exit {rec['launch_exit']}, chaos exit {rec['chaos_exit']}, goodput "
                    f"{fmt(rec.get('goodput'), '.1%')}, val ppl {fmt(rec.get('final_val_ppl'))}, "
                    f"wall {fmt(rec.get('wall_s'), '.0f')} s, ledger {'ok' if rec.get('ledger_ok') else 'FAIL'}")
                if out_path:  # after every arm: a partial result survives a crash
                    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
                    Path(out_path).write_text(json.dumps(out, indent=1) + "\n")
    finally:
        log("lab down")
        cli("lab", "down", timeout=300, check=False)
    out["total_wall_s"] = time.monotonic() - t_start

    # each run against its twin: the arm's no-chaos run (--slow-site: the equal-speed run)
    for a in out["arms"]:
        twin = next((b for b in out["arms"] if not b.get("skipped") and b.get("final_val_ppl") and not b["scenario"]
                     and (b["arm"] == "equal" if args.slow_site else b["arm"] == a["arm"])), None)
        p = a.get("final_val_ppl")
        a["ppl_vs_twin"] = p / twin["final_val_ppl"] - 1 if p and twin and a["scenario"] else None
    print(f"\n{args.rate} / {args.rtt}, 3 sites, {args.rounds} rounds, H {args.h} (ddp {args.ddp_h}), seed {args.seed}, "
          f"scenario {out['scenario'] or ('slow ' + SLOW_SITE + f' {args.slow_factor:g}x' if args.slow_site else 'none')}")
    table(out["arms"])
    print(f"\ncommand: sudo {out['command']}")
    if out_path:
        Path(out_path).write_text(json.dumps(out, indent=1) + "\n")
        print(f"results: {out_path}")
    ran = [a for a in out["arms"] if not a.get("skipped")]
    return 0 if ran and all(a.get("launch_exit") == 0 and a.get("ledger_ok") for a in ran) else 1


if __name__ == "__main__":
    raise SystemExit(main())

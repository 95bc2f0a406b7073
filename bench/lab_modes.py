"""Every sync mode on a shaped 2-site lab at tune-h's H: compute efficiency and val ppl side by side.

    sudo .venv/bin/python bench/lab_modes.py [--rate 50mbit] [--rtt 80ms] [--budget 0.1]
        [--rounds 10,30] [--modes sync,overlap,async] [--ddp auto|lab|local|none] [--seed 0]
        [--lock /tmp/h/lab.lock] [--out bench/results/lab_modes_2site_10rounds.json]

What a user does, through the real CLI only (`python -m dilococtl ...` in subprocesses, with its own
DILOCOCTL_HOME): `lab up --sites 2 --rate R --rtt T --spec-out SPEC`, `tune-h SPEC --budget B
--write` (H for the first arm's mode, sync), then for each run length in --rounds, the same run
once per mode with `launch SPEC --wait --force --yes`, SPEC edited in place between arms (only `[run]
name` and `[diloco] mode`), so launch finds its tune as it would for a user, and overlap and async
land as soon as the exchange it predicted is done. Outer lr and momentum stay unset (the default
rule applies), the seed is the same, and every arm takes H * rounds inner steps per site, so every arm trains on the same tokens (async
sites push `rounds` times, H steps each). Per site, compute efficiency (dilococtl.metrics: compute /
(compute + sync) over its rounds) and the final val ppl come from `status RUN --json`; the rounds
(sync_s, staleness, val ppl per round) from `logs RUN --json`. `lab down` always runs at the end.

DDP (`diloco.algorithm = "ddp"`, gradients averaged every inner step) at equal tokens: in the lab
when its per-step exchange (tune-h's predicted exchange of the same payload, per step) fits in
--ddp-lab-max-s, else (`--ddp auto`) on this machine without the lab: two local sites, loopback.

The lab spec `lab up` writes is sized for tests (batch 4, 2 eval batches); the runs here take the
simulator study's sizes instead (bench/modes.py: batch 8 x 64 bytes, 20 warmup steps, 16 validation
batches of 3 held-out plays), validation after every round.

--src: the code every command and node runs: a git revision of this checkout (default HEAD),
unpacked with `git archive` under the benchmark's home and put first on PYTHONPATH (the nodes get it
through a wrapper interpreter named as the sites' `python`), so edits in progress in a shared
checkout do not change a run half-way; `worktree` runs the checkout as it is.

--lock: an flock(2) file held while anything is measured, so benchmarks sharing this machine's
cores do not overlap: from tune-h through the first set of arms, then for each further set (one run
length: every mode and DDP), so the arms compared with each other run under the same conditions.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomlkit

ROOT = Path(__file__).resolve().parents[1]
MODES = ("sync", "overlap", "async")
# bench/modes.py's sizes, so the lab's figures sit next to the simulator's
RUN_KNOBS = {"data": {"batch_size": 8, "seq_len": 64, "val_plays": 3},
             "train": {"warmup_steps": 20, "eval_batches": 16, "eval_every": 1, "threads": 1}}
# ports of the local DDP arm: away from the defaults other runs on this machine may hold
LOCAL_LIGHTHOUSE_PORT, LOCAL_BASE_PORT = 29911, 29920


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def held(lock: str | None, what: str):
    """flock(2) on `lock` while `what` runs (no lock: nothing)."""
    if not lock:
        yield
        return
    with open(lock, "a") as f:
        t0 = time.monotonic()
        fcntl.flock(f, fcntl.LOCK_EX)
        if time.monotonic() - t0 > 1:
            log(f"waited {time.monotonic() - t0:.0f} s for {lock}")
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def snapshot(rev: str, home: Path) -> tuple[Path, str, str | None]:
    """(source root, commit, wrapper interpreter) of `rev` unpacked under home; `worktree`: the checkout."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()

    if rev == "worktree":
        dirty = git("status", "--short", "--untracked-files=no")
        return ROOT, git("rev-parse", "HEAD") + (" + uncommitted edits" if dirty else ""), None
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
    src = home / f"src-{commit[:10]}"
    if not src.exists():
        src.mkdir(parents=True)
        tar = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=tar, check=True)
    wrapper = src / ".python"
    wrapper.write_text(f"#!/bin/sh\nexport PYTHONPATH={shlex.quote(str(src))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
                       f"exec {shlex.quote(sys.executable)} \"$@\"\n")
    wrapper.chmod(0o755)
    return src, commit, str(wrapper)


class Cli:
    """`python -m dilococtl ARGS` as a user types it, with this benchmark's DILOCOCTL_HOME and code."""

    def __init__(self, home: Path, src: Path):
        self.src = src
        self.env = {**os.environ, "DILOCOCTL_HOME": str(home)}
        if src != ROOT:
            self.env["PYTHONPATH"] = str(src) + (f":{os.environ['PYTHONPATH']}" if os.environ.get("PYTHONPATH") else "")

    def __call__(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run([sys.executable, "-m", "dilococtl", *args], cwd=self.src, env=self.env, text=True,
                           capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
        if check and r.returncode != 0:
            raise RuntimeError(f"dilococtl {shlex.join(args)} exited {r.returncode}: {r.stderr.strip()[-2000:]}")
        return r

    def json(self, *args: str, timeout: float = 900) -> dict:
        return json.loads(self(*args, "--json", timeout=timeout).stdout)


def edit_spec(src: Path, dst: Path, changes: dict[str, dict]) -> None:
    """dst = src with `changes` ({table: {key: value}}) set, comments kept."""
    doc = tomlkit.parse(src.read_text())
    for table, kv in changes.items():
        if table not in doc:
            doc[table] = tomlkit.table()
        for k, v in kv.items():
            doc[table][k] = v
    dst.write_text(tomlkit.dumps(doc))


def local_spec(lab_spec: Path, dst: Path, work: Path, python: str | None) -> None:
    """The lab spec's run on this machine: the same model, data and trainer knobs, two local sites."""
    doc = tomlkit.parse(lab_spec.read_text())
    doc["run"]["lighthouse"] = ""
    doc["run"]["lighthouse_port"] = LOCAL_LIGHTHOUSE_PORT
    doc["run"]["base_port"] = LOCAL_BASE_PORT
    doc.pop("ssh", None)
    for s in doc["sites"]:
        s["hosts"] = ["local"]
        s["python"] = python or ""  # "": the interpreter dilococtl runs under
        s["work_dir"] = str(work / s["name"])
    dst.write_text(tomlkit.dumps(doc))


def measure(cli: Cli, spec: Path, name: str) -> dict:
    """Launch one arm, wait for it, and read its figures back from status and logs."""
    log(f"launch {name}")
    load0 = os.getloadavg()
    t0 = time.monotonic()
    r = cli("launch", str(spec), "--wait", "--force", "--yes", "--json", "--accept-new-host-keys",
            timeout=3600, check=False)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        log(f"{name} exited {r.returncode}: {r.stderr.strip()[-1500:]}")
    land = re.search(r"the update lands (\d+) of \d+ steps", r.stderr)  # launch's line: tune-h's landing
    return {**read_run(cli, name), "exit": r.returncode, "wall_s": wall, "loadavg_before": load0,
            "loadavg_after": os.getloadavg(), "land_steps": int(land[1]) if land else None}


def read_run(cli: Cli, name: str) -> dict:
    """A recorded run's figures: `status --json` per site, `logs --json` per round."""
    st = cli.json("status", name, "--no-refresh")
    rounds = []
    # exit 3 when a node cannot be reached for its trainer log (the lab is down): the records are local
    for line in cli("logs", name, "--json", check=False).stdout.splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "round":
            x = rec["record"]
            rounds.append({"site": rec["site"], **{k: x.get(k) for k in (
                "round", "step", "compute_s", "sync_s", "staleness", "val_ppl", "train_loss", "k_active",
                "committed", "outer_lr", "tokens")}})
    rounds.sort(key=lambda x: (x["round"], x["site"]))
    sites = [{k: s.get(k) for k in ("site", "state", "round", "step", "efficiency", "val_ppl", "staleness",
                                    "tokens_per_s", "bytes_sent")} for s in st["sites"]]
    spans = step_spans(cli, st["id"])
    for s in sites:
        own = [x for x in rounds if x["site"] == s["site"]]
        s["compute_s"] = sum(x["compute_s"] or 0 for x in own)
        s["sync_s"] = sum(x["sync_s"] or 0 for x in own)
        # time inside the inner-step loop that the round's compute_s leaves out: an exchange waited
        # for mid-round (overlap's landing, async's mid-round pull, ddp's gradients); overlap and ddp
        # put it in sync_s, so it must not vanish from both
        s["inside_wait_s"] = sum(max(0.0, spans[(s["site"], x["round"])] - (x["compute_s"] or 0))
                                 for x in own if (s["site"], x["round"]) in spans)
    return {"name": name, "id": st["id"], "state": st["state"], "h": st["h"], "rounds_planned": st["rounds_planned"],
            "final_val_ppl": st["final_val_ppl"], "sync_share": st["sync_share"], "sites": sites,
            "round_records": rounds}


def step_spans(cli: Cli, run_id: str) -> dict[tuple[str, int], float]:
    """(site, round) -> wall seconds from the round's first inner step's start to its last step's record,
    from the step records in the control plane's store (each is stamped after the step's exchange hook)."""
    from dilococtl.store import Store

    out: dict[tuple[str, int], float] = {}
    first: dict[tuple[str, int], float] = {}
    with Store.open(Path(cli.env["DILOCOCTL_HOME"]) / "state.db") as store:
        for x in store.steps(run_id):
            key = (x.site, x.round)
            first.setdefault(key, x.t - x.step_s)
            out[key] = x.t - first[key]
    return out


def finish(out: dict, command: str, path: str | None) -> int:
    """Print the command, write the JSON results; exit 0 only if every arm finished."""
    print(f"\ncommand: sudo {command}")
    if path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(out, indent=1) + "\n")
        print(f"results: {p.relative_to(ROOT) if p.is_relative_to(ROOT) else p}")
    return 0 if all(a["state"] == "finished" for a in out["arms"]) else 1


def fmt(v, spec: str = ".3f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="50mbit", help="every inter-site link, each direction")
    ap.add_argument("--rtt", default="80ms", help="round trip between the sites")
    ap.add_argument("--budget", type=float, default=0.1, help="tune-h's sync budget (fraction of compute)")
    ap.add_argument("--rounds", default="10", help="comma list of run lengths in rounds (one set of arms each)")
    ap.add_argument("--steps", default="", help="comma list of run lengths in inner steps per site: "
                    "rounds = steps / H rounded (one set of arms each, after the --rounds sets)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of diloco.mode arms")
    ap.add_argument("--ddp", choices=("auto", "lab", "local", "none"), default="auto",
                    help="the DDP arm: in the lab, on this machine, or auto (lab if it fits --ddp-lab-max-s)")
    ap.add_argument("--ddp-lab-max-s", type=float, default=180.0,
                    help="auto: the most seconds of per-step exchange a lab DDP run may spend")
    ap.add_argument("--seed", type=int, default=0, help="train.seed of every arm")
    ap.add_argument("--tune-duration", type=float, default=5.0, help="tune-h --duration")
    ap.add_argument("--spec", default="", help="use this existing lab's spec (no lab up / down)")
    ap.add_argument("--home", default="", help="DILOCOCTL_HOME (default: a new temporary directory)")
    ap.add_argument("--src", default="HEAD", help="git revision the runs use, or 'worktree' (the checkout as it is)")
    ap.add_argument("--lock", default="", help="flock file held while anything is measured")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lab_modes_2site_10rounds.json"), help="JSON ('' for none)")
    args = ap.parse_args(argv)
    try:
        rounds_list = [int(v) for v in args.rounds.split(",") if v.strip()]
        steps_list = [int(v) for v in args.steps.split(",") if v.strip()]
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    except ValueError:
        print(f"error: --rounds/--steps: expected comma lists of integers, got {args.rounds!r} / {args.steps!r}",
              file=sys.stderr)
        return 2
    if min(rounds_list + steps_list, default=0) < 1:
        print(f"error: --rounds/--steps: every run length must be >= 1, got {args.rounds!r} / {args.steps!r}",
              file=sys.stderr)
        return 2
    if bad := [m for m in modes if m not in MODES]:
        print(f"error: --modes: unknown {', '.join(bad)} (known: {', '.join(MODES)})", file=sys.stderr)
        return 2
    if not args.spec and os.geteuid() != 0:
        print("error: `dilococtl lab up` needs root (or pass --spec of a lab that is up)", file=sys.stderr)
        return 2
    command = (".venv/bin/python bench/lab_modes.py " + shlex.join(sys.argv[1:] if argv is None else argv)).rstrip()
    home = Path(args.home or tempfile.mkdtemp(prefix="lab-modes-"))
    home.mkdir(parents=True, exist_ok=True)
    src, commit, python = snapshot(args.src, home)
    cli = Cli(home, src)
    stamp = time.strftime("%H%M%S")
    lab_up = not args.spec
    spec = home / "lab.toml"
    lock = contextlib.ExitStack()  # --lock, held from tune-h through the first set, then per set
    out: dict = {"benchmark": "lab_modes", "date": datetime.date.today().isoformat(), "command": command,
                 "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}",
                 "link": {"rate": args.rate, "rtt": args.rtt}, "budget": args.budget, "seed": args.seed,
                 "commit": commit,
                 "knobs": RUN_KNOBS, "arms": []}
    try:
        if lab_up:
            log(f"lab up: 2 sites, {args.rate}, {args.rtt}")
            cli("lab", "up", "--sites", "2", "--rate", args.rate, "--rtt", args.rtt, "--spec-out", str(spec),
                timeout=300)
        else:
            spec.write_text(Path(args.spec).read_text())
        edit_spec(spec, spec, {**RUN_KNOBS, "train": {**RUN_KNOBS["train"], "seed": args.seed},
                               "run": {"name": f"lab-modes-tune-{stamp}"}})
        if python:  # the nodes share this filesystem: they run the snapshot through the wrapper
            doc = tomlkit.parse(spec.read_text())
            for site in doc["sites"]:
                site["python"] = python
            spec.write_text(tomlkit.dumps(doc))

        log(f"tune-h --budget {args.budget}")
        lock.enter_context(held(args.lock, "tune-h and the first set of arms"))
        tuned = cli.json("tune-h", str(spec), "--budget", str(args.budget), "--max-h", "1000000", "--write",
                         "--duration", str(args.tune_duration), "--accept-new-host-keys", timeout=900)
        h = int(tomlkit.parse(spec.read_text())["diloco"]["h"])
        choice = tuned["choice"]
        out["tune_h"] = {"h": h, "predicted_sync_s": choice["sync_s"], "step_s": choice["step_s"],
                         "predicted_efficiency": choice["efficiency"], "predicted_sync_share": choice["sync_share"],
                         "links_mbit": [x["mbit"] for x in tuned["links"]], "payload_bytes": tuned["payload_bytes"],
                         "step_s_per_site": tuned["steps"]["per_site"]}
        log(f"tune-h chose H = {h} (predicted exchange {choice['sync_s']:.3f} s, step {choice['step_s'] * 1000:.1f} ms, "
            f"predicted efficiency {choice['efficiency']:.1%})")

        rounds_list += [max(1, round(n / h)) for n in steps_list]
        for i, rounds in enumerate(rounds_list):
            if i:
                lock.enter_context(held(args.lock, f"the {rounds}-round arms"))
            for mode in modes:
                # the tuned file itself, as a user edits `mode`: launch finds its tune (spec file and H)
                name = f"lab-{mode}-r{rounds}-{stamp}"
                edit_spec(spec, spec, {"run": {"name": name}, "diloco": {"mode": mode, "rounds": rounds}})
                arm = measure(cli, spec, name)
                arm.update(mode=mode, where="lab", rounds=rounds, steps_per_site=h * rounds)
                out["arms"].append(arm)
                log(f"{name}: {arm['state']}, efficiency {[fmt(x['efficiency'], '.1%') for x in arm['sites']]}, "
                    f"val ppl {fmt(arm['final_val_ppl'])}")
            if args.ddp == "none":
                lock.close()
                continue
            ddp_exchange_s = h * rounds * choice["sync_s"]  # one payload-sized exchange per inner step
            where = args.ddp if args.ddp != "auto" else ("lab" if ddp_exchange_s <= args.ddp_lab_max_s else "local")
            s, name = home / f"ddp-{rounds}.toml", f"{'lab' if where == 'lab' else 'local'}-ddp-r{rounds}-{stamp}"
            if where == "local":
                log(f"DDP: {h * rounds} steps x ~{choice['sync_s']:.2f} s of exchange = ~{ddp_exchange_s:.0f} s "
                    f"on the lab link: run on this machine instead")
                local_spec(spec, s, home / "local-work", python)
                edit_spec(s, s, {"run": {"name": name}, "diloco": {"algorithm": "ddp", "mode": "sync", "rounds": rounds}})
            else:
                edit_spec(spec, s, {"run": {"name": name}, "diloco": {"algorithm": "ddp", "mode": "sync", "rounds": rounds}})
            arm = measure(cli, s, name)
            arm.update(mode="ddp", where=where, rounds=rounds, steps_per_site=h * rounds,
                       predicted_lab_exchange_s=ddp_exchange_s)
            out["arms"].append(arm)
            log(f"{name}: {arm['state']}, val ppl {fmt(arm['final_val_ppl'])}")
            lock.close()
    finally:
        lock.close()
        if lab_up:
            log("lab down")
            cli("lab", "down", timeout=300, check=False)

    for arm in out["arms"]:
        base = {a["mode"]: a for a in out["arms"] if a["rounds"] == arm["rounds"]}
        for ref in ("sync", "ddp"):
            p = base.get(ref, {}).get("final_val_ppl")
            arm[f"ratio_to_{ref}"] = arm["final_val_ppl"] / p if p and arm["final_val_ppl"] else None
    print(f"\ntune-h (budget {args.budget:g}, {args.rate} / {args.rtt}): H = {out['tune_h']['h']}, predicted "
          f"exchange {out['tune_h']['predicted_sync_s']:.3f} s, predicted efficiency "
          f"{out['tune_h']['predicted_efficiency']:.1%}\n")
    print("| rounds | mode | where | steps/site | compute efficiency per site | sync s per site | "
          "final val ppl | / sync | / ddp | wall s |")
    print("| ---: | --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: |")
    for a in out["arms"]:
        eff = " / ".join(fmt(s["efficiency"], ".1%") for s in a["sites"])
        syn = " / ".join(fmt(s["sync_s"], ".1f") for s in a["sites"])
        print(f"| {a['rounds']} | {a['mode']} | {a['where']} | {a['steps_per_site']} | {eff} | {syn} | "
              f"{fmt(a['final_val_ppl'])} | {fmt(a['ratio_to_sync'])} | {fmt(a['ratio_to_ddp'])} | {a['wall_s']:.0f} |")
    return finish(out, command, args.out)


if __name__ == "__main__":
    raise SystemExit(main())

"""Issue 38, point 3: fp32 sync against a compressed, fragmented arm on a slow 2-site lab link, each at the H
tune-h picks for it, at (nearly) equal tokens: compute efficiency and val ppl side by side.

    sudo .venv/bin/python bench/lab_frontier.py [--rate 10mbit] [--rtt 100ms] [--budget 0.03] [--steps 12000]
        [--arm "NAME KEY=VALUE ..."]... [--seed 0] [--out bench/results/lab_frontier.json]

Through the real CLI only, as a user would: `lab up --sites 2 --rate R --rtt T --spec-out SPEC`; per arm, a
copy of SPEC with the arm's `[diloco]` keys, `tune-h ARM_SPEC --budget B --write` (so each arm runs at its
own H), rounds = --steps / H rounded, `launch --wait`; figures from `status --json` and `logs --json`
(bench/lab_modes.py's readers). `lab down` always runs. Every arm has the same seed, data order and the
simulator study's sizes (lab_modes.RUN_KNOBS); the tokens each arm trained are reported, since H * rounds
differs a little between arms.

Default arms: `fp32` (sync, no compression, the default outer rule) and `sparseloco` (compression =
"sparseloco", fragments = 4, mode = "overlap").
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import tomlkit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab_modes import ROOT, RUN_KNOBS, Cli, edit_spec, finish, fmt, log, measure, snapshot  # noqa: E402

DEFAULT_ARMS = ("fp32 mode=sync", "sparseloco mode=overlap compression=sparseloco fragments=4")


def parse_arm(text: str) -> tuple[str, dict]:
    """'NAME k=v ...' -> (NAME, {k: value}) with TOML values (bare words are strings)."""
    name, *pairs = text.split()
    keys = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k:
            raise ValueError(f"arm {name!r}: expected KEY=VALUE, got {p!r}")
        try:
            keys[k] = tomlkit.parse(f"v = {v}")["v"].unwrap()
        except Exception:
            keys[k] = v
    return name, keys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="10mbit", help="the inter-site link, each direction")
    ap.add_argument("--rtt", default="100ms", help="round trip between the sites")
    ap.add_argument("--budget", type=float, default=0.03, help="tune-h's sync budget (fraction of compute)")
    ap.add_argument("--steps", type=int, default=12000, help="inner steps per site each arm aims at")
    ap.add_argument("--arm", action="append", default=[], help="'NAME KEY=VALUE ...' of [diloco] (repeatable)")
    ap.add_argument("--seed", type=int, default=0, help="train.seed of every arm")
    ap.add_argument("--tune-duration", type=float, default=5.0, help="tune-h --duration")
    ap.add_argument("--src", default="HEAD", help="git revision the runs use, or 'worktree'")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lab_frontier.json"), help="JSON ('' for none)")
    args = ap.parse_args(argv)
    try:
        arms = [parse_arm(a) for a in (args.arm or DEFAULT_ARMS)]
    except ValueError as e:
        print(f"error: --arm: {e}", file=sys.stderr)
        return 2
    if args.steps < 1 or not 0 < args.budget < 1:
        print("error: --steps must be >= 1 and --budget in (0, 1)", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("error: `dilococtl lab up` needs root", file=sys.stderr)
        return 2
    command = (".venv/bin/python bench/lab_frontier.py " + shlex.join(sys.argv[1:] if argv is None else argv)).rstrip()
    home = Path(tempfile.mkdtemp(prefix="lab-frontier-"))
    src, commit, python = snapshot(args.src, home)
    cli = Cli(home, src)
    stamp = time.strftime("%H%M%S")
    spec = home / "lab.toml"
    out: dict = {"benchmark": "lab_frontier", "date": datetime.date.today().isoformat(), "command": command,
                 "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}",
                 "link": {"rate": args.rate, "rtt": args.rtt}, "budget": args.budget, "seed": args.seed,
                 "commit": commit, "knobs": RUN_KNOBS, "arms": []}
    try:
        log(f"lab up: 2 sites, {args.rate}, {args.rtt}")
        cli("lab", "up", "--sites", "2", "--rate", args.rate, "--rtt", args.rtt, "--spec-out", str(spec), timeout=300)
        edit_spec(spec, spec, {**RUN_KNOBS, "train": {**RUN_KNOBS["train"], "seed": args.seed}})
        if python:  # the nodes share this filesystem: they run the snapshot through the wrapper
            doc = tomlkit.parse(spec.read_text())
            for site in doc["sites"]:
                site["python"] = python
            spec.write_text(tomlkit.dumps(doc))
        for arm_name, keys in arms:
            arm_spec = home / f"{arm_name}.toml"
            name = f"frontier-{arm_name}-{stamp}"
            edit_spec(spec, arm_spec, {"run": {"name": name}, "diloco": keys})
            log(f"{arm_name}: tune-h --budget {args.budget}")
            tuned = cli.json("tune-h", str(arm_spec), "--budget", str(args.budget), "--max-h", "1000000", "--write",
                             "--duration", str(args.tune_duration), "--accept-new-host-keys", timeout=900)
            h = int(tomlkit.parse(arm_spec.read_text())["diloco"]["h"])
            rounds = max(1, round(args.steps / h))
            edit_spec(arm_spec, arm_spec, {"diloco": {"rounds": rounds}})
            choice = tuned["choice"]
            log(f"{arm_name}: H = {h}, {rounds} rounds; predicted exchange {choice['sync_s']:.3f} s, "
                f"efficiency {choice['efficiency']:.1%}")
            arm = measure(cli, arm_spec, name)
            arm.update(arm=arm_name, keys=keys, rounds=rounds, steps_per_site=h * rounds,
                       tune_h={"h": h, "predicted_sync_s": choice["sync_s"], "step_s": choice["step_s"],
                               "predicted_efficiency": choice["efficiency"], "payload_bytes": tuned["payload_bytes"]})
            out["arms"].append(arm)
            log(f"{name}: {arm['state']}, efficiency {[fmt(x['efficiency'], '.1%') for x in arm['sites']]}, "
                f"val ppl {fmt(arm['final_val_ppl'])}")
    finally:
        log("lab down")
        cli("lab", "down", timeout=300, check=False)

    base = out["arms"][0] if out["arms"] else {}
    print(f"\n{args.rate} / {args.rtt}, tune-h budget {args.budget:g}, seed {args.seed}\n")
    print("| arm | H | rounds | steps/site | predicted sync s | measured sync s/round | compute efficiency per site "
          "| val ppl | vs first arm | wall s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for a in out["arms"]:
        eff = " / ".join(fmt(s["efficiency"], ".1%") for s in a["sites"])
        per_round = [s["sync_s"] / max(1, a["rounds"]) for s in a["sites"]]
        ratio = (a["final_val_ppl"] / base["final_val_ppl"]
                 if a.get("final_val_ppl") and base.get("final_val_ppl") else None)
        a["ratio_to_first"] = ratio
        print(f"| {a['arm']} | {a['tune_h']['h']} | {a['rounds']} | {a['steps_per_site']} | "
              f"{a['tune_h']['predicted_sync_s']:.3f} | {' / '.join(fmt(x) for x in per_round)} | {eff} | "
              f"{fmt(a['final_val_ppl'])} | {fmt(ratio, '.4f')} | {a['wall_s']:.0f} |")
    return finish(out, command, args.out)


if __name__ == "__main__":
    raise SystemExit(main())

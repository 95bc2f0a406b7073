"""One lying site in a real 3-site lab run: final val ppl beside the honest run, and what the guard reported.

    sudo .venv/bin/python bench/byzantine_lab.py [--rounds 20] [--h 20] [--attacks flip3]
        [--arms honest:auto,liar:auto,liar:mean] [--rate 50mbit] [--rtt 20ms] [--src HEAD]
        [--lock FILE] [--out bench/results/byzantine_lab.json]

What a user does, through the real CLI only (`python -m dilococtl ...` with its own DILOCOCTL_HOME):
`lab up --sites 3`, then one `launch SPEC --wait` per arm on the same lab, the same seed, data and
model (the tiny preset at bench/lab_modes.py's sizes), SPEC edited between arms in `[run] name`,
`[diloco] aggregate` and the liar site's `python` only. `lab down` always runs at the end.

The liar is tests/liar_trainer.py, a test-only wrapper of the real trainer whose pseudo-gradient is
forged (LIAR_ATTACK: flip3 = -3x the honest one, sign_flip, x10, scale:F); no production flag makes a
site lie. It reaches the liar's node the way any interpreter choice does: the liar site's `python` in
the spec is a wrapper script that runs the same interpreter and code, with `-m trainer` replaced by
`-m tests.liar_trainer` (torchrun starts its workers with the interpreter it runs under and the
module it is given, so the workers are the liar too). The other sites run the unmodified trainer.

Per arm: the final val ppl (`status --json`: the best site's last evaluation; every site's is kept
in the JSON), its ratio to the honest arm (honest:auto), and from the `rejected` events (`logs --json`)
the rounds in which the liar's contribution was dropped, the sites those events name, and why (the
norm screen, guard_norm_ratio x the other sites' median, applies under every rule; `filter` is the
robust aggregator's own drop). Each liar arm runs once per --attacks entry; an honest:mean arm also
gives what the robust default costs when nobody lies.
bench/byzantine.py is the simulator's side of the same question (every attack x sites x rule).

--src: the git revision every command and node runs (default HEAD, unpacked under the benchmark's
home, so edits in progress in a shared checkout do not change a run half-way), or `worktree`.
The liar module is always this checkout's tests/liar_trainer.py (it is the attacker, not the code
under test). --lock: an flock(2) file held while the arms run (benchmarks sharing the cores).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tomlkit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.lab_modes import Cli, edit_spec, finish, held, log, measure, snapshot  # noqa: E402
from tests.liar_trainer import ATTACK_ENV, attack_scale  # noqa: E402

LIAR_MODULE = ROOT / "tests" / "liar_trainer.py"
# bench/lab_modes.py's sizes (batch 8 x 64 bytes, 16 validation batches of 3 held-out plays); a
# validation pass every 4 rounds for the curve, and at the end
RUN_KNOBS = {"data": {"batch_size": 8, "seq_len": 64, "val_plays": 3},
             "train": {"warmup_steps": 20, "eval_batches": 16, "eval_every": 4, "threads": 1}}


@dataclass(frozen=True, slots=True)
class Arm:
    attack: str  # LIAR_ATTACK of the liar site; "" = every site honest
    aggregate: str  # [diloco] aggregate

    @property
    def label(self) -> str:
        return f"{self.attack or 'honest'}:{self.aggregate}"


def parse_arms(text: str, attacks: list[str]) -> list[Arm]:
    """`honest:auto,liar:mean` -> arms, each `liar` arm once per attack; ValueError names a bad entry."""
    arms = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        who, _, rule = part.partition(":")
        if who not in ("honest", "liar") or not rule:
            raise ValueError(f"--arms: {part!r}: expected honest:RULE or liar:RULE")
        arms += [Arm(attack="", aggregate=rule)] if who == "honest" else [Arm(attack=a, aggregate=rule) for a in attacks]
    if not any(not a.attack for a in arms):
        raise ValueError("--arms: at least one honest arm is needed (the ratios are to it)")
    return arms


def reason_kind(reason: str) -> str:
    """A rejection's reason without its figures: `norm N over N (Nx the other sites' median)`."""
    return re.sub(r"-?\d[\d.]*(e[-+]?\d+)?", "N", reason).split(":")[0].strip()


def liar_wrapper(home: Path, src: Path, python: str, attack: str) -> str:
    """An interpreter for the liar site: `python`, with the checkout's liar module and `-m trainer`
    run as `-m tests.liar_trainer` (every other invocation passes through unchanged)."""
    tests = src / "tests"
    if src != ROOT:  # the snapshot gets this checkout's liar (the attacker is not the code under test)
        tests.mkdir(exist_ok=True)
        (tests / "__init__.py").touch()
        shutil.copy(LIAR_MODULE, tests / "liar_trainer.py")
    path = home / f".liar-python-{attack.replace(':', '_')}"
    path.write_text(
        "#!/bin/bash\n"
        "# bench/byzantine_lab.py: the liar site's interpreter (test-only; see tests/liar_trainer.py)\n"
        f"export PYTHONPATH={shlex.quote(str(src))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
        f"export {ATTACK_ENV}={shlex.quote(attack)}\n"
        "a=(); prev=\n"
        'for x in "$@"; do\n'
        '  if [ "$prev" = -m ] && [ "$x" = trainer ]; then x=tests.liar_trainer; fi\n'
        '  a+=("$x"); prev=$x\n'
        "done\n"
        f'exec {shlex.quote(python)} "${{a[@]}}"\n')
    path.chmod(0o755)
    return str(path)


def set_pythons(spec: Path, honest: dict[str, str], liar_site: str, liar_python: str | None) -> None:
    """Each site's `python`: its honest interpreter, the liar site's wrapper when `liar_python`."""
    doc = tomlkit.parse(spec.read_text())
    for site in doc["sites"]:
        site["python"] = liar_python if (liar_python and site["name"] == liar_site) else honest[str(site["name"])]
    spec.write_text(tomlkit.dumps(doc))


def rejections(cli: Cli, name: str, liar_site: str) -> dict:
    """What the `rejected` events of a run say: per named site, the rounds and the reasons."""
    by_site: dict[str, dict] = {}
    refused: set[int] = set()
    for line in cli("logs", name, "--json", check=False).stdout.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        x = rec.get("record") or {}
        if rec.get("kind") != "event" or x.get("event") != "rejected":
            continue
        detail = x.get("detail") or {}
        who = detail.get("site_rejected")
        if not who:  # a round refused as a whole (not blamed on one site)
            refused.add(x.get("round"))
            continue
        s = by_site.setdefault(who, {"rounds": set(), "reasons": set(), "reported_by": set()})
        s["rounds"].add(x.get("round"))
        s["reasons"].add(reason_kind(str(detail.get("reason", ""))))
        s["reported_by"].add(rec.get("site"))
    named = {site: {"rounds": sorted(v["rounds"]), "reasons": sorted(v["reasons"]),
                    "reported_by": sorted(v["reported_by"])} for site, v in sorted(by_site.items())}
    return {"named": named, "liar_rounds_rejected": len(named.get(liar_site, {}).get("rounds", [])),
            "honest_sites_named": sorted(s for s in named if s != liar_site),
            "rounds_refused": sorted(r for r in refused if r is not None)}


def fmt(v, spec: str = ".3f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20, help="outer rounds of every arm")
    ap.add_argument("--h", type=int, default=20, help="inner steps per round")
    ap.add_argument("--attacks", default="flip3", help="comma list of LIAR_ATTACKs (tests/liar_trainer.py): "
                    "every liar arm runs once per attack")
    ap.add_argument("--arms", default="honest:auto,liar:auto,liar:mean",
                    help="comma list of honest|liar:AGGREGATE, run in this order on the same lab")
    ap.add_argument("--liar-site", default="site2", help="the lying site (not site0: it hosts the Lighthouse)")
    ap.add_argument("--compression", default="none", help="[diloco] compression of every arm")
    ap.add_argument("--rate", default="50mbit", help="every inter-site link, each direction")
    ap.add_argument("--rtt", default="20ms", help="round trip between the sites")
    ap.add_argument("--seed", type=int, default=0, help="train.seed of every arm")
    ap.add_argument("--src", default="HEAD", help="git revision the runs use, or 'worktree'")
    ap.add_argument("--home", default="", help="DILOCOCTL_HOME (default: a new temporary directory)")
    ap.add_argument("--lock", default="", help="flock file held while the arms run")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "byzantine_lab.json"), help="JSON ('' for none)")
    args = ap.parse_args(argv)
    try:
        attacks = [a.strip() for a in args.attacks.split(",") if a.strip()]
        scales = {a: attack_scale(a) for a in attacks}
        arms = parse_arms(args.arms, attacks)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.h < 1:
        print(f"error: --rounds and --h must be >= 1, got {args.rounds} and {args.h}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("error: `dilococtl lab up` needs root", file=sys.stderr)
        return 2
    command = (".venv/bin/python bench/byzantine_lab.py " + shlex.join(sys.argv[1:] if argv is None else argv)).rstrip()
    home = Path(args.home or tempfile.mkdtemp(prefix="byzantine-lab-"))
    home.mkdir(parents=True, exist_ok=True)
    src, commit, wrapper = snapshot(args.src, home)
    cli = Cli(home, src)
    stamp = time.strftime("%H%M%S")
    spec = home / "lab.toml"
    out: dict = {"benchmark": "byzantine_lab", "date": datetime.date.today().isoformat(), "command": command,
                 "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}",
                 "commit": commit, "liar_module_sha256": hashlib.sha256(LIAR_MODULE.read_bytes()).hexdigest(),
                 "link": {"rate": args.rate, "rtt": args.rtt}, "seed": args.seed, "rounds": args.rounds,
                 "h": args.h, "compression": args.compression, "attack_scales": scales,
                 "liar_site": args.liar_site, "knobs": RUN_KNOBS, "arms": []}
    try:
        log(f"lab up: 3 sites, {args.rate}, {args.rtt}")
        cli("lab", "up", "--sites", "3", "--rate", args.rate, "--rtt", args.rtt, "--spec-out", str(spec), timeout=300)
        edit_spec(spec, spec, {**RUN_KNOBS, "train": {**RUN_KNOBS["train"], "seed": args.seed},
                               "diloco": {"h": args.h, "rounds": args.rounds, "compression": args.compression,
                                          "h_auto": False}})
        doc = tomlkit.parse(spec.read_text())
        names = [str(s["name"]) for s in doc["sites"]]
        if args.liar_site not in names[1:]:
            raise SystemExit(f"error: --liar-site {args.liar_site!r}: expected one of {', '.join(names[1:])}")
        honest = {str(s["name"]): wrapper or str(s["python"]) for s in doc["sites"]}
        liars = {a: liar_wrapper(home, src, wrapper or honest[args.liar_site], a) for a in attacks}
        with held(args.lock, "the arms"):
            for arm in arms:
                name = f"byz-{arm.attack.replace(':', '_') or 'honest'}-{arm.aggregate}-{stamp}"
                edit_spec(spec, spec, {"run": {"name": name}, "diloco": {"aggregate": arm.aggregate}})
                set_pythons(spec, honest, args.liar_site, liars.get(arm.attack))
                res = measure(cli, spec, name)
                res.update(arm=arm.label, attack=arm.attack, aggregate=arm.aggregate,
                           events=rejections(cli, name, args.liar_site))
                out["arms"].append(res)
                log(f"{name}: {res['state']}, val ppl {fmt(res['final_val_ppl'])}, liar rejected in "
                    f"{res['events']['liar_rounds_rejected']} of {args.rounds} rounds")
    finally:
        log("lab down")
        cli("lab", "down", timeout=300, check=False)

    honest_runs = {a["aggregate"]: a["final_val_ppl"] for a in out["arms"] if not a["attack"]}
    base = honest_runs.get("auto") or next(iter(honest_runs.values()), None)
    out["honest_reference"] = "auto" if "auto" in honest_runs else next(iter(honest_runs), None)
    for a in out["arms"]:
        p = a["final_val_ppl"]
        a["ratio_to_honest"] = p / base if p and base else None
        a["within_1_05"] = a["ratio_to_honest"] is not None and a["ratio_to_honest"] <= 1.05
    if honest_runs.get("auto") and honest_runs.get("mean"):  # what the robust default costs with nobody lying
        out["robust_default_cost"] = honest_runs["auto"] / honest_runs["mean"]
    what = "; ".join(f"{a} = {s:g} x" for a, s in scales.items())
    print(f"\n3-site lab ({args.rate} / {args.rtt}), tiny preset, {args.rounds} rounds x H {args.h}, compression "
          f"{args.compression}; the liar is {args.liar_site}, sending its honest pseudo-gradient times ({what})\n")
    print(f"| arm | aggregate | state | final val ppl | / honest {out['honest_reference']} | rounds liar rejected | "
          "sites named by `rejected` (rounds) | reasons |")
    print("| --- | --- | --- | ---: | ---: | ---: | --- | --- |")
    for a in out["arms"]:
        ev = a["events"]
        named = ", ".join(f"{s} ({len(v['rounds'])})" for s, v in ev["named"].items()) or "none"
        reasons = "; ".join(sorted({r for v in ev["named"].values() for r in v["reasons"]})) or "-"
        liar_n = f"{ev['liar_rounds_rejected']} / {args.rounds}" if a["attack"] else "-"
        print(f"| {a['attack'] or 'honest'} | {a['aggregate']} | {a['state']} | {fmt(a['final_val_ppl'])} | "
              f"{fmt(a['ratio_to_honest'])} | {liar_n} | {named} | {reasons} |")
    if "robust_default_cost" in out:
        print(f"\nhonest runs: auto / mean = {out['robust_default_cost']:.3f}")
    return finish(out, command, args.out)


if __name__ == "__main__":
    raise SystemExit(main())

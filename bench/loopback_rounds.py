"""The demo's round exchange on loopback: gloo against the TLS transport, encrypted and clear (a benchmark).

    .venv/bin/python bench/loopback_rounds.py [--rounds 25] [--repeats 2] [--arms gloo,tls,clear]
        [--out bench/results/loopback_rounds_lighthouse_direct.json]

Each arm is `dilococtl launch playbooks/local-2site.toml --wait` (two local sites, the tiny model,
3.2 MB of pseudo-gradient per round), the spec changed only in `[run] name`, the work directory and
`[diloco] transport` / `transport_loopback_clear`: "gloo" (torchft's ProcessGroupGloo), "tls" (every
stream encrypted), "clear" (the default: streams between loopback ends leave TLS after the hello).
Arms alternate, `--repeats` times each, under one DILOCOCTL_HOME of their own. The figure per
round is the sync_s of the site that arrived last (the smaller of the two sites' sync_s: the other
also waited for it), i.e. quorum + exchange + commit + outer step; per arm the median over all its
rounds but the first (the first builds the mesh). Also the final val ppl (every arm must agree).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"gloo": 'transport = "gloo"', "tls": 'transport = "tls"\ntransport_loopback_clear = false',
        "clear": 'transport = "tls"\ntransport_loopback_clear = true'}


def arm_spec(base: str, arm: str, rep: int, rounds: int, work: Path) -> str:
    """The demo spec with this arm's run name, rounds, transport and work directory."""
    name = f"lb-{arm}-{rep}"
    out, section = [], ""
    for line in base.splitlines():
        if line.startswith("["):
            section = line.strip()
        elif section == "[run]" and line.startswith("name = "):
            line = f'name = "{name}"'
        elif line.startswith("rounds = "):
            line = f"rounds = {rounds}"
        elif line.startswith("mode = "):
            line = f"{line}\n{ARMS[arm]}"
        elif line.startswith("work_dir = "):
            line = f'work_dir = "{work / name}"'
        out.append(line)
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--arms", default="gloo,tls,clear")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "loopback_rounds_lighthouse_direct.json"))
    a = p.parse_args()
    arms = [x for x in a.arms.split(",") if x]
    if not arms or set(arms) - set(ARMS):
        sys.exit(f"bench/loopback_rounds.py: --arms takes {', '.join(ARMS)}")
    base = (ROOT / "playbooks" / "local-2site.toml").read_text()
    dctl = str(Path(sys.executable).with_name("dilococtl"))
    with tempfile.TemporaryDirectory() as tmp:
        home, work = Path(tmp) / "home", Path(tmp) / "work"
        env = dict(os.environ, DILOCOCTL_HOME=str(home))
        results: dict[str, dict] = {arm: {"round_s": [], "ppl": []} for arm in arms}
        for rep in range(a.repeats):
            for arm in arms if rep % 2 == 0 else reversed(arms):
                spec = Path(tmp) / f"{arm}-{rep}.toml"
                spec.write_text(arm_spec(base, arm, rep, a.rounds, work))
                print(f"[{arm} #{rep}] launch", file=sys.stderr, flush=True)
                r = subprocess.run([dctl, "launch", str(spec), "--wait", "--force", "--yes"], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                if r.returncode:
                    sys.exit(f"bench/loopback_rounds.py: arm {arm} failed: {r.stderr.strip().splitlines()[-1:]}")
                db = sqlite3.connect(home / "state.db")
                run_id = db.execute("select id from runs where name = ? order by created desc", (f"lb-{arm}-{rep}",)).fetchone()[0]
                rows = db.execute("select round, min(sync_s) from rounds where run_id = ? and committed = 1 "
                                  "group by round order by round", (run_id,)).fetchall()
                ppl = db.execute("select val_ppl from rounds where run_id = ? and val_ppl is not null "
                                 "order by round desc limit 1", (run_id,)).fetchone()
                db.close()
                results[arm]["round_s"] += [s for rnd, s in rows if rnd > 1]
                results[arm]["ppl"].append(ppl[0] if ppl else None)
    print(f"loopback, demo spec, {a.rounds} rounds x {a.repeats}; round = sync_s of the site that arrived last, median")
    print(f"{'arm':>6} {'rounds':>7} {'median ms':>10} {'/ gloo':>7}  final val ppl")
    med = {arm: statistics.median(v["round_s"]) for arm, v in results.items()}
    for arm, v in results.items():
        ratio = f"{med[arm] / med['gloo']:.2f}x" if "gloo" in med else ""
        print(f"{arm:>6} {len(v['round_s']):>7} {med[arm] * 1e3:>10.1f} {ratio:>7}  {v['ppl']}")
    if a.out:
        Path(a.out).write_text(json.dumps({"argv": sys.argv, "median_s": med, "arms": results}, indent=1))


if __name__ == "__main__":
    main()

"""Benchmark (not a test): what the metrics sinks add to the demo's wall time.

    python3 bench/sinks.py [--pairs 2] [--rounds 25]
    python3 bench/sinks.py --micro [--rounds 25]

Runs the demo (playbooks/local-2site.toml, `launch --wait`) side by side without sinks and with
every sink on (TensorBoard, W&B offline, MLflow file store), alternating, each in its own
DILOCOCTL_HOME, and prints per variant the median of:
  run wall    the run's own wall time, launch to end (status --json: metrics.wall_s)
  launch      the whole `launch --wait` command, its exit included (the sinks' last batch and the
              W&B run's finish happen there)
  launch CPU  user + system seconds of that command and the processes it reaped (W&B's service
              among them; not the trainers, which run detached): the control plane's own cost,
              which a busy machine does not blur as it blurs wall time
and the ratio sinks / none. Target: run wall ratio <= 1.01 (issue 39). The machine is shared and
noisy: read the ratio of each pair as well as the medians.

--micro times the sinks' own work, without training beside it: a 2-site run recorded in a store as
the collector records it, exported one round at a time as refreshes do (the first call opens the
sinks: W&B starts its service), CPU and wall seconds per call; at the end the exit drain (W&B's finish).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAYBOOK = ROOT / "playbooks" / "local-2site.toml"
SINKS = '\n[metrics]\nsinks = ["tensorboard", "wandb", "mlflow"]\n'


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def one(with_sinks: bool, rounds: int) -> tuple[float, float, float]:
    home = Path(tempfile.mkdtemp(prefix="bench-sinks-"))
    spec = home / "demo.toml"
    text = PLAYBOOK.read_text().replace("rounds = 25 ", f"rounds = {rounds} ")
    spec.write_text(text + (SINKS if with_sinks else ""))
    env = {**os.environ, "DILOCOCTL_HOME": str(home)}
    t, cpu = time.perf_counter(), _children_cpu()
    r = subprocess.run([sys.executable, "-m", "dilococtl", "launch", str(spec), "--wait", "--yes", "--force",
                        "--json"], cwd=ROOT, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    launch_s, cpu_s = time.perf_counter() - t, _children_cpu() - cpu
    if r.returncode != 0:
        raise SystemExit(f"launch failed: {r.stderr[-2000:]}")
    summary = json.loads(r.stdout)
    return summary["metrics"]["wall_s"], launch_s, cpu_s


def micro(rounds: int) -> None:
    home = Path(tempfile.mkdtemp(prefix="bench-sinks-micro-"))
    os.environ["DILOCOCTL_HOME"] = str(home)
    sys.path.insert(0, str(ROOT))
    from dilococtl.sinks import feed
    from dilococtl.store import Store
    from tests.tui.fixtures import add_rounds, make_run

    with Store.open() as store:
        for i, name in enumerate(("tensorboard", "wandb", "mlflow")):
            run = make_run(store, run_id=f"20260101-000000-{i:04x}", state="running", rounds=1)
            wall, cpu = [], []
            for r in range(2, rounds + 1):
                for site in ("site-a", "site-b"):
                    add_rounds(store, run.id, site, r, r)
                w, c = time.perf_counter(), time.process_time()
                assert feed.export(run, store, [name]) == {name: r if r == 2 else 1}
                wall.append(time.perf_counter() - w)
                cpu.append(time.process_time() - c)
            w = time.perf_counter()
            feed.close_all()
            close = time.perf_counter() - w
            print(f"| {name} | {wall[0] * 1000:.0f} | {statistics.median(wall[1:]) * 1000:.1f} | "
                  f"{statistics.median(cpu[1:]) * 1000:.1f} | {close * 1000:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--micro", action="store_true", help="time the sinks' own work per refresh")
    a = ap.parse_args()
    if a.micro:
        print("| sink | first call, opens it (ms) | per refresh, 1 round (median ms) | CPU per refresh (ms) |"
              " close at exit (ms) |\n| --- | --- | --- | --- | --- |")
        micro(a.rounds)
        return
    got: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for i in range(a.pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        for s in order:
            got[s].append(one(s, a.rounds))
            print(f"pair {i + 1}: {'sinks' if s else 'none '}: run wall {got[s][-1][0]:.1f} s, "
                  f"launch {got[s][-1][1]:.1f} s, launch CPU {got[s][-1][2]:.2f} s", file=sys.stderr, flush=True)
    print("| variant | run wall (median s) | launch --wait (median s) | launch CPU (median s) |\n"
          "| --- | --- | --- | --- |")
    for s in (False, True):
        print(f"| {'all sinks' if s else 'no sinks'} | {statistics.median(x[0] for x in got[s]):.1f} | "
              f"{statistics.median(x[1] for x in got[s]):.1f} | {statistics.median(x[2] for x in got[s]):.2f} |")
    ratios = [b[0] / a_[0] for a_, b in zip(got[False], got[True], strict=True)]
    lratios = [b[1] / a_[1] for a_, b in zip(got[False], got[True], strict=True)]
    print(f"\nrun wall ratio sinks/none per pair: {', '.join(f'{r:.3f}' for r in ratios)} "
          f"(median {statistics.median(ratios):.3f}); launch ratio: {', '.join(f'{r:.3f}' for r in lratios)}")


if __name__ == "__main__":
    main()

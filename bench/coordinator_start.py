"""CPU of a run's coordinator processes at start: torchft's Lighthouse and the TLS relay, each as it
starts now (no torch) against the same start importing torch as it used to.

- Lighthouse: `trainer.modes.torchft_compat.lighthouse_server_class()` (torchft's native extension
  alone) against `torchft.coordination.LighthouseServer` (the package, whose __init__ imports torch);
  each starts a server on a free loopback port and shuts it down.
- relay: `import trainer.transport.relay` against the same with trainer.transport.comm, which the
  package's __init__ used to import (and with it torch).

Paired runs, A B A B after one warm-up pair (bench/cli_help.py's counter: user + system CPU of the
finished child). Writes bench/results/coordinator_start.json.

    .venv/bin/python bench/coordinator_start.py --pairs 7
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.cli_help import paired_cpu, spread  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
START = "({cls})(bind='127.0.0.1:0', min_replicas=1).shutdown()"
ARMS = {
    "lighthouse": (
        "from trainer.modes.torchft_compat import lighthouse_server_class as c; " + START.format(cls="c()"),
        "from torchft.coordination import LighthouseServer as c; " + START.format(cls="c")),
    "relay": ("import trainer.transport.relay", "import trainer.transport.comm, trainer.transport.relay"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=7, help="counted A B pairs per process (after one warm-up pair)")
    args = ap.parse_args()
    out: dict = {"benchmark": "coordinator_start", "date": time.strftime("%Y-%m-%d %H:%M"),
                 "command": " ".join([".venv/bin/python", "bench/coordinator_start.py", *sys.argv[1:]]),
                 "machine": platform.machine(), "pairs": args.pairs,
                 "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                          text=True).stdout.strip()}
    for name, (now_code, old_code) in ARMS.items():
        now_cmd, old_cmd = ([sys.executable, "-c", code] for code in (now_code, old_code))
        now, old = paired_cpu(now_cmd, old_cmd, args.pairs, f"{name} ")
        out[name] = {"now_cpu_s": spread(now), "with_torch_cpu_s": spread(old),
                     "ratio": spread([x / y for x, y in zip(now, old, strict=True)])}
        s = out[name]
        print(f"{name:<11} now {s['now_cpu_s']['median']:.3f} CPU-s, with torch {s['with_torch_cpu_s']['median']:.3f}: "
              f"{s['ratio']['median']:.3f}x (pairs {s['ratio']['min']:.3f}-{s['ratio']['max']:.3f})")
    (ROOT / "bench" / "results" / "coordinator_start.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

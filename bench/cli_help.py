"""CPU time of `dilococtl --help` against a bare two-command typer app (issue 42).

Paired runs, A B A B: each pair's ratio is taken between two processes started a moment apart, so
a shared machine's drift cancels out of it. CPU seconds are user + system of the finished child
(the kernel's accounting, `resource.getrusage(RUSAGE_CHILDREN)`), stdout thrown away.

    .venv/bin/python bench/cli_help.py --pairs 21

Prints the median and range of each and of the pairs' ratios; `--json` for one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The reference: what any typer CLI costs to print its help (typer, click and rich imported).
BARE_APP = '''import typer

app = typer.Typer()


@app.command()
def hello(name: str) -> None:
    """Say hello."""


@app.command()
def bye(name: str) -> None:
    """Say goodbye."""


app()
'''


def cpu_seconds(argv: list[str]) -> float:
    """User + system CPU seconds of one run of argv (exit status ignored: --help exits 0)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def paired_cpu(a_cmd: list[str], b_cmd: list[str], pairs: int, label: str = "") -> tuple[list[float], list[float]]:
    """CPU seconds of each of `pairs` A B pairs, after one warm-up pair (page cache, .pyc files)."""
    cpu_seconds(a_cmd), cpu_seconds(b_cmd)
    a, b = [], []
    for i in range(pairs):
        a.append(cpu_seconds(a_cmd))
        b.append(cpu_seconds(b_cmd))
        print(f"{label}pair {i + 1}/{pairs}: {a[-1]:.3f} s vs {b[-1]:.3f} s", file=sys.stderr)
    return a, b


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=21, help="counted A B pairs (after one warm-up pair)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        bare = Path(tmp) / "bare_typer.py"
        bare.write_text(BARE_APP)
        a_cmd = [sys.executable, "-m", "dilococtl", "--help"]
        b_cmd = [sys.executable, str(bare), "--help"]
        a, b = paired_cpu(a_cmd, b_cmd, args.pairs)
    ratios = [x / y for x, y in zip(a, b, strict=True)]
    out = {"pairs": args.pairs, "dilococtl_help_s": spread(a), "bare_typer_help_s": spread(b),
           "ratio": spread(ratios)}
    if args.json:
        print(json.dumps(out))
        return
    for name, key in (("dilococtl --help", "dilococtl_help_s"), ("bare typer --help", "bare_typer_help_s"),
                      ("ratio (pairs)", "ratio")):
        s = out[key]
        unit = "x" if key == "ratio" else " s"
        print(f"{name:<20} median {s['median']:.3f}{unit}  (min {s['min']:.3f}, max {s['max']:.3f})")


if __name__ == "__main__":
    main()

"""Streaming DiLoCo's fragments against one exchange a round, per codec (a benchmark, not a test).

    python3 bench/fragments.py [--preset tiny] [--sites 4] [--h 50] [--rounds 100] [--fragments 4]
                               [--codecs none,int8] [--threads 1] [--jobs 1] [--out bench/results]
                               [--reuse-baseline]

Each arm is `python -m trainer.simulate --preset P --sites K --h H --rounds N --compression C
[--fragments F] --json` (with train.threads = --threads), --jobs of them at once in their own
processes; its rounds go to OUT/fragments_<codec>_f<F>.json and one line per arm compares final val
ppl and the bytes of the largest single exchange (peak) with the F = 1 arm of the same codec.
On a loaded 2-core host torch's default threads took 100 s a round (tiny, 4 sites, H 50) against
12 s with one thread, for the same numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.rules import config as config_mod  # noqa: E402
from trainer.simulate import simulate  # noqa: E402


def arm_command(preset: str, sites: int, h: int, rounds: int, codec: str, fragments: int) -> str:
    return (f"python -m trainer.simulate --preset {preset} --sites {sites} --h {h} --rounds {rounds} "
            f"--compression {codec}" + (f" --fragments {fragments}" if fragments > 1 else "") + " --json")


def arm(preset: str, sites: int, h: int, rounds: int, codec: str, fragments: int, threads: int = 1) -> dict:
    cfg = config_mod.from_dict({"model": {"preset": preset}, "train": {"threads": threads}, "diloco": {
        "sites": sites, "h": h, "rounds": rounds, "compression": codec, "fragments": fragments}})
    res = simulate(cfg)
    last = res.rounds[-1]
    return {"preset": preset, "sites": sites, "h": h, "rounds": rounds, "compression": codec,
            "fragments": fragments, "val_ppl": last.val_ppl, "bytes_per_round": last.bytes_sent,
            "peak_bytes": max(r.peak_bytes for r in res.rounds), "seconds": res.seconds,
            "command": arm_command(preset, sites, h, rounds, codec, fragments),
            "rounds_detail": [dataclasses.asdict(r) for r in res.rounds]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--sites", type=int, default=4)
    ap.add_argument("--h", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--codecs", default="none,int8", help="comma list of diloco.compression specs")
    ap.add_argument("--threads", type=int, default=1, help="train.threads of each arm (0: torch's default)")
    ap.add_argument("--jobs", type=int, default=1, help="arms run at once, each in its own process")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--reuse-baseline", action="store_true",
                    help="take an F = 1 arm from OUT when its command is this one's (the simulator at one thread is "
                         "deterministic: the same numbers), so a change to the split reruns only F > 1")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = [(codec, f) for codec in args.codecs.split(",") for f in (1, args.fragments)]
    name = {a: out / f"fragments_{a[0].replace(':', '-').replace('+', '_')}_f{a[1]}.json" for a in arms}
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        futs = {}
        for c, f in arms:
            old = json.loads(name[c, f].read_text()) if args.reuse_baseline and f == 1 and name[c, f].exists() else {}
            if old and (old.get("command"), old.get("preset"), old.get("sites"), old.get("h"), old.get("rounds")) == (
                    arm_command(args.preset, args.sites, args.h, args.rounds, c, f), args.preset, args.sites,
                    args.h, args.rounds):
                futs[c, f] = old
            else:
                futs[c, f] = pool.submit(arm, args.preset, args.sites, args.h, args.rounds, c, f, args.threads)
        results = [x if isinstance(x, dict) else x.result() for x in futs.values()]
    base: dict[str, dict] = {}
    for (codec, f), res in zip(arms, results, strict=True):
        name[codec, f].write_text(json.dumps(res, indent=1))
        b = base.setdefault(codec, res)
        print(f"{codec:>8}  F={f}  val ppl {res['val_ppl']:.4f} ({res['val_ppl'] / b['val_ppl']:.4f}x)  "
              f"bytes/round/site {res['bytes_per_round']:,}  peak {res['peak_bytes']:,} "
              f"({res['peak_bytes'] / b['peak_bytes']:.3f}x)  {res['seconds']:.0f}s", flush=True)


if __name__ == "__main__":
    main()

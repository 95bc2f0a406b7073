"""Peak RSS of one site's loader over many shards: streaming TokenSpan vs the old concatenating reader.

    .venv/bin/python bench/data_loader.py --gb 2 --dir /tmp/dl_bench

Writes `--gb` GB of uint16 shards (deleted afterwards unless --keep), then runs each reader in a
fresh process: load the split, partition it for one site of `--sites`, build the BatchLoader and
draw `--batches` batches. Each child reports its RSS after imports (torch included), its peak
RSS (ru_maxrss) and the loader's share: peak minus the baseline. Side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARD_TOKENS = 50_000_000  # 100 MB per uint16 shard


def write(dirpath: Path, gb: float) -> Path:
    """uint16 shards totalling `gb` GB, written shard by shard (never the whole array in memory)."""
    dirpath.mkdir(parents=True, exist_ok=True)
    total = int(gb * 1e9) // 2
    names, rng, k = [], np.random.default_rng(0), 0
    for start in range(0, total, SHARD_TOKENS):
        n = min(SHARD_TOKENS, total - start)
        name = f"train_{k:06d}.bin"
        rng.integers(0, 50_000, n, dtype=np.uint16).tofile(dirpath / name)
        names.append(name)
        k += 1
    rng.integers(0, 50_000, 1_000_000, dtype=np.uint16).tofile(dirpath / "val_000000.bin")
    meta = {"dtype": "uint16", "vocab_size": 50_000, "train": names, "val": ["val_000000.bin"]}
    (dirpath / "meta.json").write_text(json.dumps(meta))
    return dirpath


CHILD = r"""
import json, resource, sys, time
import numpy as np, torch  # the trainer imports both: they are the baseline
from pathlib import Path
from trainer import data as D

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

def legacy_read(root):  # today's reader before streaming: np.concatenate over every shard
    meta = json.loads((root / "meta.json").read_text())
    parts = [np.memmap(root / n, dtype=meta["dtype"], mode="r") for n in meta["train"]]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)

kind, path, sites, batches, seq, bs = sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:7])
base = rss_mb()
t0 = time.perf_counter()
train = D.read_shards(path).train if kind == "stream" else legacy_read(path)
part = D.partition(train, sites, 0)
loader = D.BatchLoader(part, seq, bs, seed=0, site_index=0)
load_s = time.perf_counter() - t0
t0 = time.perf_counter()
for _ in range(batches):
    x, y = loader.next_batch()
batch_s = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"reader": kind, "tokens": len(train), "site_tokens": len(part), "baseline_mb": base,
                  "peak_mb": peak, "loader_mb": peak - base, "end_mb": rss_mb(), "load_s": load_s,
                  "batches_per_s": batches / batch_s}))
"""


def run(kind: str, path: Path, args) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(path), str(args.sites), str(args.batches),
                          str(args.seq_len), str(args.batch_size)], cwd=ROOT, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{kind} reader failed: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="GB of train shards to write")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dl_bench"), help="where the shards go")
    ap.add_argument("--sites", type=int, default=1, help="sites the split is partitioned for (site 0 is read)")
    ap.add_argument("--batches", type=int, default=20_000, help="batches each loader draws")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--keep", action="store_true", help="keep the shards")
    args = ap.parse_args()
    t0 = time.perf_counter()
    path = write(args.dir, args.gb)
    size = sum(f.stat().st_size for f in path.glob("train_*.bin"))
    print(f"wrote {size / 1e9:.2f} GB of train shards in {len(list(path.glob('train_*.bin')))} files "
          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    try:
        rows = [run("stream", path, args), run("concat", path, args)]
    finally:
        if not args.keep:
            shutil.rmtree(path)
    print(f"{'reader':8} {'tokens':>14} {'baseline MB':>12} {'peak MB':>9} {'loader MB':>10} {'load s':>7} {'batches/s':>10}")
    for r in rows:
        print(f"{r['reader']:8} {r['tokens']:>14,} {r['baseline_mb']:>12.0f} {r['peak_mb']:>9.0f} "
              f"{r['loader_mb']:>10.0f} {r['load_s']:>7.2f} {r['batches_per_s']:>10.0f}")
    s, c = rows
    print(f"stream/concat: loader memory {s['loader_mb'] / c['loader_mb']:.3f}x, peak RSS {s['peak_mb'] / c['peak_mb']:.3f}x")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

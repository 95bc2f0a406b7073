"""Per-round compute stall of checkpoint uploads: background (trainer.checkpoints.uploader) vs blocking (issue 35).

A round is `--compute-s` of real work (matmuls) followed by the round-boundary checkpoint of a
`--state-mb` state (DCP, async_save as the trainer does), which then goes to an object store over a
link capped at `--link-mbps` (a file:// store that writes at that rate: the lab's shaped WAN would
do the same to an S3 PUT). With the link slower than a round, a blocking upload stalls every round
by the upload time; the background uploader skips rounds instead (only the newest waits) and the
loop never waits for it. Stall = round wall time - compute time, as a share of the round; the
"local-only" line is the same loop with no store (DCP's own staging, the floor of the other two).

    .venv/bin/python bench/upload_stall.py --rounds 6 --compute-s 1.0 --state-mb 64 --link-mbps 200

`--store URL` sends the uploads to a real store instead (bench/upload_stall_lab.sh: a node of a
`dilococtl lab` uploading to another region's SeaweedFS across the shaped link), and `--preset small`
checkpoints the state the trainer saves for that model (parameters, AdamW moments, outer θ and
momentum) instead of one flat tensor. Each round then does a fixed amount of work (calibrated once to
`--compute-s`), so uploads that steal CPU from compute show as longer rounds too: `slowdown` is each
mode's median round against the no-store one's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.checkpoints import store_rounds  # noqa: E402
from trainer.checkpoints.checkpoint import Checkpointer  # noqa: E402
from trainer.checkpoints.checkpoint_trust import make_key  # noqa: E402
from trainer.checkpoints.snapshot_store import FileStore, open_store  # noqa: E402


class LinkStore(FileStore):
    """A file store whose uploads go at `mbps` megabits per second (sleeping out the rest of each chunk's time)."""

    def __init__(self, url: str, root: Path, mbps: float):
        super().__init__(url, root)
        self.bytes_per_s = mbps * 1e6 / 8

    def put_file(self, key: str, path: Path) -> None:
        t0 = time.monotonic()
        super().put_file(key, path)
        rest = path.stat().st_size / self.bytes_per_s - (time.monotonic() - t0)
        if rest > 0:
            time.sleep(rest)


def calibrate(seconds: float, a: torch.Tensor) -> int:
    """Matmul iterations that take `seconds` here now: every round then does the same work."""
    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        a = (a @ a).tanh_()
        n += 1
    return n


def compute(iterations: int, a: torch.Tensor) -> None:
    for _ in range(iterations):
        a = (a @ a).tanh_()


def make_state(args) -> dict:
    """What a round-boundary checkpoint holds: one flat fp32 tensor of --state-mb, or a preset's trainer state."""
    if not args.preset:
        return {"theta": torch.randn(int(args.state_mb * (1 << 20) / 4)), "step": 0}
    from trainer.model import build_model
    from trainer.rules.model_config import ModelConfig, resolve_model

    model = build_model(resolve_model(ModelConfig(preset=args.preset)), seed=0)
    params = dict(model.named_parameters())
    return {"model": model.state_dict(),
            "inner": {f"{k}.{m}": torch.randn_like(p) for k, p in params.items() for m in ("exp_avg", "exp_avg_sq")},
            "outer": {f"{k}.{m}": torch.randn_like(p) for k, p in params.items() for m in ("theta", "momentum")},
            "step": 0}


def state_bytes(state: dict) -> int:
    return sum(v.numel() * v.element_size() for part in state.values() if isinstance(part, dict)
               for v in part.values()) + sum(v.numel() * v.element_size() for v in state.values()
                                             if isinstance(v, torch.Tensor))


def run(mode: str, args, tmp: Path, state: dict, iterations: int) -> dict:
    if args.store:
        store = open_store(f"{args.store.partition('?')[0].rstrip('/')}/bench-{mode}-{int(time.time())}"
                           + ("?" + args.store.partition("?")[2] if "?" in args.store else ""))
    else:
        store = LinkStore(f"file://{tmp / mode / 'store'}", tmp / mode / "store", args.link_mbps)
    key = make_key(tmp / "key")
    ck = Checkpointer(tmp / mode / "local", keep=2, async_save=True, key=key,
                      stores=[store] if mode == "background" else [], site="s")
    a = torch.randn(256, 256) / 16
    stalls, rounds = [], []
    cpu0, wall0 = time.process_time(), time.monotonic()
    for r in range(1, args.rounds + 1):
        t0 = time.monotonic()
        compute(iterations, a)
        t1 = time.monotonic()
        state["step"] = r
        ck.save(r, state)
        if mode == "blocking":
            ck.wait()  # the manifest, then the upload, before the next round computes
            store_rounds.upload_round(store, "s", r, ck.root / f"round-{r:06d}")
        t2 = time.monotonic()
        stalls.append(t2 - t1)
        rounds.append(t2 - t0)
    t_end = time.monotonic()
    uploader = ck._uploader
    ck.close()
    drained = time.monotonic() - t_end
    up = uploader.uploaded if uploader is not None else list(range(1, args.rounds + 1)) if mode == "blocking" else []
    # this process's CPU (compute, DCP staging, checksums, the S3 client) per second of the mode's wall time
    cores = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    return {"mode": mode, "cpu_cores": round(cores, 2), "stall_s_median": round(statistics.median(stalls[1:]), 3),
            "round_s_median": round(statistics.median(rounds[1:]), 3),
            "stall_pct": round(100 * statistics.median(stalls[1:]) / statistics.median(rounds[1:]), 2),
            "rounds_uploaded": up, "drain_at_end_s": round(drained, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--compute-s", type=float, default=1.0, help="compute per round (seconds)")
    p.add_argument("--state-mb", type=float, default=64.0, help="checkpointed state (MiB of fp32)")
    p.add_argument("--link-mbps", type=float, default=200.0, help="upload link to the store (Mbit/s)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--store", default="", help="upload to this store URL (s3://B/P?endpoint_url=...) instead")
    p.add_argument("--preset", default="", help="checkpoint this model preset's trainer state, not --state-mb")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    state = make_state(args)
    mb = state_bytes(state) / (1 << 20)
    upload_s = mb * (1 << 20) * 8 / (args.link_mbps * 1e6)
    iterations = calibrate(args.compute_s, torch.randn(256, 256) / 16)
    print(f"# state {mb:.0f} MiB: one upload takes ~{upload_s:.1f} s at {args.link_mbps:g} Mbit/s; a round "
          f"computes {args.compute_s:g} s ({iterations} matmuls)", file=sys.stderr)
    results = []
    with tempfile.TemporaryDirectory() as d:
        for mode in ("local-only", "background", "blocking"):
            res = {**run(mode, args, Path(d), state, iterations), "state_mib": round(mb, 1),
                   "upload_s_model": round(upload_s, 2)}
            base = results[0]["round_s_median"] if results else res["round_s_median"]
            res["slowdown_pct"] = round(100 * (res["round_s_median"] / base - 1), 2)
            results.append(res)
            print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()

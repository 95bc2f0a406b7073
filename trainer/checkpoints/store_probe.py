"""The checkpoint-store probe a site's node runs for `dilococtl doctor` (issue 35).

`python -m trainer.checkpoints.store_probe [--endpoint-url E] [--region R] [--bytes N] URL...` writes, reads back
and deletes one object of N bytes (4 MiB: a plain PUT, as a manifest or a small shard goes) in each
store, and prints one JSON line per URL, in order:

    {"url": U, "status": "ok", "bytes": N, "upload_mbit": X, "download_mbit": Y}
    {"url": U, "status": "fail", "bytes": N, "error": "one line"}

It runs on the node whose uploads it measures, so the rates are that node's path to the store (a
site's uploads to another region's store cross the WAN, not the operator's link). The object lives
under the store's root as `_doctor/probe-RANDOM`, never under a run, and is deleted whatever
happens. Credentials come from this process's AWS chain only (trainer.checkpoints.snapshot_store): none is
taken on the command line and none is printed. Exit 0 when every store passed, 1 when one failed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from trainer.checkpoints.snapshot_store import StoreError, open_store

PROBE_BYTES = 4 << 20  # below the multipart threshold: one PUT, as a manifest or a small shard goes
PROBE_PREFIX = "_doctor/"  # under the store's root, beside (never inside) the runs' directories


@dataclass(kw_only=True, slots=True)
class ProbeResult:
    url: str
    status: str  # ok | fail
    bytes: int
    upload_mbit: float = 0.0  # bytes * 8 / PUT seconds
    download_mbit: float = 0.0  # bytes * 8 / GET seconds
    error: str = ""  # why it failed (one line, the URL not repeated)

    def to_json(self) -> dict:
        d = asdict(self)
        return {k: v for k, v in d.items() if k in ("url", "status", "bytes") or v}


def _mbit(nbytes: int, seconds: float) -> float:
    return round(nbytes * 8 / max(seconds, 1e-6) / 1e6, 3)


def probe(url: str, *, endpoint_url: str = "", region: str = "", nbytes: int = PROBE_BYTES) -> ProbeResult:
    """Write, read back and delete one object of `nbytes` in store `url`: its rates, or why not."""
    key = f"{PROBE_PREFIX}probe-{secrets.token_hex(6)}"
    data = os.urandom(nbytes)
    store = None
    try:
        store = open_store(url, endpoint_url=endpoint_url, region=region)
        with tempfile.TemporaryDirectory(prefix="store-probe-") as d:
            path = Path(d) / "probe"
            path.write_bytes(data)
            t0 = time.monotonic()
            store.put_file(key, path)  # the uploader's call for a round's files
            put_s = time.monotonic() - t0
        t0 = time.monotonic()
        back = store.get_bytes(key, nbytes)
        get_s = time.monotonic() - t0
        if back != data:
            raise StoreError(f"{url}: the probe object read back differs from what was written")
        store.delete([key])
        if key in store.list(PROBE_PREFIX):
            raise StoreError(f"{url}: the probe object is still listed after its delete")
    except (StoreError, OSError) as e:
        why = (str(e) or type(e).__name__).splitlines()[0]
        if store is not None:
            try:
                store.delete([key])
            except (StoreError, OSError):
                pass  # the failure above is the line to show
        return ProbeResult(url=url, status="fail", bytes=nbytes, error=why.removeprefix(f"{url}: "))
    return ProbeResult(url=url, status="ok", bytes=nbytes, upload_mbit=_mbit(nbytes, put_s),
                       download_mbit=_mbit(nbytes, get_s))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.checkpoints.store_probe", description=__doc__.splitlines()[0])
    ap.add_argument("urls", nargs="+", metavar="URL", help="s3://bucket/prefix or file:///path")
    ap.add_argument("--endpoint-url", default="", help="the S3 service of stores that name none in their URL")
    ap.add_argument("--region", default="")
    ap.add_argument("--bytes", type=int, default=PROBE_BYTES, dest="nbytes", help="the probe object's size")
    args = ap.parse_args(argv)
    if args.nbytes < 1:
        ap.error(f"--bytes must be at least 1, not {args.nbytes}")
    failed = 0
    for url in args.urls:
        r = probe(url, endpoint_url=args.endpoint_url, region=args.region, nbytes=args.nbytes)
        failed += r.status != "ok"
        print(json.dumps(r.to_json()), flush=True)  # one line per store as it finishes
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""doctor's checkpoint-store check: each store a site uploads to takes, returns and deletes a probe object.

The probe goes from this machine, with this process's AWS chain (as `dilococtl checkpoints` and resume
reach the stores), so the rate is this machine's path to the store; a site's own path may differ
(`lab up --object-store` puts the operator on an unshaped link). The probe lives under the store's
root as `_doctor/probe-RANDOM`, never under a run, and is deleted whatever happens.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dilococtl.spec import RunSpec, site_stores

PROBE_BYTES = 4 << 20  # one object below the multipart threshold: a plain PUT, as a manifest or small shard goes
OK, FAIL = "ok", "fail"


@dataclass(kw_only=True, slots=True)
class StoreCheck:
    url: str  # the store as the spec names it
    sites: list[str] = field(default_factory=list)  # sites whose rounds go there (own store or replica)
    status: str = OK  # ok | fail
    detail: str = ""  # the measured rates, or why the probe failed (one line)
    upload_mbit: float = 0.0  # probe bytes * 8 / PUT seconds


def spec_stores(spec: RunSpec) -> dict[str, list[str]]:
    """Every store of the spec (own and replica, in spec order) -> the sites that upload to it."""
    out: dict[str, list[str]] = {}
    for i, site in enumerate(spec.sites):
        s = site_stores(spec, i)
        for url in filter(None, [s["store"], *s["replica_stores"]]):
            out.setdefault(url, []).append(site.name)
    return out


def probe(url: str, *, endpoint_url: str = "", region: str = "", nbytes: int = PROBE_BYTES) -> StoreCheck:
    """Write, read back and delete one object of `nbytes` in store `url`; its upload rate, or why not."""
    from trainer.snapshot_store import StoreError, open_store

    check = StoreCheck(url=url)
    key = f"_doctor/probe-{secrets.token_hex(6)}"
    data = os.urandom(nbytes)
    store = None
    try:
        store = open_store(url, endpoint_url=endpoint_url, region=region)
        with tempfile.TemporaryDirectory(prefix="dilococtl-probe-") as d:
            path = Path(d) / "probe"
            path.write_bytes(data)
            t0 = time.monotonic()
            store.put_file(key, path)
            put_s = time.monotonic() - t0
        t0 = time.monotonic()
        back = store.get_bytes(key, nbytes)
        get_s = time.monotonic() - t0
        if hashlib.sha256(back).digest() != hashlib.sha256(data).digest():
            raise StoreError(f"{url}: the probe object read back differs from what was written")
        store.delete([key])
        if key in store.list("_doctor/"):
            raise StoreError(f"{url}: the probe object is still listed after its delete")
    except (StoreError, OSError) as e:
        why = (str(e) or type(e).__name__).splitlines()[0]
        check.status, check.detail = FAIL, why.removeprefix(f"{url}: ")  # the line names the store once
        if store is not None:
            try:
                store.delete([key])
            except (StoreError, OSError):
                pass  # the failure above is the line to show
        return check
    check.upload_mbit = nbytes * 8 / max(put_s, 1e-6) / 1e6
    check.detail = (f"wrote, read and deleted {nbytes >> 20} MiB: upload {check.upload_mbit:.1f} Mbit/s, "
                    f"download {nbytes * 8 / max(get_s, 1e-6) / 1e6:.1f} Mbit/s")
    return check


def check_stores(spec: RunSpec) -> list[StoreCheck]:
    """One probe per store of `spec` ([] when no site uploads checkpoints)."""
    out = []
    for url, sites in spec_stores(spec).items():
        check = probe(url, endpoint_url=spec.checkpoint.store_endpoint, region=spec.checkpoint.store_region)
        check.sites = sites
        out.append(check)
    return out


def line(check: StoreCheck) -> str:
    """doctor's line for one store."""
    who = ", ".join(check.sites)
    if check.status == OK:
        return f"ok: checkpoint store {check.url} ({who}): {check.detail}"
    return f"fail: checkpoint store {check.url} ({who}): {check.detail}"

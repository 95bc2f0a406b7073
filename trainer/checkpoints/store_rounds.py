"""A site's checkpoint rounds in an object store: upload, list, verify, fetch, prune.

Layout and rules in trainer.checkpoints.snapshot_store's module doc. The manifest is the local one
(trainer.checkpoints.checkpoint), uploaded unchanged after every object it lists; what a stored round is checked
against is that manifest's HMAC signature under the run's key, then each object's size (from the
listing) and, before anything is loaded, its SHA-256 (while downloading).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainer.checkpoints.manifest_sign import (  # one rule for local and stored rounds
    MANIFEST,
    round_dir,
    sha256_file,
    signature_problem,
)
from trainer.checkpoints.snapshot_store import SnapshotStore, StoreError

MANIFEST_MAX = 16 << 20  # a stored manifest bigger than this is refused unread
_ROUND_RE = re.compile(r"^round-(\d+)$")


def round_prefix(site: str, round: int) -> str:
    """The key prefix of one round of one site in a store."""
    return f"{site}/round-{round:06d}/"


@dataclass
class StoredRound:
    """One round of a site as one store holds it."""

    round: int
    store: str  # the store's URL
    bytes: int  # total size of the round's objects
    created: float | None  # when the round was checkpointed (the manifest's "created"), if known
    why: str  # "" = complete and verified; else why it is not used (one line, naming the object)


def list_rounds(store: SnapshotStore, site: str) -> dict[int, dict[str, int]]:
    """{round: {object name: size}} of `site` in `store`, complete or not."""
    out: dict[int, dict[str, int]] = {}
    for key, size in store.list(f"{site}/").items():
        parts = key.split("/")
        if len(parts) != 3:
            continue
        m = _ROUND_RE.match(parts[1])
        if m:
            out.setdefault(int(m.group(1)), {})[parts[2]] = size
    return out


def _read_manifest(store: SnapshotStore, site: str, round: int, key: bytes) -> tuple[dict | None, str]:

    name = round_prefix(site, round) + MANIFEST
    try:
        manifest = json.loads(store.get_bytes(name, MANIFEST_MAX))
        files = manifest["files"]
        mround = int(manifest["round"])
    except StoreError as e:
        return None, str(e)
    except (ValueError, KeyError, TypeError) as e:
        return None, f"{store.url}/{name}: manifest unreadable: {(str(e) or type(e).__name__).splitlines()[0]}"
    why = signature_problem(manifest, key)
    if why:
        return None, f"{store.url}/{name}: {why}"
    if mround != round:
        return None, f"{store.url}/{name}: manifest is for round {mround}"
    if not isinstance(files, dict) or ".metadata" not in files:
        return None, f"{store.url}/{name}: manifest lists no DCP .metadata"
    for fname, want in files.items():
        if not isinstance(want, dict) or "/" in fname or fname in ("", ".", "..", MANIFEST):
            return None, f"{store.url}/{name}: entry {fname!r} is not an object of this round"
    return manifest, ""


def check_round(store: SnapshotStore, site: str, round: int, objects: dict[str, int],
                key: bytes) -> tuple[dict | None, str]:
    """(manifest, "") when the stored round is complete, signed and every object has its size; else (None, why).

    SHA-256 is checked on download (fetch_round), not here: listing a store reads no object.
    """
    if MANIFEST not in objects:
        return None, f"{store.url}/{round_prefix(site, round)}: no manifest (the upload did not finish)"
    manifest, why = _read_manifest(store, site, round, key)
    if manifest is None:
        return None, why
    for fname, want in sorted(manifest["files"].items()):
        obj = round_prefix(site, round) + fname
        if fname not in objects:
            return None, f"object {store.url}/{obj} is missing"
        if objects[fname] != want.get("size"):
            return None, f"object {store.url}/{obj} has {objects[fname]} bytes, manifest says {want.get('size')}"
    return manifest, ""


def describe(store: SnapshotStore, site: str, key: bytes) -> list[StoredRound]:
    """Every round of `site` in `store`, newest first, with its size and verdict (signature and sizes)."""
    out = []
    for r, objects in sorted(list_rounds(store, site).items(), reverse=True):
        manifest, why = check_round(store, site, r, objects, key)
        created = float(manifest["created"]) if manifest and "created" in manifest else None
        out.append(StoredRound(round=r, store=store.url, bytes=sum(objects.values()), created=created, why=why))
    return out


def upload_round(store: SnapshotStore, site: str, round: int, local_dir: Path) -> int:
    """Upload a local, verified round directory: every object its manifest lists, then the manifest; bytes sent."""
    local_dir = Path(local_dir)
    manifest_bytes = (local_dir / MANIFEST).read_bytes()
    files = json.loads(manifest_bytes)["files"]
    prefix = round_prefix(site, round)
    # a stored copy of this round from an abandoned timeline (a restart from an older round) stops
    # counting before any of its objects is replaced
    store.delete([prefix + MANIFEST])
    sent = 0
    for name in sorted(files):
        store.put_file(prefix + name, local_dir / name)
        sent += int(files[name]["size"])
    store.put_bytes(prefix + MANIFEST, manifest_bytes)  # last: the round counts from here on
    return sent + len(manifest_bytes)


def fetch_round(store: SnapshotStore, site: str, round: int, objects: dict[str, int], dest: Path,
                key: bytes) -> str:
    """Download a stored round into the local round directory `dest`, every object checked; "" or why not.

    The objects land in a temporary sibling directory that is renamed to `dest` only once every one
    has its manifest's size and SHA-256 (and the manifest is written last, as a local save does), so
    a refused or interrupted fetch leaves nothing a later load could take for complete.
    """
    manifest, why = check_round(store, site, round, objects, key)
    if manifest is None:
        return why
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.fetch-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for fname, want in sorted(manifest["files"].items()):
            obj = round_prefix(site, round) + fname
            try:
                store.get_file(obj, tmp / fname)
            except StoreError as e:
                return str(e)
            digest = sha256_file(tmp / fname)
            if digest != want.get("sha256"):
                return (f"object {store.url}/{obj} checksum mismatch (sha256 {digest[:16]}..., manifest says "
                        f"{str(want.get('sha256'))[:16]}...)")
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
        return ""
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prune(store: SnapshotStore, site: str, keep: int, protect: set[int] | None = None,
          newest: int | None = None) -> list[int]:
    """Keep the `keep` newest rounds that have a manifest; delete the rest (partial uploads too). Rounds deleted.

    `newest`: the round just uploaded; rounds after it are from a timeline a restart from an older
    round abandoned, and go too (else a later restart would take them for the newest).
    A round loses its manifest before its objects, so it never looks complete while half-deleted.
    """
    rounds = list_rounds(store, site)
    stale = {r for r in rounds if newest is not None and r > newest}
    complete = sorted(r for r, objs in rounds.items() if MANIFEST in objs and r not in stale)
    kept = (set(complete[-keep:]) | (protect or set())) - stale
    gone = []
    for r, objs in sorted(rounds.items()):
        if r in kept:
            continue
        prefix = round_prefix(site, r)
        if MANIFEST in objs:
            store.delete([prefix + MANIFEST])
        store.delete([prefix + n for n in objs if n != MANIFEST])
        gone.append(r)
    return gone


def restore_newest(stores: list[SnapshotStore], site: str, local_root: Path, key: bytes, *,
                   newer_than: int | None = None, max_round: int | None = None,
                   on_skip: Callable[[int, str], None] | None = None) -> int | None:
    """Fetch the newest round (> newer_than, <= max_round) that verifies in any of `stores` into local_root.

    Rounds are tried newest first, each in every store that has it; a refused one is reported to
    `on_skip(round, why)` and the next is tried. Returns the round fetched, or None.
    """

    listed: dict[int, list[tuple[SnapshotStore, dict[str, int]]]] = {}
    for store in stores:
        try:
            found = list_rounds(store, site)
        except StoreError as e:
            if on_skip is not None:
                on_skip(-1, str(e))
            continue
        for r, objs in found.items():
            listed.setdefault(r, []).append((store, objs))
    for r in sorted(listed, reverse=True):
        if (newer_than is not None and r <= newer_than) or (max_round is not None and r > max_round):
            continue
        for store, objs in listed[r]:
            why = fetch_round(store, site, r, objs, round_dir(local_root, r), key)
            if not why:
                return r
            if on_skip is not None:
                on_skip(r, why)
    return None


def age(created: float | None, now: float | None = None) -> str:
    """'3m', '2h', '5d' since `created` ('-' when unknown)."""
    if created is None:
        return "-"
    s = max(0.0, (now if now is not None else time.time()) - created)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit}"
    return f"{s:.0f}s"

"""A round's checkpoint directory and the signature of its manifest: one rule for the rounds a site keeps
on its own disk (trainer.checkpoints.checkpoint) and those it fetches from an object store (trainer.checkpoints.store_rounds)."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 2  # bump when the manifest's fields change meaning (2: SHA-256 + HMAC signature)
_CHUNK = 8 << 20  # bytes read at a time while checksumming


def round_dir(root: Path, round: int) -> Path:
    """Directory of one round's checkpoint."""
    return Path(root) / f"round-{round:06d}"


def _signed_bytes(manifest: Mapping[str, Any]) -> bytes:
    """What the signature covers: the whole manifest but its signature, as canonical JSON."""
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(manifest: dict[str, Any], key: bytes) -> dict[str, Any]:
    """`manifest` with its HMAC-SHA256 signature under `key`."""
    return {**manifest, "signature": hmac.new(key, _signed_bytes(manifest), hashlib.sha256).hexdigest()}


def signature_problem(manifest: Any, key: bytes) -> str:
    if not isinstance(manifest, dict):
        return "manifest unreadable: not a JSON object"
    if manifest.get("format") != MANIFEST_FORMAT or "signature" not in manifest:
        return (f"unsigned checkpoint (manifest format {manifest.get('format', 1)}, made before checkpoints were "
                f"signed): refused, nothing vouches for who wrote it")
    want = hmac.new(key, _signed_bytes(manifest), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(want, str(manifest["signature"])):
        return "signature does not verify under this run's checkpoint key: refused"
    return ""


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes, as the manifest lists it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()

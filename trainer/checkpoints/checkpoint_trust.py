"""What makes a site's checkpoint directory trusted: the run's signing key, the signed manifest, `verify`.

A checkpoint counts only when its manifest is there, its HMAC-SHA256 signature verifies under the run's
checkpoint key, and every file it lists (DCP's .metadata included) has the recorded size and SHA-256.
The signature proves authorship, not only integrity: DCP reads `.metadata` (and its byte items) with
pickle, so a checkpoint is verified before any byte of it is deserialised, and one whose signature is
missing or wrong is refused. The key (32 random bytes, 0600) is made per run by the control plane and
handed to the trainer by path (DILOCO_CHECKPOINT_KEY); without it, the user's own key under
$DILOCOCTL_HOME (default ~/.dilococtl) is used, made on first use. Old unsigned checkpoints (manifest
format 1) are refused: nothing vouches for who wrote them. `write_manifest` puts a manifest in place
last (tmp + fsync + rename + fsync of the directory). The errors every checkpoint module raises
(CheckpointError, CheckpointKeyError) are defined here. trainer.checkpoints.checkpoint.Checkpointer writes and
loads the checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

from trainer.checkpoints.manifest_sign import MANIFEST, sha256_file, signature_problem

KEY_ENV = "DILOCO_CHECKPOINT_KEY"  # path of the run's checkpoint signing key (launch sets it); never the key itself
KEY_FILE = "checkpoint.key"  # the signing key's file name, in the control plane's run_ca/RUN_ID and a node's _keys
KEY_BYTES = 32  # HMAC-SHA256 key length
_MANIFEST_MAX = 16 << 20  # a manifest bigger than this is refused unread
ROUND_DIR_RE = re.compile(r"^round-(\d+)$")  # a round directory's name: round-000012


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or loaded (I/O, a failed rank, a state that does not fit)."""


class CheckpointKeyError(CheckpointError):
    """The checkpoint signing key is missing, unreadable, the wrong size or readable by others."""


# ---------------------------------------------------------------------- the signing key


def default_key_path() -> Path:
    """$DILOCO_CHECKPOINT_KEY, else the user's own key under $DILOCOCTL_HOME (default ~/.dilococtl)."""
    named = os.environ.get(KEY_ENV)
    if named:
        return Path(named).expanduser()
    home = os.environ.get("DILOCOCTL_HOME") or str(Path.home() / ".dilococtl")
    return Path(home).expanduser() / KEY_FILE


def make_key(path: Path) -> bytes:
    """A new random key at `path` (0600, in a directory made 0700); an existing key is kept and read.

    Written to a temporary name and hard-linked into place, so concurrent makers agree on one key.
    """
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: use theirs
    finally:
        tmp.unlink(missing_ok=True)
    return load_key(path)


def load_key(path: Path) -> bytes:
    """The key in `path`; CheckpointKeyError (one line naming the file) unless it is ours and private."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise CheckpointKeyError(f"checkpoint key {path}: cannot read it: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid():
            raise CheckpointKeyError(f"checkpoint key {path}: owned by uid {st.st_uid}, not by this user")
        if st.st_mode & 0o077:
            raise CheckpointKeyError(f"checkpoint key {path}: mode {st.st_mode & 0o777:o} lets others read it "
                                     f"(must be 0600)")
        key = f.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise CheckpointKeyError(f"checkpoint key {path}: holds {len(key)} bytes, not {KEY_BYTES}")
    return key


def default_key() -> bytes:
    """The key checkpoints are signed and verified with when none is passed (default_key_path).

    A key named by $DILOCO_CHECKPOINT_KEY must exist (launch delivered it); the user's own key is
    made on first use.
    """
    path = default_key_path()
    if os.environ.get(KEY_ENV) or path.exists():
        return load_key(path)
    return make_key(path)


# ---------------------------------------------------------------------- verification


def verify(path: Path, key: bytes | None = None) -> str:
    """Why the checkpoint directory `path` is not complete, intact and signed with `key`, or "" when it is.

    Reads only the manifest (JSON) and hashes files: nothing is deserialised. `key`: default_key().
    """
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        return "no manifest (the save did not finish)"
    try:
        if mpath.stat().st_size > _MANIFEST_MAX:
            return f"manifest unreadable: over {_MANIFEST_MAX} bytes"
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        mround = int(manifest["round"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"manifest unreadable: {first_line(e)}"
    why = signature_problem(manifest, default_key() if key is None else key)
    if why:
        return why
    m = ROUND_DIR_RE.match(path.name)
    if m and int(m.group(1)) != mround:
        return f"manifest is for round {mround}, directory for round {int(m.group(1))}"
    if not isinstance(files, dict) or ".metadata" not in files:
        return "manifest lists no DCP .metadata"
    for name, want in files.items():
        if not isinstance(want, dict) or "/" in name or name in ("", ".", "..", MANIFEST):
            return f"manifest entry {name!r} is not a file of this directory"
        fpath = path / name
        try:
            size = fpath.stat().st_size
        except OSError:
            return f"file {name} is missing"
        if size != want.get("size"):
            return f"file {name} has {size} bytes, manifest says {want.get('size')}"
    for name, want in files.items():
        try:
            digest = sha256_file(path / name)
        except OSError as e:
            return f"file {name} unreadable: {first_line(e)}"
        if digest != want.get("sha256"):
            return f"file {name} checksum mismatch (sha256 {digest[:16]}..., manifest says {str(want.get('sha256'))[:16]}...)"
    return ""


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Put `manifest` in place as PATH/manifest.json (tmp, fsync, rename, fsync of the directory): the
    one way a site's or the outer service's round becomes complete."""
    tmp = path / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)
    fd = os.open(path, os.O_RDONLY)  # the rename itself must survive a crash
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def first_line(e: BaseException) -> str:
    """The first line of `e`'s message (its type's name when it has none): one line for an event or error."""
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


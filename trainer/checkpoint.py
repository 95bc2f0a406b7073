"""Per-site checkpoints on torch.distributed.checkpoint (DCP), with a manifest that proves completeness.

Layout under root (= RUN_DIR/SITE/checkpoints):

    round-000012/__0_0.distcp ...   DCP data files, one or more per rank
    round-000012/.metadata          DCP's index, written by rank 0 once every rank's data is written
    round-000012/manifest.json      ours, written LAST: {"format": 2, "round", "files": {name: {"size", "sha256"}},
                                    "signature"}

A checkpoint counts only when its manifest is there, its HMAC-SHA256 signature verifies under the run's
checkpoint key, and every file it lists (DCP's .metadata included) has the recorded size and SHA-256.
The signature proves authorship, not only integrity: DCP reads `.metadata` (and its byte items) with
pickle, so a checkpoint is verified before any byte of it is deserialised, and one whose signature is
missing or wrong is refused. The key (32 random bytes, 0600) is made per run by the control plane and
handed to the trainer by path (DILOCO_CHECKPOINT_KEY); without it, the user's own key under
$DILOCOCTL_HOME (default ~/.dilococtl) is used, made on first use. Old unsigned checkpoints (manifest
format 1) are refused: nothing vouches for who wrote them. The manifest is renamed into place (tmp + fsync + rename + fsync of the directory) by
rank 0 after DCP's future is done, and that future completes only after DCP's collective finish step
(every rank's writes gathered, then .metadata written), so a process killed at any moment leaves
either no manifest or a complete checkpoint. Anything else is passed over with a
"checkpoint_skipped" event.

With object stores (`stores`, [checkpoint] store), rank 0 hands each finished round to a background
uploader (trainer.uploader; objects first, this same signed manifest last) and the save path never
waits for it; `wait()` does. A load whose newest local round (<= max_round) is missing, broken or
older than a stored one fetches the stored round first (trainer.store_rounds.restore_newest: every
object checked against the signed manifest before it is renamed into root), then loads it as a
local one. The site's nodes share root (spec: one work_dir per site), so rank 0's fetch serves all.

Non-tensor values (ints, floats, strings, lists, tuples, dicts, bytes, numpy arrays and RNG states)
are encoded as typed JSON into one bytes leaf per tensor-free subtree, which DCP stores as a bytes IO
item; loading replaces them whole. Nothing of ours is pickled. Tensors stay
DCP tensors and are loaded into the caller's tensors in place (DTensor shards included). Each rank
also saves a skeleton of its state (real key types, tensor shapes), so a value that holds no tensors
at load time (a fresh optimizer's empty `state`) is replaced by the saved subtree. DCP keeps one
copy of a non-tensor value per key across ranks: per-rank values need per-rank keys.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from trainer import jsonwire
from trainer.manifest_sign import (  # noqa: F401 (re-exported)
    MANIFEST,
    MANIFEST_FORMAT,
    round_dir,
    sha256_file,
    sign,
    signature_problem,
)

KEY_ENV = "DILOCO_CHECKPOINT_KEY"  # path of the run's checkpoint signing key (launch sets it); never the key itself
KEY_FILE = "checkpoint.key"  # the signing key's file name, in the control plane's run_ca/RUN_ID and a node's _keys
KEY_BYTES = 32  # HMAC-SHA256 key length
_MANIFEST_MAX = 16 << 20  # a manifest bigger than this is refused unread
_DIR_RE = re.compile(r"^round-(\d+)$")

EventSink = Callable[[str, str, dict], None]


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


class Checkpointer:
    """Saves, verifies, prunes and loads one site's checkpoints.

    Every rank of the site's process group (if one is initialised) must call save/load_latest in
    the same order; latest/rounds are local reads. Events go to `on_event` on rank 0 only, and the
    "checkpoint" event of an async save is sent from the checkpoint thread.
    """

    def __init__(self, root: Path, keep: int = 3, async_save: bool = True,
                 on_event: EventSink | None = None, key: bytes | None = None,
                 stores: list[Any] | None = None, site: str = ""):
        if keep < 1:
            raise ValueError(f"checkpoint.keep: must be >= 1, got {keep}")
        self.root = Path(root)
        # signs manifests and is checked before anything is read (module doc); None: default_key()
        self.key = key if key is not None else default_key()
        if len(self.key) != KEY_BYTES:
            raise CheckpointKeyError(f"checkpoint key: {len(self.key)} bytes, not {KEY_BYTES}")
        self.keep = keep
        self.async_save = async_save
        self.on_event = on_event
        self._pg: Any = None  # own gloo group: the checkpoint thread's collectives never mix with training's
        self._pending: Future | None = None
        self._worker: ThreadPoolExecutor | None = None
        # (dir, stat of its files) -> why it fails ("" = verified); lets prune skip re-hashing
        self._verified: dict[tuple, str] = {}
        self._lock = threading.Lock()
        # object stores (trainer.snapshot_store) every finished round is uploaded to, in the background,
        # under `site`/; a load with no newer verified local round fetches from them (trainer.store_rounds)
        self.stores = list(stores or [])
        self.site = site or "site"
        self._uploader: Any = None  # trainer.uploader.Uploader, made on rank 0 at the first upload
        # DCP warns on every call without a process group; a single process is a supported case here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")

    # ------------------------------------------------------------------ process group

    def _group(self) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._pg is None:
            # new_group is collective: every rank reaches it at the same save/load_latest call.
            self._pg = dist.new_group(backend="gloo")
        return self._pg

    def _rank_world(self) -> tuple[int, int]:
        pg = self._group()
        return (dist.get_rank(pg), dist.get_world_size(pg)) if pg is not None else (0, 1)

    def _emit(self, kind: str, message: str, detail: dict) -> None:
        if self.on_event is not None and self._rank_world()[0] == 0:
            self.on_event(kind, message, detail)

    # ------------------------------------------------------------------ save

    def save(self, round: int, state: dict[str, Any]) -> None:
        """Checkpoint `state` as round `round`; with async_save, returns once the tensors are staged."""
        if round < 0:
            raise ValueError(f"checkpoint round must be >= 0, got {round}")
        packed = _pack(state)
        self._wait_save()  # not the upload: compute never waits for the store
        t0 = time.monotonic()
        pg = self._group()
        rank, _ = self._rank_world()
        path = round_dir(self.root, round)
        status = [""]
        if rank == 0:
            try:
                # A leftover of the same round (a save killed, then a resume from an older one)
                # loses its manifest first, so it is never taken for complete while being replaced.
                if path.exists():
                    (path / MANIFEST).unlink(missing_ok=True)
                    shutil.rmtree(path)
                path.mkdir(parents=True)
            except OSError as e:
                status[0] = f"{type(e).__name__}: {_first_line(e)}"
        if pg is not None:
            # doubles as the barrier: no rank writes into the directory before it is fresh
            status = jsonwire.broadcast(status, src=0, group=pg)
        if status[0]:
            raise CheckpointError(f"cannot prepare checkpoint directory {path}: {status[0]}")
        packed[_skeleton_key(rank)] = jsonwire.dumps(_skeleton(state))
        if self.async_save:
            fut = dcp.async_save(packed, checkpoint_id=str(path), process_group=pg, no_dist=pg is None)
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
            self._pending = self._worker.submit(self._complete, round, path, fut, t0)
        else:
            md = dcp.save(packed, checkpoint_id=str(path), process_group=pg, no_dist=pg is None)
            self._complete(round, path, md, t0)

    def wait(self, upload_timeout_s: float | None = None) -> None:
        """Block until an in-flight save has its manifest and its upload (if any) is done.

        Raises CheckpointError if the save failed; a failed upload is an event, not an error. With
        `upload_timeout_s` (a preemption's grace), an upload still going after that long is left to be
        cut by the process's exit: its round has no manifest in the store and is never loaded.
        """
        self._wait_save()
        if self._uploader is not None and not self._uploader.flush(upload_timeout_s):
            busy = sorted(self._uploader.busy())
            if busy:
                self._emit("checkpoint_upload_cut", f"upload of round {busy[-1]} not finished within "
                           f"{upload_timeout_s:.1f} s: the store keeps its previous rounds",
                           {"round": busy[-1], "seconds": _secs(upload_timeout_s or 0.0)})

    def _wait_save(self) -> None:
        fut, self._pending = self._pending, None
        if fut is not None:
            fut.result()

    def close(self) -> None:
        """Wait for the in-flight save and stop the checkpoint thread."""
        try:
            self.wait()
        finally:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
                self._worker = None
            if self._uploader is not None:
                self._uploader.close()
                self._uploader = None

    def _upload(self, round: int, path: Path) -> None:
        """Hand a finished round to the background uploader (rank 0, stores configured)."""
        if not self.stores:
            return
        if self._uploader is None:
            from trainer.uploader import Uploader

            self._uploader = Uploader(self.stores, self.site, self.keep, on_event=self.on_event)
        self._uploader.submit(round, path)

    def _complete(self, round: int, path: Path, done: Future | Any, t0: float) -> None:
        """After DCP finished: checksum (files split over ranks), manifest on rank 0, prune, event."""
        pg = self._group()
        rank, world = self._rank_world()
        err, entries = "", {}
        try:
            metadata = done.result() if isinstance(done, Future) else done
            names = sorted({info.relative_path for info in metadata.storage_data.values()} | {".metadata"})
            entries = {name: _file_entry(path / name) for name in names[rank::world]}
        except BaseException as e:  # every rank must still reach the gather below
            err = f"rank {rank}: {type(e).__name__}: {_first_line(e)}"
        if pg is not None:
            parts: list[Any] = jsonwire.gather([err, entries], dst=0, group=pg) or []
        else:
            parts = [(err, entries)]
        status = [""]
        if rank == 0:
            errors = [e for e, _ in parts if e]
            if errors:
                status[0] = "; ".join(errors)
            else:
                try:
                    files = {name: entry for _, part in parts for name, entry in part.items()}
                    write_manifest(path, sign({"format": MANIFEST_FORMAT, "round": round, "world_size": world,
                                                "files": dict(sorted(files.items())), "created": time.time()},
                                               self.key))
                    with self._lock:  # just checksummed: prune need not re-hash it
                        self._verified[self._stat_key(path)] = ""
                    self._prune(round)
                    self._upload(round, path)
                except Exception as e:  # reported to every rank below
                    status[0] = f"rank 0: {type(e).__name__}: {_first_line(e)}"
        if pg is not None:
            status = jsonwire.broadcast(status, src=0, group=pg)
        if status[0]:
            raise CheckpointError(f"checkpoint of round {round} at {path} failed: {status[0]}")
        seconds = time.monotonic() - t0
        self._emit("checkpoint", f"checkpoint round {round} complete ({seconds:.2f} s)",
                   {"round": round, "path": str(path), "seconds": _secs(seconds)})

    def _prune(self, just_saved: int) -> None:
        """Keep the `keep` newest complete checkpoints; drop older ones and dead partial saves."""
        complete = self.rounds()
        kept = set(complete[-self.keep:])
        if self._uploader is not None:
            kept |= self._uploader.busy()  # still going up to the store
        for r, path in self._dirs():
            if r in kept or r == just_saved:
                continue
            # Partial or corrupt saves are dead too: the save in flight (just_saved) is finished.
            (path / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
        with self._lock:
            self._verified = {k: v for k, v in self._verified.items() if Path(k[0]).exists()}

    # ------------------------------------------------------------------ read side

    def _dirs(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _DIR_RE.match(p.name)
            if m and p.is_dir():
                found.append((int(m.group(1)), p))
        return sorted(found)

    def _stat_key(self, path: Path) -> tuple:
        try:
            stats = tuple((p.name, s.st_size, s.st_mtime_ns, s.st_ino)
                          for p in sorted(path.iterdir()) for s in [p.stat()])
        except OSError:
            return (str(path), None)
        return (str(path), stats)

    def _check(self, path: Path, cached: bool) -> str:
        """Why the checkpoint at `path` is not usable, or "" when it verifies."""
        key = self._stat_key(path)
        with self._lock:
            if cached and key in self._verified:
                return self._verified[key]
        why = verify(path, self.key)
        with self._lock:
            self._verified[key] = why
        return why

    def rounds(self) -> list[int]:
        """Rounds with a complete, manifest-verified checkpoint, oldest first.

        Verification results are cached by the files' size/mtime/inode, so a checkpoint is hashed
        once per process; latest() and load_latest() always re-hash.
        """
        return [r for r, path in self._dirs() if not self._check(path, cached=True)]

    def latest(self) -> int | None:
        """Newest round whose checkpoint verifies (fully re-hashed), or None."""
        for r, path in reversed(self._dirs()):
            if not self._check(path, cached=False):
                return r
        return None

    def load_latest(self, state: dict[str, Any], max_round: int | None = None) -> int | None:
        """Fill `state` in place from the newest checkpoint that verifies; its round, or None.

        With `max_round`, newer checkpoints are left alone (a whole-run restart from a common round).

        Tensors are loaded into the given tensors (same shapes needed); every other value is
        replaced by the saved one, tensors included: a fresh optimizer's empty `state` comes back
        as the saved per-parameter state, with its int keys. Keys of `state` that the checkpoint
        lacks are an error (CheckpointError naming the key).
        """
        self.wait()
        pg = self._group()
        rank, _ = self._rank_world()
        choice: list[Any] = [None, ""]  # round to load, error
        if rank == 0:
            try:
                for r, path in reversed(self._dirs()):
                    if max_round is not None and r > max_round:
                        continue
                    why = self._check(path, cached=False)
                    if not why:
                        choice[0] = r
                        break
                    self._emit("checkpoint_skipped", f"checkpoint {path} skipped: {why}",
                               {"round": r, "path": str(path), "why": why})
                if self.stores:
                    fetched = self._restore(newer_than=choice[0], max_round=max_round)
                    if fetched is not None:
                        choice[0] = fetched
            except OSError as e:  # e.g. root unreadable: every rank must hear of it, not hang
                choice[1] = f"{type(e).__name__}: {_first_line(e)}"
        if pg is not None:
            choice = jsonwire.broadcast(choice, src=0, group=pg)
        if choice[1]:
            raise CheckpointError(f"cannot search checkpoints under {self.root}: {choice[1]}")
        if choice[0] is None:
            return None
        path = round_dir(self.root, choice[0])
        try:
            # The saved structure first (tiny): it says what to build where `state` holds no tensors.
            saved_keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
            key = _skeleton_key(rank) if _skeleton_key(rank) in saved_keys else _skeleton_key(0)
            holder = {key: b""}
            dcp.load(holder, checkpoint_id=str(path), process_group=pg, no_dist=pg is None)
            packed = _pack_target(state, _skeleton_from_json(jsonwire.loads(holder[key])))
            dcp.load(packed, checkpoint_id=str(path), process_group=pg, no_dist=pg is None)
        except (Exception, CheckpointException) as e:  # DCP shares a failure with every rank: all raise
            why = _dcp_reason(e)
            raise CheckpointError(f"cannot load checkpoint {path} into the given state: {why}") from e
        _unpack_into(state, packed)
        return choice[0]

    def _restore(self, newer_than: int | None, max_round: int | None) -> int | None:
        """Fetch the newest verified stored round newer than the local one into root; its round, or None."""
        from trainer import store_rounds

        def skipped(r: int, why: str) -> None:
            self._emit("checkpoint_skipped", f"stored round {r} skipped: {why}" if r >= 0 else why,
                       {"round": r, "why": why, "stored": True})

        t0 = time.monotonic()
        got = store_rounds.restore_newest(self.stores, self.site, self.root, self.key, newer_than=newer_than,
                                          max_round=max_round, on_skip=skipped)
        if got is not None:
            seconds = time.monotonic() - t0
            self._emit("checkpoint_restored", f"round {got} fetched from the checkpoint store ({seconds:.2f} s)",
                       {"round": got, "seconds": _secs(seconds)})
        return got


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
        return f"manifest unreadable: {_first_line(e)}"
    why = signature_problem(manifest, default_key() if key is None else key)
    if why:
        return why
    m = _DIR_RE.match(path.name)
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
            return f"file {name} unreadable: {_first_line(e)}"
        if digest != want.get("sha256"):
            return f"file {name} checksum mismatch (sha256 {digest[:16]}..., manifest says {str(want.get('sha256'))[:16]}...)"
    return ""


def _file_entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


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


# ---------------------------------------------------------------------- state packing


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_tensor(v) for v in value)
    return False


def _pack_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping) and _has_tensor(value):
        return {k: _pack_value(v) for k, v in value.items()}
    if isinstance(value, list) and _has_tensor(value):
        return [_pack_value(v) for v in value]
    # One opaque leaf per tensor-free subtree: DCP would otherwise split it into per-key items whose
    # structure the loading side must reproduce exactly (an RNG state dict, an int-keyed mapping).
    try:
        return jsonwire.dumps(value)
    except TypeError as e:
        raise CheckpointError(f"cannot checkpoint this value: {e}") from None


def _pack(state: Mapping[str, Any]) -> dict[str, Any]:
    """DCP's view of `state`: the same tensors, every tensor-free subtree as typed JSON bytes."""
    if not isinstance(state, Mapping):
        raise ValueError(f"checkpoint state must be a dict, got {type(state).__name__}")
    return {k: _pack_value(v) for k, v in state.items()}


def _skeleton_key(rank: int) -> str:
    return f"_checkpointer_skeleton_rank{rank}"


class _TensorSpec(tuple):
    """(shape, dtype) of a saved tensor in a skeleton; a distinct type so no saved tuple is mistaken for it."""


_OPAQUE = "opaque"  # skeleton leaf for a JSON-encoded tensor-free subtree


def _skeleton(value: Any) -> Any:
    """The saved structure with real key types: containers that hold tensors, tensor specs, opaque leaves.

    DCP keys everything by dotted strings, so it alone could not rebuild an int-keyed optimizer state.
    """
    if isinstance(value, torch.Tensor):
        return {"tensor": [list(value.shape), str(value.dtype).removeprefix("torch.")]}
    if isinstance(value, Mapping) and _has_tensor(value):
        return {"map": [[k, _skeleton(v)] for k, v in value.items()]}
    if isinstance(value, list) and _has_tensor(value):
        return {"seq": [_skeleton(v) for v in value]}
    return _OPAQUE


def _skeleton_from_json(tree: Any) -> Any:
    """The skeleton `_skeleton` saved, as _build and _pack_target read it (dicts, lists, _TensorSpec)."""
    if tree == _OPAQUE:
        return _OPAQUE
    if isinstance(tree, dict) and len(tree) == 1:
        (tag, body), = tree.items()
        if tag == "tensor":
            shape, dtype = body
            dt = getattr(torch, str(dtype), None)
            if not isinstance(dt, torch.dtype):
                raise CheckpointError(f"skeleton names an unknown dtype {dtype!r}")
            return _TensorSpec((tuple(int(n) for n in shape), dt))
        if tag == "map":
            return {k: _skeleton_from_json(v) for k, v in body}
        if tag == "seq":
            return [_skeleton_from_json(v) for v in body]
    raise CheckpointError("checkpoint skeleton is malformed")


def _build(skel: Any) -> Any:
    """A fresh DCP target for a saved subtree: new tensors, placeholders for opaque leaves."""
    if isinstance(skel, _TensorSpec):
        shape, dtype = skel
        return torch.empty(shape, dtype=dtype)
    if isinstance(skel, dict):
        return {k: _build(v) for k, v in skel.items()}
    if isinstance(skel, list):
        return [_build(v) for v in skel]
    return b""


def _pack_target(target: Any, skel: Any) -> Any:
    """DCP's load target for `target`: its own tensors, and built ones where it holds none.

    A tensor-free value where the checkpoint has tensors (a fresh optimizer's empty `state`) is
    replaced by the saved subtree; keys the checkpoint lacks are left for DCP to report.
    """
    keys = list(target.keys()) if isinstance(target, Mapping) else range(len(target))
    out: Any = {} if isinstance(target, Mapping) else [None] * len(target)
    for k in keys:
        value = target[k]
        if isinstance(skel, dict):
            sub = skel.get(k, None)
        else:
            sub = skel[k] if isinstance(skel, list) and k < len(skel) else None
        if isinstance(value, torch.Tensor):
            out[k] = value
        elif sub is None:
            out[k] = _pack_value(value)
        elif not _has_tensor(value) and (isinstance(sub, (dict, list, _TensorSpec))):
            out[k] = _build(sub)
        elif isinstance(value, (Mapping, list)) and _has_tensor(value) and isinstance(sub, (dict, list)):
            out[k] = _pack_target(value, sub)
        else:
            out[k] = _pack_value(value)
    return out


def _materialize(loaded: Any) -> Any:
    if isinstance(loaded, (bytes, bytearray)):
        return jsonwire.loads(loaded)
    if isinstance(loaded, dict):
        return {k: _materialize(v) for k, v in loaded.items()}
    if isinstance(loaded, list):
        return [_materialize(v) for v in loaded]
    return loaded


def _unpack_into(target: Any, packed: Any) -> None:
    """Put loaded values from `packed` (built from `target`) back into `target`."""
    keys = list(target.keys()) if isinstance(target, Mapping) else range(len(target))
    for k in keys:
        orig, got = target[k], packed[k]
        if isinstance(orig, torch.Tensor):
            if got is not orig:  # DCP loads plain tensors in place; copy if it ever hands back a new one
                orig.copy_(got)
        elif isinstance(orig, (Mapping, list)) and _has_tensor(orig):
            _unpack_into(orig, got)
        else:
            target[k] = _materialize(got)


# ---------------------------------------------------------------------- small helpers


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _dcp_reason(e: BaseException) -> str:
    # DCP wraps per-rank tracebacks into one long message; its last "Error: ..." line is the cause.
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln and ":" in ln:
            return ln
    return lines[-1] if lines else type(e).__name__


def _secs(seconds: float) -> float:
    return float(f"{seconds:.3f}")

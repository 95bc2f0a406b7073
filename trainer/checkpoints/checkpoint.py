"""Per-site checkpoints on torch.distributed.checkpoint (DCP), with a manifest that proves completeness.

Layout under root (= RUN_DIR/SITE/checkpoints):

    round-000012/__0_0.distcp ...   DCP data files, one or more per rank
    round-000012/.metadata          DCP's index, written by rank 0 once every rank's data is written
    round-000012/manifest.json      ours, written LAST: {"format": 2, "round", "files": {name: {"size", "sha256"}},
                                    "signature"}

A checkpoint counts only when its manifest is there, its HMAC-SHA256 signature verifies under the
run's checkpoint key, and every file it lists has the recorded size and SHA-256; it is verified
before any byte of it is deserialised (trainer.checkpoints.checkpoint_trust: the key, `verify`,
`write_manifest`). The manifest is renamed into place (tmp + fsync + rename + fsync of the
directory) by rank 0 after DCP's future is done, and that future completes only after DCP's
collective finish step (every rank's writes gathered, then .metadata written), so a process killed
at any moment leaves either no manifest or a complete checkpoint. Anything else is passed over with
a "checkpoint_skipped" event.

With object stores (`stores`, [checkpoint] store), rank 0 hands each finished round to a background
uploader (trainer.checkpoints.uploader; objects first, this same signed manifest last) and the save path never
waits for it; `wait()` does. A load whose newest local round (<= max_round) is missing, broken or
older than a stored one fetches the stored round first (trainer.checkpoints.store_rounds.restore_newest: every
object checked against the signed manifest before it is renamed into root), then loads it as a
local one. The site's nodes share root (spec: one work_dir per site), so rank 0's fetch serves all.

Nothing of ours is pickled: non-tensor values are stored as typed JSON, tensors as DCP tensors loaded
in place, with a skeleton of each rank's state (trainer.checkpoints.checkpoint_pack).
"""

from __future__ import annotations

import shutil
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from trainer import jsonwire
from trainer.checkpoints.checkpoint_pack import (
    pack_state,
    pack_target,
    skeleton,
    skeleton_from_json,
    skeleton_key,
    unpack_into,
)
from trainer.checkpoints.checkpoint_trust import (
    KEY_BYTES,
    ROUND_DIR_RE,
    CheckpointError,
    CheckpointKeyError,
    default_key,
    first_line,
    verify,
    write_manifest,
)
from trainer.checkpoints.manifest_sign import MANIFEST, MANIFEST_FORMAT, round_dir, sha256_file, sign

EventSink = Callable[[str, str, dict], None]


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
        # object stores (trainer.checkpoints.snapshot_store) every finished round is uploaded to, in the background,
        # under `site`/; a load with no newer verified local round fetches from them (trainer.checkpoints.store_rounds)
        self.stores = list(stores or [])
        self.site = site or "site"
        self._uploader: Any = None  # trainer.checkpoints.uploader.Uploader, made on rank 0 at the first upload
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
        packed = pack_state(state)
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
                status[0] = f"{type(e).__name__}: {first_line(e)}"
        if pg is not None:
            # doubles as the barrier: no rank writes into the directory before it is fresh
            status = jsonwire.broadcast(status, src=0, group=pg)
        if status[0]:
            raise CheckpointError(f"cannot prepare checkpoint directory {path}: {status[0]}")
        packed[skeleton_key(rank)] = jsonwire.dumps(skeleton(state))
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
            from trainer.checkpoints.uploader import Uploader

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
            err = f"rank {rank}: {type(e).__name__}: {first_line(e)}"
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
                    status[0] = f"rank 0: {type(e).__name__}: {first_line(e)}"
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
            m = ROUND_DIR_RE.match(p.name)
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
                choice[1] = f"{type(e).__name__}: {first_line(e)}"
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
            key = skeleton_key(rank) if skeleton_key(rank) in saved_keys else skeleton_key(0)
            holder = {key: b""}
            dcp.load(holder, checkpoint_id=str(path), process_group=pg, no_dist=pg is None)
            packed = pack_target(state, skeleton_from_json(jsonwire.loads(holder[key])))
            dcp.load(packed, checkpoint_id=str(path), process_group=pg, no_dist=pg is None)
        except (Exception, CheckpointException) as e:  # DCP shares a failure with every rank: all raise
            why = _dcp_reason(e)
            raise CheckpointError(f"cannot load checkpoint {path} into the given state: {why}") from e
        unpack_into(state, packed)
        return choice[0]

    def _restore(self, newer_than: int | None, max_round: int | None) -> int | None:
        """Fetch the newest verified stored round newer than the local one into root; its round, or None."""
        from trainer.checkpoints import store_rounds

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


def _file_entry(path: Path) -> dict[str, Any]:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def _dcp_reason(e: BaseException) -> str:
    # DCP wraps per-rank tracebacks into one long message; its last "Error: ..." line is the cause.
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln and ":" in ln:
            return ln
    return lines[-1] if lines else type(e).__name__


def _secs(seconds: float) -> float:
    return float(f"{seconds:.3f}")

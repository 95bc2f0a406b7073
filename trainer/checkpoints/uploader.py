"""Background upload of a site's finished local checkpoints to its object stores; compute never waits.

One thread per site leader. `submit` only records the newest round to send: a round finished while
an older one is still going up replaces any round still waiting (an upload slower than a round
skips rounds rather than queueing them or holding the training loop). Each round goes to every
store (the run's store and its replicas), objects first and the manifest last, then the store is
pruned to `keep` rounds. A failed upload is an event; the next round tries again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainer.checkpoints import store_rounds
from trainer.checkpoints.snapshot_store import SnapshotStore, StoreError

EventSink = Callable[[str, str, dict], None]


class Uploader:
    """Sends finished round directories to `stores` in a thread of its own."""

    def __init__(self, stores: list[SnapshotStore], site: str, keep: int, on_event: EventSink | None = None):
        self.stores = stores
        self.site = site
        self.keep = keep
        self.on_event = on_event
        self._cond = threading.Condition()
        self._next: tuple[int, Path] | None = None  # waiting to start (only the newest is kept)
        self._current: int | None = None  # going up now
        self._closed = False
        self.uploaded: list[int] = []  # rounds that reached every store, in order (tests, benches)
        self._thread = threading.Thread(target=self._run, name="checkpoint-upload", daemon=True)
        self._thread.start()

    def submit(self, round: int, path: Path) -> None:
        """Queue the local round directory `path` (already verified); replaces a round not yet started."""
        with self._cond:
            if self._next is not None:
                self._emit("checkpoint_upload_skipped",
                           f"round {self._next[0]} not uploaded: round {round} finished before its upload began",
                           {"round": self._next[0], "newer": round})
            self._next = (round, Path(path))
            self._cond.notify_all()

    def busy(self) -> set[int]:
        """Rounds waiting or going up: their local directories must stay."""
        with self._cond:
            return {r for r in (self._current, self._next[0] if self._next else None) if r is not None}

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until nothing is waiting or going up; False if `timeout_s` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._next is not None or self._current is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float | None = None) -> None:
        """Finish what is queued (up to `timeout_s`), then stop the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=1.0)

    def _emit(self, kind: str, message: str, detail: dict) -> None:
        if self.on_event is not None:
            self.on_event(kind, message, detail)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._next is None and not self._closed:
                    self._cond.wait()
                if self._next is None:
                    return
                (round, path), self._next = self._next, None
                self._current = round
            try:
                self._upload(round, path)
            finally:
                with self._cond:
                    self._current = None
                    self._cond.notify_all()

    def _upload(self, round: int, path: Path) -> None:
        ok = True
        for store in self.stores:
            t0 = time.monotonic()
            try:
                sent = store_rounds.upload_round(store, self.site, round, path)
                seconds = time.monotonic() - t0
                gone = store_rounds.prune(store, self.site, self.keep, protect={round}, newest=round)
                self._emit("checkpoint_uploaded", f"round {round} uploaded to {store.url} "
                           f"({sent / 1e6:.1f} MB in {seconds:.2f} s)",
                           {"round": round, "store": store.url, "bytes": sent, "seconds": round_s(seconds),
                            "pruned": gone})
            except (StoreError, OSError, ValueError, KeyError) as e:
                ok = False
                text = (str(e) or type(e).__name__).splitlines()[0]
                self._emit("checkpoint_upload_failed", f"round {round} not uploaded to {store.url}: {text}",
                           {"round": round, "store": store.url, "why": text})
        if ok:
            self.uploaded.append(round)


def round_s(seconds: float) -> float:
    return float(f"{seconds:.3f}")

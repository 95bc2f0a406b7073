"""The collective interface the outer exchange runs over, and in-process implementations of it.

`Comm` is what `trainer.codecs.compression.Compressor.average` needs: a group of `size` members (the
sites in the quorum) that all make the same calls in the same order with same-shaped tensors.
The distributed implementation (torchft's cross-site process group) lives with the trainer;
`ThreadComm` simulates K sites as K threads of one process (tests, single-process simulation),
`SoloComm` is the group of one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


class Comm(Protocol):
    size: int  # processes in the group (sites in the quorum)
    rank: int  # this member's place in the group, 0 <= rank < size

    def allreduce_sum(self, t: Tensor) -> None:
        """Sum `t` (fp32) over the group, in place; every member ends with the same values."""

    def allgather(self, t: Tensor) -> list[Tensor]:
        """Every member's `t` (same shape and dtype everywhere), ordered by rank."""

    def alltoall(self, t: Tensor) -> Tensor:
        """`t` (1-D, `size` equal parts) scattered: part j goes to member j; returns what this
        member received, the part from member i at position i."""


class SoloComm:
    """A group of one: nothing crosses a wire."""

    size = 1
    rank = 0

    def allreduce_sum(self, t: Tensor) -> None:
        pass

    def allgather(self, t: Tensor) -> list[Tensor]:
        return [t.detach().clone()]

    def alltoall(self, t: Tensor) -> Tensor:
        return t.detach().clone()


class _Room:
    """What the members of one ThreadComm group share: slots and a generation-counting barrier.

    threading.Barrier is not used: its abort() also fails a member that the last arrival had
    already released but that had not yet woken up, i.e. a collective that completed.
    """

    def __init__(self, k: int, timeout_s: float):
        self.k = k
        self.timeout_s = timeout_s
        self.slots: list[Tensor | None] = [None] * k
        self._cond = threading.Condition()
        self._arrived = 0
        self._generation = 0
        self._broken = False

    def wait(self) -> None:
        with self._cond:
            if self._broken:
                raise threading.BrokenBarrierError
            gen = self._generation
            self._arrived += 1
            if self._arrived == self.k:
                self._arrived = 0
                self._generation += 1
                self._cond.notify_all()
                return
            self._cond.wait_for(lambda: self._generation != gen or self._broken, self.timeout_s)
            if self._generation != gen:
                return
            self._broken = True  # timed out or aborted: nobody may pass this group again
            self._cond.notify_all()
            raise threading.BrokenBarrierError

    def abort(self) -> None:
        with self._cond:
            self._broken = True
            self._cond.notify_all()


class ThreadComm:
    """One member of a group of K simulated sites, each site running in its own thread.

    Sums are done in rank order by every member, so all members get bitwise equal results and a
    run is reproducible. A member that fails should call `abort()` (`run_sites` does) so the
    others raise `threading.BrokenBarrierError` instead of waiting for the timeout.
    """

    def __init__(self, room: _Room, rank: int, size: int):
        self._room = room
        self.rank = rank
        self.size = size

    @classmethod
    def group(cls, k: int, timeout_s: float = 60.0) -> list[ThreadComm]:
        """K members sharing one room; hand member i to the thread that plays site i."""
        if k < 1:
            raise ValueError(f"a ThreadComm group needs k >= 1 members, got {k}")
        room = _Room(k, timeout_s)
        return [cls(room, i, k) for i in range(k)]

    def abort(self) -> None:
        """Break the group: members waiting in (or entering) a collective raise BrokenBarrierError."""
        self._room.abort()

    def _exchange(self, t: Tensor) -> list[Tensor]:
        room = self._room
        room.slots[self.rank] = t.detach().clone()
        room.wait()
        slots: list[Tensor] = list(room.slots)  # type: ignore[arg-type]
        # nobody refills a slot for the next collective before everyone has taken this one's
        room.wait()
        first = slots[0]
        for r, s in enumerate(slots):
            if s.shape != first.shape or s.dtype != first.dtype:
                raise ValueError(f"collective mismatch: rank 0 sent {tuple(first.shape)} {first.dtype}, "
                                 f"rank {r} sent {tuple(s.shape)} {s.dtype}")
        return slots

    def allreduce_sum(self, t: Tensor) -> None:
        slots = self._exchange(t)
        acc = slots[0].clone()
        for s in slots[1:]:
            acc += s
        t.copy_(acc)

    def allgather(self, t: Tensor) -> list[Tensor]:
        # each member gets its own copies: the caller may write into what it receives
        return [s.clone() for s in self._exchange(t)]

    def alltoall(self, t: Tensor) -> Tensor:
        slots = self._exchange(t)
        return torch.cat([s.view(self.size, -1)[self.rank] for s in slots])


def run_sites(comms: Sequence[Any], fn: Callable[[int, Any], T]) -> list[T]:
    """Run fn(rank, comm) for every member in its own thread; results in rank order.

    The first exception raised by any site is re-raised here (after the group is aborted, so
    no thread is left waiting in a collective). `comms` are ThreadComm members, or wrappers of
    them that pass `abort()` on.
    """
    results: list[Any] = [None] * len(comms)
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def body(rank: int, comm: ThreadComm) -> None:
        try:
            results[rank] = fn(rank, comm)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            with lock:
                errors.append((rank, e))
            comm.abort()

    threads = [threading.Thread(target=body, args=(i, c), name=f"site{i}") for i, c in enumerate(comms)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        # the original failure, not the BrokenBarrierError it caused elsewhere
        errors.sort(key=lambda re: isinstance(re[1], threading.BrokenBarrierError))
        raise errors[0][1]
    return results


__all__ = ["Comm", "SoloComm", "ThreadComm", "run_sites"]

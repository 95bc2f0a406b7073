"""Issue 34, finding 7: in-site object collectives never unpickle, and why it matters (the store's bind).

Two gloo processes on loopback (torch.multiprocessing) run trainer.jsonwire's broadcast and gather and
async mode's `_broadcast_obj` with pickle made to raise; a control shows torch's own
broadcast_object_list trips that trap, so the trap would have caught a pickle.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.ports import free_port


def _listening(port: int) -> list[str]:
    """Local addresses of the sockets listening on `port` (hex as /proc/net/tcp{,6} writes them)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.split(":")[1], 16) == port:
                found.append(local.split(":")[0])
    return found


def test_tcpstore_listens_on_every_interface_even_when_given_loopback():
    # torchrun's agent makes exactly this store (c10d rendezvous, is_master on the leader): the claim
    # of the issue holds, so what crosses the process group must not be a pickle.
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    addrs = _listening(store.port)
    assert addrs, "no listening socket found for the store"
    assert all(set(a) == {"0"} for a in addrs), addrs  # 0.0.0.0 or [::]: every interface
    del store


def _no_pickle() -> None:
    def trap(*_a, **_k):
        raise AssertionError("pickle used")

    import torch.distributed.distributed_c10d as c10d

    pickle.loads = trap  # type: ignore[assignment]
    pickle.load = trap  # type: ignore[assignment]
    c10d._unpickler = trap  # what broadcast_object_list / gather_object unpickle with


VALUE = {"round": 7, "why": "", 3: (1.5, float("inf")), "b": b"\x00\xff", "arr": np.arange(4, dtype=np.uint32),
         "rejected": ("site-a",), "none": None, "nested": [[1, 2], {"k": True}]}


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from trainer import jsonwire
        from trainer.modes.async_mode import _broadcast_obj, _result_from_wire, _result_to_wire
        from trainer.modes.exchange import ExchangeResult

        _no_pickle()
        got = jsonwire.broadcast(VALUE if rank == 0 else None, src=0)
        gathered = jsonwire.gather({"rank": rank, "pad": "x" * (100 * rank)}, dst=0)
        res = ExchangeResult(committed=True, k_active=2, rejected=("b",), h_next=None, outer_lr=0.35)
        box = _broadcast_obj((5, _result_to_wire(res), 1.0, "") if rank == 0 else None, 2)
        control = ""
        try:
            dist.broadcast_object_list([{"x": 1}], src=0)
        except AssertionError as e:  # the trap fires on the receiving side
            control = str(e)
        summary = {
            "same": bool(got["round"] == 7 and got[3] == (1.5, float("inf")) and got["b"] == b"\x00\xff"
                         and np.array_equal(got["arr"], VALUE["arr"]) and got["arr"].dtype == np.uint32
                         and got["rejected"] == ("site-a",) and got["nested"] == [[1, 2], {"k": True}]),
            "gathered": gathered,
            "result": repr(_result_from_wire(box[1])) if box[0] == 5 else "",
            "control": control,
        }
        torch.save(summary, f"{out}.{rank}")
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without tearing gloo down: its teardown aborted a process twice on CI ("terminate called
    # without an active exception", even after a barrier), a torch/gloo race this test is not about.
    os._exit(0)


def test_json_collectives_round_trip_over_gloo_without_pickle(tmp_path: Path):
    from trainer.modes.exchange import ExchangeResult

    out = str(tmp_path / "res")
    mp.start_processes(_worker, args=(free_port(), out), nprocs=2, join=True, start_method="spawn")
    res = [torch.load(f"{out}.{r}", weights_only=True) for r in (0, 1)]
    assert res[0]["same"] and res[1]["same"]
    assert res[0]["gathered"] == [{"rank": 0, "pad": ""}, {"rank": 1, "pad": "x" * 100}]
    assert res[1]["gathered"] is None
    want = repr(ExchangeResult(committed=True, k_active=2, rejected=("b",), h_next=None, outer_lr=0.35))
    assert res[0]["result"] == res[1]["result"] == want
    assert res[1]["control"] == "pickle used"  # torch's object collective would have unpickled


def test_announced_size_over_the_cap_is_refused():
    from trainer import jsonwire

    with pytest.raises(jsonwire.WireError, match="announced"):
        jsonwire._checked_len(jsonwire.MAX_BYTES + 1)

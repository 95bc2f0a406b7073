import threading
import time

import pytest
import torch

from trainer.collectives import SoloComm, ThreadComm, run_sites


def test_allreduce_sums_in_site_order_and_every_site_gets_the_same_bits():
    # 1e8 + 1 - 1e8 is 0 in fp32 when summed left to right, 1 in another order
    values = [torch.tensor([1e8, 0.5]), torch.tensor([1.0, 0.25]), torch.tensor([-1e8, 0.125])]
    comms = ThreadComm.group(3)

    def site(rank, comm):
        t = values[rank].clone()
        comm.allreduce_sum(t)
        return t

    out = run_sites(comms, site)
    expected = (values[0] + values[1]) + values[2]
    for t in out:
        assert torch.equal(t, expected)
    assert out[0].tolist() == [0.0, 0.875]


def test_allgather_is_ordered_by_rank_and_returns_private_copies():
    comms = ThreadComm.group(4)

    def site(rank, comm):
        got = comm.allgather(torch.full((2, 3), float(rank), dtype=torch.float32))
        got[0].fill_(-1.0)  # must not leak into another site's copy
        comm.allreduce_sum(torch.zeros(1))  # a second collective: nobody reads before all wrote
        return [float(g[1, 2]) for g in got[1:]], got[0]

    out = run_sites(comms, site)
    for rest, first in out:
        assert rest == [1.0, 2.0, 3.0]
        assert bool((first == -1.0).all())


def test_allgather_of_bytes_keeps_dtype():
    comms = ThreadComm.group(2)
    out = run_sites(comms, lambda r, c: c.allgather(torch.arange(5, dtype=torch.uint8) + r))
    assert out[1][1].dtype == torch.uint8
    assert out[1][1].tolist() == [1, 2, 3, 4, 5]


def test_mismatched_shapes_fail_at_every_site():
    comms = ThreadComm.group(2)
    failures = []

    def site(rank, comm):
        try:
            comm.allgather(torch.zeros(3 + rank))
        except ValueError as e:
            failures.append(str(e))
            raise

    with pytest.raises(ValueError, match="collective mismatch"):
        run_sites(comms, site)
    assert len(failures) == 2


def test_a_failing_site_releases_the_others_quickly():
    comms = ThreadComm.group(3, timeout_s=60.0)

    def site(rank, comm):
        if rank == 1:
            raise RuntimeError("site 1 broke")
        comm.allreduce_sum(torch.ones(2))

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="site 1 broke"):
        run_sites(comms, site)
    assert time.monotonic() - t0 < 5.0


def test_barrier_timeout_when_a_site_never_calls():
    comms = ThreadComm.group(2, timeout_s=0.2)
    with pytest.raises(threading.BrokenBarrierError):
        comms[0].allreduce_sum(torch.ones(1))


def test_solo_comm_is_a_group_of_one():
    c = SoloComm()
    t = torch.tensor([1.5, -2.0])
    c.allreduce_sum(t)
    assert c.size == 1 and t.tolist() == [1.5, -2.0]
    got = c.allgather(t)
    got[0].zero_()
    assert len(got) == 1 and t.tolist() == [1.5, -2.0]


def test_group_needs_members():
    with pytest.raises(ValueError, match="k >= 1"):
        ThreadComm.group(0)

"""diloco.fragments on two torchrun sites through torchft: every fragment's exchange, equal to the simulator."""

from __future__ import annotations

import pytest
import torch

from tests.integration.dist_helpers import start_site, tiny_config
from tests.integration.test_trainer_dist import final_params, lighthouse2, records, wait_all  # noqa: F401 (fixture)
from trainer.codec_spec import payload_bytes
from trainer.fragments import split
from trainer.simulate import simulate

pytestmark = pytest.mark.slow


def test_two_sites_with_two_fragments_equal_the_simulator(tmp_path, lighthouse2):  # noqa: F811
    knobs = {"diloco.min_sites": 2, "diloco.compression": "int8", "diloco.fragments": 2, "diloco.h": 4}
    cfgs = [tiny_config(tmp_path, i, **knobs) for i in range(2)]
    procs = [start_site(c, lighthouse2, tmp_path / f"site{i}.log") for i, c in enumerate(cfgs)]
    codes = wait_all(procs, 240)
    assert codes == [0, 0], [(tmp_path / f"site{i}.log").read_text()[-3000:] for i in range(2)]

    sim = simulate(cfgs[0])
    shapes = [tuple(p.shape) for p in sim.params]
    per = [payload_bytes("int8", [shapes[i] for i in idx], cfgs[0].diloco.codec_options())
           for idx in split([p.numel() for p in sim.params], 2)]
    site0, site1 = final_params(tmp_path, "site0"), final_params(tmp_path, "site1")
    for a, b, s in zip(site0, site1, sim.params, strict=True):
        assert torch.equal(a, b)  # both sites end on the same θ, bit for bit
        torch.testing.assert_close(a, s, rtol=1e-5, atol=1e-7)
    for site in ("site0", "site1"):
        rounds = records(tmp_path, site, "round")
        assert [r.round for r in rounds] == [1, 2, 3]
        assert all(r.k_active == 2 and r.committed for r in rounds)
        assert [r.bytes_sent for r in rounds] == [r.bytes_sent for r in sim.rounds]
        assert all(r.bytes_sent == sum(per) for r in rounds)  # two exchanges a round, one per fragment
        assert rounds[-1].val_ppl == pytest.approx(sim.rounds[-1].val_ppl, rel=1e-4)
        assert all(r.quorum_s > 0 and r.payload_s > 0 for r in rounds)
        start = next(e for e in records(tmp_path, site, "event") if e.event == "start")
        assert start.detail["fragment_payload_bytes"] == per and start.detail["payload_bytes"] == sum(per)
    assert max(per) < 0.6 * sum(per)  # the peak of an exchange: one fragment's
    assert all(r.peak_bytes == max(per) for r in sim.rounds)

"""Streaming DiLoCo's fragments: the split, the schedule, the config's refusals."""

import pytest
import torch

from trainer.model import Transformer
from trainer.rules.config import from_dict
from trainer.rules.fragments import due, offsets, split
from trainer.rules.model_config import ModelConfig, param_tensors
from trainer.rules.tables import ConfigError
from trainer.simulate import main as sim_main
from trainer.simulate import simulate


def sizes(preset: str, **model) -> list[int]:
    return [p.numel() for p in Transformer(ModelConfig(preset=preset, **model)).parameters()]


@pytest.mark.parametrize("preset,model", [("tiny", {}), ("small", {}), ("tiny", {"tie_embeddings": True}),
                                          ("tiny", {"n_layers": 5})])
def test_param_tensors_counts_what_the_model_builds(preset, model):
    assert param_tensors(ModelConfig(preset=preset, **model)) == len(sizes(preset, **model))


def test_one_fragment_is_everything():
    assert split([5, 1, 7], 1) == [[0, 1, 2]]


def test_fragments_are_nonempty_and_hold_every_parameter_once():
    ns = sizes("small")
    for f in range(1, len(ns) + 1):
        parts = split(ns, f)
        assert len(parts) == f and all(len(p) > 0 for p in parts)
        assert sorted(i for p in parts for i in p) == list(range(len(ns)))
        assert all(p == sorted(p) for p in parts) and [p[0] for p in parts] == sorted(p[0] for p in parts)
    assert split([0, 0, 0, 5], 3) == [[0, 2], [1], [3]]  # size-0 tensors still fill an empty fragment


@pytest.mark.parametrize("preset,model,bounds", [
    ("small", {}, ((2, 0.5001), (4, 0.2501), (8, 0.128))),
    # a contiguous cut of tiny peaked at 27.8% of 4: its embedding and head are an eighth each
    ("tiny", {}, ((2, 0.501), (4, 0.2535), (8, 0.131))),
])
def test_the_split_is_balanced_by_numel(preset, model, bounds):
    ns = sizes(preset, **model)
    total = sum(ns)
    for f, peak in bounds:
        assert max(sum(ns[i] for i in p) for p in split(ns, f)) / total < peak
    assert split([4, 4, 4, 4], 2) == [[0, 2], [1, 3]]
    assert split([9, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert split([5, 4, 3, 3, 3], 2) == [[0, 1], [2, 3, 4]]  # largest-first alone gives 5+3 | 4+3+3: a swap evens it


def test_the_split_is_deterministic():
    ns = sizes("tiny")
    assert split(ns, 4) == split(list(ns), 4)
    assert split(ns, 4) == [[0, 3, 12, 17], [1, 2, 7, 9, 10, 11, 19], [4, 13, 18, 20], [5, 6, 8, 14, 15, 16]]


@pytest.mark.parametrize("f", [0, -1, 4])
def test_split_refuses_a_count_out_of_range(f):
    with pytest.raises(ValueError, match="fragments"):
        split([1, 2, 3], f)


def test_offsets_spread_the_exchanges_over_the_round():
    assert offsets(50, 1) == [50]
    assert offsets(50, 4) == [12, 25, 37, 50]
    assert offsets(4, 4) == [1, 2, 3, 4]
    assert offsets(3, 4) == [1, 1, 2, 3]  # a round cut short at the run's end: two after step 1
    assert due(25, 50, 4) == [1] and due(24, 50, 4) == [] and due(50, 50, 4) == [3]
    assert due(1, 3, 4) == [0, 1]
    with pytest.raises(ValueError):
        offsets(0, 2)


def cfg(**diloco):
    return from_dict({"model": {"preset": "tiny"}, "diloco": {"h": 8, **diloco}})


def test_fragments_default_to_one_and_accept_a_good_count():
    assert cfg().diloco.fragments == 1
    assert cfg(fragments=4, mode="overlap").diloco.fragments == 4
    assert cfg(fragments=8).diloco.fragments == 8  # as many as H


@pytest.mark.parametrize("diloco,why", [
    ({"fragments": 0}, "must be >= 1"),
    ({"fragments": -2}, "must be >= 1"),
    ({"fragments": 22, "h": 100}, "21 parameter tensors"),
    ({"fragments": 9}, "H = 8"),
    ({"fragments": 2, "mode": "async"}, "lockstep"),
    ({"fragments": 2, "algorithm": "ddp"}, "lockstep"),
    ({"fragments": 2, "h": "auto"}, "'auto'"),
])
def test_config_refuses_fragments_it_cannot_run(diloco, why):
    with pytest.raises(ConfigError, match=why) as e:
        cfg(**diloco)
    assert "diloco.fragments: " in str(e.value) and "\n" not in str(e.value)


def test_config_refuses_fragments_under_pipeline_stages():
    with pytest.raises(ConfigError, match="pipeline"):
        from_dict({"model": {"preset": "tiny"}, "diloco": {"h": 8, "fragments": 2}, "parallel": {"pp": 2}})


# -- the simulator ------------------------------------------------------------------------------------

def sim_cfg(mode: str = "sync", rounds: int = 2, **diloco):
    return from_dict({
        "model": {"preset": "tiny"},
        "data": {"seq_len": 16, "batch_size": 2},
        "train": {"threads": 1, "eval_every": 0, "eval_batches": 1, "warmup_steps": 1},
        "diloco": {"sites": 2, "h": 2, "rounds": rounds, "mode": mode, "outer_lr": 0.7, "outer_momentum": 0.9,
                   **diloco},
    })


def test_one_fragment_gives_the_numbers_of_before_fragments():
    # val ppl of these two runs before diloco.fragments existed (trainer/simulate.py at 047f2a4)
    assert simulate(sim_cfg("sync", fragments=1)).rounds[-1].val_ppl == 135.41043336223498
    assert simulate(sim_cfg("overlap")).rounds[-1].val_ppl == 138.86545783300812


def test_fragments_cut_the_peak_bytes_of_an_exchange():
    one = simulate(sim_cfg(h=4, compression="int8"))
    four = simulate(sim_cfg(h=4, compression="int8", fragments=4))
    for a, b in zip(one.rounds, four.rounds, strict=True):
        assert a.peak_bytes == a.bytes_sent
        assert b.peak_bytes < 0.3 * a.peak_bytes  # the largest fragment is 28% of tiny's parameters
        assert abs(b.bytes_sent - a.bytes_sent) < 0.001 * a.bytes_sent  # a few scale bytes more, in all
    over = simulate(sim_cfg("overlap", h=4, fragments=4, compression="int8"))
    assert [r.peak_bytes for r in over.rounds] == [r.peak_bytes for r in four.rounds]


def test_a_fragment_is_averaged_right_after_its_offset():
    """Plain averaging, fragments 2 of a round of 2: fragment 0 is the sites' mean after inner step 1,
    exactly as a run of one step per round; fragment 1 moved on from there."""
    plain = {"outer_lr": 1.0, "outer_momentum": 0.0}
    cfg = sim_cfg(rounds=1, fragments=2, **plain)
    cfg.train.schedule = "constant"
    two = simulate(cfg)
    cfg1 = sim_cfg(rounds=1, h=1, **plain)
    cfg1.train.schedule = "constant"
    one_step = simulate(cfg1)
    frag0 = split([p.numel() for p in two.params], 2)[0]
    assert all(torch.equal(two.params[i], one_step.params[i]) for i in frag0)
    assert not any(torch.equal(two.params[i], one_step.params[i]) for i in set(range(len(two.params))) - set(frag0))


def test_a_fragments_outer_step_moves_only_its_parameters_and_momentum():
    from trainer.outer.optimizer import OuterState

    d = sim_cfg().diloco
    outer = OuterState([torch.zeros(3), torch.zeros(2)], d)
    outer.step([torch.ones(3), torch.ones(2)], 2)
    before = [p.detach().clone() for p in outer.params]
    mom = outer.opt.state[outer.params[1]]["momentum_buffer"].clone()
    outer.step([torch.ones(3)], 2, only=[0])
    assert not torch.equal(outer.params[0], before[0])
    assert torch.equal(outer.params[1], before[1])
    assert torch.equal(outer.opt.state[outer.params[1]]["momentum_buffer"], mom)
    local = [torch.full((3,), 5.0), torch.full((2,), 5.0)]
    outer.copy_to(local, only=[1])
    assert torch.equal(local[1], outer.params[1]) and torch.equal(local[0], torch.full((3,), 5.0))
    assert [t.shape for t in outer.deltas(local, only=[1])] == [(2,)]


def test_every_mode_with_fragments_is_deterministic_and_ends_on_theta():
    for mode in ("sync", "overlap"):
        a, b = simulate(sim_cfg(mode, h=4, fragments=3)), simulate(sim_cfg(mode, h=4, fragments=3))
        assert all(torch.equal(x, y) for x, y in zip(a.params, b.params, strict=True))
        assert a.rounds[-1].val_ppl == b.rounds[-1].val_ppl and a.rounds[-1].val_ppl < 256


def test_cli_refuses_bad_fragments(capsys):
    assert sim_main(["--preset", "tiny", "--fragments", "0"]) == 2
    assert "diloco.fragments" in capsys.readouterr().err
    assert sim_main(["--preset", "tiny", "--h", "4", "--fragments", "5"]) == 2
    assert sim_main(["--preset", "tiny", "--mode", "async", "--fragments", "2"]) == 2


def test_a_rounds_result_sums_its_fragments_exchanges():
    from trainer.modes.exchange import ExchangeResult
    from trainer.modes.ft_exchange import merged

    a = ExchangeResult(sync_s=1.0, k_active=2, committed=True, applied=True, outer_lr=0.5, bytes_sent=10, bytes_recv=20,
                       exchange_bytes=(10,), h_next=8, rejected=("s1",), exchange_t=5.0, quorum_s=0.1, weight_s=0.2,
                       payload_s=0.3)
    b = ExchangeResult(sync_s=2.0, k_active=1, committed=False, applied=False, outer_lr=0.7, bytes_sent=30,
                       bytes_recv=40, exchange_bytes=(30,), h_next=8, rejected=("s1", "s2"), exchange_t=9.0,
                       quorum_s=0.1, weight_s=0.2, payload_s=0.3)
    m = merged([a, b])
    assert (m.sync_s, m.k_active, m.committed, m.applied, m.outer_lr) == (3.0, 1, False, True, 0.7)
    assert (m.bytes_sent, m.bytes_recv, m.exchange_bytes, m.rejected, m.exchange_t) == (40, 60, (10, 30), ("s1", "s2"), 5.0)
    assert m.quorum_s == pytest.approx(0.2) and m.payload_s == pytest.approx(0.6)
    assert merged([]) == ExchangeResult()

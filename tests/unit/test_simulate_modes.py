"""The simulator in every mode: deterministic, overlap one round late, async staleness from site speeds."""

import pytest
import torch

from trainer.rules.config import from_dict
from trainer.simulate import arrival_order, main, simulate


def tiny(mode: str = "sync", rounds: int = 2, steps: int = 0, **diloco) -> object:
    return from_dict({
        "model": {"preset": "tiny"},
        "data": {"seq_len": 16, "batch_size": 2},
        "train": {"threads": 1, "eval_every": 0, "eval_batches": 1, "warmup_steps": 1, "steps": steps},
        "diloco": {"sites": 2, "h": 2, "rounds": rounds, "mode": mode, "outer_lr": 0.7, "outer_momentum": 0.9,
                   **diloco},
    })


def test_arrival_order_follows_the_speed_ratios():
    assert arrival_order([1, 1], 2) == [0, 1, 0, 1]  # equal times: the lower index first
    # site 1 twice as fast: pushes at 0.5, 1, 1.5 against site 0's 1, 2, 3
    assert arrival_order([1, 2], 3) == [1, 0, 1, 1, 0, 0]
    # times: site 0 at 1/3, 2/3; site 1 at 1, 2; site 2 at 2/3, 4/3
    assert arrival_order([3, 1, 1.5], 2) == [0, 0, 2, 1, 2, 1]
    for bad in ([], [1, 0], [1, float("nan")], [1, -2], [float("inf")]):
        with pytest.raises(ValueError, match="site speeds must be finite and > 0"):
            arrival_order(bad, 2)


def test_async_staleness_follows_from_the_arrival_pattern():
    # taking turns (diloco.async_turns): every push waited for, the site continues from θ as it left it
    res = simulate(tiny("async", rounds=2, async_turns=True), speeds=[1, 2])
    assert [r.site for r in res.rounds] == [0, 1, 0, 1]  # site order, whatever the speeds
    assert [r.staleness for r in res.rounds] == [0, 1, 1, 1]  # every later push one version behind
    # overlap_land = 1: the update lands just before the site's next push; order [1, 0, 1, 1, 0, 0]
    res = simulate(tiny("async", rounds=3, overlap_land=1.0), speeds=[1, 2])
    assert [r.site for r in res.rounds] == [1, 0, 1, 1, 0, 0]
    # a push's γ = versions applied since the θ its site rebased on: site 0's first push missed site 1's
    assert [r.staleness for r in res.rounds] == [0, 1, 0, 0, 0, 0]
    assert [r.round for r in res.rounds] == [1, 1, 2, 3, 2, 3]  # each site's own round count
    assert res.rounds[-1].val_ppl is not None


def test_async_site_pulls_again_inside_its_round():
    # the default: land_step(2, 0.1) = 1 step into each round the site pulls θ and rebases on it if it
    # moved; its push is then based on that version. Site 0's pull at t = 1.5 sees site 1's push at
    # t = 1, so its push at t = 2 is one version old, not two (pulls at (j − 1/2) / speed)
    res = simulate(tiny("async", rounds=3), speeds=[1, 2])
    assert [r.site for r in res.rounds] == [1, 0, 1, 1, 0, 0]
    assert [r.staleness for r in res.rounds] == [0, 1, 1, 0, 1, 0]
    even = simulate(tiny("async", rounds=2))
    assert [r.staleness for r in even.rounds] == [0, 1, 0, 1]  # site 0's second round took in site 1's first
    late = simulate(tiny("async", rounds=2, overlap_land=1.0))
    assert any(not torch.equal(a, b) for a, b in zip(even.params, late.params, strict=True))
    # nothing to take in before the first push: one round is the same with or without the pull
    one, one_late = simulate(tiny("async", rounds=1)), simulate(tiny("async", rounds=1, overlap_land=1.0))
    assert all(torch.equal(a, b) for a, b in zip(one.params, one_late.params, strict=True))


def test_every_mode_is_deterministic():
    for mode in ("sync", "overlap", "async"):
        a, b = simulate(tiny(mode)), simulate(tiny(mode))
        assert all(torch.equal(x, y) for x, y in zip(a.params, b.params, strict=True)), mode
        assert [r.train_loss for r in a.rounds] == [r.train_loss for r in b.rounds]
    a, b = simulate(tiny(algorithm="ddp")), simulate(tiny(algorithm="ddp"))
    assert all(torch.equal(x, y) for x, y in zip(a.params, b.params, strict=True))


def test_overlap_lands_one_round_late():
    # one round: the only update lands at the end, as in sync
    one_sync, one_over = simulate(tiny("sync", rounds=1)), simulate(tiny("overlap", rounds=1))
    assert all(torch.equal(x, y) for x, y in zip(one_sync.params, one_over.params, strict=True))
    over = simulate(tiny("overlap", rounds=3))
    assert [r.staleness for r in over.rounds] == [0, 1, 1]
    sync = simulate(tiny("sync", rounds=3))
    assert any(not torch.equal(x, y) for x, y in zip(sync.params, over.params, strict=True))


def test_overlap_with_plain_averaging_holds_round_1_back_until_round_2_is_done():
    # outer lr 1, no momentum. Round 1's average is still in flight at the end of round 2, so the
    # sites never saw it: both rounds are their own 2H steps from θ_0, and θ_final = θ_0 − Δ̄_1 − Δ̄_2
    # is the plain average of those, which is sync with one round of 2H steps
    plain = {"outer_lr": 1.0, "outer_momentum": 0.0}
    over = simulate(tiny("overlap", rounds=2, overlap_land=1.0, **plain))
    sync = simulate(tiny("sync", rounds=1, h=4, **plain))
    for a, b in zip(over.params, sync.params, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert any(not torch.equal(a, b) for a, b in zip(simulate(tiny("sync", rounds=2, **plain)).params,
                                                      over.params, strict=True))


def test_async_at_equal_speeds_with_delayed_nesterov_and_no_dampening_is_overlap():
    # equal speeds: both sites push on the same θ and land the newest one at the same step as
    # overlap does; one Nesterov step per K pushes (async_momentum "delayed") and α = 0 then make
    # the K pushes one synchronous round, so what async's defaults add over overlap is exactly the
    # per-push momentum and the second pusher's dampening (BENCHMARKS.md, issue 16)
    over = simulate(tiny("overlap", rounds=3, h=4))
    same = simulate(tiny("async", rounds=3, h=4, async_momentum="delayed", async_alpha=0.0))
    for a, b in zip(over.params, same.params, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    for other in ({"async_alpha": 0.0}, {"async_momentum": "delayed", "async_alpha": 0.5}):
        diff = simulate(tiny("async", rounds=3, h=4, **other))
        assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(over.params, diff.params, strict=True))


def test_cli_refuses_bad_speeds(capsys):
    assert main(["--preset", "tiny", "--mode", "async", "--speeds", "1,nan"]) == 2
    assert "site speeds must be finite and > 0" in capsys.readouterr().err
    assert main(["--preset", "tiny", "--mode", "async", "--speeds", "1,2,3"]) == 2
    assert "3 speeds for 2 sites" in capsys.readouterr().err


def test_overlap_mix_reaches_the_rebase():
    # round 1 sends, round 2 rebases: with a mixing factor the sites keep part of their own parameters
    plain, mixed = simulate(tiny("overlap", rounds=3)), simulate(tiny("overlap", rounds=3, overlap_mix=0.5))
    assert any(not torch.equal(a, b) for a, b in zip(plain.params, mixed.params, strict=True))
    two = simulate(tiny("overlap", rounds=1, overlap_mix=0.5))  # no rebase in a one-round run
    assert all(torch.equal(a, b) for a, b in zip(two.params, simulate(tiny("overlap", rounds=1)).params, strict=True))


def test_overlap_update_can_land_inside_the_next_round():
    from trainer.rules.outer_rule import UNTUNED_LAND, land_step

    assert [land_step(100, f) for f in (1.0, 0.1, 0.15, 0.001)] == [100, 10, 15, 1]
    assert (land_step(20, 0.1), land_step(500, 0.1), land_step(3, 0.5)) == (2, 50, 2)
    assert UNTUNED_LAND == {"overlap": 0.05, "async": 0.1}  # unset, without a tune: 1 step of 20
    default = simulate(tiny("overlap", rounds=2, h=20))
    same = simulate(tiny("overlap", rounds=2, h=20, overlap_land=0.05))
    tenth = simulate(tiny("overlap", rounds=2, h=20, overlap_land=0.1))
    assert all(torch.equal(a, b) for a, b in zip(default.params, same.params, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(default.params, tenth.params, strict=True))
    with pytest.raises(ValueError, match="diloco.overlap_land: must be in"):
        tiny("overlap", overlap_land=0.0)
    # async's own default: 2 steps of 20
    default = simulate(tiny("async", rounds=2, h=20))
    tenth = simulate(tiny("async", rounds=2, h=20, overlap_land=0.1))
    early = simulate(tiny("async", rounds=2, h=20, overlap_land=0.05))
    assert all(torch.equal(a, b) for a, b in zip(default.params, tenth.params, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(default.params, early.params, strict=True))


@pytest.mark.parametrize("mode", ["sync", "overlap", "ddp"])
def test_train_steps_sizes_the_simulated_run_as_the_trainer_does(mode):
    # train.steps = 5 with H = 2: rounds of 2, 2 and 1 steps (the last cut to fit, trainer.rules.schedule.round_h),
    # whatever diloco.rounds says; the final val ppl is taken on the last, cut round
    extra = {"algorithm": "ddp"} if mode == "ddp" else {"mode": mode}
    res = simulate(tiny(rounds=10, steps=5, **extra))
    assert [r.round for r in res.rounds] == [1, 2, 3]
    assert res.rounds[-1].tokens == 2 * 5 * 2 * 16  # sites x steps x batch x seq_len
    assert res.rounds[-1].val_ppl is not None and res.rounds[1].val_ppl is None
    # train.steps = H x rounds is the same run as `rounds` rounds, to the bit
    by_steps, by_rounds = simulate(tiny(rounds=10, steps=4, **extra)), simulate(tiny(rounds=2, **extra))
    assert all(torch.equal(x, y) for x, y in zip(by_steps.params, by_rounds.params, strict=True))

"""Async push math (trainer.outer.optimizer.apply_push), overlap's rebase and the outer defaults, against hand-computed values."""

import pytest
import torch

from trainer.outer.optimizer import OuterState, apply_push, overlap_rebase
from trainer.rules.config import dump_toml, from_dict, load
from trainer.rules.diloco_config import DilocoConfig


def cfg(**kw) -> DilocoConfig:
    base = {"sites": 2, "outer_lr": 0.8, "outer_momentum": 0.5, "mode": "async", "async_alpha": 0.5}
    return DilocoConfig(**{**base, **kw})


def test_push_applies_dampened_nesterov_with_lr_over_k():
    outer = OuterState([torch.tensor([1.0, 2.0])], cfg())
    # γ = 0: ψ = 1, lr = 0.8/2 = 0.4; b = g = [1, 0]; θ -= 0.4 (g + 0.5 b) = 0.4 * [1.5, 0]
    s = apply_push(outer, [torch.tensor([1.0, 0.0])], 0)
    assert (s.scale, s.lr) == (1.0, pytest.approx(0.4))
    assert outer.params[0].tolist() == pytest.approx([0.4, 2.0])
    # γ = 2: ψ = 1/(1 + 0.5*2) = 0.5, g = [0, 1]; b = 0.5*[1, 0] + [0, 1] = [0.5, 1];
    # θ -= 0.4 (g + 0.5 b) = 0.4 * [0.25, 1.5]
    s = apply_push(outer, [torch.tensor([0.0, 2.0])], 2)
    assert s.scale == pytest.approx(0.5)
    assert outer.params[0].tolist() == pytest.approx([0.4 - 0.1, 2.0 - 0.6])
    # weight (the service's norm clip) multiplies the gradient like ψ does
    w = OuterState([torch.tensor([1.0])], cfg(outer_momentum=0.0))
    apply_push(w, [torch.tensor([1.0])], 1, weight=0.3)  # θ -= 0.4 * (2/3 * 0.3)
    assert w.params[0].item() == pytest.approx(1.0 - 0.4 * 0.2)


def test_delayed_nesterov_moves_momentum_once_per_round():
    c = cfg(async_momentum="delayed", outer_lr=0.7, outer_momentum=0.9, async_alpha=0.0)
    outer = OuterState([torch.tensor([0.0])], c)
    # push 1: plain step η/K g = 0.35 * 1; no momentum yet
    assert apply_push(outer, [torch.tensor([1.0])], 0).lr == pytest.approx(0.35)
    assert outer.params[0].item() == pytest.approx(-0.35)
    # push 2 closes the round: plain 0.35 * 3; m = (1 + 3)/2 = 2; θ -= 0.7 * 0.9 * 2
    apply_push(outer, [torch.tensor([3.0])], 1)
    assert outer.params[0].item() == pytest.approx(-0.35 - 1.05 - 1.26)
    # round 2, one push: 0.35 * 2; momentum waits for the second push
    apply_push(outer, [torch.tensor([2.0])], 1)
    assert outer.params[0].item() == pytest.approx(-2.66 - 0.7)
    # its state survives a checkpoint: the next push closes the round identically in both
    again = OuterState([torch.tensor([0.0])], c)
    again.load_state_dict(outer.state_dict())
    for o in (outer, again):
        apply_push(o, [torch.tensor([0.0])], 1)  # m = 0.9 * 2 + (2 + 0)/2 = 2.8; θ -= 0.63 * 2.8
    assert outer.params[0].item() == pytest.approx(-3.36 - 1.764)
    assert again.params[0].item() == outer.params[0].item()


def test_delayed_nesterov_equals_a_sync_round_when_pushes_share_their_base():
    c = cfg(async_momentum="delayed", outer_lr=0.7, outer_momentum=0.9, async_alpha=0.5)
    sync = OuterState([torch.tensor([1.0, -1.0])], cfg(outer_lr=0.7, outer_momentum=0.9, mode="sync"))
    push = OuterState([torch.tensor([1.0, -1.0])], c)
    for r in range(3):
        d1, d2 = torch.tensor([0.2, 0.1 * r]), torch.tensor([-0.1, 0.3])
        sync.step([(d1 + d2) / 2], 2)
        apply_push(push, [d1], 0)
        apply_push(push, [d2], 0)
        assert push.params[0].tolist() == pytest.approx(sync.params[0].tolist(), abs=1e-6)


def test_overlap_rebase_keeps_own_progress_and_mixes():
    local = [torch.tensor([5.0, 5.0])]
    overlap_rebase(local, [torch.tensor([1.0, 2.0])], [torch.tensor([0.5, -0.5])])
    assert local[0].tolist() == [0.5, 2.5]  # θ − own
    local = [torch.tensor([5.0, 5.0])]
    overlap_rebase(local, [torch.tensor([1.0, 2.0])], [torch.tensor([0.5, -0.5])], mix=0.25)
    assert local[0].tolist() == pytest.approx([0.75 * 0.5 + 0.25 * 5, 0.75 * 2.5 + 0.25 * 5])


def test_unset_outer_hparams_follow_the_rule_and_an_explicit_value_wins(tmp_path):
    from trainer.rules.outer_rule import default_outer_hparams, outer_hparams

    d = from_dict({"diloco": {"h": 100, "mode": "overlap"}}).diloco
    assert (d.outer_lr, d.outer_momentum) == (None, None)
    assert outer_hparams(d) == default_outer_hparams(100, "overlap")
    d = from_dict({"diloco": {"h": 100, "mode": "overlap", "outer_momentum": 0.3}}).diloco
    assert outer_hparams(d) == (default_outer_hparams(100, "overlap")[0], 0.3)
    assert outer_hparams(from_dict({"diloco": {"algorithm": "localsgd"}}).diloco) == (1.0, 0.0)
    # unset knobs are absent from the TOML the trainer is launched with, and read back unset
    p = tmp_path / "t.toml"
    p.write_text(dump_toml(from_dict({"diloco": {"h": 100}})))
    assert "outer_lr" not in p.read_text()
    assert load(p).diloco.outer_lr is None
    with pytest.raises(ValueError, match="diloco.outer_momentum: must be in"):
        from_dict({"diloco": {"outer_momentum": 1.0}})
    with pytest.raises(ValueError, match="diloco.overlap_mix: must be in"):
        from_dict({"diloco": {"overlap_mix": -0.1}})


def test_default_rule_is_the_measured_pair():
    from trainer.rules.outer_rule import default_outer_hparams

    # BENCHMARKS.md, quality of every sync mode: lr 0.7, momentum 0.5 below H = 500 and lr 1, momentum
    # 0.3 from there on, in every mode, except runs of at most 5 rounds, which average the sites (lr 1,
    # no momentum)
    for mode in ("sync", "overlap", "async"):
        for h, pair in ((1, (0.7, 0.5)), (20, (0.7, 0.5)), (499, (0.7, 0.5)), (500, (1.0, 0.3)), (5000, (1.0, 0.3))):
            assert default_outer_hparams(h, mode) == pair  # rounds not known
            for rounds in (6, 10, 50, 1000):
                assert default_outer_hparams(h, mode, rounds) == pair
            for rounds in (1, 2, 5):
                assert default_outer_hparams(h, mode, rounds) == (1.0, 0.0)
    with pytest.raises(ValueError, match="rounds must be >= 0"):
        default_outer_hparams(20, "sync", -1)
    with pytest.raises(ValueError, match="H must be > 0"):
        default_outer_hparams(0, "sync")
    with pytest.raises(ValueError, match="mode must be"):
        default_outer_hparams(20, "ddp")
    # what a spec that sets neither gets, through the trainer's OuterState: diloco.rounds counts,
    # or the rounds train.steps makes (trainer.rules.schedule.planned_rounds: 1000 steps of H 500 are 2)
    from trainer.rules.schedule import planned_rounds

    def pair(outer):
        return outer.opt.param_groups[0]["lr"], outer.opt.param_groups[0]["momentum"]

    cfg = from_dict({"diloco": {"h": 100, "mode": "async"}})  # 10 rounds
    assert pair(OuterState([torch.zeros(1)], cfg.diloco)) == (0.7, 0.5)
    # async: the same pair, and its staleness dampening off in a short run (α 0, else 0.5); explicit wins
    cfg = from_dict({"diloco": {"h": 100, "mode": "async", "rounds": 2}})
    short = OuterState([torch.zeros(1)], cfg.diloco)
    assert (pair(short), short.alpha) == ((1.0, 0.0), 0.0)
    assert apply_push(short, [torch.ones(1)], gamma=1).scale == 1.0
    cfg = from_dict({"diloco": {"h": 100, "mode": "async", "rounds": 6}})
    long = OuterState([torch.zeros(1)], cfg.diloco)
    assert (pair(long), long.alpha) == ((0.7, 0.5), 0.5)
    assert apply_push(long, [torch.ones(1)], gamma=1).scale == pytest.approx(2 / 3)
    cfg = from_dict({"diloco": {"h": 100, "mode": "async", "rounds": 2, "async_alpha": 0.25}})
    assert OuterState([torch.zeros(1)], cfg.diloco).alpha == 0.25
    from trainer.rules.outer_rule import default_async_alpha
    assert [default_async_alpha(r) for r in (0, 1, 5, 6, 50)] == [0.5, 0.0, 0.0, 0.5, 0.5]
    with pytest.raises(ValueError, match="rounds must be >= 0"):
        default_async_alpha(-1)
    cfg = from_dict({"diloco": {"h": 100, "rounds": 4}})
    assert pair(OuterState([torch.zeros(1)], cfg.diloco)) == (1.0, 0.0)
    cfg = from_dict({"diloco": {"h": 500, "rounds": 50}, "train": {"steps": 1000}})
    assert planned_rounds(cfg) == 2
    assert pair(OuterState([torch.zeros(1)], cfg.diloco, planned_rounds(cfg))) == (1.0, 0.0)
    cfg = from_dict({"diloco": {"h": 300, "rounds": 2}, "train": {"steps": 1900}})
    assert planned_rounds(cfg) == 7  # the last round is cut short, and counts
    assert pair(OuterState([torch.zeros(1)], cfg.diloco, planned_rounds(cfg))) == (0.7, 0.5)
    # an explicit value still wins in a short run
    cfg = from_dict({"diloco": {"h": 100, "rounds": 2, "outer_momentum": 0.5}})
    assert pair(OuterState([torch.zeros(1)], cfg.diloco)) == (1.0, 0.5)

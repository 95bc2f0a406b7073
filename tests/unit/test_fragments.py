"""Streaming DiLoCo's fragments: the split, the schedule, the config's refusals."""

import pytest

from trainer.config import ConfigError, ModelConfig, from_dict
from trainer.fragments import due, offsets, param_tensors, split
from trainer.model import Transformer


def sizes(preset: str, **model) -> list[int]:
    return [p.numel() for p in Transformer(ModelConfig(preset=preset, **model)).parameters()]


@pytest.mark.parametrize("preset,model", [("tiny", {}), ("small", {}), ("tiny", {"tie_embeddings": True}),
                                          ("tiny", {"n_layers": 5})])
def test_param_tensors_counts_what_the_model_builds(preset, model):
    assert param_tensors(ModelConfig(preset=preset, **model)) == len(sizes(preset, **model))


def test_one_fragment_is_everything():
    assert split([5, 1, 7], 1) == [range(0, 3)]


def test_fragments_are_contiguous_nonempty_and_cover_every_parameter():
    ns = sizes("small")
    for f in range(1, len(ns) + 1):
        parts = split(ns, f)
        assert len(parts) == f and all(len(p) > 0 for p in parts)
        assert [i for p in parts for i in p] == list(range(len(ns)))


def test_the_split_is_balanced_by_numel():
    ns = sizes("small")
    total = sum(ns)
    for f, peak in ((2, 0.51), (4, 0.27), (8, 0.14)):
        assert max(sum(ns[i] for i in p) for p in split(ns, f)) / total < peak
    # the largest fragment is as small as any contiguous cut makes it: [4, 4, 4 | 1, 1, 1, 1, 4 ...]
    assert split([4, 4, 4, 4], 2) == [range(0, 2), range(2, 4)]
    assert split([9, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 10)]
    assert split([1, 1, 1, 1, 1, 1, 1, 1, 1, 9], 2) == [range(0, 9), range(9, 10)]


def test_the_split_is_deterministic():
    ns = sizes("tiny")
    assert split(ns, 4) == split(list(ns), 4)
    assert [(p.start, p.stop) for p in split(ns, 4)] == [(0, 7), (7, 11), (11, 18), (18, 21)]


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

"""Streaming shards: a split of many shards reads like their concatenation without building it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer import data as tdata
from trainer.data import BatchLoader, DataError, TokenSpan, load_tokens, partition, write_shards
from trainer.rules.config import DataConfig


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng(3)
    train = rng.integers(0, 50_000, 10_007)
    val = rng.integers(0, 50_000, 999)
    out = write_shards(train, val, tmp_path / "s", 50_000, shard_tokens=1_000)  # 11 train shards
    return out, train, val


def test_split_is_a_span_over_every_shard_not_a_copy(shards):
    out, train, _ = shards
    corpus = load_tokens(DataConfig(source="shards", path=str(out)))
    assert isinstance(corpus.train, TokenSpan) and len(corpus.train) == len(train)
    assert len(corpus.train.paths) == 11
    # every read is a slice of the concatenation, also across shard boundaries
    for a, b in [(0, 1), (995, 1_005), (0, 10_007), (2_999, 7_001), (10_006, 10_007), (5, 5)]:
        assert np.array_equal(corpus.train[a:b], train[a:b]), (a, b)
    assert corpus.train[-1] == train[-1] and corpus.train[1_000] == train[1_000]
    with pytest.raises(IndexError):
        corpus.train[10_007]


@pytest.mark.parametrize("sites", [1, 2, 3, 7])
def test_site_partitions_are_shard_offset_ranges_equal_to_concatenation(shards, sites):
    out, train, _ = shards
    span = load_tokens(DataConfig(source="shards", path=str(out))).train
    covered = []
    for i in range(sites):
        part = partition(span, sites, i)
        assert isinstance(part, TokenSpan)  # still lazy: nothing read yet
        assert np.array_equal(np.asarray(part), partition(train, sites, i))
        ranges = part.ranges()
        assert sum(b - a for _, a, b in ranges) == len(part)
        covered += [(p.name, a, b) for p, a, b in ranges]
        # a process's share of a site's share is still a range of shards
        sub = partition(part, 2, 1)
        assert np.array_equal(np.asarray(sub), partition(partition(train, sites, i), 2, 1))
    assert sum(b - a for _, a, b in covered) == len(train)


def test_loader_over_span_equals_loader_over_concatenation_and_resumes(shards):
    out, train, _ = shards
    span = partition(load_tokens(DataConfig(source="shards", path=str(out))).train, 2, 1)
    arr = partition(train, 2, 1)
    a = BatchLoader(span, seq_len=31, batch_size=4, seed=9, site_index=1)
    b = BatchLoader(arr, seq_len=31, batch_size=4, seed=9, site_index=1)
    for _ in range(100):  # several epochs (156 windows, 39 batches each)
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    state = a.state_dict()
    assert state == {"epoch": 2, "cursor": 88}
    want = [a.next_batch() for _ in range(50)]
    fresh = BatchLoader(span, seq_len=31, batch_size=4, seed=9, site_index=1)
    fresh.load_state_dict(state)
    got = [fresh.next_batch() for _ in range(50)]
    assert all(torch.equal(w[0], g[0]) and torch.equal(w[1], g[1]) for w, g in zip(want, got, strict=True))


def test_open_files_are_capped_and_reads_stay_right(shards, monkeypatch):
    out, train, _ = shards
    monkeypatch.setattr(tdata, "OPEN_SHARDS", 2)
    span = load_tokens(DataConfig(source="shards", path=str(out))).train
    got = np.concatenate([span[i:i + 512] for i in range(0, len(span), 512)])  # every shard, in turn
    assert np.array_equal(got, train)
    assert len(span._shards[0]._files.fds) == 2


def test_a_shard_cut_short_after_opening_is_one_line(shards):
    out, _, _ = shards
    span = load_tokens(DataConfig(source="shards", path=str(out))).train
    (out / "train_000003.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"shard .*train_000003.bin is shorter than when it was opened"):
        span[3_000:3_010]


def test_span_bounds_are_checked(shards):
    out, _, _ = shards
    span = load_tokens(DataConfig(source="shards", path=str(out))).train
    with pytest.raises(DataError, match="outside 10007 tokens"):
        span.span(10, 10_008)
    with pytest.raises(IndexError, match="step 1"):
        span[::2]

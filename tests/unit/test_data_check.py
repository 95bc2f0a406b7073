"""doctor's data check: shards present, one meta.json on every node, enough tokens for the plan."""

from __future__ import annotations

import dataclasses

from dilococtl.data_check import Plan, judge

PLAN = Plan(path="/data/x", sites=2, dp=2, steps=100, batch_size=8, seq_len=63, vocab_size=50_000)
GOOD = {"exists": True, "meta_sha256": "a" * 64, "vocab_size": 32_000, "train_tokens": 2 * 2 * 64 * 800,
        "val_tokens": 1000, "train_missing": [], "val_missing": []}


def test_judge_counts_epochs_of_each_process_share():
    status, detail, short = judge(PLAN, "h1", GOOD, None)
    # each process: 204800 / 2 sites / 2 procs / 64 = 800 sequences; 100 steps x 8 = 800: one epoch
    assert (status, short) == ("ok", "1.00 ep") and "204,800 train tokens" in detail
    status, detail, short = judge(dataclasses.replace(PLAN, steps=300), "h1", GOOD, None)
    assert (status, short) == ("warn", "3.0 ep") and "the data repeats" in detail
    status, detail, _ = judge(PLAN, "h1", {**GOOD, "train_tokens": 2 * 2 * 64 * 7}, None)
    assert status == "fail" and "7 sequences of 64, fewer than a batch of 8" in detail


def test_judge_failures_name_the_node_and_the_problem():
    assert judge(PLAN, "h2", GOOD, ("h1", "b" * 64))[:2] == (
        "fail", "/data/x/meta.json on h2 differs from h1's (sha256 aaaaaaaaaaaa vs bbbbbbbbbbbb): every node must "
                "read the same data")
    assert judge(PLAN, "h2", {"exists": False}, None)[1] == "data.path /data/x does not exist on h2"
    assert "must be absolute" in judge(dataclasses.replace(PLAN, path="data/x"), "h", GOOD, None)[1]
    assert "lacks shard(s) train_000003.bin" in judge(PLAN, "h", {**GOOD, "train_missing": ["train_000003.bin"]}, None)[1]
    assert "vocab_size 60000 exceeds model.vocab_size 50000" in judge(PLAN, "h", {**GOOD, "vocab_size": 60_000}, None)[1]
    assert "bad json" in judge(PLAN, "h", {"exists": True, "meta_error": "bad json"}, None)[1]


def test_judge_names_the_tokenizer_and_the_validation_split():
    probe = {**GOOD, "tokenizer": "tokenizer.json", "tokenizer_error": "missing"}
    assert judge(PLAN, "h", probe, None)[:2] == (
        "fail", "/data/x/tokenizer.json on h (the tokenizer meta.json names): missing")
    status, detail, _ = judge(PLAN, "h", {**GOOD, "val_tokens": 40}, None)
    assert status == "fail" and detail.startswith("data.seq_len 63: the validation split of /data/x has 40 tokens")


def test_first_error_is_the_trainers_line_not_torchruns_traceback():
    from dilococtl.logs import first_error

    log = ("W1201 20:42:05.123000 4242 torch/distributed/run.py:792] setting OMP_NUM_THREADS\n"
           "[rank0]: error: IndexError: index out of range in self\n"
           "Traceback (most recent call last):\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    assert first_error(log) == "error: IndexError: index out of range in self"
    assert first_error("Traceback (most recent call last):\n  File x\nValueError: bad thing\n") == "ValueError: bad thing"
    assert first_error("all fine\n") is None

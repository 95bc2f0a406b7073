"""`dilococtl data prepare`: sources -> shards the trainer reads, resumable, with one-line errors."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer
from typer.testing import CliRunner

from dilococtl import data_prepare as dp
from dilococtl.cli import app
from dilococtl.data_prepare import PrepareConfig, prepare
from dilococtl.errors import BadInput
from trainer.data import read_shards

WORDS = "the quick brown fox jumps over a lazy dog while seven bold wizards quietly vex a jolly king".split()


def _doc(rng, n=60) -> str:
    return " ".join(rng.choice(WORDS, n)) + "."


@pytest.fixture
def corpus(tmp_path):
    """Three text files, a JSONL of 12 documents and a Parquet of 8: 23 documents in all."""
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    src.mkdir()
    docs = {}
    for i in range(3):
        docs[f"t{i}"] = _doc(rng)
        (src / f"a{i}.txt").write_text(docs[f"t{i}"])
    lines = []
    for i in range(12):
        docs[f"j{i}"] = _doc(rng)
        lines.append(json.dumps({"id": i, "body": docs[f"j{i}"]}))
    (src / "b.jsonl").write_text("\n".join(lines) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_doc(rng) for _ in range(8)]
    pq.write_table(pa.table({"body": rows, "n": list(range(8))}), src / "c.parquet")
    for i, r in enumerate(rows):
        docs[f"p{i}"] = r
    return src, docs


def _run(src, out, **kw) -> dict:
    cfg = dict(sources=[str(src)], out=out, train_tokenizer=300, field="body", val_fraction=0.2, workers=1)
    cfg.update(kw)
    return prepare(PrepareConfig(**cfg))


def _split_docs(tokens: np.ndarray, tok: Tokenizer, eos: int) -> list[str]:
    ends = np.flatnonzero(tokens == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(tokens[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]


def test_prepare_writes_shards_meta_and_holds_out_whole_documents(corpus, tmp_path):
    src, docs = corpus
    out = tmp_path / "out"
    meta = _run(src, out, shard_tokens=500)
    corpus_ = read_shards(out)  # the trainer's own reader
    assert corpus_.vocab_size == meta["vocab_size"] == 300 and meta["dtype"] == "uint16"
    train, val = np.asarray(corpus_.train), np.asarray(corpus_.val)
    assert (meta["tokens"]["train"], meta["tokens"]["val"]) == (len(train), len(val))
    assert len(meta["train"]) == -(-len(train) // 500) and all(
        (out / n).stat().st_size <= 500 * 2 for n in meta["train"])
    # 23 documents, 20% held out: round(4.6) = 5, whole documents on both sides, none lost
    assert (meta["documents"]["train"], meta["documents"]["val"]) == (18, 5)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos = meta["tokenizer"]["eos_id"]
    assert eos == 0 and tok.id_to_token(0) == "<|endoftext|>"
    got_train, got_val = _split_docs(train, tok, eos), _split_docs(val, tok, eos)
    assert sorted(got_train + got_val) == sorted(docs.values())
    assert not set(got_train) & set(got_val)
    # hashes of the tokenizer and of every source
    assert meta["tokenizer"]["sha256"] == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    by_path = {Path(s["path"]).name: s for s in meta["sources"]}
    assert set(by_path) == {"a0.txt", "a1.txt", "a2.txt", "b.jsonl", "c.parquet"}
    for name, s in by_path.items():
        assert s["sha256"] == hashlib.sha256((src / name).read_bytes()).hexdigest()
    assert (by_path["b.jsonl"]["documents"], by_path["c.parquet"]["documents"]) == (12, 8)
    assert sum(s["train_tokens"] for s in meta["sources"]) == len(train)
    assert not (out / dp.WORK_DIR).exists()


def test_prepare_is_idempotent_and_parallel_equals_serial(corpus, tmp_path):
    src, _ = corpus
    out = tmp_path / "out"
    first = _run(src, out)
    stamp = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    again = _run(src, out)
    assert again["up_to_date"] and again["prepare_key"] == first["prepare_key"]
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir()} == stamp  # nothing rewritten
    par = _run(src, tmp_path / "par", workers=2)
    for split in ("train", "val"):
        a = b"".join((out / n).read_bytes() for n in first[split])
        b = b"".join((tmp_path / "par" / n).read_bytes() for n in par[split])
        assert a == b


def test_interrupted_prepare_resumes_without_redoing_parts(corpus, tmp_path, monkeypatch):
    src, _ = corpus
    clean = _run(src, tmp_path / "clean")
    out = tmp_path / "out"
    real, calls, die = dp.tokenize_part, [], [True]

    def dies_on_third(index, *a):
        calls.append(index)
        if die[0] and len(calls) == 3:
            raise RuntimeError("killed mid-prepare")
        return real(index, *a)

    monkeypatch.setattr(dp, "tokenize_part", dies_on_third)
    with pytest.raises(RuntimeError, match="killed mid-prepare"):
        _run(src, out)
    assert not (out / "meta.json").exists()  # never reads as complete
    with pytest.raises(Exception, match="no meta.json"):
        read_shards(out)
    calls.clear()
    die[0] = False
    meta = _run(src, out)
    assert calls == [2, 3, 4]  # parts 0 and 1 were done and kept
    for split in ("train", "val"):
        assert [(out / n).read_bytes() for n in meta[split]] == [(tmp_path / "clean" / n).read_bytes()
                                                                  for n in clean[split]]


def test_changed_source_redoes_the_prepare(corpus, tmp_path):
    src, _ = corpus
    out = tmp_path / "out"
    first = _run(src, out)
    (src / "a0.txt").write_text("a different document about a lazy king.")
    second = _run(src, out)
    assert not second.get("up_to_date") and second["prepare_key"] != first["prepare_key"]
    assert second["sources"][0]["sha256"] != first["sources"][0]["sha256"]


def test_given_tokenizer_file_and_uint32_for_big_vocab(corpus, tmp_path):
    src, _ = corpus
    from tokenizers import models, pre_tokenizers

    words = sorted(set(WORDS))
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    vocab["zzz_filler"] = 70_000  # a sparse id past 65535: uint32 shards
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tok.json"))
    meta = prepare(PrepareConfig(sources=[str(src / "a0.txt"), str(src / "a1.txt"), str(src / "a2.txt")],
                                 out=tmp_path / "out", tokenizer=str(tmp_path / "tok.json"), workers=1))
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_001  # the largest id + 1, not the count
    c = read_shards(tmp_path / "out")
    assert c.train.dtype == np.uint32 and len(c.train) + len(c.val) == 3 * (61 + 1)  # 60 words + "." + EOT


def test_val_indices_spread_and_need_two_documents():
    assert dp.val_indices(10, 0.2) == [2, 7]
    assert dp.val_indices(3, 0.001) == [1]  # at least one
    assert dp.val_indices(2, 0.99) == [1]  # never every document
    with pytest.raises(BadInput, match="at least 2"):
        dp.val_indices(1, 0.5)


def _cli(*args: str):
    return CliRunner().invoke(app, ["data", "prepare", *args])


def _one_line_error(r, code: int = 2) -> str:
    assert r.exit_code == code, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_cli_bad_inputs_are_one_line_naming_the_file(corpus, tmp_path):
    src, _ = corpus
    common = ["--train-tokenizer", "300", "--field", "body", "-j", "1"]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert f"source {empty}: empty file" in _one_line_error(_cli(str(src), str(empty), "--out", str(tmp_path / "o1"), *common))
    bad_field = tmp_path / "bad.jsonl"
    bad_field.write_text('{"body": "ok text here"}\n{"text": "no body"}\n')
    msg = _one_line_error(_cli(str(src), str(bad_field), "--out", str(tmp_path / "o2"), *common))
    assert f"source {bad_field}:2: no field 'body'" in msg
    assert not (tmp_path / "o2" / "meta.json").exists()
    garbled = tmp_path / "garbled.txt"
    garbled.write_bytes(b"\xff\xfe\xfa not utf-8 \xc3\x28")
    msg = _one_line_error(_cli(str(src), str(garbled), "--out", str(tmp_path / "o3"), *common))
    assert f"source {garbled}: 1 undecodable document(s) (1 of 24 in all, more than --max-bad 0.001)" in msg
    # past the threshold only: 1 of 24 is allowed at --max-bad 0.05, and counted
    r = _cli(str(src), str(garbled), "--out", str(tmp_path / "o3"), *common, "--max-bad", "0.05", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["documents"]["undecodable"] == 1
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert f"out {blocker / 'out'}: not writable" in _one_line_error(_cli(str(src), "--out", str(blocker / "out"), *common))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    assert "is not empty and holds no earlier prepare" in _one_line_error(_cli(str(src), "--out", str(foreign), *common))
    assert (foreign / "keep.txt").read_text() == "mine"
    assert "no such file or directory" in _one_line_error(_cli(str(tmp_path / "nope"), "--out", str(tmp_path / "o4"), *common))
    assert "--val-fraction: must be in (0, 1), got nan" in _one_line_error(
        _cli(str(src), "--out", str(tmp_path / "o5"), *common, "--val-fraction", "nan"))
    assert "exactly one of --tokenizer and --train-tokenizer" in _one_line_error(
        _cli(str(src), "--out", str(tmp_path / "o6"), "--field", "body"))
    assert "nor in the local Hugging Face cache (no download is tried" in _one_line_error(
        _cli(str(src), "--out", str(tmp_path / "o7"), "--tokenizer", "no-such-org/no-such-tokenizer"))
    assert not (tmp_path / "o7").exists()


def test_cli_prepare_prints_summary_and_json(corpus, tmp_path):
    src, _ = corpus
    out = tmp_path / "out"
    r = _cli(str(src), "--out", str(out), "--train-tokenizer", "300", "--field", "body", "-j", "1")
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "meta.json").read_text())
    assert r.stdout.startswith(f"wrote {out}: {meta['tokens']['train']:,} train + {meta['tokens']['val']:,} val tokens")
    assert "tokenize" in r.stderr  # the progress bar went to stderr
    r = _cli(str(src), "--out", str(out), "--train-tokenizer", "300", "--field", "body", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["up_to_date"] is True


def test_one_file_by_another_name_is_the_same_prepare_and_json_says_what_was_written(corpus, tmp_path):
    """Issue 42: a rerun naming the sources another way (a symlink, `..`) finds the earlier prepare;
    --json says whether this call wrote anything; a failed prepare leaves no empty --out behind."""
    src, _ = corpus
    out = tmp_path / "out"
    common = ["--out", str(out), "--train-tokenizer", "300", "--field", "body", "-j", "1", "--json"]
    r = _cli(str(src), *common)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["written"] is True
    stamp = {f.name: f.stat().st_mtime_ns for f in out.iterdir()}
    (tmp_path / "link").symlink_to(src)
    for other in (tmp_path / "link", src / ".." / src.name):
        r = _cli(str(other), *common)
        assert r.exit_code == 0, r.output
        got = json.loads(r.stdout)
        assert (got["written"], got["up_to_date"]) == (False, True), other
    assert {f.name: f.stat().st_mtime_ns for f in out.iterdir()} == stamp  # nothing rewritten
    assert all(Path(s["path"]).is_absolute() for s in json.loads((out / "meta.json").read_text())["sources"])

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    fresh = tmp_path / "fresh"
    assert "empty file" in _one_line_error(_cli(str(src), str(empty), *common[2:], "--out", str(fresh)))
    assert not fresh.exists()

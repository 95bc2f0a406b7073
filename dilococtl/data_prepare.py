"""`dilococtl data prepare`: text, JSON Lines or Parquet sources -> token shards the trainer reads.

Three phases, each resumable:
1. scan: list the source files, hash them and count their documents (a text file is one
   document, a JSONL line or a Parquet row is one). Held-out validation documents are chosen
   evenly over the global document order, so the split is whole documents, never a slice of one.
2. tokenize (parallel processes, one source file each): every document's tokens plus an
   end-of-text separator go to a part file under OUT/.prepare/; a part is done when its record
   (written last, atomically) matches the settings, so an interrupted prepare redoes only the rest.
3. pack: the parts are written in order into uint16/uint32 shards of at most `shard_tokens`
   (each to a temporary name, then renamed), and meta.json last: a directory without meta.json
   is never read as complete.

No torch here: the operator's machine may have none.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dilococtl.errors import BadInput, DilocoError
from trainer.checkpoints.manifest_sign import sha256_file
from trainer.data import DEFAULT_SHARD_TOKENS, ShardWriter, shard_dtype  # numpy only, no torch

FORMAT = 1  # meta.json "format": shards written by this module
WORK_DIR = ".prepare"  # under OUT: part files and the trained tokenizer of an unfinished prepare
TOKENIZER_FILE = "tokenizer.json"
EOT = "<|endoftext|>"  # the separator a trained tokenizer gets (id 0)
EOS_NAMES = (EOT, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")  # a given tokenizer's separator, first found
JSONL_EXT = (".jsonl", ".ndjson", ".jsonl.txt")
PARQUET_EXT = (".parquet",)
READ_CHUNK = 1 << 20


@dataclass(kw_only=True, slots=True)
class PrepareConfig:
    sources: list[str]  # files, directories (every file under them) or glob patterns
    out: Path  # output directory (empty, new, or an earlier prepare's)
    tokenizer: str = ""  # a tokenizer.json (or a directory holding one), or a name in the local HF cache
    train_tokenizer: int = 0  # > 0: train a byte-level BPE of this vocabulary size on the sources instead
    field: str = "text"  # JSONL key / Parquet column holding the text
    val_fraction: float = 0.01  # documents held out for validation (at least one)
    shard_tokens: int = DEFAULT_SHARD_TOKENS  # tokens per .bin shard
    workers: int = 0  # tokenizing processes (0: one per CPU)
    max_bad_fraction: float = 0.001  # undecodable documents allowed (skipped and counted) before failing


@dataclass(kw_only=True, slots=True)
class Source:
    path: str
    kind: str  # text | jsonl | parquet
    sha256: str
    size: int
    documents: int
    first_doc: int = 0  # index of its first document in the global order


@dataclass(kw_only=True, slots=True)
class PartResult:
    index: int
    key: str
    train_tokens: int = 0
    val_tokens: int = 0
    train_docs: int = 0
    val_docs: int = 0
    undecodable: int = 0
    empty: int = 0  # documents with no text (skipped)
    extra: dict = field(default_factory=dict)


# --- scan ---------------------------------------------------------------------------------


def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_EXT):
        return "jsonl"
    if name.endswith(PARQUET_EXT):
        return "parquet"
    return "text"


def expand_sources(specs: list[str]) -> list[Path]:
    """Every file the source arguments name, sorted, each once; a name matching nothing is bad input."""
    if not specs:
        raise BadInput("data prepare: no SOURCE given")
    found: list[Path] = []
    for spec in specs:
        p = Path(spec)
        if p.is_file():
            found.append(p)
        elif p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
            if not files:
                raise BadInput(f"source {spec}: directory holds no files")
            found += files
        elif any(c in spec for c in "*?["):
            files = sorted(Path(f) for f in glob.glob(spec, recursive=True) if Path(f).is_file())
            if not files:
                raise BadInput(f"source {spec}: pattern matches no files")
            found += files
        else:
            raise BadInput(f"source {spec}: no such file or directory")
    seen, out = set(), []
    for f in found:
        r = f.resolve()  # one file by any name: meta.json and the settings key hold this path, so a rerun
        if r not in seen:  # that names the file another way (./a, a symlink) finds the earlier prepare
            seen.add(r)
            out.append(r)
    return out


def scan_source(path: Path) -> Source:
    """Hash a source and count its documents, reading it once."""
    kind = _kind(path)
    h, size, lines, last = hashlib.sha256(), 0, 0, b"\n"
    try:
        with open(path, "rb") as f:
            while chunk := f.read(READ_CHUNK):
                h.update(chunk)
                size += len(chunk)
                lines += chunk.count(b"\n")
                last = chunk[-1:]
    except OSError as e:
        raise BadInput(f"source {path}: cannot read: {e.strerror or e}") from None
    if size == 0:
        raise BadInput(f"source {path}: empty file")
    if kind == "text":
        docs = 1
    elif kind == "jsonl":
        docs = lines + (last != b"\n")
    else:
        docs = _parquet_rows(path)
    return Source(path=str(path), kind=kind, sha256=h.hexdigest(), size=size, documents=docs)


def _parquet_rows(path: Path) -> int:
    pq = _pyarrow()
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception as e:  # pyarrow raises several kinds for a damaged file
        raise BadInput(f"source {path}: not a readable Parquet file: {e}") from None


def _pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BadInput("Parquet sources need pyarrow: pip install 'dilococtl[parquet]'") from None
    return pq


def val_indices(n_docs: int, fraction: float) -> list[int]:
    """Global indices of the held-out documents: max(1, round(n * fraction)), evenly spread."""
    if n_docs < 2:
        raise BadInput(f"data prepare: {n_docs} document(s); at least 2 are needed to hold one out for validation")
    k = min(n_docs - 1, max(1, round(n_docs * fraction)))
    return [i * n_docs // k + n_docs // (2 * k) for i in range(k)]


# --- documents ----------------------------------------------------------------------------


def iter_documents(src: Source, field_name: str) -> Iterator[tuple[int, str | None]]:
    """(local index, text) per document; text None for undecodable bytes (counted by the caller)."""
    path = Path(src.path)
    if src.kind == "text":
        raw = path.read_bytes()
        try:
            yield 0, raw.decode("utf-8")
        except UnicodeDecodeError:
            yield 0, None
    elif src.kind == "jsonl":
        with open(path, "rb") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    yield i, ""
                    continue
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError:
                    yield i, None
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise BadInput(f"source {path}:{i + 1}: not valid JSON ({e.msg})") from None
                if not isinstance(obj, dict) or field_name not in obj:
                    raise BadInput(f"source {path}:{i + 1}: no field {field_name!r} (choose it with --field)")
                value = obj[field_name]
                if not isinstance(value, str):
                    raise BadInput(f"source {path}:{i + 1}: field {field_name!r} is {type(value).__name__}, not text")
                yield i, value
    else:
        pq = _pyarrow()
        pf = pq.ParquetFile(path)
        if field_name not in pf.schema_arrow.names:
            raise BadInput(f"source {path}: no column {field_name!r} (columns: {', '.join(pf.schema_arrow.names)}; "
                           f"choose one with --field)")
        i = 0
        for batch in pf.iter_batches(columns=[field_name], batch_size=1024):
            for value in batch.column(0).to_pylist():
                if value is None:
                    yield i, ""
                elif isinstance(value, bytes):
                    try:
                        yield i, value.decode("utf-8")
                    except UnicodeDecodeError:
                        yield i, None
                elif isinstance(value, str):
                    yield i, value
                else:
                    raise BadInput(f"source {path}: column {field_name!r} holds {type(value).__name__}, not text")
                i += 1


# --- tokenizer ----------------------------------------------------------------------------


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DilocoError("the tokenizers package is missing: pip install tokenizers") from None
    return tokenizers


def resolve_tokenizer(name: str) -> Path:
    """A tokenizer.json file for `name`: a file, a directory holding one, or a local HF cache entry."""
    p = Path(name)
    if p.is_file():
        return p
    if p.is_dir() and (p / TOKENIZER_FILE).is_file():
        return p / TOKENIZER_FILE
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        try_to_load_from_cache = None
    if try_to_load_from_cache is not None:
        try:
            hit = try_to_load_from_cache(name, TOKENIZER_FILE)
        except Exception:  # an invalid repo id
            hit = None
        if isinstance(hit, str) and Path(hit).is_file():
            return Path(hit)
    raise BadInput(f"tokenizer {name}: not a tokenizer.json, nor a directory holding one, nor in the local "
                   f"Hugging Face cache (no download is tried; or use --train-tokenizer VOCAB)")


def train_tokenizer(sources: list[Source], field_name: str, vocab: int, out_file: Path) -> None:
    """Train a byte-level BPE of `vocab` tokens on every document, with EOT as token 0."""
    tk = _tokenizers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        for src in sources:
            for _, text in iter_documents(src, field_name):
                if text:
                    yield text

    tok.train_from_iterator(texts(), trainer=trainer)
    tmp = out_file.with_suffix(".tmp")
    tok.save(str(tmp))
    os.replace(tmp, out_file)


def eos_id(tok) -> int | None:
    for name in EOS_NAMES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


# --- tokenize one source (runs in a worker process) ---------------------------------------


def _part_paths(work: Path, index: int) -> tuple[Path, Path, Path]:
    stem = work / f"part_{index:06d}"
    return stem.with_suffix(".train.bin"), stem.with_suffix(".val.bin"), stem.with_suffix(".json")


def tokenize_part(index: int, src_d: dict, work: str, tok_file: str, field_name: str, key: str,
                  val_local: list[int], dtype: str) -> dict:
    """Tokenize one source into its part files; returns the PartResult as a dict."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the processes are the parallelism
    tk = _tokenizers()
    src = Source(**src_d)
    tok = tk.Tokenizer.from_file(tok_file)
    eos = eos_id(tok)
    train_f, val_f, rec_f = _part_paths(Path(work), index)
    res = PartResult(index=index, key=key)
    held = set(val_local)
    batch: list[tuple[int, str]] = []
    with open(train_f.with_suffix(".tmp"), "wb") as ft, open(val_f.with_suffix(".tmp"), "wb") as fv:
        def flush():
            encs = tok.encode_batch([t for _, t in batch], add_special_tokens=False)
            for (i, _), enc in zip(batch, encs, strict=True):
                ids = enc.ids + ([eos] if eos is not None else [])
                arr = np.asarray(ids, dtype=dtype)
                if i in held:
                    fv.write(arr.tobytes())
                    res.val_tokens += arr.size
                    res.val_docs += 1
                else:
                    ft.write(arr.tobytes())
                    res.train_tokens += arr.size
                    res.train_docs += 1
            batch.clear()

        for i, text in iter_documents(src, field_name):
            if text is None:
                res.undecodable += 1
            elif not text:
                res.empty += 1
            else:
                batch.append((i, text))
                if len(batch) >= 256:
                    flush()
        if batch:
            flush()
    os.replace(train_f.with_suffix(".tmp"), train_f)
    os.replace(val_f.with_suffix(".tmp"), val_f)
    tmp = rec_f.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(res)))
    os.replace(tmp, rec_f)  # the record last: a part is done only when it exists
    return asdict(res)


def _done_part(work: Path, index: int, key: str) -> dict | None:
    train_f, val_f, rec_f = _part_paths(work, index)
    try:
        rec = json.loads(rec_f.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if rec.get("key") != key or not train_f.is_file() or not val_f.is_file():
        return None
    return rec


# --- the whole prepare --------------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class Progress:
    """Callbacks the CLI draws its progress bar with (all optional)."""

    phase: Callable[[str, int], None] = lambda name, total: None  # a phase starts: name, total bytes
    advance: Callable[[int, int], None] = lambda nbytes, ntokens: None  # a source is done


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise BadInput(f"out {out}: exists and is not a directory")
    if out.is_dir():
        ours = (out / "meta.json").is_file() or (out / WORK_DIR).is_dir()
        if not ours and any(out.iterdir()):
            raise BadInput(f"out {out}: directory is not empty and holds no earlier prepare")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise BadInput(f"out {out}: not writable: {e.strerror or e}") from None


def _settings_key(cfg: PrepareConfig, tok_sha: str, sources: list[Source], dtype: str) -> str:
    blob = json.dumps({"format": FORMAT, "tokenizer": tok_sha, "field": cfg.field, "val_fraction": cfg.val_fraction,
                       "dtype": dtype, "sources": [(s.path, s.sha256) for s in sources]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def prepare(cfg: PrepareConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Run (or resume, or confirm) a prepare; returns the meta.json it wrote or found, with
    `up_to_date` True when it found it (nothing written)."""
    _check_cfg(cfg)
    if cfg.tokenizer:
        resolve_tokenizer(cfg.tokenizer)  # a bad name fails before OUT is made
    out = Path(cfg.out)
    made = not out.exists()
    try:
        meta = _prepare(cfg, out, progress or Progress())
    except BaseException:
        if made:  # a failure leaves no empty OUT behind (a work dir holding resumable parts stays)
            for d in (out / WORK_DIR, out):
                try:
                    d.rmdir()
                except OSError:
                    pass
        raise
    meta.setdefault("up_to_date", False)
    return meta


def _prepare(cfg: PrepareConfig, out: Path, pg: Progress) -> dict[str, Any]:
    _check_out(out)
    inside = out.resolve()
    files = [f for f in expand_sources(cfg.sources) if inside not in f.resolve().parents]  # never our own output
    if not files:
        raise BadInput(f"data prepare: every source lies inside the output directory {out}")
    pg.phase("scan", sum(f.stat().st_size for f in files))
    sources = []
    for f in files:
        sources.append(scan_source(f))
        pg.advance(sources[-1].size, 0)
    n = 0
    for s in sources:
        s.first_doc, n = n, n + s.documents
    held = val_indices(n, cfg.val_fraction)

    work = out / WORK_DIR
    tok_file, tok_desc = _tokenizer_for(cfg, sources, work)
    tk = _tokenizers()
    try:
        tok = tk.Tokenizer.from_file(str(tok_file))
    except Exception as e:
        raise BadInput(f"tokenizer {tok_file}: cannot be loaded: {e}") from None
    vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1  # ids may be sparse: the largest sizes the model
    dtype = shard_dtype(vocab)
    tok_sha = sha256_file(tok_file)
    key = _settings_key(cfg, tok_sha, sources, dtype)

    meta_f = out / "meta.json"
    if meta_f.is_file():
        try:
            old = json.loads(meta_f.read_text())
        except (OSError, json.JSONDecodeError):
            old = {}
        if old.get("prepare_key") == key and old.get("shard_tokens") == cfg.shard_tokens and _shards_present(out, old):
            old["up_to_date"] = True
            return old
        meta_f.unlink()  # from here on the directory does not read as complete
    work.mkdir(exist_ok=True)

    # tokenize: one task per source not already done under the same settings
    parts: dict[int, dict] = {}
    todo = []
    for i, s in enumerate(sources):
        rec = _done_part(work, i, key)
        if rec is not None:
            parts[i] = rec
        else:
            local = [g - s.first_doc for g in held if s.first_doc <= g < s.first_doc + s.documents]
            todo.append((i, s, local))
    pg.phase("tokenize", sum(s.size for _, s, _ in todo))
    workers = cfg.workers or os.cpu_count() or 1
    if todo:
        args = [(i, asdict(s), str(work), str(tok_file), cfg.field, key, local, dtype) for i, s, local in todo]
        if workers == 1 or len(todo) == 1:
            for a in args:
                r = tokenize_part(*a)
                parts[r["index"]] = r
                pg.advance(sources[r["index"]].size, r["train_tokens"] + r["val_tokens"])
        else:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor, as_completed

            # spawn: the parent may hold tokenizers' threads (training), which fork would copy broken
            with ProcessPoolExecutor(max_workers=min(workers, len(todo)), mp_context=mp.get_context("spawn")) as ex:
                futs = [ex.submit(tokenize_part, *a) for a in args]
                try:
                    for fut in as_completed(futs):
                        r = fut.result()
                        parts[r["index"]] = r
                        pg.advance(sources[r["index"]].size, r["train_tokens"] + r["val_tokens"])
                except BaseException:
                    for f in futs:
                        f.cancel()
                    raise

    bad = sum(p["undecodable"] for p in parts.values())
    if bad > cfg.max_bad_fraction * n:
        worst = max(parts.values(), key=lambda p: p["undecodable"])
        raise BadInput(f"source {sources[worst['index']].path}: {worst['undecodable']} undecodable document(s) "
                       f"({bad} of {n} in all, more than --max-bad {cfg.max_bad_fraction:g})")
    train_total = sum(p["train_tokens"] for p in parts.values())
    val_total = sum(p["val_tokens"] for p in parts.values())
    if train_total == 0:
        raise BadInput("data prepare: the sources hold no training text")
    if val_total == 0:
        raise BadInput("data prepare: every held-out document is empty or undecodable; raise --val-fraction")

    # pack: parts -> shards, meta.json last
    pg.phase("pack", (train_total + val_total) * np.dtype(dtype).itemsize)
    for old_shard in list(out.glob("train_*.bin")) + list(out.glob("val_*.bin")) + list(out.glob("*.bin.tmp")):
        old_shard.unlink()
    names = {}
    for split in ("train", "val"):
        names[split] = _pack(out, work, split, len(sources), dtype, cfg.shard_tokens, pg)
    shutil.copyfile(tok_file, out / (TOKENIZER_FILE + ".tmp"))  # (it may be OUT's own: copy, then rename)
    os.replace(out / (TOKENIZER_FILE + ".tmp"), out / TOKENIZER_FILE)
    meta = {
        "format": FORMAT,
        "dtype": dtype,
        "vocab_size": vocab,
        "train": names["train"],
        "val": names["val"],
        "tokens": {"train": train_total, "val": val_total},
        "documents": {"train": sum(p["train_docs"] for p in parts.values()),
                      "val": sum(p["val_docs"] for p in parts.values()),
                      "empty": sum(p["empty"] for p in parts.values()), "undecodable": bad},
        "val_fraction": cfg.val_fraction,
        "shard_tokens": cfg.shard_tokens,
        "tokenizer": {"file": TOKENIZER_FILE, "sha256": tok_sha, "source": tok_desc, "eos_id": eos_id(tok)},
        "field": cfg.field,
        "sources": [{"path": s.path, "kind": s.kind, "sha256": s.sha256, "bytes": s.size, "documents": s.documents,
                     "train_tokens": parts[i]["train_tokens"], "val_tokens": parts[i]["val_tokens"],
                     "undecodable": parts[i]["undecodable"]} for i, s in enumerate(sources)],
        "prepare_key": key,
    }
    tmp = out / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, meta_f)
    shutil.rmtree(work, ignore_errors=True)
    return meta


def _check_cfg(cfg: PrepareConfig) -> None:
    if bool(cfg.tokenizer) == bool(cfg.train_tokenizer):
        raise BadInput("data prepare: give exactly one of --tokenizer and --train-tokenizer")
    if cfg.train_tokenizer and not 257 <= cfg.train_tokenizer <= 2**32:
        raise BadInput(f"--train-tokenizer: vocabulary must be in [257, 2**32] (256 bytes + the separator), "
                       f"got {cfg.train_tokenizer}")
    if not 0 < cfg.val_fraction < 1:  # also refuses NaN
        raise BadInput(f"--val-fraction: must be in (0, 1), got {cfg.val_fraction}")
    if not 0 <= cfg.max_bad_fraction <= 1:
        raise BadInput(f"--max-bad: must be in [0, 1], got {cfg.max_bad_fraction}")
    if cfg.shard_tokens < 1:
        raise BadInput(f"--shard-tokens: must be >= 1, got {cfg.shard_tokens}")
    if cfg.workers < 0:
        raise BadInput(f"--workers: must be >= 0, got {cfg.workers}")
    if not cfg.field or "\n" in cfg.field:
        raise BadInput(f"--field: must be a non-empty single-line name, got {cfg.field!r}")


def _tokenizer_for(cfg: PrepareConfig, sources: list[Source], work: Path) -> tuple[Path, str]:
    if cfg.tokenizer:
        return resolve_tokenizer(cfg.tokenizer), cfg.tokenizer
    f = work / TOKENIZER_FILE
    stamp = work / "tokenizer.key"
    want = hashlib.sha256(json.dumps([cfg.train_tokenizer, cfg.field, [s.sha256 for s in sources]]).encode()).hexdigest()
    desc = f"byte-level BPE trained on the sources (vocab {cfg.train_tokenizer}, key {want[:16]})"
    try:  # a finished prepare of the same sources already holds this tokenizer
        done = json.loads((cfg.out / "meta.json").read_text())["tokenizer"]
        if done["source"] == desc and sha256_file(cfg.out / TOKENIZER_FILE) == done["sha256"]:
            return cfg.out / TOKENIZER_FILE, desc
    except (OSError, ValueError, KeyError, TypeError):
        pass
    work.mkdir(exist_ok=True)
    if not (f.is_file() and stamp.is_file() and stamp.read_text() == want):
        train_tokenizer(sources, cfg.field, cfg.train_tokenizer, f)
        stamp.write_text(want)
    return f, desc


def _shards_present(out: Path, meta: dict) -> bool:
    names = list(meta.get("train") or []) + list(meta.get("val") or [])
    return bool(names) and all((out / n).is_file() for n in names)


def _pack(out: Path, work: Path, split: str, n_parts: int, dtype: str, shard_tokens: int, pg: Progress) -> list[str]:
    """Concatenate the parts' `split` tokens into shards of at most `shard_tokens`, in part order."""
    w = ShardWriter(out, split, dtype, shard_tokens)
    for i in range(n_parts):
        train_f, val_f, _ = _part_paths(work, i)
        with open(train_f if split == "train" else val_f, "rb") as f:
            while buf := f.read(READ_CHUNK):  # whole tokens: READ_CHUNK is a multiple of 4
                w.write(buf)
                pg.advance(len(buf), 0)
    return w.close()


def describe(meta: dict) -> str:
    """One line summing up a prepare."""
    t = meta["tokens"]
    d = meta["documents"]
    return (f"{t['train']:,} train + {t['val']:,} val tokens ({d['train']} + {d['val']} documents) in "
            f"{len(meta['train'])} + {len(meta['val'])} {meta['dtype']} shards, vocab {meta['vocab_size']}")

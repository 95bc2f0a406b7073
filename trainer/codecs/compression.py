"""Pseudo-gradient compression with error feedback for the outer exchange.

Every site of the quorum runs, once per outer round:

    comp = Compressor(spec="powersgd:16+int8", error_feedback=True, seed=0)   # once
    averaged, stats = comp.average(deltas, comm, weight)

and gets back the same `averaged` list: sum_k w_k * decoded_k / sum_k w_k over the sites, where
decoded_k is what site k's wire form decodes to (top-k: over the sites that sent each coordinate).
The wire layout of every spec is planned from the shapes alone (`trainer.rules.codec_spec.wire_plan`),
so `payload_bytes` is exact without torch.

Codecs (spec stages, see trainer.rules.codec_spec):
  none         one flat fp32 buffer, all-reduced (sum), divided by the summed weight.
  int8, fp8,   per-chunk scale and one code per value (trainer.codecs.quantize; fp4 packs two codes a
  fp4          byte), averaged shard by shard ("qsum", trainer.codecs.quant_shards): each shard's owner
               decodes, averages in fp32, re-quantizes and all-gathers, so a site sends about
               2(K-1)/K of its payload, as a ring all-reduce would.
  topk:F       the largest |x|, values + indices: the ceil(F*b) largest of every block of b values
               (options.topk_block, 4096 by default) with int16 offsets, or, when that is
               cheaper, the ceil(F*n) largest of the tensor with int32 indices. A tensor for which
               top-k would not save bytes is sent dense. All-gathered; each coordinate is averaged
               over the sites that sent a value there (their summed weight), not over all sites:
               sites mostly pick different coordinates, and the plain mean would shrink most
               values K-fold.
  sparse:F     SparseLoCo's codec (trainer.codecs.sparse_codec): chunked top-k with 2-bit values (or int8)
               and 12-bit offsets, reduced shard by shard ("ssum": all-to-all to each shard's
               owner, which merges, re-selects and all-gathers), so its bytes do not grow with K.
  powersgd:R   a parameter with >= 2 dims is viewed as rows x cols (shape[0] x the rest) and sent
               as P = M Q (rows x R), all-reduced and averaged, orthonormalised (QR) into P^, then
               Q = M^T P^ (cols x R), all-reduced and averaged; the decoded matrix is P^ Q^T. Both
               steps are linear in M, so summing is exact. Q is warm-started from the previous
               round's average (initially the same seeded normal matrix at every site) and
               orthonormalised before use: same span, but P's columns stay comparable in size,
               which is what keeps a quantized P accurate. 1-D parameters and matrices that would
               not gain (rows*cols < gain * R*(rows+cols)) take the plain path: fp32, or the
               quantizer of the chain.
  A+Q          a quantizer Q (int8, fp8, fp4) encodes what the first stage sends (top-k values; P
               and Q, column by column, no chunk straddling two columns); P and Q are averaged
               shard by shard, the top-k values all-gathered.

Weights: 1.0 for a participating site, 0.0 for one that must not contribute (it has just
healed). Every site makes the same collective calls with the same shapes whatever its weight; a
weight-0 site sends zeros and gets the same result. The weight travels inside the first buffer
(one fp32), so the denominator needs no extra collective.

Error feedback (per site): x = delta + e is compressed, and e <- decay * (x - own), where own is
what this site's wire form decodes to; not updated when the weight is 0. With decay 1 the running
sum of the averages plus the weighted mean residual is the running sum of the weighted mean inputs
(dense codecs, PowerSGD; top-k at one site: the senders' mean is not a mean of the inputs), within
a bound that does not grow with the rounds. Lossless paths (fp32) keep no residual. A shard's
owner keeps a second residual: what its re-quantized average lost, added to the next average of
the same shard (reset when the group size changes the shards). Both are part of the checkpoint
(`state_dict`).

What the comm sees: per round one or two phases (PowerSGD: P, then Q), each on a 1-D tensor:
`allreduce_sum` on fp32 ("none", PowerSGD without a quantizer), `alltoall` then `allgather` on
uint8 (int8/fp8/fp4), `allgather` on uint8 (top-k). Every site must use the same spec, options and
parameter shapes.


How this module is cut: the Compressor (here) keeps the per-site state and runs the round; each
parameter's values go into and out of the wire buffers through trainer.codecs.wire_buffer, the quantizers
are trainer.codecs.quantize, and the collectives, their byte accounting (WireStats) and the means over
what came back are trainer.codecs.phase_exchange.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from trainer.codecs.norms import sq_sum
from trainer.codecs.phase_exchange import (
    PhaseExchange,
    WireStats,
    apply_weight,
    finite_mean,
    joined,
    weighted_mean,
)
from trainer.codecs.quant_shards import QuantShards
from trainer.codecs.sparse_codec import SparseShards
from trainer.codecs.wire_buffer import RouteCodec, WireBuffer
from trainer.collectives import Comm
from trainer.rules.codec_spec import CodecOptions, Phase, Route, WirePlan, parse_codec_spec, wire_plan


class NonFiniteDelta(ValueError):
    """A pseudo-gradient holds NaN or Inf; raised before anything is sent."""

    def __init__(self, index: int, shape: tuple[int, ...]):
        super().__init__(f"pseudo-gradient of parameter {index} (shape {shape}) holds NaN/Inf; nothing was sent")
        self.index = index


class Compressor:
    """Per-site compressed averaging of pseudo-gradients, with error feedback and PowerSGD state."""

    def __init__(self, spec: str = "none", *, error_feedback: bool = True, decay: float = 1.0, seed: int = 0,
                 options: CodecOptions | None = None, site: int = 0):
        """`decay` scales the residual kept for the next round (1.0: classic error feedback);
        `seed` must be equal at every site (initial PowerSGD Q); `site` only decorrelates
        stochastic rounding between sites."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"error feedback decay must be in [0, 1], got {decay}")
        self.spec = spec
        self.options = options or CodecOptions()
        self.options.check()
        wire_plan(spec, [], self.options)  # a bad spec fails here, not in round 1
        self.error_feedback = error_feedback
        self.decay = decay
        self.seed = seed
        self._gen = torch.Generator().manual_seed(seed * 1_000_003 + site + 1) if self.options.stochastic else None
        self.codec = RouteCodec(self.options, self._gen)  # each parameter into and out of the wire buffers
        self.plan: WirePlan | None = None
        self._residual: dict[int, Tensor] = {}
        self._q: dict[int, Tensor] = {}
        self._shard_maps: dict[int, QuantShards | SparseShards] = {}  # "qsum"/"ssum" phases by index: the shards for the last group size
        self._shard_state: dict[int, dict[str, Any]] = {}  # loaded shard residuals, used once the group size matches
        # the sparse codec's last verdict: (ranks a shard owner dropped, whether one refused the round)
        self.screened: list[Any] = [set(), False]

    @property
    def sharded(self) -> bool:
        """The codec reduces shard by shard (the sparse codec): `average`, not `contributions`."""
        stages = parse_codec_spec(self.spec)
        return bool(stages) and stages[0].name == "sparse"

    # --- state -------------------------------------------------------------------------------

    def prepare(self, shapes: Sequence[tuple[int, ...]]) -> None:
        """Plan the wire and allocate residuals and Q for these parameter shapes (idempotent).

        `average` does it on first use. State loaded before it is kept (and checked against the
        shapes); call it before `state_dict()` when a loader fills tensors in place.
        """
        shapes = [tuple(int(s) for s in sh) for sh in shapes]
        if self.plan is not None:
            have = [r.shape for r in self.plan.routes]
            if have != shapes:
                raise ValueError(f"compressor planned for {len(have)} parameters {have[:3]}..., got "
                                 f"{len(shapes)} {shapes[:3]}...: parameter shapes must not change")
            return
        plan = wire_plan(self.spec, shapes, self.options)
        # state loaded before the first round (a resumed checkpoint) is kept, if it fits
        want_q = {r.index: r.cols * r.rank for r in plan.routes if r.kind == "powersgd"}
        want_e = {r.index: r.numel for r in plan.routes if self.error_feedback and _lossy(r)}
        if self._q:
            _check_sizes("PowerSGD Q", {i: t.numel() for i, t in self._q.items()}, want_q)
        if self._residual:
            _check_sizes("residual", {i: t.numel() for i, t in self._residual.items()}, want_e)
        for r in plan.routes:
            if r.index in want_q and r.index not in self._q:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + r.index)
                self._q[r.index] = torch.randn(r.cols, r.rank, generator=g)
            elif r.index in self._q:
                self._q[r.index] = self._q[r.index].reshape(r.cols, r.rank)
            if r.index in want_e and r.index not in self._residual:
                self._residual[r.index] = torch.zeros(r.numel)
        self.plan = plan

    def state_dict(self) -> dict[str, Any]:
        """This site's own state (error-feedback residuals, by parameter index): checkpoint it."""
        shards = {str(i): {"k": sh.k, "owner": sh.owner, "e": sh.residual.clone()}
                  for i, sh in self._shard_maps.items() if sh.residual is not None}
        shards.update({str(i): st for i, st in self._shard_state.items() if str(i) not in shards})
        return {"spec": self.spec, "residuals": {str(i): e.clone() for i, e in self._residual.items()},
                "shards": shards}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("spec") != self.spec:
            raise ValueError(f"compressor state is for spec {sd.get('spec')!r}, this compressor uses {self.spec!r}")
        res = {int(i): t.detach().reshape(-1).to(torch.float32).clone() for i, t in sd["residuals"].items()}
        if self.plan is not None:
            _check_sizes("residual", {i: t.numel() for i, t in res.items()}, {i: e.numel() for i, e in self._residual.items()})
        self._residual = res
        self._shard_maps = {}
        self._shard_state = {int(i): st for i, st in sd.get("shards", {}).items()}

    def global_state(self) -> dict[str, Any]:
        """State equal at every site (PowerSGD's warm-start Q): a healing site loads it from a peer."""
        return {"spec": self.spec, "q": {str(i): q.clone() for i, q in self._q.items()}}

    def load_global_state(self, gs: dict[str, Any]) -> None:
        if gs.get("spec") != self.spec:
            raise ValueError(f"global compressor state is for spec {gs.get('spec')!r}, this compressor uses {self.spec!r}")
        q = {int(i): t.detach().to(torch.float32).clone() for i, t in gs["q"].items()}
        if self.plan is not None:
            _check_sizes("PowerSGD Q", {i: t.numel() for i, t in q.items()}, {i: t.numel() for i, t in self._q.items()})
        self._q = q

    # --- the exchange ------------------------------------------------------------------------

    def contribution_norm(self, deltas: Sequence[Tensor]) -> float:
        """||Δ + e||: the norm of what `average` would encode for `deltas` (NaN or inf if non-finite)."""
        self.prepare([tuple(d.shape) for d in deltas])
        assert self.plan is not None
        sq = 0.0
        for r, d in zip(self.plan.routes, deltas, strict=True):
            x = d.detach().reshape(-1).to(torch.float32)  # as _inputs encodes it
            e = self._residual.get(r.index)
            sq += sq_sum(x + e if e is not None else x)
        return math.sqrt(sq) if sq == sq else math.nan

    def _inputs(self, deltas: Sequence[Tensor], weight: float, scale: float) -> list[Tensor]:
        """What each parameter's codec encodes: (Δ + e) * scale flat in fp32; zeros at weight 0."""
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weight must be a finite number >= 0, got {weight}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale}")
        self.prepare([tuple(d.shape) for d in deltas])
        plan = self.plan
        assert plan is not None
        part = weight > 0
        if part:
            for i, d in enumerate(deltas):
                # one reduction instead of a mask; the exact test only when the sum says so
                # (finite values can still overflow the sum)
                if not math.isfinite(float(d.sum())) and not bool(torch.isfinite(d).all()):
                    raise NonFiniteDelta(i, tuple(d.shape))
        xs: list[Tensor] = []
        for r, d in zip(plan.routes, deltas, strict=True):
            if not part:
                xs.append(torch.zeros(r.numel))  # a healed site's delta means nothing: send zeros
                continue
            x = d.detach().reshape(-1).to(torch.float32)
            e = self._residual.get(r.index)
            x = x + e if e is not None else x
            xs.append(x * scale if scale != 1.0 else x)
        return xs

    def _encode_first(self, xs: list[Tensor], weight: float) -> WireBuffer:
        """Phase 1's buffer: dense and top-k parameters, PowerSGD's P, the weight."""
        assert self.plan is not None
        mine = WireBuffer(self.plan.phases[0])
        mine.view(-1, "weight").fill_(weight)
        for r in self.plan.routes:
            x = xs[r.index]
            if r.kind == "dense":
                self.codec.encode_vec(x, r.vec, mine, r.index, "")
            elif r.kind == "topk":
                self.codec.encode_topk(x, r, mine)
            elif r.kind == "sparse":
                self.codec.encode_sparse(x, r, mine)
            else:
                p = x.view(r.rows, r.cols) @ torch.linalg.qr(self._q[r.index], mode="reduced").Q
                self.codec.encode_vec(p.t(), r.vec, mine, r.index, "P", r.rank)  # column by column
        return mine

    def _encode_q(self, xs: list[Tensor], p_hat: dict[int, Tensor]) -> tuple[WireBuffer, dict[int, Tensor]]:
        """Phase 2's buffer, PowerSGD's Q = M^T P^ (linear in M again), and this site's own Qs."""
        assert self.plan is not None
        mine2 = WireBuffer(self.plan.phases[1])
        q_own: dict[int, Tensor] = {}
        for r in self.plan.routes:
            if r.kind == "powersgd":
                q_own[r.index] = xs[r.index].view(r.rows, r.cols).t() @ p_hat[r.index]
                self.codec.encode_vec(q_own[r.index].t(), r.vec, mine2, r.index, "Q", r.rank)
        return mine2, q_own

    def _own_q(self, r: Route, q_own: dict[int, Tensor], mine2: WireBuffer) -> Tensor:
        """This site's Q as the others decode it (rows x rank)."""
        if r.vec == "raw":
            return q_own[r.index]
        return self.codec.decode_vec(r.vec, mine2, r.index, "Q", r.rank).view(r.rank, r.cols).t()

    def _feedback(self, xs: list[Tensor], own: dict[int, Tensor]) -> None:
        for i, dec in own.items():
            self._residual[i] = (xs[i] - dec).mul_(self.decay) if self.decay != 1.0 else xs[i] - dec


    def average(self, deltas: Sequence[Tensor], comm: Comm, weight: float = 1.0, scale: float = 1.0,
                rank_weights: Sequence[float] | None = None, norm_ratio: float = 0.0) -> tuple[list[Tensor], WireStats]:
        """Weighted average over the group of every site's compressed `deltas` (fp32, same shapes).

        `scale` multiplies this site's contribution (Δ + e) before encoding: a clipped site's
        excess is dropped, not carried to the next round in the residual. The sparse codec's shard
        owners weigh rank i by `rank_weights[i]` (agreed by every site) instead of what its message
        claims, and screen by `norm_ratio` (trainer.codecs.sparse_codec.SparseShards); their verdict is
        left in `screened`.
        """
        xs = self._inputs(deltas, weight, scale)
        plan = self.plan
        assert plan is not None
        part = weight > 0
        ex = PhaseExchange(comm, dense=4 * sum(r.numel for r in plan.routes), shards=self._shards, gen=self._gen,
                           error_feedback=self.error_feedback, weight=weight, rank_weights=rank_weights,
                           norm_ratio=norm_ratio)
        self.screened = ex.screened  # filled in by the sparse codec's shard owners
        out: list[Tensor | None] = [None] * len(plan.routes)
        own: dict[int, Tensor] = {}  # what this site's contribution decodes to (residuals)

        # phase 1: dense and top-k parameters, PowerSGD's P
        mine = self._encode_first(xs, weight)
        apply_weight(mine, weight)
        got = ex.send(mine)
        weights = [float(b.view(-1, "weight")) for b in got]
        total = sum(weights)
        if not total > 0:
            raise ValueError("no participating site in this round (the weights sum to 0)")
        merged = ex.merged if comm.size > 1 else None
        p_hat = self._average_first(got, mine, weights, total, merged, part, out, own)

        # phase 2: PowerSGD's Q = M^T P^, linear in M again
        if len(plan.phases) > 1:
            mine2, q_own = self._encode_q(xs, p_hat)
            apply_weight(mine2, weight)
            self._average_q(ex.send(mine2), mine2, q_own, p_hat, weights, total, part, out, own)

        self._feedback(xs, own)
        return out, ex.settle()  # type: ignore[return-value]

    def _average_first(self, got: list[WireBuffer], mine: WireBuffer, weights: list[float], total: float,
                       merged: dict[int, Tensor] | None, part: bool, out: list[Tensor | None],
                       own: dict[int, Tensor]) -> dict[int, Tensor]:
        """Phase 1 of `average`: each parameter's average into `out` and, where this site keeps a
        residual, what its own contribution decodes to into `own`; returns PowerSGD's P^ by
        parameter. `merged`: the sparse shard owners' averages (None in a group of one)."""
        assert self.plan is not None
        codec = self.codec
        p_hat: dict[int, Tensor] = {}
        for r in self.plan.routes:
            if r.kind == "powersgd":
                p = weighted_mean(got, weights, total, lambda b, r=r: codec.decode_vec(r.vec, b, r.index, "P", r.rank))
                p_hat[r.index] = torch.linalg.qr(p.view(r.rank, r.rows).t(), mode="reduced").Q
                continue
            if r.kind == "sparse":  # averaged shard by shard already (a group of one: its own records)
                out[r.index] = (merged[r.index] if merged is not None else codec.decode_sparse(got[0], r)).view(r.shape)
                if part and r.index in self._residual:
                    own[r.index] = codec.decode_sparse(mine, r)
                continue
            if r.kind == "topk":
                out[r.index] = codec.topk_mean(got, weights, r).view(r.shape)
                if part and r.index in self._residual:
                    own[r.index] = codec.decode_topk(mine, r)
                continue
            decode = lambda b, r=r: codec.decode_vec(r.vec, b, r.index, "")  # noqa: E731
            out[r.index] = weighted_mean(got, weights, total, decode).view(r.shape)
            if part and r.index in self._residual:
                own[r.index] = decode(mine)
        return p_hat

    def _average_q(self, got2: list[WireBuffer], mine2: WireBuffer, q_own: dict[int, Tensor], p_hat: dict[int, Tensor],
                   weights: list[float], total: float, part: bool, out: list[Tensor | None],
                   own: dict[int, Tensor]) -> None:
        """Phase 2 of `average`: PowerSGD's decoded matrices P^ Q^T into `out` (and `own`); the
        averaged Q is the next round's warm start, equal at every site."""
        assert self.plan is not None
        for r in self.plan.routes:
            if r.kind != "powersgd":
                continue
            i = r.index
            q = weighted_mean(got2, weights, total,
                              lambda b, r=r: self.codec.decode_vec(r.vec, b, r.index, "Q", r.rank))
            q = q.view(r.rank, r.cols).t().contiguous()
            out[i] = (p_hat[i] @ q.t()).view(r.shape)
            self._q[i] = q  # the warm start, equal at every site
            if part and i in self._residual:
                own[i] = (p_hat[i] @ self._own_q(r, q_own, mine2).t()).view(-1)

    def contributions(self, deltas: Sequence[Tensor], comm: Comm, weight: float = 1.0,
                      scale: float = 1.0) -> tuple[list[Tensor], list[float], WireStats]:
        """Every member's contribution as this site decodes it from the bytes it received:
        (one flat fp32 vector per rank, parameters concatenated; each rank's weight; stats).

        Every phase is all-gathered whole (no summing on the way, no shard owner), so no member's
        result depends on another member's arithmetic: what a robust aggregator (trainer.outer.aggregate)
        needs, at (K-1)/(2(K-1)/K) = K/2 times a ring all-reduce's bytes. PowerSGD's P^ is the mean of
        the finite Ps; each site's contribution is P^ Q_k^T.
        """
        xs = self._inputs(deltas, weight, scale)
        plan = self.plan
        assert plan is not None
        part = weight > 0
        ex = PhaseExchange(comm, dense=4 * sum(r.numel for r in plan.routes))
        codec = self.codec

        mine = self._encode_first(xs, weight)
        got = ex.gather(mine)
        weights = [float(b.view(-1, "weight")) for b in got]
        takes_part = [1.0 if w > 0 else 0.0 for w in weights]  # what P^ and Q average over: who takes part
        per: list[list[Tensor | None]] = [[None] * len(plan.routes) for _ in got]
        own: dict[int, Tensor] = {}
        p_hat: dict[int, Tensor] = {}
        for r in plan.routes:
            if r.kind == "powersgd":
                ps = [codec.decode_vec(r.vec, b, r.index, "P", r.rank) for b in got]
                p_hat[r.index] = torch.linalg.qr(finite_mean(ps, takes_part).view(r.rank, r.rows).t(), mode="reduced").Q
                continue
            dec = (lambda b, r=r: codec.decode_topk(b, r)) if r.kind == "topk" else \
                (lambda b, r=r: codec.decode_sparse(b, r)) if r.kind == "sparse" else \
                (lambda b, r=r: codec.decode_vec(r.vec, b, r.index, ""))
            for k, b in enumerate(got):
                per[k][r.index] = dec(b).reshape(-1).float()
            if part and r.index in self._residual:
                own[r.index] = per[comm.rank][r.index]  # type: ignore[assignment]
        if len(plan.phases) > 1:
            mine2, q_own = self._encode_q(xs, p_hat)
            got2 = ex.gather(mine2)
            for r in plan.routes:
                if r.kind != "powersgd":
                    continue
                i = r.index
                qs = [codec.decode_vec(r.vec, b, i, "Q", r.rank).view(r.rank, r.cols).t() for b in got2]
                for k, q in enumerate(qs):
                    per[k][i] = (p_hat[i] @ q.t()).reshape(-1)
                self._q[i] = finite_mean(qs, takes_part).contiguous()  # the warm start, equal at every site
                if part and i in self._residual:
                    own[i] = (p_hat[i] @ self._own_q(r, q_own, mine2).t()).view(-1)
        self._feedback(xs, own)
        stats = ex.settle()
        return [joined(p) for p in per], weights, stats  # type: ignore[arg-type]

    def _shards(self, phase: Phase, k: int) -> QuantShards | SparseShards:
        """The shards phase `phase` ("qsum" or "ssum") is averaged in over a group of `k`."""
        assert self.plan is not None
        index = self.plan.phases.index(phase)
        sh = self._shard_maps.get(index)
        if sh is None or sh.k != k:  # a new group size re-cuts the shards; the old residual goes
            sh = self._shard_maps[index] = SparseShards(phase, self.plan.routes, k, self.options) \
                if phase.op == "ssum" else QuantShards(phase, k, self.options)
            saved = self._shard_state.pop(index, None)
            if saved is not None and int(saved["k"]) == k:
                sh.owner, sh.residual = int(saved["owner"]), saved["e"].detach().reshape(-1).float().clone()
        return sh


def split_flat(flat: Tensor, shapes: Sequence[Sequence[int]]) -> list[Tensor]:
    """`flat` cut into private tensors of these shapes, in order."""
    out, pos = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(flat[pos:pos + n].view(tuple(s)).clone())
        pos += n
    return out


def _lossy(r: Route) -> bool:
    return r.kind != "dense" or r.vec != "raw"


def _check_sizes(what: str, got: dict[int, int], want: dict[int, int]) -> None:
    if got != want:
        raise ValueError(f"{what} state does not fit the parameters: sizes {sorted(got.items())[:4]}... "
                         f"vs expected {sorted(want.items())[:4]}...")


__all__ = ["Compressor", "NonFiniteDelta", "split_flat"]

"""The [diloco] section: how the sites train apart and merge, every knob documented here once.

Outer rounds (H, their number, H adapted: h = "auto"), when the outer update is applied (mode), the
outer optimizer, the codec chain on the wire, the cross-site transport and its pacing, fragments,
the guards and the aggregation of the sites' contributions. Its table's shorthands (`h = "auto"`, a
codec preset's name) are spelled out by DilocoConfig.expand_table; the checks of the per-link
pacing table and of fragments are here, the rest with the other sections' (trainer.rules.config.validate).

No torch import: the control plane validates run specs with it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer.rules.model_config import ModelConfig, param_tensors
from trainer.rules.tables import ConfigError

LINK_ARROW = "->"  # "SRC->DST": a directed link between two sites (site names hold no '>')


def link_key(src: str, dst: str) -> str:
    """The key of the directed link `src` -> `dst` in per-link tables."""
    return f"{src}{LINK_ARROW}{dst}"


def parse_link_key(key: str) -> tuple[str, str]:
    """(src, dst) of a "SRC->DST" key; ValueError for anything else."""
    src, arrow, dst = key.partition(LINK_ARROW)
    if not arrow or not src or not dst or ">" in dst:
        raise ValueError(f"{key!r} is not SRC->DST")
    return src, dst


SITE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # fullmatch; as the spec's site names


@dataclass(kw_only=True, slots=True)
class DilocoConfig:
    algorithm: Literal["diloco", "localsgd", "ddp"] = "diloco"  # ddp: gradients averaged every step
    h: int = 20  # inner steps per outer round; "auto" in TOML: start at h_min and adapt (h_auto)
    h_auto: bool = False  # re-choose H every round so sync stays under sync_budget of compute
    h_min: int = 10  # h_auto: smallest H (also the start)
    h_max: int = 1000  # h_auto: largest H
    sync_budget: float = 0.1  # h_auto: allowed sync time as a fraction of compute time
    rounds: int = 10  # outer rounds in the run
    h_policy: Literal["steps", "time"] = "steps"  # steps: every site takes H inner steps a round. time:
    # every site computes for the same window, H x the median of the sites' last step times (agreed in
    # the exchange), so on uneven hardware a faster site takes more steps and a slower one fewer, and
    # none waits at the barrier for a straggler; the run is sized in rounds (sync and overlap modes)
    late_merge: bool = False  # sync: a site the quorum went on without (it arrives after the round committed
    # and heals to the newer θ) keeps that round's pseudo-gradient and adds it, damped by 1/(1+αγ) (γ: rounds
    # committed without it, α: async_alpha's), to its next contribution instead of throwing it away
    merge_weighting: Literal["tokens", "equal"] = "tokens"  # sites that trained different numbers of
    # tokens in a round (h_policy "time", sites of other widths) are averaged by tokens, a claim capped at
    # guard_norm_ratio x the other sites' median (trainer.outer.guard.token_weights); equal: one vote each
    outer_lr: float | None = None  # Nesterov SGD on the pseudo-gradient (localsgd forces 1.0); unset:
    # trainer.rules.outer_rule.default_outer_hparams(h, mode, rounds), the rule measured per H, mode and rounds
    outer_momentum: float | None = None  # (localsgd forces 0); unset: the same rule. The paper's 0.9
    # overshoots at small H and under staleness (BENCHMARKS.md, quality of every sync mode)
    elastic_lr: bool = True  # scale outer lr by K_active / K_nominal
    sites: int = 2  # K_nominal: sites the run was planned with
    min_sites: int = 1  # fewer live sites than this: the round is not committed
    grace: float = 0.0  # sync, overlap: how long a round's quorum waits for a live site that has not asked
    # yet, as a multiple of the exchange tune-h predicted for this spec and H (launch sets the Lighthouse's
    # run.join_timeout_ms from it: dilococtl/grace.py); 0: run.join_timeout_ms as written
    compression: str = "none"  # codec chain, e.g. "int8", "fp8", "fp4", "powersgd:16+int8", "topk:0.01+fp4"
    error_feedback: bool = True  # carry the compression residual into the next round
    error_feedback_decay: float = 0.5  # the residual carried is decay * what the round lost. A site
    # restarts each round from the global parameters, so its inner steps re-learn much of what the
    # codec dropped; with the full residual (1.0, classic error feedback) that is counted twice, and
    # PowerSGD did worse than with none. Top-k differs: with plain outer SGD (outer_momentum 0,
    # outer_lr 1) its residual does the momentum's work; carry 0.95 (SparseLoCo; BENCHMARKS.md, compression)
    stochastic_rounding: bool = False  # int8/fp8/fp4: unbiased stochastic rounding instead of round-to-nearest
    codec_chunk: int = 1024  # int8/fp8/fp4: values sharing one scale (smaller: closer fit, more scale bytes)
    codec_scale_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"  # int8/fp8/fp4: wire type of those scales
    codec_topk_block: int = 4096  # top-k keeps its fraction of every block of this many values (at most
    # 65536: offsets are 16-bit); small blocks spread what is kept over the whole tensor: 4096 did
    # better than 65536 (BENCHMARKS.md, compression); the sparse codec's chunks (at most 4096: 12-bit offsets)
    codec_sparse_merge: int = 1  # sparse codec: each shard's owner sends back this many times k values of every
    # merged chunk (the sites' choices differ, so the merge holds up to K x k): more keeps more of each round
    # at that many times the all-gather's bytes; 1 keeps a round's bytes those of a ring all-reduce
    mode: Literal["sync", "overlap", "async"] = "sync"  # when the outer update is applied
    link_mbit: float = 1000.0  # slowest WAN link, Mbit/s: sizes the exchange timeouts
    timeout_s: float = 0.0  # fixed exchange timeout (0: derived from payload and link_mbit)
    transport: Literal["auto", "gloo", "tls"] = "auto"  # cross-site data plane: trainer.transport (mutual
    # TLS 1.3 under the run's CA, transport_streams connections per peer and direction; needs
    # run.tls_ca/tls_cert/tls_key, which launch makes for every run) or torchft's gloo (plaintext, one
    # connection per peer, heal state unpickled: trusted networks only, named explicitly); auto: tls,
    # an error without the identity (never a silent gloo). Sync, overlap and ddp modes
    transport_streams: int = 4  # tls: connections per peer and direction; a link whose bandwidth-delay
    # product exceeds one TCP window needs about BDP / window of them
    transport_pace_mbit: float = 0.0  # tls: pace the streams to each peer to this total, Mbit/s (0: off);
    # near the link rate, so many streams do not overrun a shallow bottleneck queue (BENCHMARKS.md, transport)
    transport_link_pace_mbit: dict[str, float] = field(default_factory=dict)  # tls: per directed link
    # "SRC->DST" (site names), what SRC's streams to DST are paced to in all, Mbit/s per process (0:
    # unpaced); overrides transport_pace_mbit on that link. Links of different rates each need their
    # own: tune-h --write derives it per link (dilococtl/tune/choose.py, derive_link_pace)
    transport_congestion: str = "auto"  # tls: TCP congestion control of the streams; auto: CUBIC, else
    # Reno (loss-based, whose window tune-h models; trainer.transport.tcp_cc), a name (e.g. "bbr"), or "" for the host's
    transport_loopback_clear: bool = True  # tls: a stream whose two ends are loopback addresses (sites
    # on one host) leaves TLS after the authenticated hello and carries chunks in the clear: its bytes
    # never leave the kernel, and the cipher was most of its cost (BENCHMARKS.md, "Loopback"); false
    # keeps every stream encrypted
    async_alpha: float | None = None  # async: a push of staleness γ is dampened by 1/(1+αγ); unset: the
    # rule's (trainer.rules.outer_rule.async_alpha: 0.5, 0 in runs of at most 5 rounds)
    async_dampening: Literal["inverse", "sqrt"] = "inverse"  # async: 1/(1+αγ), or 1/sqrt(1+γ)
    async_momentum: Literal["push", "delayed"] = "push"  # async: Nesterov momentum stepped on every push,
    # or once per K pushes with each push's own step plain SGD (delayed Nesterov, arXiv 2401.09135)
    overlap_mix: float = 0.0  # overlap: fraction of its own parameters a site keeps when the late update
    # lands (Streaming DiLoCo's mixing factor); 0: θ_{t+1} plus its own progress since
    overlap_land: float | None = None  # overlap, async: fraction of the next round after which a round's
    # update lands and the site rebases on it (1: at the round's end; trainer.outer.optimizer.land_step); an exchange
    # still in flight then is waited for. Unset: launch lands it as soon as the exchange tune-h predicted
    # for this spec and H is done (trainer.rules.outer_rule.land_for), else at UNTUNED_LAND (overlap 5%, async 10%)
    fragments: int = 1  # sync, overlap: Streaming DiLoCo's fragments (trainer/rules/fragments.py): the parameter
    # tensors dealt into F fragments of about equal size, fragment f exchanged (its own quorum, guard, codec
    # state and outer step) after inner step floor((f+1)H/F) of each round, so one exchange carries ~1/F of
    # the bytes
    async_checkpoint_every: int = 10  # async: the outer service saves its state every this many versions (0: off)
    async_turns: bool = False  # async: pushes take turns in site order (site i's j-th push makes version
    # j*sites+i+1; a site waits for its turn). A reproducible run, equal to the simulator's async mode with
    # sites of equal speed, at the cost of async's freedom: for debugging and comparing settings, fresh runs
    guard_norm_ratio: float = 3.0  # a contribution whose norm exceeds this many times the median of the
    # other sites' norms (computed from the bytes received) is dropped for the round (0: off), as a
    # non-finite one always is (trainer/outer/guard.py); the async service clips a push to this many times
    # the OTHER sites' recent pushes' median instead (a site never raises its own bound)
    guard_max_norm: float = 0.0  # absolute bound on a contribution's norm, clipped to it (0: none)
    guard_min_cosine: float = -0.5  # 2 sites: their contributions' cosine under this and the round is not
    # committed (with 2 sites a liar cannot be told from the honest site; trainer/outer/guard.py). Not 0: two
    # honest sites agree less as training goes on (tiny, H 300: 0.01-0.23 late; H 1000 with 4 fragments
    # down to -0.03; a lab run at H 1210 -0.04 to -0.2), and each refusal threw away both sites' round
    # (3 of 4 rounds in that run). A site's own pseudo-gradient sent flipped while the two agree is still
    # refused; a vector orthogonal to the honest one never was, at any bound
    aggregate: Literal["auto", "mean", "median", "trimmed", "clip", "filter"] = "auto"  # how the kept
    # contributions combine (trainer/outer/aggregate.py): auto is filter from 3 sites on, else the mean; top-k
    # codecs (sites send different coordinates) allow only the mean
    aggregate_clip_ratio: float = 2.0  # clip, filter: a contribution farther from the coordinate median than
    # this many times the sites' median distance is clipped to it (clip) or dropped (filter)
    aggregate_trim: int = -1  # trimmed: values dropped at each end of every coordinate (-1: (K-1)//2)

    def codec_options(self):
        """The codec options these knobs set (a trainer.rules.codec_spec.CodecOptions)."""
        from trainer.rules.codec_spec import CodecOptions  # no torch

        return CodecOptions(chunk=self.codec_chunk, scale_dtype=self.codec_scale_dtype,
                            stochastic=self.stochastic_rounding, topk_block=self.codec_topk_block,
                            sparse_merge=self.codec_sparse_merge)

    @staticmethod
    def expand_table(table: dict[str, Any]) -> dict[str, Any]:
        """The [diloco] table with its shorthands spelled out (trainer.rules.tables reads it after this):
        `h = "auto"` adapts H from h_min (h_auto), and `compression = NAME` of a codec preset is its settings."""
        if table.get("h") == "auto":
            table = {**table, "h": table.get("h_min", 10), "h_auto": True}
        from trainer.rules.codec_spec import expand_preset  # no torch

        return expand_preset(table)


def fragment_checks(d: DilocoConfig, model: ModelConfig, pp: int) -> list[tuple[bool, str, str]]:
    """diloco.fragments: 1 to the model's parameter tensors and to H; more than 1 only for rounds in lockstep."""
    f = d.fragments
    try:
        n = param_tensors(model)
    except ConfigError:  # a bad model is reported by its own check
        n = f
    return [
        (f >= 1, "diloco.fragments", f"must be >= 1, got {f}"),
        (f <= n, "diloco.fragments", f"{f} fragments of a model with {n} parameter tensors: at most {n}"),
        (f == 1 or (d.mode != "async" and d.algorithm != "ddp"), "diloco.fragments",
         f"{f} fragments need outer rounds in lockstep (mode sync or overlap, algorithm diloco or localsgd)"),
        (f == 1 or not d.h_auto, "diloco.fragments", f"{f} fragments need a fixed H, not h = 'auto'"),
        (d.h_auto or f <= d.h, "diloco.fragments", f"{f} fragments in a round of H = {d.h} inner steps: at most H"),
        (f == 1 or pp == 1, "diloco.fragments",
         f"{f} fragments split the parameters by index, which pipeline stages (parallel.pp) do not share"),
    ]


def link_pace_checks(table: dict[str, float]) -> list[tuple[bool, str, str]]:
    """diloco.transport_link_pace_mbit: keys SRC->DST of two different site names, values finite, >= 0."""
    out = [(len(table) <= 256 * 255, "diloco.transport_link_pace_mbit", f"{len(table)} links; at most 256 x 255")]
    for key, mbit in table.items():
        name = f"diloco.transport_link_pace_mbit.{key[:80]!r}"
        try:
            src, dst = parse_link_key(key)
            ok = bool(SITE_NAME_RE.fullmatch(src) and SITE_NAME_RE.fullmatch(dst)) and src != dst
        except ValueError:
            ok = False
        out.append((ok, name, "keys must be SRC->DST, two different site names"))
        out.append((math.isfinite(mbit) and 0 <= mbit <= 1e7, name, f"must be a finite number in [0, 1e7] (0: unpaced), got {mbit}"))
    return out

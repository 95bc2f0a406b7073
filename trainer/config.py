"""Typed trainer configuration: one dataclass per component, every knob documented here once.

No torch import: the control plane validates run specs with these same classes.
The trainer reads a TOML file whose tables are named like the fields of `TrainerConfig`
(`[model]`, `[data]`, `[train]`, `[diloco]`, `[checkpoint]`, `[run]`, `[parallel]`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the key."""


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


MAX_WAIT_S = 86400.0  # the longest wait or timeout any knob may set: a day (every wait has a finite bound)


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    preset: str = "tiny"  # named size: tiny | small | 125m | 1b | 7b (fields below override it)
    dim: int = 0  # hidden size (0: from the preset)
    n_layers: int = 0  # transformer blocks (0: from the preset)
    n_heads: int = 0  # attention heads (0: from the preset)
    n_kv_heads: int = 0  # key/value heads for grouped-query attention (0: = n_heads)
    ffn_hidden: int = 0  # SwiGLU hidden size (0: from the preset)
    vocab_size: int = 0  # tokens; 256 for byte-level text (0: from the preset)
    max_seq_len: int = 0  # longest sequence RoPE is prepared for (0: from the preset)
    rope_theta: float = 10000.0  # RoPE base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # share the input embedding with the output head


# name -> (dim, n_layers, n_heads, n_kv_heads, ffn_hidden, vocab_size, max_seq_len)
PRESETS: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "tiny": (64, 2, 4, 2, 176, 256, 128),  # CPU tests: ~0.1M parameters
    "small": (384, 6, 6, 6, 1024, 256, 256),  # CPU benchmarks: ~10.8M parameters
    "125m": (768, 12, 12, 12, 1792, 32000, 2048),  # GPU: ~127M
    "1b": (2048, 24, 16, 8, 3840, 32000, 2048),  # GPU: ~1.00B (24 layers: 8 or 4 pipeline stages)
    "7b": (4096, 32, 32, 32, 11008, 32000, 4096),  # GPU: ~6.74B (LLaMA-2 7B shape)
}


def resolve_model(cfg: ModelConfig) -> ModelConfig:
    """Fill the zero fields of `cfg` from its preset."""
    if cfg.preset not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {cfg.preset!r} (known: {', '.join(PRESETS)})")
    dim, layers, heads, kv, ffn, vocab, seq = PRESETS[cfg.preset]
    out = dataclasses.replace(cfg)
    for name, value in (("dim", dim), ("n_layers", layers), ("n_heads", heads), ("n_kv_heads", kv),
                        ("ffn_hidden", ffn), ("vocab_size", vocab), ("max_seq_len", seq)):
        if getattr(out, name) == 0:
            setattr(out, name, value)
    if out.dim % out.n_heads:
        raise ConfigError(f"model.dim: {out.dim} is not divisible by n_heads {out.n_heads}")
    if out.n_heads % out.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads: {out.n_kv_heads} does not divide n_heads {out.n_heads}")
    if (out.dim // out.n_heads) % 2:  # rotary embeddings turn pairs of a head's channels
        raise ConfigError(f"model.dim: {out.dim} / n_heads {out.n_heads} = head dimension {out.dim // out.n_heads}, "
                          f"which must be even for rotary embeddings")
    return out


def param_count(cfg: ModelConfig) -> int:
    """Exact number of parameters of the model `trainer.model.Transformer` builds for `cfg`."""
    m = resolve_model(cfg)
    head_dim = m.dim // m.n_heads
    attn = m.dim * m.dim * 2 + m.dim * m.n_kv_heads * head_dim * 2  # q, o, k, v (no biases)
    mlp = 3 * m.dim * m.ffn_hidden  # SwiGLU: w1, w3 in, w2 out
    block = attn + mlp + 2 * m.dim  # two RMSNorm weights
    embed = m.vocab_size * m.dim * (1 if m.tie_embeddings else 2)
    return m.n_layers * block + embed + m.dim  # final norm


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: Literal["shakespeare", "shards"] = "shakespeare"  # bundled corpus, or token shards
    path: str = ""  # shards: a directory of *.bin token files + meta.json
    val_plays: int = 3  # shakespeare: whole plays held out for validation
    seq_len: int = 64  # tokens per training sequence
    batch_size: int = 8  # sequences per step per process
    seed: int = 1234  # order of sequences within each site's partition


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    lr: float = 3e-3  # inner AdamW peak learning rate
    min_lr_ratio: float = 0.1  # final lr as a fraction of the peak
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # after warmup
    warmup_steps: int = 20  # linear warmup, in inner steps
    decay_fraction: float = 0.2  # wsd: the last fraction of steps that decays
    steps: int = 0  # inner steps per site for the whole run; the lr schedule spans exactly these and
    # the run ends when they are done, whatever H does (0: diloco.h * diloco.rounds). With h = "auto"
    # set it: H changes, so rounds alone do not say how long the run is
    beta1: float = 0.9  # AdamW
    beta2: float = 0.95  # AdamW
    weight_decay: float = 0.1  # AdamW, decoupled
    grad_clip: float = 1.0  # max global grad norm (0: off)
    seed: int = 0  # model initialisation; equal at every site
    eval_every: int = 1  # rounds between validation passes (0: only at the end)
    eval_batches: int = 8  # validation batches per pass
    device: str = "auto"  # auto | cpu | cuda
    bf16: bool = True  # bf16 autocast on CUDA (ignored on CPU)
    threads: int = 0  # torch intra-op threads (0: torch's default)
    diverge_evals: int = 3  # validation ppl rising this many evaluations in a row (or non-finite) raises
    # a 'diverging' event (0: off)
    stop_on_divergence: bool = False  # then stop the run (exit 1) instead of burning compute; the newest
    # checkpoint at or before the best evaluation is named in the event, for `resume --round`


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
    # guard_norm_ratio x the other sites' median (trainer.guard.token_weights); equal: one vote each
    outer_lr: float | None = None  # Nesterov SGD on the pseudo-gradient (localsgd forces 1.0); unset:
    # trainer.outer_rule.default_outer_hparams(h, mode, rounds), the rule measured per H, mode and rounds
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
    # own: tune-h --write derives it per link (dilococtl/tune.py, derive_link_pace)
    transport_congestion: str = "auto"  # tls: TCP congestion control of the streams; auto: CUBIC, else
    # Reno (loss-based, whose window tune-h models; trainer.tcp_cc), a name (e.g. "bbr"), or "" for the host's
    transport_loopback_clear: bool = True  # tls: a stream whose two ends are loopback addresses (sites
    # on one host) leaves TLS after the authenticated hello and carries chunks in the clear: its bytes
    # never leave the kernel, and the cipher was most of its cost (BENCHMARKS.md, "Loopback"); false
    # keeps every stream encrypted
    async_alpha: float | None = None  # async: a push of staleness γ is dampened by 1/(1+αγ); unset: the
    # rule's (trainer.outer_rule.async_alpha: 0.5, 0 in runs of at most 5 rounds)
    async_dampening: Literal["inverse", "sqrt"] = "inverse"  # async: 1/(1+αγ), or 1/sqrt(1+γ)
    async_momentum: Literal["push", "delayed"] = "push"  # async: Nesterov momentum stepped on every push,
    # or once per K pushes with each push's own step plain SGD (delayed Nesterov, arXiv 2401.09135)
    overlap_mix: float = 0.0  # overlap: fraction of its own parameters a site keeps when the late update
    # lands (Streaming DiLoCo's mixing factor); 0: θ_{t+1} plus its own progress since
    overlap_land: float | None = None  # overlap, async: fraction of the next round after which a round's
    # update lands and the site rebases on it (1: at the round's end; trainer.outer.land_step); an exchange
    # still in flight then is waited for. Unset: launch lands it as soon as the exchange tune-h predicted
    # for this spec and H is done (trainer.outer_rule.land_for), else at UNTUNED_LAND (overlap 5%, async 10%)
    fragments: int = 1  # sync, overlap: Streaming DiLoCo's fragments (trainer/fragments.py): the parameter
    # tensors dealt into F fragments of about equal size, fragment f exchanged (its own quorum, guard, codec
    # state and outer step) after inner step floor((f+1)H/F) of each round, so one exchange carries ~1/F of
    # the bytes
    async_checkpoint_every: int = 10  # async: the outer service saves its state every this many versions (0: off)
    async_turns: bool = False  # async: pushes take turns in site order (site i's j-th push makes version
    # j*sites+i+1; a site waits for its turn). A reproducible run, equal to the simulator's async mode with
    # sites of equal speed, at the cost of async's freedom: for debugging and comparing settings, fresh runs
    guard_norm_ratio: float = 3.0  # a contribution whose norm exceeds this many times the median of the
    # other sites' norms (computed from the bytes received) is dropped for the round (0: off), as a
    # non-finite one always is (trainer/guard.py); the async service clips a push to this many times
    # the OTHER sites' recent pushes' median instead (a site never raises its own bound)
    guard_max_norm: float = 0.0  # absolute bound on a contribution's norm, clipped to it (0: none)
    guard_min_cosine: float = -0.5  # 2 sites: their contributions' cosine under this and the round is not
    # committed (with 2 sites a liar cannot be told from the honest site; trainer/guard.py). Not 0: two
    # honest sites agree less as training goes on (tiny, H 300: 0.01-0.23 late; H 1000 with 4 fragments
    # down to -0.03; a lab run at H 1210 -0.04 to -0.2), and each refusal threw away both sites' round
    # (3 of 4 rounds in that run). A site's own pseudo-gradient sent flipped while the two agree is still
    # refused; a vector orthogonal to the honest one never was, at any bound
    aggregate: Literal["auto", "mean", "median", "trimmed", "clip", "filter"] = "auto"  # how the kept
    # contributions combine (trainer/aggregate.py): auto is filter from 3 sites on, else the mean; top-k
    # codecs (sites send different coordinates) allow only the mean
    aggregate_clip_ratio: float = 2.0  # clip, filter: a contribution farther from the coordinate median than
    # this many times the sites' median distance is clipped to it (clip) or dropped (filter)
    aggregate_trim: int = -1  # trimmed: values dropped at each end of every coordinate (-1: (K-1)//2)

    def codec_options(self):
        """The codec options these knobs set (a trainer.codec_spec.CodecOptions)."""
        from trainer.codec_spec import CodecOptions  # no torch

        return CodecOptions(chunk=self.codec_chunk, scale_dtype=self.codec_scale_dtype,
                            stochastic=self.stochastic_rounding, topk_block=self.codec_topk_block,
                            sparse_merge=self.codec_sparse_merge)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every_rounds: int = 1  # rounds between checkpoints (0: off)
    keep: int = 3  # newest checkpoints kept per site, locally and in each store
    async_save: bool = True  # DCP async_save: training goes on while it writes
    # object store every checkpointed round is uploaded to in the background, under RUN_ID/SITE/ (s3://bucket/prefix
    # or file:///shared/path; "" = local disk only); credentials only from the AWS chain (env, profile, instance
    # role), never here. [[sites]] checkpoint_store overrides it per site (trainer.snapshot_store)
    store: str = ""
    store_endpoint: str = ""  # S3-compatible service URL ("" = AWS itself, or $AWS_ENDPOINT_URL_S3)
    store_region: str = ""  # S3 region ("" = the AWS chain's)
    replicas: int = 1  # stores each round lands in: the site's own, then the next sites' stores in spec order
    replica_stores: list[str] = field(default_factory=list)  # launch fills it from `replicas`: the further stores


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    tp: int = 1  # tensor-parallel degree (inside a node: it all-reduces every layer)
    pp: int = 1  # pipeline stages (layers split in order; fits the slower links between nodes)
    dp_shard: int = 1  # FSDP2 degree: parameters, grads and AdamW state sharded over this many replicas
    microbatches: int = 0  # pipeline microbatches per step (0: = pp); must divide data.batch_size
    pp_schedule: Literal["gpipe", "1f1b"] = "1f1b"  # 1f1b holds fewer activations than gpipe
    sequence_parallel: bool = True  # with tp: norms run on sequence shards (less activation memory)
    compile: bool = False  # torch.compile each block (GPU only: ignored on CPU, where it costs more than it saves)


@dataclass(kw_only=True, slots=True)
class RunConfig:
    run_id: str = "run"  # the run's id in the control plane's records
    run_dir: str = "runs/run"  # per-site metrics and checkpoints go under RUN_DIR/SITE/
    site: str = "site0"  # this site's name
    site_index: int = 0  # this site's index in [0, sites): selects its data partition
    lighthouse: str = ""  # torchft Lighthouse URL (empty: TORCHFT_LIGHTHOUSE)
    lighthouse_site: str = ""  # transport "tls": the Lighthouse is behind a mutual-TLS relay whose certificate
    # names this (trainer.transport.relay); empty: the Lighthouse is dialled directly, in plaintext
    lighthouse_loopback: str = ""  # with lighthouse_site, for a site whose leader runs on the Lighthouse's host:
    # the Lighthouse's own loopback URL, dialled directly, not through the relay (launch sets it; that port is open
    # to local processes anyway, and the relay's two Python hops each way took a loopback quorum from 2.0 to 3.4 ms)
    grace_s: float = 30.0  # on SIGTERM: time allowed for the final checkpoint
    startup_wait_s: float = 120.0  # a fresh run waits this long for all sites before training alone
    resume: bool = True  # start from this site's newest valid checkpoint when there is one
    resume_round: int = -1  # whole-run restart: load the newest checkpoint <= this round, wait for all sites (-1: off)
    service_url: str = ""  # async: https URL of the outer parameter service
    service_cert: str = ""  # async: its PEM certificate, pinned (the only one trusted)
    service_token_file: str = ""  # async: file holding the bearer token for pushes and pulls
    service_retry_s: float = 60.0  # async: how long an unreachable service is retried before the site fails
    tls_ca: str = ""  # transport "tls": PEM certificate of the run's CA, the only one trusted
    tls_cert: str = ""  # transport "tls": this site's PEM certificate (its CN and DNS name are run.site)
    tls_key: str = ""  # transport "tls": this site's PEM private key (mode 0600, or it is refused)
    transport_host: str = ""  # transport "tls": the address other sites dial (empty: this node's hostname)
    transport_port: int = 0  # transport "tls": listening port of local rank 0, rank i uses port + i (0: any
    # free one); published through torchft's store


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    diloco: DilocoConfig = field(default_factory=DilocoConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    @property
    def total_steps(self) -> int:
        """Inner steps per site the run takes and the lr schedule spans (trainer.schedule.round_h)."""
        return self.train.steps or self.diloco.h * self.diloco.rounds


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(hint))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is type(None):
        return value is None
    if origin is dict:
        kt, vt = typing.get_args(hint)
        return isinstance(value, dict) and all(_type_ok(k, kt) and _type_ok(v, vt) for k, v in value.items())
    if origin is list:
        (vt,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(v, vt) for v in value)
    return isinstance(value, hint)


def section_from_dict(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a TOML table; unknown keys and wrong types raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a table, got {type(data).__name__}")
    if cls is DilocoConfig and data.get("h") == "auto":  # `h = "auto"`: adapt H from h_min
        data = {**data, "h": data.get("h_min", 10), "h_auto": True}
    if cls is DilocoConfig:
        from trainer.codec_spec import expand_preset  # no torch

        data = expand_preset(data)
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = f"{where}.{key}" if where else key
        if key not in known:
            raise ConfigError(f"{name}: unknown key (known: {', '.join(sorted(known))})")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = section_from_dict(hint, value, name)
            continue
        if not _type_ok(value, hint):
            origin = typing.get_origin(hint)
            want = (", ".join(map(repr, typing.get_args(hint))) if origin is Literal
                    else "a table of numbers" if origin is dict else getattr(hint, "__name__", str(hint)))
            got = repr(value)  # a table may be huge: the message stays one short line
            raise ConfigError(f"{name}: expected {want}, got {got[:200]}{'...' if len(got) > 200 else ''}")
        if hint is float:
            value = float(value)
        elif typing.get_origin(hint) is dict and typing.get_args(hint)[1] is float:
            value = {k: float(v) for k, v in value.items()}
        kwargs[key] = value
    return cls(**kwargs)


def validate(cfg: TrainerConfig) -> TrainerConfig:
    """Check values the types cannot; returns cfg with the model resolved from its preset."""
    d, t, m = cfg.diloco, cfg.train, cfg.model
    _check_values(cfg)
    checks = [
        (d.h > 0, "diloco.h", f"must be > 0, got {d.h}"),
        (d.rounds > 0, "diloco.rounds", f"must be > 0, got {d.rounds}"),
        (not d.h_auto or 0 < d.h_min <= d.h_max, "diloco.h_min", f"must be in (0, h_max={d.h_max}], got {d.h_min}"),
        (not d.h_auto or 0 < d.sync_budget < 1, "diloco.sync_budget", f"must be in (0, 1), got {d.sync_budget}"),
        (not d.h_auto or d.algorithm != "ddp", "diloco.h", "'auto' needs outer rounds; the ddp baseline has none"),
        (d.sites > 0, "diloco.sites", f"must be > 0, got {d.sites}"),
        (1 <= d.min_sites <= d.sites, "diloco.min_sites", f"must be in [1, sites={d.sites}], got {d.min_sites}"),
        (0 <= d.grace <= 100, "diloco.grace", f"must be in [0, 100] (x the predicted exchange; 0: off), got {d.grace}"),
        (d.grace == 0 or (d.mode != "async" and d.algorithm != "ddp"), "diloco.grace",
         "a quorum's wait for late sites: async sites push on their own, ddp has no rounds to commit without one"),
        (d.outer_lr is None or d.outer_lr > 0, "diloco.outer_lr", f"must be > 0, got {d.outer_lr}"),
        (d.outer_momentum is None or 0 <= d.outer_momentum < 1, "diloco.outer_momentum",
         f"must be in [0, 1), got {d.outer_momentum}"),
        (0 <= d.overlap_mix < 1, "diloco.overlap_mix", f"must be in [0, 1), got {d.overlap_mix}"),
        (d.overlap_land is None or 0 < d.overlap_land <= 1, "diloco.overlap_land",
         f"must be in (0, 1], got {d.overlap_land}"),
        (0 <= d.error_feedback_decay <= 1, "diloco.error_feedback_decay", f"must be in [0, 1], got {d.error_feedback_decay}"),
        (d.codec_chunk >= 1, "diloco.codec_chunk", f"must be >= 1, got {d.codec_chunk}"),
        (1 <= d.codec_topk_block <= 65536, "diloco.codec_topk_block", f"must be in [1, 65536], got {d.codec_topk_block}"),
        (1 <= d.codec_sparse_merge <= 64, "diloco.codec_sparse_merge", f"must be in [1, 64], got {d.codec_sparse_merge}"),
        # a bound on both sides: the exchange timeout is derived from it (trainer.ft.exchange_timeout)
        (0.01 <= d.link_mbit <= 1e6, "diloco.link_mbit", f"must be in [0.01, 1e6] Mbit/s, got {d.link_mbit:g}"),
        (d.async_alpha is None or d.async_alpha >= 0, "diloco.async_alpha", f"must be >= 0, got {d.async_alpha}"),
        (d.async_checkpoint_every >= 0, "diloco.async_checkpoint_every", "must be >= 0"),
        (0 <= cfg.train.diverge_evals <= 1000, "train.diverge_evals", f"must be in [0, 1000], got {cfg.train.diverge_evals}"),
        (math.isfinite(d.guard_norm_ratio) and (d.guard_norm_ratio == 0 or d.guard_norm_ratio >= 1),
         "diloco.guard_norm_ratio", f"must be 0 (off) or a finite number >= 1, got {d.guard_norm_ratio}"),
        (math.isfinite(d.guard_max_norm) and d.guard_max_norm >= 0, "diloco.guard_max_norm",
         f"must be a finite number >= 0 (0: none), got {d.guard_max_norm}"),
        (math.isfinite(d.guard_min_cosine) and -1 <= d.guard_min_cosine <= 1, "diloco.guard_min_cosine",
         f"must be in [-1, 1], got {d.guard_min_cosine}"),
        (math.isfinite(d.aggregate_clip_ratio) and d.aggregate_clip_ratio >= 1, "diloco.aggregate_clip_ratio",
         f"must be a finite number >= 1, got {d.aggregate_clip_ratio}"),
        (-1 <= d.aggregate_trim < max(d.sites, 1) / 2, "diloco.aggregate_trim",
         f"must be -1 (auto) or in [0, sites/2), got {d.aggregate_trim} with {d.sites} sites"),
        (d.aggregate in ("auto", "mean") or not _sparse(d.compression), "diloco.aggregate",
         f"{d.aggregate!r} combines coordinate by coordinate, but a sparse codec ({d.compression}) sends each "
         f"site's own coordinates: use 'mean' or 'auto'"),
        (d.mode != "async" or not d.h_auto, "diloco.h", "'auto' needs rounds in lockstep; async sites have none"),
        (d.mode != "async" or (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp_shard) == (1, 1, 1),
         "diloco.mode", "'async' runs plain data-parallel sites only (parallel.tp, pp and dp_shard must be 1)"),
        (not cfg.run.service_url or cfg.run.service_url.startswith("https://"), "run.service_url",
         f"must be an https:// URL (the service speaks TLS only), got {cfg.run.service_url!r}"),
        (0 <= cfg.run.service_retry_s <= MAX_WAIT_S, "run.service_retry_s",
         f"must be in [0, {MAX_WAIT_S:g}] seconds, got {cfg.run.service_retry_s}"),
        (0 <= cfg.run.grace_s <= MAX_WAIT_S, "run.grace_s", f"must be in [0, {MAX_WAIT_S:g}] seconds, got {cfg.run.grace_s}"),
        (0 <= cfg.run.startup_wait_s <= MAX_WAIT_S, "run.startup_wait_s",
         f"must be in [0, {MAX_WAIT_S:g}] seconds, got {cfg.run.startup_wait_s}"),
        (1 <= d.transport_streams <= 256, "diloco.transport_streams", f"must be in [1, 256], got {d.transport_streams}"),
        (re.fullmatch(r"[a-z0-9_]{0,15}", d.transport_congestion) is not None, "diloco.transport_congestion",
         f"must name a TCP congestion control (e.g. cubic, bbr), got {d.transport_congestion!r}"),
        (math.isfinite(d.transport_pace_mbit) and d.transport_pace_mbit >= 0, "diloco.transport_pace_mbit",
         f"must be a finite number >= 0 (0: off), got {d.transport_pace_mbit}"),
        *_link_pace_checks(d.transport_link_pace_mbit),
        *_fragment_checks(cfg),
        # it bypasses the relay, so it may only ever name this host's loopback
        (not cfg.run.lighthouse_loopback or
         re.fullmatch(r"http://(127\.0\.0\.1|\[::1\]):\d{1,5}", cfg.run.lighthouse_loopback) is not None,
         "run.lighthouse_loopback", f"must be http://127.0.0.1:PORT or http://[::1]:PORT, got {cfg.run.lighthouse_loopback!r}"),
        (0 <= cfg.run.transport_port <= 65535, "run.transport_port", f"must be in [0, 65535], got {cfg.run.transport_port}"),
        (0 <= d.timeout_s <= MAX_WAIT_S, "diloco.timeout_s", f"must be in [0, {MAX_WAIT_S:g}] seconds (0: derived), got {d.timeout_s}"),
        (d.mode == "sync" or d.algorithm == "diloco" or d.algorithm == "localsgd", "diloco.mode",
         f"{d.mode!r} needs an outer step; the '{d.algorithm}' baseline runs in 'sync' mode"),
        (d.h_policy == "steps" or (d.mode != "async" and d.algorithm != "ddp"), "diloco.h_policy",
         "'time' paces the rounds of sync and overlap DiLoCo; async sites already run at their own pace, ddp "
         "has no rounds"),
        (not d.late_merge or (d.mode == "sync" and d.algorithm != "ddp"), "diloco.late_merge",
         "merges a late site's round into the next exchange of sync DiLoCo (overlap already lands a round late, "
         "async dampens every push)"),
        (d.h_policy == "steps" or not (t.steps or d.h_auto), "diloco.h_policy",
         "'time' runs a number of rounds: size the run with diloco.rounds and a fixed h, not train.steps or "
         "h = \"auto\""),
        (t.lr > 0, "train.lr", f"must be > 0, got {t.lr}"),
        (t.warmup_steps >= 0, "train.warmup_steps", f"must be >= 0, got {t.warmup_steps}"),
        (t.steps >= 0, "train.steps", f"must be >= 0, got {t.steps}"),
        (not t.steps or d.mode != "async", "train.steps", "async sites count pushes, not steps: size the run with diloco.rounds"),
        (0 < t.decay_fraction <= 1, "train.decay_fraction", f"must be in (0, 1], got {t.decay_fraction}"),
        (t.grad_clip >= 0, "train.grad_clip", f"must be >= 0, got {t.grad_clip}"),
        (0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}"),
        (0 <= t.beta1 < 1, "train.beta1", f"must be in [0, 1), got {t.beta1}"),
        (0 <= t.beta2 < 1, "train.beta2", f"must be in [0, 1), got {t.beta2}"),
        (t.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {t.weight_decay}"),
        (t.seed >= 0, "train.seed", f"must be >= 0, got {t.seed}"),
        (t.eval_every >= 0, "train.eval_every", f"must be >= 0 (0: only at the end), got {t.eval_every}"),
        (t.eval_batches >= 1, "train.eval_batches", f"must be >= 1, got {t.eval_batches}"),
        (t.threads >= 0, "train.threads", f"must be >= 0 (0: torch's default), got {t.threads}"),
        *((getattr(m, k) >= 0, f"model.{k}", f"must be >= 0 (0: from the preset), got {getattr(m, k)}")
          for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len")),
        (m.rope_theta > 0, "model.rope_theta", f"must be > 0, got {m.rope_theta}"),
        (m.norm_eps > 0, "model.norm_eps", f"must be > 0, got {m.norm_eps}"),
        (cfg.data.seed >= 0, "data.seed", f"must be >= 0, got {cfg.data.seed}"),
        (cfg.data.source != "shakespeare" or cfg.data.val_plays >= 1, "data.val_plays",
         f"must be >= 1 (whole plays held out for validation), got {cfg.data.val_plays}"),
        (t.device in ("auto", "cpu", "cuda"), "train.device", f"must be auto, cpu or cuda, got {t.device!r}"),
        (cfg.data.seq_len > 0, "data.seq_len", f"must be > 0, got {cfg.data.seq_len}"),
        (cfg.data.batch_size > 0, "data.batch_size", f"must be > 0, got {cfg.data.batch_size}"),
        (cfg.data.source != "shards" or bool(cfg.data.path), "data.path", "required when data.source is 'shards'"),
        (cfg.checkpoint.every_rounds >= 0, "checkpoint.every_rounds", "must be >= 0"),
        (cfg.checkpoint.keep >= 1, "checkpoint.keep", "must be >= 1"),
        (cfg.checkpoint.replicas >= 1, "checkpoint.replicas", f"must be >= 1, got {cfg.checkpoint.replicas}"),
        (cfg.checkpoint.replicas <= 1 + len(cfg.checkpoint.replica_stores), "checkpoint.replicas",
         f"{cfg.checkpoint.replicas} stores wanted but "
         f"{len([u for u in [cfg.checkpoint.store, *cfg.checkpoint.replica_stores] if u])} distinct ones named"),
        (bool(cfg.checkpoint.store) or not cfg.checkpoint.replica_stores, "checkpoint.replica_stores",
         "needs checkpoint.store"),
        (cfg.run.resume_round >= -1, "run.resume_round", f"must be >= -1, got {cfg.run.resume_round}"),
        (0 <= cfg.run.site_index < d.sites, "run.site_index", f"must be in [0, sites={d.sites}), got {cfg.run.site_index}"),
    ]
    for ok, key, problem in checks:
        if not ok:
            raise ConfigError(f"{key}: {problem}")
    for url in filter(None, [cfg.checkpoint.store, *cfg.checkpoint.replica_stores]):
        from trainer.snapshot_store import StoreError, check_url  # no boto3

        try:
            check_url(url)
        except StoreError as e:
            raise ConfigError(f"checkpoint.store: {e}") from None
    model = resolve_model(cfg.model)
    _check_parallel(cfg.parallel, model, cfg.data.batch_size)
    if cfg.data.seq_len > model.max_seq_len:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} exceeds model.max_seq_len {model.max_seq_len}")
    if d.compression != "none":
        from trainer.codec_spec import parse_codec_spec  # no torch

        try:
            parse_codec_spec(d.compression)
        except ValueError as e:
            raise ConfigError(f"diloco.compression: {e}") from None
    return dataclasses.replace(cfg, model=model)


TORCHRUN_SHUTDOWN_S = 30  # torchrun's own --shutdown-timeout: a trainer first finishes its round (the next
# safe point), then checkpoints; with 20 s (a 5 s grace + 15) a Slurm site's trainer was SIGKILLed first
TORCHRUN_MARGIN_S = 15  # beyond a longer grace


def torchrun_shutdown_s(grace_s: float) -> int:
    """torchrun's --shutdown-timeout for a trainer with `grace_s` of SIGTERM grace: torchrun forwards the
    TERM and SIGKILLs what still runs after this. Its default (30 s) cuts the final checkpoint of a grace
    near or past it; never less than that default. Below a Slurm site's signal lead (grace + 30 s)."""
    return max(TORCHRUN_SHUTDOWN_S, math.ceil(grace_s) + TORCHRUN_MARGIN_S)


SITE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # fullmatch; as the spec's site names


def param_tensors(m: ModelConfig) -> int:
    """Parameter tensors of the `trainer.model.Transformer` built for `m`: per block 4 attention and 3
    feed-forward matrices and 2 norms; the embedding, the final norm and (untied) the output head."""
    m = resolve_model(m)
    return 9 * m.n_layers + 2 + (0 if m.tie_embeddings else 1)


def _sparse(spec: str) -> bool:
    """The codec sends each site's own coordinates (a bad spec is reported by its own check)."""
    from trainer.codec_spec import is_sparse  # no torch

    try:
        return is_sparse(spec)
    except ValueError:
        return False


def _fragment_checks(cfg: TrainerConfig) -> list[tuple[bool, str, str]]:
    """diloco.fragments: 1 to the model's parameter tensors and to H; more than 1 only for rounds in lockstep."""

    d, f = cfg.diloco, cfg.diloco.fragments
    try:
        n = param_tensors(cfg.model)
    except ConfigError:  # a bad model is reported by its own check
        n = f
    return [
        (f >= 1, "diloco.fragments", f"must be >= 1, got {f}"),
        (f <= n, "diloco.fragments", f"{f} fragments of a model with {n} parameter tensors: at most {n}"),
        (f == 1 or (d.mode != "async" and d.algorithm != "ddp"), "diloco.fragments",
         f"{f} fragments need outer rounds in lockstep (mode sync or overlap, algorithm diloco or localsgd)"),
        (f == 1 or not d.h_auto, "diloco.fragments", f"{f} fragments need a fixed H, not h = 'auto'"),
        (d.h_auto or f <= d.h, "diloco.fragments", f"{f} fragments in a round of H = {d.h} inner steps: at most H"),
        (f == 1 or cfg.parallel.pp == 1, "diloco.fragments",
         f"{f} fragments split the parameters by index, which pipeline stages (parallel.pp) do not share"),
    ]


def _link_pace_checks(table: dict[str, float]) -> list[tuple[bool, str, str]]:
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


def _check_values(cfg: TrainerConfig) -> None:
    """What holds for every knob: numbers are finite (inf or nan as a timeout, a rate or a learning
    rate hangs or poisons a run) and text has no control characters (a newline splits a command or
    a record line, NUL cannot reach the OS)."""
    for sec in dataclasses.fields(cfg):
        obj = getattr(cfg, sec.name)
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ConfigError(f"{sec.name}.{f.name}: must be a finite number, got {v}")
            if isinstance(v, str) and any(not c.isprintable() for c in v):
                raise ConfigError(f"{sec.name}.{f.name}: control characters are not allowed, got {v!r}")


def _check_parallel(par: ParallelConfig, model: ModelConfig, batch_size: int) -> None:
    """Parallelism the model and batch allow; the process count is checked at start (mesh.py)."""
    for knob in ("tp", "pp", "dp_shard"):
        if getattr(par, knob) < 1:
            raise ConfigError(f"parallel.{knob}: must be >= 1, got {getattr(par, knob)}")
    if model.n_heads % par.tp or model.n_kv_heads % par.tp:
        raise ConfigError(f"parallel.tp: {par.tp} does not divide the model's heads "
                          f"(n_heads {model.n_heads}, n_kv_heads {model.n_kv_heads})")
    if par.pp > model.n_layers:
        raise ConfigError(f"parallel.pp: {par.pp} stages for {model.n_layers} layers")
    if model.tie_embeddings and (par.tp > 1 or par.pp > 1):
        raise ConfigError("model.tie_embeddings: not supported with parallel.tp > 1 or parallel.pp > 1")
    mb = par.microbatches or par.pp
    if par.microbatches < 0 or batch_size % mb:
        raise ConfigError(f"parallel.microbatches: {par.microbatches} must be >= 0 and divide "
                          f"data.batch_size {batch_size}")
    if par.pp > 1 and par.pp_schedule == "1f1b" and mb < par.pp:
        raise ConfigError(f"parallel.microbatches: 1f1b needs at least pp = {par.pp} microbatches, got {mb}")


def from_dict(data: dict[str, Any], where: str = "config") -> TrainerConfig:
    """Build and validate a TrainerConfig from nested dicts (a parsed TOML document)."""
    try:
        return validate(section_from_dict(TrainerConfig, data, ""))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def has_identity(cfg: TrainerConfig) -> bool:
    """Whether this site holds its identity under the run's CA (certificate, key, the CA's certificate)."""
    return all((cfg.run.tls_ca, cfg.run.tls_cert, cfg.run.tls_key))


def cross_site_transport(cfg: TrainerConfig) -> str:
    """The data plane a site's exchange runs over: "tls" or "gloo" (diloco.transport "auto" resolved).

    "auto" is "tls", and never falls back to gloo (plaintext, heal state unpickled): a site without
    its identity is an error, and gloo is only ever chosen by name.
    """
    t = cfg.diloco.transport
    if t != "auto":
        return t
    if not has_identity(cfg):
        raise ConfigError(AUTO_NO_IDENTITY.format(missing=", ".join(_missing_identity(cfg))))
    return "tls"


AUTO_NO_IDENTITY = ("diloco.transport: \"auto\" means tls, but this site has no {missing} (launch makes them); "
                    "set transport = \"gloo\" explicitly to exchange in plaintext on a trusted network")


def _missing_identity(cfg: TrainerConfig) -> list[str]:
    r = cfg.run
    return [f"run.{k}" for k in ("tls_ca", "tls_cert", "tls_key") if not getattr(r, k)]


def load(path: str | Path) -> TrainerConfig:
    """Read and validate a trainer TOML file."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: invalid TOML: {e}") from None
    cfg = from_dict(data, str(p))
    d = cfg.diloco
    # a site's identity is filled in by launch (dilococtl.plan), after the spec was checked
    if d.transport == "tls" and d.mode != "async" and not has_identity(cfg):
        raise ConfigError(f"{p}: diloco.transport: 'tls' needs run.tls_ca, run.tls_cert and run.tls_key")
    return cfg


def to_dict(cfg: TrainerConfig) -> dict[str, Any]:
    """Nested dict of `cfg`, ready for tomlkit/json."""
    return dataclasses.asdict(cfg)


def dump_toml(cfg: TrainerConfig) -> str:
    """TOML text that `load` reads back to an equal config."""
    import tomlkit

    # an unset knob (None: a derived default, e.g. diloco.outer_lr) is written as an absent key
    doc = {sec: {k: v for k, v in kv.items() if v is not None} for sec, kv in to_dict(cfg).items()}
    return tomlkit.dumps(doc)

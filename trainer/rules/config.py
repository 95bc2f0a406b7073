"""Typed trainer configuration: one dataclass per component, every knob documented once.

No torch import: the control plane validates run specs with these same classes.
The trainer reads a TOML file whose tables are named like the fields of `TrainerConfig`
(`[model]`, `[data]`, `[train]`, `[diloco]`, `[checkpoint]`, `[run]`, `[parallel]`), with the one
table loader of trainer.rules.tables. [model] is trainer.rules.model_config's, [diloco] trainer.rules.diloco_config's;
the other sections, the checks that span sections (`validate`), and reading and writing the file are here.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainer.rules.diloco_config import DilocoConfig, fragment_checks, link_pace_checks
from trainer.rules.model_config import ModelConfig, resolve_model
from trainer.rules.tables import MAX_WAIT_S, ConfigError, check_values, table_from_dict


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
    peak_tflops: float = 0.0  # MFU: one device's peak TFLOP/s (0: its datasheet's dense bf16 figure where
    # trainer.rules.mfu knows the device by name; unknown, as a CPU: no MFU shown)
    diverge_evals: int = 3  # validation ppl rising this many evaluations in a row (or non-finite) raises
    # a 'diverging' event (0: off)
    stop_on_divergence: bool = False  # then stop the run (exit 1) instead of burning compute; the newest
    # checkpoint at or before the best evaluation is named in the event, for `resume --round`


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every_rounds: int = 1  # rounds between checkpoints (0: off)
    keep: int = 3  # newest checkpoints kept per site, locally and in each store
    async_save: bool = True  # DCP async_save: training goes on while it writes
    # object store every checkpointed round is uploaded to in the background, under RUN_ID/SITE/ (s3://bucket/prefix
    # or file:///shared/path; "" = local disk only); credentials only from the AWS chain (env, profile, instance
    # role), never here. [[sites]] checkpoint_store overrides it per site (trainer.checkpoints.snapshot_store)
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
        """Inner steps per site the run takes and the lr schedule spans (trainer.rules.schedule.round_h)."""
        return self.train.steps or self.diloco.h * self.diloco.rounds


def validate(cfg: TrainerConfig) -> TrainerConfig:
    """Check values the types cannot; returns cfg with the model resolved from its preset."""
    d, t, m = cfg.diloco, cfg.train, cfg.model
    check_values((sec.name, getattr(cfg, sec.name)) for sec in dataclasses.fields(cfg))
    checks = [
        (d.h > 0, "diloco.h", f"must be > 0, got {d.h}"),
        (0 <= t.peak_tflops <= 1e5, "train.peak_tflops", f"must be in [0, 1e5] TFLOP/s (0: from the device), got {t.peak_tflops}"),
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
        # a bound on both sides: the exchange timeout is derived from it (trainer.modes.ft.exchange_timeout)
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
        *link_pace_checks(d.transport_link_pace_mbit),
        *fragment_checks(d, cfg.model, cfg.parallel.pp),
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
        from trainer.checkpoints.snapshot_store import StoreError, check_url  # no boto3

        try:
            check_url(url)
        except StoreError as e:
            raise ConfigError(f"checkpoint.store: {e}") from None
    model = resolve_model(cfg.model)
    _check_parallel(cfg.parallel, model, cfg.data.batch_size)
    if cfg.data.seq_len > model.max_seq_len:
        raise ConfigError(f"data.seq_len: {cfg.data.seq_len} exceeds model.max_seq_len {model.max_seq_len}")
    if d.compression != "none":
        from trainer.rules.codec_spec import parse_codec_spec  # no torch

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


def _sparse(spec: str) -> bool:
    """The codec sends each site's own coordinates (a bad spec is reported by its own check)."""
    from trainer.rules.codec_spec import is_sparse  # no torch

    try:
        return is_sparse(spec)
    except ValueError:
        return False


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
        return validate(table_from_dict(TrainerConfig, data, ""))
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

"""The round pipeline of one site process: H inner steps, the mode's exchange, then the round's records.

One process per local rank (torchrun). Local rank 0 of each site writes the site's metrics.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoints.checkpoint import Checkpointer
from trainer.checkpoints.snapshot_store import checkpoint_stores
from trainer.codecs.compression import Compressor
from trainer.data import load_tokens, val_batches
from trainer.divergence import Diverged, DivergenceWatch, safe_exp
from trainer.modes.exchange import Exchange, ExchangeResult, Preempted
from trainer.modes.ft import RunEnded, announce_end, exchange_timeout, make_manager, transport_note
from trainer.outer.optimizer import OuterState
from trainer.records import METRICS_FILE, MetricsWriter, RoundRecord, StepRecord
from trainer.rules.config import TrainerConfig
from trainer.rules.fragments import compressor, split
from trainer.rules.mfu import device_peak_flops, model_flops_per_token
from trainer.rules.schedule import MAX_TIME_STEPS, planned_rounds, round_h, run_over
from trainer.site import SiteTrainer, flat_average, pick_device

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_PREEMPTED = 143  # 128 + SIGTERM: stopped on request after saving a checkpoint



def mfu_constants(cfg: TrainerConfig, device: torch.device, world: int) -> dict[str, object]:
    """What the control plane computes MFU from (trainer.rules.mfu): a token's training FLOPs, the
    device's name, and the peak FLOP/s of the site's `world` processes (None: unknown device)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    peak = device_peak_flops(name, cfg.train.peak_tflops)
    return {"flops_per_token": model_flops_per_token(cfg.model, cfg.data.seq_len), "device_name": name,
            "peak_flops": peak * world if peak is not None else None}

class _NullMetrics:
    def write(self, rec) -> None:
        pass

    def event(self, *a, **k) -> None:
        pass

    def close(self) -> None:
        pass


def make_exchange(run: SiteRun) -> Exchange:
    """The exchange of the configured mode (the one place that maps a mode to its class)."""
    d = run.cfg.diloco
    if d.mode == "async":
        from trainer.modes.async_mode import AsyncExchange

        return AsyncExchange(run)
    from trainer.modes.ft_exchange import DdpExchange, FragmentOverlapExchange, OverlapExchange, SyncExchange

    if d.algorithm == "ddp":
        return DdpExchange(run)
    if d.mode == "overlap":
        return FragmentOverlapExchange(run) if d.fragments > 1 else OverlapExchange(run)
    return SyncExchange(run)


@dataclass(kw_only=True, slots=True)
class LateRound:
    """A round this site computed that the quorum committed without it (diloco.late_merge)."""

    deltas: list[torch.Tensor]  # its pseudo-gradient, against the θ it started from
    tokens: float  # what it trained on
    missed: int  # rounds committed without it by the time it healed: the staleness γ it lands with
    round: int  # which round it was


class SiteRun:
    """State and round pipeline of one process of one site: compute H inner steps, exchange, finish."""

    def __init__(self, cfg: TrainerConfig, metrics, stop: threading.Event):
        self.cfg = cfg
        self.metrics = metrics
        self.stop = stop  # set by SIGTERM: stop at the next safe point
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.device = pick_device(cfg)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.site_dir = Path(cfg.run.run_dir) / cfg.run.site
        self.round = 0  # rounds completed (committed or not)
        self.h_done = 0  # inner steps done in the current round (non-zero only after a preemption)
        self.healed = False  # set by the heal callback during a quorum
        self.heal_pending: dict | None = None  # a received heal state, until the site's ranks agree to install it
        self.h = cfg.diloco.h  # inner steps of the current round (changes when diloco.h_auto)
        self.last_sync = (0.0, 0.0)  # h_auto, h_policy "time": this site's last (sync_s, step_s), sent with the next exchange
        self.window_s = 0.0  # h_policy "time": the compute window the sites agreed on (0: none yet, take H steps)
        self.round_tokens = 0.0  # tokens this site trained in the round just computed (merge_weighting)
        self.contributing = False  # in an exchange that sends this site's round (a heal then makes it late)
        self.late: LateRound | None = None  # late_merge: the round the quorum went on without, until merged
        self.divergence = DivergenceWatch(cfg.train.diverge_evals)

        corpus = load_tokens(cfg.data)
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.site = SiteTrainer(cfg, corpus.train, cfg.run.site_index, self.device,
                                shard=self.rank, shards=self.world)
        self.vbatches = val_batches(corpus.val, cfg.data.seq_len, cfg.data.batch_size, cfg.train.eval_batches)
        self.outer = OuterState(self.site.params, cfg.diloco, planned_rounds(cfg))  # the rule counts rounds
        # diloco.fragments: parameter indices of each fragment (by global sizes: every rank splits alike),
        # each with its own codec state; one fragment is every parameter
        self.frags = split([p.numel() for p in self.site.params], cfg.diloco.fragments)
        self.comps: list[Compressor] = []
        for f, idx in enumerate(self.frags):
            self.comps.append(compressor(cfg.diloco, cfg.train.seed, cfg.run.site_index, f))
            self.comps[f].prepare([tuple(self.site.local_params[i].shape) for i in idx])  # this process's shards
        self.comp = self.comps[0]
        self.fragment = 0  # the fragment of the exchange under way (a heal source tells a healing site)
        # fragments: a heal moves the site to its source's place in the round (fragment, inner step); not
        # once overlap's exchanges run beside the compute loop (ft_exchange.FragmentOverlapExchange)
        self.place_from_heal = True
        # θ is stepped on overlap's exchange thread; an evaluation of θ on this one reads it whole (before or after)
        self.theta_lock = threading.Lock()
        self.payload = sum(c.plan.payload_bytes for c in self.comps)
        self.timeout = exchange_timeout(cfg, max(c.plan.payload_bytes for c in self.comps))  # per exchange
        self.ckpt = Checkpointer(self.site_dir / "checkpoints", keep=cfg.checkpoint.keep,
                                 async_save=cfg.checkpoint.async_save,
                                 on_event=lambda kind, msg, detail: self.metrics.event(kind, msg, **detail),
                                 stores=checkpoint_stores(cfg), site=cfg.run.site)
        self.manager = None  # torchft Manager (sync, overlap, ddp); async mode has the outer service instead
        self._loaded: dict = {}  # the state dict last handed to or filled by the checkpointer
        upto = cfg.run.resume_round if cfg.run.resume_round >= 0 else None
        self.resumed_from = self.ckpt.load_latest(self._ckpt_state(), max_round=upto) if cfg.run.resume else None
        if self.resumed_from is not None:
            self._apply_ckpt_state()
        self.exchange = make_exchange(self)
        if cfg.diloco.mode != "async":
            self.manager = make_manager(cfg, self.timeout, self._ft_state, self._ft_load,
                                        on_event=lambda kind, msg, **d: self.metrics.event(kind, msg, **d))
            if self.resumed_from is not None:
                try:
                    self.manager.load_state_dict(self._loaded["manager"])
                except BaseException:
                    self.close()  # the manager's threads would keep the process alive
                    raise
        n_params = sum(p.numel() for p in self.site.params)
        self.metrics.event("start", f"site {cfg.run.site} rank {self.rank}/{self.world}: {n_params} params",
                           round=self.round, params=n_params, payload_bytes=self.payload,
                           **({"fragment_payload_bytes": [c.plan.payload_bytes for c in self.comps]}
                              if len(self.comps) > 1 else {}),
                           timeout_s=self.timeout.total_seconds(), resumed_from=self.resumed_from,
                           world=self.world, device=str(self.device), **mfu_constants(cfg, self.device, self.world))
        if self.rank == 0:
            print(f"[{cfg.run.site}] model {cfg.model.preset}: {n_params:,} parameters; payload "
                  f"{self.payload:,} bytes/round; exchange timeout {self.timeout.total_seconds():.0f}s; "
                  f"{transport_note(cfg)}", flush=True)

    @property
    def stop_requested(self) -> bool:
        return self.stop.is_set()

    @property
    def step_tokens(self) -> int:
        """Tokens the whole site trains in one inner step."""
        return self.cfg.data.batch_size * self.cfg.data.seq_len * self.site.dp

    # -- state for checkpoints and for healing -----------------------------------------------

    def _ckpt_state(self) -> dict:
        """What a site checkpoints: its own local progress plus the global state.

        With model parallelism the model, optimizer and outer state are keyed by parameter name
        and laid out like the (sharded) parameters, so DCP can load them into another layout.
        """
        if self.site.par is None:
            model, inner, outer = self.site.model.state_dict(), self.site.inner.state_dict(), self.outer.state_dict()
        else:
            from trainer.parallel import state as pstate

            pstate.init_optimizer_state(self.site.inner)  # a fresh optimizer needs tensors to load into
            model = pstate.model_state(self.site.model)
            inner = pstate.optimizer_state(self.site.model, self.site.inner)
            outer = pstate.outer_state(self.outer, self.site.model)
        self._loaded = {
            "model": model,
            "inner": inner,
            "outer": outer,
            # per-rank keys: DCP keeps one copy of a plain tensor or value per key
            f"codec_rank{self.rank}": self.comp.state_dict(),
            "codec_global": self.comp.global_state(),
            **{f"codec{f}_rank{self.rank}": c.state_dict() for f, c in enumerate(self.comps) if f},
            **{f"codec{f}_global": c.global_state() for f, c in enumerate(self.comps) if f},
            # DCP keeps one copy of a non-tensor value per key: per-rank values need per-rank keys
            f"loader_rank{self.rank}": self.site.loader.state_dict(),
            "progress": {"round": self.round, "step": self.site.step, "h_done": self.h_done,
                         "tokens": self.site.tokens, "h": self.h,
                         # the next one due: at a round's end, the first (overlap's last exchange may still run)
                         **({"fragment": self.fragment if self.h_done else 0} if len(self.frags) > 1 else {})},
            f"rng_rank{self.rank}": torch.get_rng_state(),
            "manager": self.manager.state_dict() if self.manager is not None else {"step": 0, "batches_committed": 0},
        }
        return self._loaded

    def _apply_ckpt_state(self) -> None:
        s = self._loaded
        if self.site.par is None:
            self.site.model.load_state_dict(s["model"])
            self.site.inner.load_state_dict(s["inner"])
            self.outer.load_state_dict(s["outer"])
        else:
            from trainer.parallel import state as pstate

            pstate.load_model_state(self.site.model, s["model"])
            pstate.load_optimizer_state(self.site.model, self.site.inner, s["inner"])
            pstate.load_outer_state(self.outer, self.site.model, s["outer"])
        self.comp.load_state_dict(s[f"codec_rank{self.rank}"])
        self.comp.load_global_state(s["codec_global"])
        for f, c in enumerate(self.comps[1:], start=1):
            c.load_state_dict(s[f"codec{f}_rank{self.rank}"])
            c.load_global_state(s[f"codec{f}_global"])
        self.site.loader.load_state_dict(s[f"loader_rank{self.rank}"])
        torch.set_rng_state(s[f"rng_rank{self.rank}"])
        p = s["progress"]
        self.round, self.site.step, self.h_done, self.site.tokens = (
            int(p["round"]), int(p["step"]), int(p["h_done"]), int(p["tokens"]))
        self.h = int(p.get("h", self.h))
        self.fragment = int(p.get("fragment", 0))

    def _ft_state(self) -> dict:
        """What a healing peer receives: the global parameters and outer state, and the round."""
        sd = {"outer": self.outer.state_dict(), "codec": self.comp.global_state(),
              "round": self.round, "step": self.site.step, "h": self.h}
        if len(self.comps) > 1:  # where in the round the source is: which fragment, after which inner step
            sd |= {"codecs": [c.global_state() for c in self.comps[1:]], "fragment": self.fragment,
                   "h_done": self.h_done}
        return sd

    def _ft_load(self, sd: dict) -> None:
        """torchft's heal callback. The state arrives screened (trainer.outer.heal_guard, in the transport); it is
        held until every rank of the site knows no rank refused its own (trainer.modes.ft_exchange.settle_heal),
        which then installs it with _ft_install."""
        self.heal_pending = sd

    def _ft_install(self, sd: dict) -> None:
        """Install a screened heal state: θ and the outer momentum (hyperparameters stay this site's own,
        OuterState.load_state_dict), the codec's shared state, the round, the inner step and H. With
        late_merge, a site healed while sending its round keeps that round's pseudo-gradient first."""
        if len(self.comps) > 1 and not (isinstance(f := sd["fragment"], int) and 0 <= f < len(self.comps) and
                                        isinstance(done := sd["h_done"], int) and 0 <= done <= self.h):
            raise ValueError(f"heal state: fragment {sd['fragment']!r} after inner step {sd['h_done']!r} "
                             f"is not a place in a round of {self.h}")
        if self.contributing and self.cfg.diloco.late_merge and self.round_tokens > 0 and len(self.comps) == 1:
            self.late = LateRound(deltas=self.outer.deltas(self.site.params), tokens=self.round_tokens,
                                  missed=max(1, int(sd["round"]) - self.round), round=self.round + 1)
        self.outer.load_state_dict(sd["outer"])
        self.comp.load_global_state(sd["codec"])
        self.round, self.site.step = int(sd["round"]), int(sd["step"])
        self.h = int(sd.get("h", self.h))
        if len(self.comps) > 1:
            for c, gs in zip(self.comps[1:], sd["codecs"], strict=True):
                c.load_global_state(gs)
            if self.place_from_heal:  # mid-round: go on from where the source is
                self.fragment, self.h_done = sd["fragment"], sd["h_done"]
        self.healed = True

    def save(self) -> None:
        self.ckpt.save(self.round, self._ckpt_state())

    # -- the round pipeline -------------------------------------------------------------------

    def _site_grad_hook(self):
        """Gradients averaged inside the site: over its data-parallel replicas only when the model
        is tensor/pipeline/FSDP-parallel (SiteTrainer knows the groups), else over every process."""
        if self.site.par is not None:
            return self.site.grad_hook()
        if self.world == 1:
            return None

        def hook(grads: list[torch.Tensor]) -> None:
            flat_average(grads, dist.all_reduce, self.world)
        return hook

    def compute(self, h: int) -> tuple[float, list[float]]:
        """Inner steps until the round has h; returns (seconds, losses)."""
        hook = self.exchange.grad_hook(self._site_grad_hook())
        losses = []
        waited = 0.0  # seconds the exchange took inside the inner steps (ddp's gradients, overlap's landing)
        t0 = time.perf_counter()
        tokens_per_step = self.step_tokens
        while self.h_done < h:
            if self.cfg.diloco.h_policy == "time":  # the schedule follows rounds, whatever a round's step count
                self.site.lr_step = self.round * self.h + self.h_done * self.h // h
            loss, lr, secs = self.site.inner_step(hook)
            if not math.isfinite(loss):
                raise FloatingPointError(f"inner loss is {loss} at step {self.site.step}")
            self.h_done += 1
            losses.append(loss)
            waited += self.exchange.after_step(self.h_done, h)
            self.metrics.write(StepRecord(step=self.site.step, round=self.round + 1, loss=loss, lr=lr,
                                          step_s=secs, tokens_per_s=tokens_per_step / max(secs, 1e-9)))
            if self._site_stops():
                raise Preempted()
        self.round_tokens = float(h * tokens_per_step)
        return time.perf_counter() - t0 - waited, losses

    def _site_stops(self) -> bool:
        """Whether the site stops after this inner step. SIGTERM reaches a site's processes moments
        apart; one that stopped while another took one more step left them in different collectives
        (the checkpoint's, the step's gradient all-reduce) until torchrun killed both, nothing saved: a
        2-node Slurm site at its time limit then failed instead of requeueing. So they agree each step."""
        if self.world == 1:
            return self.stop_requested
        flag = torch.tensor([1.0 if self.stop_requested else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return float(flag.item()) > 0

    def round_steps(self) -> int:
        """Inner steps of the next round: H (cut to the run's end), or under h_policy "time" as many as
        fit the agreed window at this site's last step time (1 to MAX_TIME_STEPS x H)."""
        h = round_h(self.h, self.site.step - self.h_done, self.cfg)
        step_s = self.last_sync[1]
        if self.cfg.diloco.h_policy != "time" or self.window_s <= 0 or not step_s > 0 or self.h_done:
            return h
        return max(1, min(MAX_TIME_STEPS * self.h, round(self.window_s / step_s)))

    def run(self) -> int:
        """Every round of the run: compute, exchange, finish; returns the exit code."""
        self.exchange.join()
        # the run ends on its inner steps (train.steps, or h * rounds), whatever H does (h = "auto")
        while not run_over(self.round, self.site.step - self.h_done, self.cfg):
            self.exchange.begin_round()
            h = self.round_steps()
            compute_s, losses = self.compute(h)
            if self.cfg.diloco.h_policy == "time":  # this round's step time rides this round's exchange
                self.note_timings(h, compute_s, self.last_sync[0])
            res = self.exchange.finish(last=run_over(self.round + 1, self.site.step, self.cfg))
            self.finish_round(h, compute_s, losses, res)
        self.ckpt.wait()
        return EXIT_OK

    def finish_round(self, h: int, compute_s: float, losses: list[float], res: ExchangeResult) -> None:
        """After the exchange: the round's record, eval, h_auto bookkeeping and checkpoint."""
        cfg, d = self.cfg, self.cfg.diloco
        self.round += 1
        self.h_done = 0
        val = None
        if (cfg.train.eval_every and self.round % cfg.train.eval_every == 0) or run_over(self.round, self.site.step, cfg):
            if len(self.frags) > 1:  # fragments: the site's own parameters mix θ and local progress
                with self.theta_lock, self.outer.installed(self.site.params):
                    val = self.site.evaluate(self.vbatches)
            else:
                val = self.site.evaluate(self.vbatches)
        ppl = safe_exp(val) if val is not None else None
        self.metrics.write(RoundRecord(
            round=self.round, step=self.site.step, h=h, compute_s=compute_s, sync_s=res.sync_s,
            bytes_sent=res.bytes_sent, bytes_recv=res.bytes_recv, k_active=res.k_active,
            k_nominal=d.sites, outer_lr=res.outer_lr, committed=res.committed,
            train_loss=sum(losses) / len(losses) if losses else None, val_loss=val,
            val_ppl=ppl, tokens=self.site.tokens * self.site.dp, staleness=res.staleness,
            exchange_t=res.exchange_t, quorum_s=res.quorum_s, weight_s=res.weight_s, payload_s=res.payload_s,
            exchange_bytes=list(res.exchange_bytes) if len(self.frags) > 1 else None))
        if ppl is not None and (bad := self.divergence.observe(self.round, ppl)):
            good = [r for r in self.ckpt.rounds() if r <= bad.best_round]
            stop = cfg.train.stop_on_divergence
            self.metrics.event("diverging", bad.message + (f"; newest checkpoint at or before it: round {good[-1]}"
                               if good else "") + ("; stopping (train.stop_on_divergence)" if stop else ""),
                               round=self.round, best_round=bad.best_round, checkpoint_round=good[-1] if good else None)
            if stop:  # before this round's checkpoint: the newest one stays the last before the rise
                raise Diverged(bad.message)
        if d.h_auto:
            self.adapt_h(res)
        if d.h_auto or d.h_policy == "time":
            self.note_timings(h, compute_s, res.sync_s)
        if res.window_s > 0:
            self.window_s = res.window_s
        if cfg.checkpoint.every_rounds and self.round % cfg.checkpoint.every_rounds == 0:
            self.save()

    def adapt_h(self, res: ExchangeResult) -> None:
        """h_auto: apply the H the sites agreed on."""
        d = self.cfg.diloco
        if res.h_next is not None and res.h_next != self.h:
            old, self.h = self.h, int(res.h_next)
            self.metrics.event("h_changed", f"H {old} -> {self.h} (sync budget {d.sync_budget:.0%})",
                               round=self.round, old=old, new=self.h)

    def note_timings(self, h: int, compute_s: float, sync_s: float) -> None:
        """Keep (sync_s, step_s), which the next exchange sends for the sites' agreement."""
        if compute_s > 0 and h > 0:
            t = torch.tensor([float(sync_s), compute_s / h], dtype=torch.float64, device=self.device)
            if self.world > 1:  # every local rank must send the same timings, or ranks would pick different H
                dist.broadcast(t, src=0)
            self.last_sync = (float(t[0]), float(t[1]))

    def save_final_model(self) -> None:
        """RUN_DIR/SITE/final_model.pt: the trained global parameters, loadable with
        Transformer.load_state_dict (with pipeline stages, one file per stage: final_model_stageK.pt)."""
        par = self.site.par
        if par is None:
            if self.rank == 0:
                torch.save(self.site.model.state_dict(), self.site_dir / "final_model.pt")
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.site.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if par.dims.pp > 1:
            if all(c == 0 for name, c in par.dims.coords(self.rank).items() if name != "pp"):  # one per stage
                torch.save(full, self.site_dir / f"final_model_stage{par.stage}.pt")
        elif self.rank == 0:
            torch.save(full, self.site_dir / "final_model.pt")

    def close(self) -> None:
        self.exchange.close()
        if self.manager is not None:
            self.manager.shutdown(wait=False)


def train(cfg: TrainerConfig) -> int:
    """Run one site process to the end; returns the process exit code."""
    rank = int(os.environ.get("RANK", "0"))
    metrics = MetricsWriter(Path(cfg.run.run_dir) / cfg.run.site / METRICS_FILE, cfg.run.site) if rank == 0 \
        else _NullMetrics()
    stop = threading.Event()
    signaled = [0.0]  # when SIGTERM came: the grace counts from the notice, not from the next safe point

    def on_sigterm(*_) -> None:
        if not stop.is_set():
            signaled[0] = time.monotonic()
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    run = None
    try:
        run = SiteRun(cfg, metrics, stop)
        code = run.run()
        if run.manager is not None and rank == 0:  # a straggler still waiting for a quorum may stop now
            announce_end(run.manager, cfg.run.site)
        final = safe_exp(run.site.evaluate(run.vbatches))  # collective under tensor/pipeline parallelism
        run.save_final_model()
        metrics.event("stopped", f"finished {run.round} rounds", round=run.round, val_ppl=final)
        return code
    except RunEnded as e:  # a straggler the quorum went on without: θ_final is the others' (no final model here)
        assert run is not None
        run.ckpt.wait()
        metrics.event("ended_behind", f"{e}; this site stopped after round {run.round}", round=run.round,
                      step=run.site.step)
        return EXIT_OK
    except Preempted:
        assert run is not None  # only the round pipeline raises it
        deadline = (signaled[0] or time.monotonic()) + cfg.run.grace_s
        try:  # overlap: let the exchange in flight finish before saving θ
            run.exchange.drain(timeout_s=max(0.0, deadline - time.monotonic()) / 2)
        except Exception:  # a failed or slow exchange: the checkpoint keeps the θ it had
            pass
        run.save()
        run.ckpt.wait(upload_timeout_s=max(0.0, deadline - time.monotonic() - 1.0))  # an upload cut here has no manifest
        metrics.event("preempted", f"stopped on SIGTERM at step {run.site.step}; checkpoint saved "
                      f"in {cfg.run.grace_s - (deadline - time.monotonic()):.1f}s", round=run.round,
                      step=run.site.step)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            # torchrun exits 1 on SIGTERM whatever its workers return: the node's wrapper reads this marker
            (run.site_dir / f"node{os.environ.get('GROUP_RANK', '0')}.preempted").touch()
        return EXIT_PREEMPTED
    except Exception as e:
        metrics.event("error", f"{type(e).__name__}: {e}", round=run.round if run is not None else 0)
        raise
    finally:
        if run is not None:
            run.close()
        metrics.close()

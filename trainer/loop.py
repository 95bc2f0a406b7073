"""The distributed DiLoCo loop of one site: H inner steps, then the outer exchange through torchft.

One process per local rank (torchrun). Local rank 0 of each site writes the site's metrics.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint import Checkpointer
from trainer.compression import Compressor, NonFiniteDelta, wire_cost
from trainer.config import TrainerConfig
from trainer.data import load_tokens, val_batches
from trainer.ft import TorchftComm, exchange_timeout, make_manager
from trainer.outer import OuterState
from trainer.records import METRICS_FILE, MetricsWriter, RoundRecord, StepRecord
from trainer.site import SiteTrainer, pick_device
from trainer.sync_rule import clamped_h

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_PREEMPTED = 143  # 128 + SIGTERM: stopped on request after saving a checkpoint


def needed_h(sync_s: float, step_s: float, d) -> int:
    """Smallest H on the grid with sync_s <= sync_budget * H * step_s, within [h_min, h_max]."""
    return clamped_h(sync_s, step_s, d.sync_budget, d.h_min, d.h_max)


def agreed_h(samples: list[tuple[float, float]], current: int, d) -> int:
    """The H every site switches to, from each contributing site's last (sync_s, step_s).

    The exchange costs the smallest sync time (the last site to arrive waited only for the
    exchange; the others also for its compute, which no H can buy back); the slowest site's step
    time sets how long a round computes. No measurement yet: keep the current H.
    """
    measured = [(s, t) for s, t in samples if s > 0 and t > 0]
    if not measured:
        return current
    return needed_h(min(s for s, _ in measured), max(t for _, t in measured), d)


class _NullMetrics:
    def write(self, rec) -> None:
        pass

    def event(self, *a, **k) -> None:
        pass

    def close(self) -> None:
        pass


class Preempted(Exception):
    """SIGTERM arrived: the loop stopped at a safe point."""


class SiteRun:
    """State and loop of one process of one site."""

    def __init__(self, cfg: TrainerConfig):
        self.cfg = cfg
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.device = pick_device(cfg)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.site_dir = Path(cfg.run.run_dir) / cfg.run.site
        self.metrics = MetricsWriter(self.site_dir / METRICS_FILE, cfg.run.site) if self.rank == 0 \
            else _NullMetrics()
        self.stop_requested = False
        self.round = 0  # rounds completed (committed or not)
        self.h_done = 0  # inner steps done in the current round (non-zero only after a preemption)
        self.healed = False
        self.h = cfg.diloco.h  # inner steps of the current round (changes when diloco.h_auto)
        self.last_sync = (0.0, 0.0)  # h_auto: this site's last (sync_s, step_s), sent with the next exchange
        self.pending = None  # overlap mode: the exchange running in the background
        self._pool = None

    # -- setup -------------------------------------------------------------------------------

    def setup(self) -> None:
        cfg = self.cfg
        corpus = load_tokens(cfg.data)
        if self.world > 1 and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.site = SiteTrainer(cfg, corpus.train, cfg.run.site_index, self.device,
                                shard=self.rank, shards=self.world)
        self.vbatches = val_batches(corpus.val, cfg.data.seq_len, cfg.data.batch_size, cfg.train.eval_batches)
        self.outer = OuterState(self.site.params, cfg.diloco)
        self.comp = Compressor(spec=cfg.diloco.compression, error_feedback=cfg.diloco.error_feedback,
                               decay=cfg.diloco.error_feedback_decay, seed=cfg.train.seed,
                               site=cfg.run.site_index, options=cfg.diloco.codec_options())
        shapes = [tuple(p.shape) for p in self.site.local_params]  # this process's shards
        self.comp.prepare(shapes)
        self.payload = self.comp.plan.payload_bytes
        self.timeout = exchange_timeout(cfg, self.payload)
        self.ckpt = Checkpointer(self.site_dir / "checkpoints", keep=cfg.checkpoint.keep,
                                 async_save=cfg.checkpoint.async_save,
                                 on_event=lambda kind, msg, detail: self.metrics.event(kind, msg, **detail))
        upto = cfg.run.resume_round if cfg.run.resume_round >= 0 else None
        self.resumed_from = self.ckpt.load_latest(self._ckpt_state(), max_round=upto) if cfg.run.resume else None
        if self.resumed_from is not None:
            self._apply_ckpt_state()
        if cfg.diloco.mode != "async":  # async: no Lighthouse; the outer service owns θ (trainer.async_mode)
            self.manager = make_manager(cfg, self.timeout, self._ft_state, self._ft_load)
            if self.resumed_from is not None:
                self.manager.load_state_dict(self._loaded["manager"])
        n_params = sum(p.numel() for p in self.site.params)
        self.metrics.event("start", f"site {cfg.run.site} rank {self.rank}/{self.world}: {n_params} params",
                           round=self.round, params=n_params, payload_bytes=self.payload,
                           timeout_s=self.timeout.total_seconds(), resumed_from=self.resumed_from,
                           world=self.world, device=str(self.device))
        if self.rank == 0:
            print(f"[{cfg.run.site}] model {cfg.model.preset}: {n_params:,} parameters; payload "
                  f"{self.payload:,} bytes/round; exchange timeout {self.timeout.total_seconds():.0f}s",
                  flush=True)

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
            # DCP keeps one copy of a non-tensor value per key: per-rank values need per-rank keys
            f"loader_rank{self.rank}": self.site.loader.state_dict(),
            "progress": {"round": self.round, "step": self.site.step, "h_done": self.h_done,
                         "tokens": self.site.tokens, "h": self.h},
            f"rng_rank{self.rank}": torch.get_rng_state(),
            "manager": self.manager.state_dict() if hasattr(self, "manager") else {"step": 0, "batches_committed": 0},
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
        self.site.loader.load_state_dict(s[f"loader_rank{self.rank}"])
        torch.set_rng_state(s[f"rng_rank{self.rank}"])
        p = s["progress"]
        self.round, self.site.step, self.h_done, self.site.tokens = (
            int(p["round"]), int(p["step"]), int(p["h_done"]), int(p["tokens"]))
        self.h = int(p.get("h", self.h))

    def _ft_state(self) -> dict:
        """What a healing peer receives: the global parameters and outer state, and the round."""
        return {"outer": self.outer.state_dict(), "codec": self.comp.global_state(),
                "round": self.round, "step": self.site.step, "h": self.h}

    def _ft_load(self, sd: dict) -> None:
        self.outer.load_state_dict(sd["outer"])
        self.comp.load_global_state(sd["codec"])
        self.round, self.site.step = int(sd["round"]), int(sd["step"])
        self.h = int(sd.get("h", self.h))
        self.healed = True

    def save(self) -> None:
        self.ckpt.save(self.round, self._ckpt_state())

    # -- the loop ----------------------------------------------------------------------------

    def _site_grad_hook(self):
        """Gradients averaged inside the site: over its data-parallel replicas only when the model
        is tensor/pipeline/FSDP-parallel (SiteTrainer knows the groups), else over every process."""
        if self.site.par is not None:
            return self.site.grad_hook()
        if self.world == 1:
            return None

        def hook(grads: list[torch.Tensor]) -> None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= self.world
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        return hook

    def _ddp_hook(self):
        """Baseline: gradients averaged across sites at every step (one quorum per step)."""
        site_hook = self._site_grad_hook()

        def hook(grads: list[torch.Tensor]) -> None:
            if site_hook:
                site_hook(grads)
            t0 = time.perf_counter()
            self.manager.start_quorum()
            comm = TorchftComm(self.manager, self.timeout)
            from trainer.parallel import local

            grads = [local(g) for g in grads]
            flat = torch.cat([g.reshape(-1).float().cpu() for g in grads] + [torch.ones(1)])
            try:
                comm.allreduce_sum(flat)
                self._ddp_bytes += int(wire_cost("sum", flat.nbytes, comm.size))
            except Exception as e:
                self.metrics.event("error", f"gradient exchange failed: {e}", round=self.round + 1)
            self._ddp_k = int(flat[-1])
            ok = self.manager.should_commit()
            flat /= max(1.0, float(flat[-1]))
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g) if ok else torch.zeros_like(g))
                offset += g.numel()
            self._ddp_sync_s += time.perf_counter() - t0
        return hook

    def compute(self, h: int) -> tuple[float, list[float]]:
        """Inner steps until the round has h; returns (seconds, losses)."""
        hook = self._ddp_hook() if self.cfg.diloco.algorithm == "ddp" else self._site_grad_hook()
        self._ddp_bytes, self._ddp_sync_s = 0, 0.0
        losses = []
        t0 = time.perf_counter()
        tokens_per_step = self.cfg.data.batch_size * self.cfg.data.seq_len * self.site.dp
        while self.h_done < h:
            loss, lr, secs = self.site.inner_step(hook)
            if not math.isfinite(loss):
                raise FloatingPointError(f"inner loss is {loss} at step {self.site.step}")
            self.h_done += 1
            losses.append(loss)
            self.metrics.write(StepRecord(step=self.site.step, round=self.round + 1, loss=loss, lr=lr,
                                          step_s=secs, tokens_per_s=tokens_per_step / max(secs, 1e-9)))
            if self.stop_requested:
                raise Preempted()
        return time.perf_counter() - t0, losses

    def exchange(self, deltas_fn, contribute: bool) -> dict:
        """One quorum + exchange + commit + outer step; the site's own parameters are not touched.

        `deltas_fn()` gives this site's pseudo-gradient; it is called after the quorum, which may
        have healed θ from a peer. `contribute=False`: join (and heal) without a delta.
        """
        t0 = time.perf_counter()
        self.healed = False
        self.manager.start_quorum()
        if self.healed:
            self.metrics.event("heal", f"healed from a live peer at round {self.round}", round=self.round)
        weight = 1.0 if contribute and not self.healed and self.manager.is_participating() else 0.0
        stats = None
        k_active = 0
        avg = None
        h_next = self.h
        try:
            if err := self.manager.errored():  # e.g. the process group could not be configured
                raise RuntimeError(f"quorum failed: {err.original_exception}")
            comm = TorchftComm(self.manager, self.timeout)
            # each site's weight, gathered with its last round's timings so every site derives
            # the same next H (h_auto) from the same numbers
            got = comm.allgather(torch.tensor([weight, *self.last_sync], dtype=torch.float64))
            k_active = int(round(sum(float(g[0]) for g in got)))
            if k_active > 0 and self.cfg.diloco.h_auto:
                h_next = agreed_h([(float(g[1]), float(g[2])) for g in got if g[0] > 0], self.h,
                                  self.cfg.diloco)
            if k_active > 0:
                deltas = deltas_fn()
                if weight == 0.0:
                    deltas = [torch.zeros_like(d) for d in deltas]
                avg, stats = self.comp.average(deltas, comm, weight)
        except NonFiniteDelta:
            raise  # a broken pseudo-gradient is a training failure, not a network fault
        except Exception as e:  # the exchange failed: the round is not committed anywhere
            if not self.manager.errored():
                self.manager.report_error(e)
            avg, k_active = None, 0
            self.metrics.event("error", f"exchange failed, round rolled back: {e}", round=self.round + 1)
        committed = self.manager.should_commit()
        lr = 0.0
        applied = committed and avg is not None and k_active > 0
        if applied:
            lr = self.outer.step(avg, k_active)
        return {"sync_s": time.perf_counter() - t0, "k_active": k_active, "committed": committed,
                "applied": applied, "h_next": h_next if committed else self.h, "outer_lr": lr, "bytes_sent": stats.bytes_sent if stats else 0,
                "bytes_recv": stats.bytes_recv if stats else 0}

    def sync(self, contribute: bool) -> dict:
        """The exchange of sync mode: Δ = θ_t − θ_local, then every site restarts from θ_{t+1}."""
        res = self.exchange(lambda: self.outer.deltas(self.site.params), contribute)
        if contribute or self.healed or res["applied"]:
            # after a commit: θ_{t+1}; after a failed round: back to θ_t (the round's work is lost)
            self.outer.copy_to(self.site.params)
        return res

    def join(self) -> None:
        """Enter the quorum before training: heal if the others moved on; wait for peers at a fresh start.

        A fresh run waits (up to run.startup_wait_s) until all K sites are in one quorum, so no site
        trains round 1 alone while another is still importing torch; so does a whole-run restart
        (run.resume_round). A restarted site joins once:
        the others are mid-round and it must not make them wait a round per try.
        """
        d = self.cfg.diloco
        deadline = time.monotonic() + self.cfg.run.startup_wait_s
        while True:
            res = self.sync(contribute=False)
            if self.healed:
                self.h_done = 0
            if res["committed"] and res["k_active"] > 0:
                # the others completed a round during our join: θ moved on, our partial round is void
                self.round += 1
                self.h_done = 0
            size = self.manager.num_participants() if not self.manager.errored() else 0
            rejoining = self.resumed_from is not None and self.cfg.run.resume_round < 0  # not a whole-run restart
            if rejoining or size >= d.sites or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        self.metrics.event("quorum", f"joined with {size} of {d.sites} sites at round {self.round}",
                           round=self.round, k_active=size, healed=self.healed)

    def run(self) -> int:
        cfg = self.cfg
        d = cfg.diloco
        if d.mode == "async":
            from trainer.async_mode import run_async

            return run_async(self)
        if self.resumed_from is not None or d.sites > 1:
            self.join()
        while self.round < d.rounds:
            start = [p.detach().float().cpu().clone() for p in self.site.params] if d.mode == "overlap" else None
            h = self.h
            compute_s, losses = self.compute(h)
            if d.algorithm == "ddp":  # gradients were averaged at every step: nothing left to exchange
                compute_s -= self._ddp_sync_s
                res = {"sync_s": self._ddp_sync_s, "k_active": getattr(self, "_ddp_k", 1), "committed": True,
                       "outer_lr": 0.0, "bytes_sent": self._ddp_bytes, "bytes_recv": self._ddp_bytes}
            elif d.mode == "overlap":
                res = self.overlap_step(start)
                if self.round + 1 == d.rounds:  # the last exchange: wait, and end on θ_final everywhere
                    t0 = time.perf_counter()
                    last = self.pending.result()
                    self.pending = None
                    self.outer.copy_to(self.site.params)
                    res["sync_s"] += time.perf_counter() - t0
                    res["bytes_sent"] += last["bytes_sent"]
                    res["bytes_recv"] += last["bytes_recv"]
            else:
                res = self.sync(contribute=True)
            self.round += 1
            self.h_done = 0
            val = None
            if (cfg.train.eval_every and self.round % cfg.train.eval_every == 0) or self.round == d.rounds:
                val = self.site.evaluate(self.vbatches)
            self.metrics.write(RoundRecord(
                round=self.round, step=self.site.step, h=h, compute_s=compute_s, sync_s=res["sync_s"],
                bytes_sent=res["bytes_sent"], bytes_recv=res["bytes_recv"], k_active=res["k_active"],
                k_nominal=d.sites, outer_lr=res["outer_lr"], committed=res["committed"],
                train_loss=sum(losses) / len(losses) if losses else None, val_loss=val,
                val_ppl=math.exp(val) if val is not None else None, tokens=self.site.tokens * self.site.dp,
                staleness=1 if d.mode == "overlap" else 0))
            if d.h_auto:
                self.adapt_h(h, compute_s, res)
            if cfg.checkpoint.every_rounds and self.round % cfg.checkpoint.every_rounds == 0:
                self.save()
        if self.pending is not None:  # overlap: the last round's exchange, then every site holds θ_final
            self.pending.result()
            self.pending = None
            self.outer.copy_to(self.site.params)
        self.ckpt.wait()
        return EXIT_OK

    def adapt_h(self, h: int, compute_s: float, res: dict) -> None:
        """h_auto: apply the H the sites agreed on, and keep this round's timings for the next agreement."""
        d = self.cfg.diloco
        if res.get("h_next", self.h) != self.h:
            old, self.h = self.h, int(res["h_next"])
            self.metrics.event("h_changed", f"H {old} -> {self.h} (sync budget {d.sync_budget:.0%})",
                               round=self.round, old=old, new=self.h)
        if compute_s > 0 and h > 0:
            t = torch.tensor([float(res["sync_s"]), compute_s / h], dtype=torch.float64, device=self.device)
            if self.world > 1:  # every local rank must send the same timings, or ranks would pick different H
                dist.broadcast(t, src=0)
            self.last_sync = (float(t[0]), float(t[1]))

    def overlap_step(self, start: list[torch.Tensor]) -> dict:
        """Overlap mode: wait for the previous round's exchange, rebase, send this round's in the background.

        The site keeps training while its round-t pseudo-gradient crosses the WAN; the averaged update
        lands one round late (staleness 1). After it lands the site's parameters are θ_{t+1} plus its
        own progress of the round just computed, which is the next delta it sends.
        """
        own = [s - p.detach().float().cpu() for s, p in zip(start, self.site.params, strict=True)]
        res = {"sync_s": 0.0, "k_active": 0, "committed": False, "applied": False, "outer_lr": 0.0,
               "bytes_sent": 0, "bytes_recv": 0}
        if self.pending is not None:
            t0 = time.perf_counter()
            res = dict(self.pending.result())
            res["sync_s"] = time.perf_counter() - t0  # only the wait shows: the rest overlapped compute
            with torch.no_grad():
                for p, g, o in zip(self.site.params, self.outer.params, own, strict=True):
                    p.copy_((g.detach() - o).to(p.device, p.dtype))
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(1, thread_name_prefix="outer-exchange")
        self.pending = self._pool.submit(self.exchange, lambda: own, True)
        return res

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

    def request_stop(self, *_args) -> None:
        self.stop_requested = True

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if hasattr(self, "manager"):
            self.manager.shutdown(wait=False)
        self.metrics.close()


def train(cfg: TrainerConfig) -> int:
    """Run one site process to the end; returns the process exit code."""
    run = SiteRun(cfg)
    signal.signal(signal.SIGTERM, run.request_stop)
    try:
        run.setup()
        code = run.run()
        final = math.exp(run.site.evaluate(run.vbatches))  # collective under tensor/pipeline parallelism
        run.save_final_model()
        run.metrics.event("stopped", f"finished {run.round} rounds", round=run.round, val_ppl=final)
        return code
    except Preempted:
        deadline = time.monotonic() + cfg.run.grace_s
        if run.pending is not None:  # overlap: let the exchange in flight finish before saving θ
            try:
                run.pending.result(timeout=cfg.run.grace_s / 2)
            except Exception:  # a failed or slow exchange: the checkpoint keeps the θ it had
                pass
        run.save()
        run.ckpt.wait()
        run.metrics.event("preempted", f"stopped on SIGTERM at step {run.site.step}; checkpoint saved "
                          f"in {cfg.run.grace_s - (deadline - time.monotonic()):.1f}s", round=run.round,
                          step=run.site.step)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            # torchrun exits 1 on SIGTERM whatever its workers return: the node's wrapper reads this marker
            (run.site_dir / f"node{os.environ.get('GROUP_RANK', '0')}.preempted").touch()
        return EXIT_PREEMPTED
    except Exception as e:
        run.metrics.event("error", f"{type(e).__name__}: {e}", round=run.round)
        raise
    finally:
        run.close()

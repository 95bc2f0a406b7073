"""The exchanges that run over torchft's cross-site quorum: sync, overlap and the ddp baseline.

Each round: a quorum (which may heal this site from a live peer), an allgather of the sites'
weights and timings, the compressed average of the pseudo-gradients, torchft's commit vote, and
the outer step. A failed exchange rolls the round back at every site.
"""

from __future__ import annotations

import math
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.codecs.compression import NonFiniteDelta
from trainer.codecs.phase_exchange import WireStats, wire_cost
from trainer.modes.exchange import Exchange, ExchangeResult, GradHook
from trainer.modes.ft import cross_site_comm, start_quorum, undo_heal
from trainer.outer.guard import GuardedAverage, GuardRule, guarded_average
from trainer.outer.heal_guard import HealRefused
from trainer.outer.optimizer import dampening, overlap_rebase
from trainer.rules.codec_spec import is_sparse
from trainer.rules.fragments import offsets
from trainer.rules.outer_rule import async_alpha, land_step, landing
from trainer.rules.sync_rule import clamped_h
from trainer.site import flat_average


def agreed_h(samples: list[tuple[float, float]], current: int, d) -> int:
    """The H every site switches to, from each contributing site's last (sync_s, step_s).

    The exchange costs the smallest sync time (the last site to arrive waited only for the
    exchange; the others also for its compute, which no H can buy back); the slowest site's step
    time sets how long a round computes. No measurement yet: keep the current H.
    """
    measured = [(s, t) for s, t in samples if math.isfinite(s) and math.isfinite(t) and s > 0 and t > 0]
    if not measured:
        return current
    return clamped_h(min(s for s, _ in measured), max(t for _, t in measured), d.sync_budget, d.h_min, d.h_max)


def agreed_window(samples: list[tuple[float, float]], h: int) -> float:
    """h_policy "time": the compute window of the next round, H x the median of the contributing sites'
    last step times (0: nobody has measured one yet). A median, so one site's claim cannot set it."""
    steps = sorted(t for _, t in samples if math.isfinite(t) and t > 0)
    return h * statistics.median(steps) if steps else 0.0


def settle_heal(run, refused: HealRefused | None) -> HealRefused | None:
    """After a quorum: every rank of the site installs the heal state it received, or none does.

    A source sends each rank its own state, and may make one rank's pass screening and another's
    fail; one rank installing while another refuses would split the site (θ, round, step). So the
    ranks agree first (one all-reduce), and a rank whose state passed drops it, and torchft's step
    with it, when any rank refused. Returns the refusal this rank reports, if any.
    """
    pending, run.heal_pending = run.heal_pending, None
    if (group := getattr(run.manager, "_dilococtl_heal_pg", None)) is not None:
        # 1: this rank refused its state; 0.5: it failed to receive it (its error fails the site's vote)
        failed = pending is None and run.manager.errored() is not None
        flag = torch.tensor([1.0 if refused is not None else 0.5 if failed else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if refused is None and float(flag.item()) > 0 and pending is not None:
            if float(flag.item()) == 1.0:  # refused: excluded at every rank
                refused = undo_heal(run.manager, "another rank of this site refused its heal state")
            else:  # not received: nothing to blame the source for; the site's vote fails this round
                undo_heal(run.manager, "", exclude=False)
            pending = None
    if pending is not None and refused is None:
        run._ft_install(pending)
    return refused


@dataclass(kw_only=True, slots=True)
class RoundAverage:
    """What step 2 of a round's exchange (TorchftExchange.average) leaves for the commit."""

    avg: list[Tensor] | None = None  # the guarded average; None: the round rolls back
    k_active: int = 0  # sites the average holds
    stats: WireStats | None = None  # bytes and seconds of its collectives
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (site, why) refused this round
    guarded: GuardedAverage | None = None  # the guard's whole result (its weight and payload seconds)
    h_next: int = 0  # h_auto: the H every site agreed on
    window: float = 0.0  # h_policy "time": the compute window every site agreed on (0: none)


class TorchftExchange(Exchange):
    """What every torchft mode shares: joining the quorum and one round's exchange."""

    @property
    def guard_rule(self) -> GuardRule:
        return GuardRule.of(self.run.cfg.diloco, sparse=is_sparse(self.run.cfg.diloco.compression))

    def exchange(self, deltas_fn, contribute: bool, commit_with: int = 0, tokens: float = 0.0,
                 fragment: int = 0) -> ExchangeResult:
        """One quorum + exchange + commit + outer step; the site's own parameters are not touched.

        `deltas_fn()` gives this site's pseudo-gradient; it is called after the quorum, which may
        have healed θ from a peer. `contribute=False`: join (and heal) without a delta. `commit_with`:
        vote against the commit unless the quorum has that many sites (see join). `tokens`: what the
        delta was trained on (merge_weighting). `fragment` (diloco.fragments): the parameters exchanged
        and stepped, with their own codec; a heal in the quorum puts the site at its source's fragment,
        and after the exchange run.fragment is the next one due.
        """
        run = self.run
        t0, began = time.perf_counter(), time.time()
        quorum_s = self.quorum(t0, contribute, fragment)
        f = run.fragment  # the source's, after a heal
        avg = self.average(deltas_fn, contribute, f, tokens)
        committed, applied, lr = self.commit(avg, commit_with, run.frags[f])
        if contribute or run.healed or applied:  # this fragment's exchange is behind the site: the next is due
            run.fragment = (f + 1) % len(run.frags)
        g, stats = avg.guarded, avg.stats
        return ExchangeResult(sync_s=time.perf_counter() - t0, k_active=avg.k_active, committed=committed,
                              applied=applied, h_next=avg.h_next if committed else run.h, outer_lr=lr,
                              window_s=avg.window if committed else 0.0,
                              bytes_sent=stats.bytes_sent if stats else 0,
                              exchange_bytes=(stats.bytes_sent if stats else 0,),
                              bytes_recv=stats.bytes_recv if stats else 0, staleness=self.staleness,
                              rejected=tuple(site for site, _ in avg.rejected), exchange_t=began, quorum_s=quorum_s,
                              weight_s=g.weight_s if g else None, payload_s=g.payload_s if g else None)

    def quorum(self, t0: float, contribute: bool, fragment: int) -> float:
        """Step 1: join the round's quorum; a heal from a live peer may put this site at its source's
        round and fragment (screened first: trainer.outer.heal_guard). Seconds since `t0`."""
        run = self.run
        run.healed, run.contributing, run.fragment = False, contribute, fragment
        try:
            refused = settle_heal(run, start_quorum(run.manager))  # synchronous (trainer.modes.ft: use_async_quorum=False)
        finally:
            run.contributing = False
        quorum_s = time.perf_counter() - t0
        if refused is not None:  # nothing of it was installed: this round runs on the site's own state
            run.metrics.event("rejected", f"round {run.round + 1}: heal from {refused.source} refused: "
                              f"{refused.reason}", round=run.round + 1, site_rejected=refused.source,
                              reason=refused.reason, heal=True)
        if run.healed:
            run.metrics.event("heal", f"healed from a live peer at round {run.round}", round=run.round)
        return quorum_s

    def average(self, deltas_fn, contribute: bool, f: int, tokens: float) -> RoundAverage:
        """Step 2: every site's contribution to fragment `f`, screened and averaged alike by every site
        (trainer.outer.guard), with the next H (h_auto) and compute window (h_policy "time") every site
        derives from the same gathered timings. A failure leaves no average: the round rolls back."""
        run, d = self.run, self.run.cfg.diloco
        idx, comp = run.frags[f], run.comps[f]
        out = RoundAverage(h_next=run.h)
        weight = 1.0 if contribute and not run.healed and run.manager.is_participating() else 0.0
        try:
            if err := run.manager.errored():  # e.g. the process group could not be configured
                raise RuntimeError(f"quorum failed: {err.original_exception}")
            comm = cross_site_comm(run.manager, run.timeout)
            deltas = deltas_fn() if weight > 0 else [torch.zeros_like(run.outer.params[i]) for i in idx]
            # each site's weight and contribution (screened by every site alike), gathered with its
            # last round's timings so every site derives the same next H (h_auto) from the same numbers
            g = out.guarded = guarded_average(comp, deltas, comm, weight, run.cfg.run.site, self.guard_rule,
                                              extra=run.last_sync, tokens=tokens)
            out.rejected = g.rejected
            for site, why in g.rejected:
                run.metrics.event("rejected", f"round {run.round + 1}: contribution of {site}: {why}",
                                  round=run.round + 1, site_rejected=site, reason=why)
            if g.failed:
                run.metrics.event("rejected", f"round {run.round + 1} not committed: {g.failed}",
                                  round=run.round + 1, reason=g.failed)
                raise RuntimeError(g.failed)
            out.k_active, out.avg, out.stats = g.k_active, g.avg, g.stats
            samples = [(float(r[0]), float(r[1])) for r, w in zip(g.rows, g.weights, strict=True) if w > 0]
            if out.k_active > 0 and d.h_auto:
                out.h_next = agreed_h(samples, run.h, d)
            if out.k_active > 0 and d.h_policy == "time":
                out.window = agreed_window(samples, run.h)
        except NonFiniteDelta:
            raise  # a broken pseudo-gradient is a training failure, not a network fault
        except Exception as e:  # the exchange failed: the round is not committed anywhere
            if not run.manager.errored():
                run.manager.report_error(e)
            out.avg, out.k_active = None, 0
            run.metrics.event("error", f"exchange failed, round rolled back: {e}", round=run.round + 1)
        return out

    def commit(self, avg: RoundAverage, commit_with: int, idx: list[int]) -> tuple[bool, bool, float]:
        """Step 3: torchft's commit vote (this site votes against while fewer than `commit_with` sites
        take part), then the outer step on the average where the round committed:
        (committed, applied, the outer lr applied)."""
        run = self.run
        if commit_with and run.manager.num_participants() < commit_with and not run.manager.errored():
            run.manager.report_error(RuntimeError(f"waiting for all {commit_with} sites"))
        committed = run.manager.should_commit()
        lr = 0.0
        applied = committed and avg.avg is not None and avg.k_active > 0
        if applied:
            with run.theta_lock:
                lr = run.outer.step(avg.avg, avg.k_active, idx)
        return committed, applied, lr

    def sync(self, contribute: bool, commit_with: int = 0, fragment: int = 0) -> ExchangeResult:
        """The exchange of sync mode: Δ = θ_t − θ_local, then every site restarts from θ_{t+1} (`fragment`:
        of that fragment's parameters; a healed site restarts from all of θ)."""
        run = self.run
        late, psi = (run.late, 0.0) if contribute else (None, 0.0)
        if late is not None:  # late_merge: the round the quorum went on without rides along, damped
            run.late = None
            psi = dampening(late.missed, async_alpha(run.cfg.diloco))
            run.metrics.event("late_merge", f"round {run.round + 1}: merged round {late.round}, committed without "
                              f"this site {late.missed} round(s) before, at weight {psi:.3g}",
                              round=run.round + 1, late_round=late.round, missed=late.missed, weight=psi)

        idx = run.frags[fragment]

        def deltas() -> list[Tensor]:
            own = run.outer.deltas(run.site.params, idx)
            return own if late is None else [d + psi * x for d, x in zip(own, late.deltas, strict=True)]

        tokens = (run.round_tokens + (psi * late.tokens if late else 0.0)) if contribute else 0.0
        res = self.exchange(deltas, contribute, commit_with, tokens, fragment)
        if contribute or run.healed or res.applied:
            # after a commit: θ_{t+1}; after a failed round: back to θ_t (the round's work is lost)
            run.outer.copy_to(run.site.params, None if run.healed else idx)
        return res

    def join(self) -> None:
        """Enter the quorum before training: heal if the others moved on; wait for peers at a fresh start.

        A fresh run waits (up to run.startup_wait_s) until all K sites are in one quorum, so no site
        trains round 1 alone while another is still importing torch; so does a whole-run restart
        (run.resume_round). A restarted site joins once: the others are mid-round and it must not
        make them wait a round per try. A lone site that starts fresh has nobody to wait for.
        """
        run = self.run
        d = run.cfg.diloco
        if run.resumed_from is None and d.sites <= 1:
            return
        deadline = time.monotonic() + run.cfg.run.startup_wait_s
        rejoining = run.resumed_from is not None and run.cfg.run.resume_round < 0  # not a whole-run restart
        while True:
            # Waiting for the others, a join must not commit: each commit advances torchft's step, and the
            # sites that arrive later would then heal from the first one and lose the inner steps they
            # restored mid-round (a whole-run restart after a preemption left each site at its own step).
            waiting = not rejoining and time.monotonic() < deadline
            res = self.sync(contribute=False, commit_with=d.sites if waiting else 0, fragment=run.fragment)
            if run.healed and len(run.frags) == 1:  # (fragments: the heal put the site where its source is)
                run.h_done = 0
            if res.committed and res.k_active > 0 and run.fragment == 0 and not self.staleness:
                # the others completed a round during our join: θ moved on, our partial round is void (overlap:
                # a source's round already counts the exchange it had in flight, so the heal gave the site its round)
                run.round += 1
                run.h_done = 0
            size = run.manager.num_participants() if res.committed else 0
            if rejoining or size >= d.sites or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        run.metrics.event("quorum", f"joined with {size} of {d.sites} sites at round {run.round}",
                          round=run.round, k_active=size, healed=run.healed)


class SyncExchange(TorchftExchange):
    """DiLoCo: every site blocks at the round boundary until θ_{t+1} is known.

    With diloco.fragments F > 1 (Streaming DiLoCo without overlap) each fragment's exchange is a whole
    sync exchange of its own right after its inner step (trainer.rules.fragments.offsets), all of them in
    after_step, the last at the round's end; a heal moves the site to its source's place in the round
    (run.fragment, run.h_done), and the compute loop goes on from there. finish sums the round's exchanges.
    """

    def __init__(self, run):
        super().__init__(run)
        self.done: list[ExchangeResult] = []  # fragments: this round's exchanges so far

    def after_step(self, done: int, h: int) -> float:
        run = self.run
        if len(run.frags) == 1:
            return 0.0
        t0 = time.perf_counter()
        run.round_tokens = float(h * run.step_tokens)
        at = offsets(h, len(run.frags))
        # in fragment order: the next one due (run.fragment) while its step has come; a heal may move it on
        while run.h_done >= at[run.fragment] and not (self.done and run.fragment == 0):
            self.done.append(self.sync(contribute=True, fragment=run.fragment))
        return time.perf_counter() - t0

    def finish(self, last: bool) -> ExchangeResult:
        run = self.run
        if len(run.frags) == 1:
            return self.sync(contribute=True)
        done, self.done = self.done, []
        if last:  # the run ends on θ_final (the fragments' progress since their last exchange is dropped)
            run.outer.copy_to(run.site.params)
        return merged(done)


def merged(parts: list[ExchangeResult]) -> ExchangeResult:
    """One round's result from its fragments' exchanges, in order: times and bytes add up; committed when
    every one was; the agreements (next H, window) are the last one's."""
    if not parts:
        return ExchangeResult()
    last = parts[-1]
    timed = [p for p in parts if p.quorum_s is not None]
    return ExchangeResult(
        sync_s=sum(p.sync_s for p in parts), k_active=min(p.k_active for p in parts),
        committed=all(p.committed for p in parts), applied=any(p.applied for p in parts), outer_lr=last.outer_lr,
        bytes_sent=sum(p.bytes_sent for p in parts), bytes_recv=sum(p.bytes_recv for p in parts),
        exchange_bytes=tuple(b for p in parts for b in p.exchange_bytes), h_next=last.h_next, window_s=last.window_s,
        rejected=tuple(dict.fromkeys(s for p in parts for s in p.rejected)), exchange_t=parts[0].exchange_t,
        quorum_s=sum(p.quorum_s or 0.0 for p in timed) if timed else None,
        weight_s=sum(p.weight_s or 0.0 for p in timed) if timed else None,
        payload_s=sum(p.payload_s or 0.0 for p in timed) if timed else None)


class OverlapExchange(TorchftExchange):
    """Round t's exchange runs in the background while round t+1 computes.

    The update lands `land_step(h, landing(diloco))` inner steps into round t+1 (at its end with
    overlap_land 1): the site waits for the exchange if it is not done, rebases on θ_{t+1} keeping
    its own progress since the round began, and computes the rest of the round from there. What it
    sends next is its progress against θ_{t+1} (trainer.simulate's overlap_round is the reference).
    """

    staleness = 1

    def __init__(self, run):
        super().__init__(run)
        self.pending: Future[ExchangeResult] | None = None
        self.start: list[Tensor] = []  # the site's parameters when the round began
        self.landed: ExchangeResult | None = None  # the previous round's exchange, once landed this round
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="outer-exchange")

    def begin_round(self) -> None:
        self.start = [p.detach().float().cpu().clone() for p in self.run.site.params]
        self.landed = None

    def progress(self, idx=None) -> list[Tensor]:
        """The site's progress since `start` (start minus its parameters now), of these parameter indices."""
        params = self.run.site.params
        return [self.start[i] - params[i].detach().float().cpu() for i in (range(len(params)) if idx is None else idx)]

    def after_step(self, done: int, h: int) -> float:
        if self.pending is None or done != land_step(h, landing(self.run.cfg.diloco)) or done == h:
            return 0.0
        t0 = time.perf_counter()
        self.landed = self._land()
        self.landed.sync_s = time.perf_counter() - t0  # only the wait shows (compute leaves it out)
        return self.landed.sync_s

    def _land(self) -> ExchangeResult:
        """Wait for the exchange in flight (its outer step is applied) and rebase on θ_{t+1}."""
        run = self.run
        assert self.pending is not None
        res = self.pending.result()
        self.pending = None
        own = self.progress()
        with torch.no_grad():
            overlap_rebase(run.site.params, run.outer.params, own, run.cfg.diloco.overlap_mix)
        return res

    def finish(self, last: bool) -> ExchangeResult:
        run = self.run
        if self.landed is not None:  # landed mid-round: the progress since is measured against θ_{t+1}
            res, send = self.landed, run.outer.deltas(run.site.params)
        else:
            send = self.progress()
            res = ExchangeResult(staleness=self.staleness)
            if self.pending is not None:
                t0 = time.perf_counter()
                res = self._land()
                res.sync_s = time.perf_counter() - t0  # only the wait shows: the rest overlapped compute
        self.pending = self._pool.submit(self.exchange, lambda: send, True, 0, run.round_tokens)
        if last:  # the last exchange: wait, and end on θ_final everywhere
            t0 = time.perf_counter()
            final = self.pending.result()
            self.pending = None
            run.outer.copy_to(run.site.params)
            res.sync_s += time.perf_counter() - t0
            res.bytes_sent += final.bytes_sent
            res.bytes_recv += final.bytes_recv
        return res

    def drain(self, timeout_s: float | None = None) -> None:
        """Let the exchange in flight finish, so a checkpoint saved now holds the θ it produced."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result(timeout=timeout_s)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class DdpExchange(TorchftExchange):
    """Baseline: gradients averaged across sites at every inner step (one quorum per step)."""

    def __init__(self, run):
        super().__init__(run)
        self.bytes = 0  # wire bytes of this round's gradient exchanges
        self.sync_s = 0.0  # seconds of this round's gradient exchanges
        self.counted = 0.0  # of those, what after_step already handed to the round's compute time
        self.k = 1  # sites in the last step's average

    def begin_round(self) -> None:
        self.bytes, self.sync_s, self.counted = 0, 0.0, 0.0

    def after_step(self, done: int, h: int) -> float:
        new, self.counted = self.sync_s - self.counted, self.sync_s  # the step's gradient exchange
        return new

    def grad_hook(self, site_hook: GradHook | None) -> GradHook:
        run = self.run

        def hook(grads: list[Tensor]) -> None:
            if site_hook:
                site_hook(grads)
            t0 = time.perf_counter()
            if (refused := settle_heal(run, start_quorum(run.manager))) is not None:
                run.metrics.event("rejected", f"step {run.site.step}: {refused}", round=run.round + 1,
                                  site_rejected=refused.source, reason=refused.reason, heal=True)
            comm = cross_site_comm(run.manager, run.timeout)
            from trainer.parallel import local

            def reduce_sum(flat: Tensor) -> None:
                try:
                    comm.allreduce_sum(flat)
                    self.bytes += int(wire_cost("sum", flat.nbytes, comm.size))
                except Exception as e:
                    run.metrics.event("error", f"gradient exchange failed: {e}", round=run.round + 1)
                self.k = int(flat[-1])

            # summed with a count of the contributing sites; zeroed when the commit vote fails
            flat_average([local(g) for g in grads], reduce_sum, keep=run.manager.should_commit)
            self.sync_s += time.perf_counter() - t0
        return hook

    def finish(self, last: bool) -> ExchangeResult:
        # gradients were averaged at every step: nothing left to exchange
        return ExchangeResult(sync_s=self.sync_s, k_active=self.k,
                              committed=True, bytes_sent=self.bytes, bytes_recv=self.bytes)


class FragmentOverlapExchange(OverlapExchange):
    """Overlap with diloco.fragments F > 1 (Streaming DiLoCo): fragment f's exchange starts right after its
    inner step (trainer.rules.fragments.offsets) and runs while the site computes; the one before it lands
    `land_step` of the way from its own start to the next exchange point (at the latest just before that
    exchange starts), and the site rebases that fragment on θ keeping its progress since it was sent.
    A fragment's send is its progress since its last send, taken against θ once its update has landed.
    One exchange is in flight at a time. trainer.simulate's overlap_round is the reference.

    A round's record carries the exchanges that landed in it (their waits, bytes and commits); the
    last exchange of the run is waited for and every site ends on θ_final.
    """

    def __init__(self, run):
        super().__init__(run)
        self.pending_f = 0  # the fragment of the exchange in flight
        self.next_f = 0  # the next fragment due this round
        self.rebased = [False] * len(run.frags)  # its update landed since it was last sent
        self.parts: list[ExchangeResult] = []  # the exchanges that landed this round

    def begin_round(self) -> None:
        run = self.run
        if not self.start:  # the first round, or after a restart: each fragment's progress counts from here
            self.start = [p.detach().float().cpu().clone() for p in run.site.params]
        run.place_from_heal = False  # from now on a heal arrives mid-round, on the exchange's thread
        self.next_f = run.fragment if run.h_done else 0
        self.parts = []

    def after_step(self, done: int, h: int) -> float:
        run = self.run
        at = offsets(h, len(run.frags))
        waited = 0.0
        f = self.next_f
        if self.pending is not None and f < len(at):
            prev = at[f - 1] if f else 0
            if at[f] > prev and done == prev + land_step(at[f] - prev, landing(run.cfg.diloco)) < at[f]:
                waited += self._land_fragment()
        while self.next_f < len(at) and done >= at[self.next_f]:
            f = self.next_f
            idx = run.frags[f]
            send = run.outer.deltas(run.site.params, idx) if self.rebased[f] else self.progress(idx)
            if self.pending is not None:  # lands now, just before this exchange starts
                waited += self._land_fragment()
            run.round_tokens = float(h * run.step_tokens)
            self.pending_f = f
            self.pending = self._pool.submit(self.exchange, lambda s=send: s, True, 0, run.round_tokens, f)
            for i in idx:
                self.start[i] = run.site.params[i].detach().float().cpu().clone()
            self.rebased[f] = False
            self.next_f += 1
        return waited

    def _land_fragment(self) -> float:
        """Wait for the exchange in flight (its outer step is applied) and rebase its fragment on θ; the wait."""
        run = self.run
        assert self.pending is not None
        t0 = time.perf_counter()
        res = self.pending.result()
        self.pending = None
        if res.applied:  # a refused round leaves the site's progress where it is (as the simulator does)
            idx = run.frags[self.pending_f]
            own = self.progress(idx)
            with torch.no_grad():
                overlap_rebase([run.site.params[i] for i in idx], [run.outer.params[i] for i in idx], own,
                               run.cfg.diloco.overlap_mix)
            self.rebased[self.pending_f] = True
        res.sync_s = time.perf_counter() - t0  # only the wait shows: the rest overlapped compute
        self.parts.append(res)
        return res.sync_s

    def finish(self, last: bool) -> ExchangeResult:
        run = self.run
        if last:  # the last exchange: wait, and end on θ_final everywhere
            if self.pending is not None:
                self._land_fragment()
            run.outer.copy_to(run.site.params)
        res = merged(self.parts) if self.parts else ExchangeResult()
        res.staleness = self.staleness
        self.parts = []
        return res

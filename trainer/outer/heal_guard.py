"""Screening of a healed state before anything of it is installed (issue 34, findings 2 and 8).

torchft's quorum makes the participant with the highest self-reported step the source every lagging
site heals from, and installs whatever that source sends. Here a healing site checks, between
receiving the state and handing it to torchft, that:
- the claim is possible: a site that committed its previous round (it is "live") is at most
  MAX_STEP_GAP_LIVE commits behind any honest source, unless more than half of the other
  participants report the source's step (`corroborated`: a straggler the quorum went on without),
  which in a quorum of 3 or more a live site requires. In a quorum of two there is nobody to ask:
  a live site heals from a source any number of commits ahead that the run can reach, screened at
  the live bound (refusing forked θ for good: 2 sites, one paused for 3 rounds, refused its peer in
  every later round and both ended on different θ; a liar gains nothing it could not get by
  claiming one commit ahead). Any site refuses a step, round or inner step beyond the run's plan,
  and an H the run could not have agreed on;
- the state is the site's own kind of state: the same tensors (shapes, dtypes), all finite; θ within
  HEAL_MAX_REL_DIST (HEAL_MAX_REL_DIST_LIVE for a live site) of the site's own θ, relative to ||θ||;
  the outer momentum within HEAL_MAX_REL_MOMENTUM of ||θ||;
- the source was never refused before: a refused source stays refused for the rest of the process
  (except for a step the run can reach that a quorum of 3 or more did not vouch for, refused only
  that once)
  (torchft offers no way to drop a member from the next quorum; it stays in the quorum and its
  contributions are screened by trainer.outer.guard, but nobody heals from it again).
A refusal raises HealRefused inside torchft's recovery (trainer.modes.ft wraps the checkpoint transport):
torchft then installs nothing, not even the step, and reports the error; trainer.modes.ft.start_quorum
clears that error, so the site takes part in the round with its own state, and the exchange names
the source in a "rejected" event. Only state tensors and counters are installed: the outer
optimizer's hyperparameters always come from the site's own config (OuterState.load_state_dict).

The heal size cap (finding 8) is derived from the site's own state: its tensors' bytes, plus its
momentum buffers when it has none yet, plus a small margin for the header and tree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.codecs.norms import sq_sum_all

HEAL_MAX_REL_DIST = 4.0  # a healed θ farther than this x ||own θ|| from the site's own θ is refused
HEAL_MAX_REL_DIST_LIVE = 0.5  # the same for a live site (committed its previous round: at most a round behind)
HEAL_MAX_REL_MOMENTUM = 4.0  # a healed outer momentum buffer larger than this x ||own θ|| (all of it) is refused
MAX_STEP_GAP_LIVE = 1  # commits an honest source can be ahead of a site that committed its previous round
HEAL_MARGIN_BYTES = 64 << 10  # heal size cap: bytes allowed above the state's tensors (header, tree) ...
HEAL_BYTES_PER_TENSOR = 512  # ... plus this per tensor (its safetensors header entry and tree node)


class HealRefused(Exception):
    """A heal source or its state failed screening; nothing of it was installed."""

    def __init__(self, source: str, reason: str):
        super().__init__(f"heal from {source} refused: {reason}")
        self.source, self.reason = source, reason


@dataclass(kw_only=True, slots=True)
class HealLimits:
    """What the run's plan allows a healed state to say."""

    planned_rounds: int  # outer rounds the run takes at most
    total_steps: int  # inner steps a site can reach in the run (h_policy "time": up to MAX_TIME_STEPS x H a round)
    h: int  # the configured H (the only one without h_auto)
    h_auto: bool  # H may change, within [h_min, h_max]
    h_min: int
    h_max: int
    commits: int = 0  # torchft commits the run takes at most: one per exchange, F a round with fragments

    @classmethod
    def from_config(cls, cfg) -> HealLimits:
        from trainer.rules.schedule import MAX_TIME_STEPS, planned_rounds

        d = cfg.diloco
        # h_policy "time" runs its rounds, each of 1 to MAX_TIME_STEPS x H inner steps: a fast site passes
        # rounds x H (refused for good at 25,010 of 24,000 steps, a 3-site chaos run forked at its end)
        steps = planned_rounds(cfg) * MAX_TIME_STEPS * d.h if d.h_policy == "time" else cfg.total_steps
        return cls(planned_rounds=planned_rounds(cfg), total_steps=steps, h=d.h, h_auto=d.h_auto,
                   h_min=d.h_min, h_max=d.h_max, commits=planned_rounds(cfg) * d.fragments)


@dataclass(kw_only=True, slots=True)
class QuorumView:
    """What torchft's quorum told this site (QuorumResult), as the screening needs it."""

    own_step: int  # this site's manager step when it asked for the quorum
    max_step: int  # the highest step a participant reported: the source's claim
    participants: int  # sites in the quorum, this one included
    at_max: int  # of them, those reporting max_step
    source: str  # the site this one heals from (its replica id before ":"), "" when none


def quorum_view(own_step: int, result) -> QuorumView:
    """A QuorumView of torchft's QuorumResult (replica_ids are in replica-rank order)."""
    src = result.recover_src_replica_rank
    ids = list(result.replica_ids or [])
    source = ids[src].split(":")[0] if src is not None and 0 <= src < len(ids) else \
        (f"replica {src}" if src is not None else "")
    return QuorumView(own_step=int(own_step), max_step=int(result.max_step), participants=int(result.replica_world_size),
                      at_max=int(result.max_world_size), source=source)


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, list | tuple):
        return [t for v in x for t in _tensors(v)]
    return []


def expected_heal_bytes(own: dict) -> int:
    """The heal size cap: what a state like this site's own (trainer.modes.loop's _ft_state) can take on the
    wire. A site that has not stepped yet has no momentum buffers; a source has one per parameter."""
    tensors = _tensors(own)
    size = sum(t.numel() * t.element_size() for t in tensors)
    params = own["outer"]["params"]
    buffers = _momentum_buffers(own["outer"])
    missing = [p for i, p in enumerate(params) if i not in buffers]
    size += sum(p.numel() * p.element_size() for p in missing)
    return size + HEAL_MARGIN_BYTES + HEAL_BYTES_PER_TENSOR * (len(tensors) + len(missing))


def _momentum_buffers(outer: dict) -> dict[int, torch.Tensor]:
    state = outer.get("opt", {}).get("state", {}) if isinstance(outer.get("opt"), dict) else {}
    return {k: v["momentum_buffer"] for k, v in state.items()
            if isinstance(v, dict) and isinstance(v.get("momentum_buffer"), torch.Tensor)}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _norm(ts: list[torch.Tensor]) -> float:
    return math.sqrt(sq_sum_all(ts))


def _same_tensors(what: str, got: Any, own: list[torch.Tensor]) -> str | None:
    """None when `got` is a list of finite tensors shaped and typed exactly like `own`, else why not."""
    if not isinstance(got, list | tuple) or len(got) != len(own):
        return f"{what}: {len(got) if isinstance(got, list | tuple) else type(got).__name__} tensors, this site has {len(own)}"
    for i, (g, o) in enumerate(zip(got, own, strict=True)):
        if not isinstance(g, torch.Tensor):
            return f"{what}[{i}] is a {type(g).__name__}, not a tensor"
        if g.shape != o.shape or g.dtype != o.dtype:
            return f"{what}[{i}] is {g.dtype} {tuple(g.shape)}, this site's is {o.dtype} {tuple(o.shape)}"
        if not bool(torch.isfinite(g).all()):
            return f"{what}[{i}] holds non-finite values"
    return None


def corroborated(view: QuorumView) -> bool:
    """In a quorum of 3 or more, more than half of the other participants report the source's step.

    Then a live site may be any number of commits behind (a straggler the quorum went on without:
    a site slowed 6x fell 2 commits behind and, refused, could never rejoin), and is screened like
    a restarted one; one liar cannot make a majority report its step."""
    return view.participants >= 3 and 2 * view.at_max > view.participants - 1


def check_claim(view: QuorumView, live: bool) -> str | None:
    """None when the source's claimed step is possible for this site, else why not."""
    if live and not corroborated(view) and view.max_step > view.own_step + MAX_STEP_GAP_LIVE:
        return (f"claims step {view.max_step}, but this site committed step {view.own_step} in its last "
                f"round: an honest source is at most {MAX_STEP_GAP_LIVE} ahead")
    others = view.participants - 1
    if live and view.participants >= 3 and 2 * view.at_max <= others:
        return (f"claims step {view.max_step}, which only {view.at_max} of the quorum's {others} other "
                f"sites report (not a majority)")
    return None


def check_state(got: Any, max_step: int, own: dict, limits: HealLimits, live: bool,
                far_behind: bool = False, ahead: int = 0) -> str | None:
    """None when the received manager state (torchft's {"user": {"default": ...}, "torchft": ...}) may be
    installed at a site whose own state (trainer.modes.loop's _ft_state) is `own`, else why not. `far_behind`:
    a live straggler in a quorum of two, any number of rounds behind, held to the live distance bound.
    `ahead`: commits the source is ahead of this site (a live site: at most MAX_STEP_GAP_LIVE)."""
    if not isinstance(got, dict) or set(got) != {"user", "torchft"} or not isinstance(got["user"], dict) \
            or set(got["user"]) != {"default"} or not isinstance(got["torchft"], dict):
        return "not a manager state (user.default, torchft)"
    ft, sd = got["torchft"], got["user"]["default"]
    if not _is_int(ft.get("step")) or ft["step"] != max_step or not _is_int(ft.get("batches_committed")) or ft["batches_committed"] < 0:
        return f"torchft state {ft!r} does not match the claimed step {max_step}"
    if not isinstance(sd, dict) or set(sd) != set(own):
        return f"state keys {sorted(map(str, sd)) if isinstance(sd, dict) else type(sd).__name__}, expected {sorted(own)}"
    if why := _check_counters(sd, own, limits, live, ahead):
        return why
    outer, own_outer = sd["outer"], own["outer"]
    if not isinstance(outer, dict) or set(outer) != set(own_outer) or not isinstance(outer.get("opt"), dict) \
            or not isinstance(outer["opt"].get("state"), dict):
        return f"outer state is not {{{', '.join(own_outer)}}} with opt.state"
    own_params = list(own_outer["params"])
    if why := _same_tensors("outer.params", outer.get("params"), own_params):
        return why
    buffers = outer["opt"]["state"]
    for k, v in buffers.items():
        if not _is_int(k) or not 0 <= k < len(own_params) or not isinstance(v, dict):
            return f"outer momentum entry {k!r} names no parameter"
        if (m := v.get("momentum_buffer")) is not None and \
                (why := _same_tensors(f"outer momentum[{k}]", [m], [own_params[k]])):
            return why
    if (why := _check_codec(sd["codec"], own["codec"])):
        return why
    if "codecs" in own and (why := _check_fragments(sd, own)):
        return why
    own_norm = max(_norm(own_params), 1e-12)
    dist = _norm([g - o for g, o in zip(outer["params"], own_params, strict=True)])
    bound = HEAL_MAX_REL_DIST_LIVE if live or far_behind else HEAL_MAX_REL_DIST
    if not dist <= bound * own_norm:
        return f"θ is {dist / own_norm:.3g} x ||θ|| from this site's own (at most {bound:g})"
    moms = [v["momentum_buffer"] for v in buffers.values() if v.get("momentum_buffer") is not None]
    if moms and not (mn := _norm(moms)) <= HEAL_MAX_REL_MOMENTUM * own_norm:
        return f"outer momentum is {mn / own_norm:.3g} x ||θ|| (at most {HEAL_MAX_REL_MOMENTUM:g})"
    return None


def _check_counters(sd: dict, own: dict, limits: HealLimits, live: bool, ahead: int = 0) -> str | None:
    """round, inner step and H against the run's plan (and, for a live site, its own round)."""
    r, step, h = sd.get("round"), sd.get("step"), sd.get("h")
    if not (_is_int(r) and _is_int(step) and _is_int(h)):
        return f"round {r!r}, step {step!r}, h {h!r}: not integers"
    if not 0 <= r <= limits.planned_rounds:
        return f"round {r} is beyond the run's {limits.planned_rounds} rounds"
    # one either way: overlap mode counts a round on the main thread while the exchange thread heals; and
    # a round for each commit the source is ahead (a live site the quorum went on without once was 2
    # rounds behind a source 1 commit ahead, refused it for good, and trained on its own θ to the end)
    if live and not -1 <= r - own["round"] <= 1 + max(0, ahead):
        return f"round {r}, but this site completed round {own['round']} with the quorum"
    if not 0 <= step <= limits.total_steps:
        return f"inner step {step} is beyond the run's {limits.total_steps} steps"
    if not (limits.h_min <= h <= limits.h_max if limits.h_auto else h == limits.h):
        return f"H {h} is not one this run can use"
    return None


def _check_fragments(sd: dict, own: dict) -> str | None:
    """diloco.fragments: the other fragments' codec states, and a place in a round (fragment, inner step)."""
    codecs = sd["codecs"]
    if not isinstance(codecs, list) or len(codecs) != len(own["codecs"]):
        return f"{len(codecs) if isinstance(codecs, list) else type(codecs).__name__} fragment codec states, " \
               f"this site has {len(own['codecs'])}"
    for g, o in zip(codecs, own["codecs"], strict=True):
        if why := _check_codec(g, o):
            return why
    f, done = sd["fragment"], sd["h_done"]
    if not (_is_int(f) and 0 <= f <= len(codecs) and _is_int(done) and 0 <= done <= sd["h"]):
        return f"fragment {f!r} after inner step {done!r} is not a place in a round of {sd['h']}"
    return None


def _check_codec(got: Any, own: dict) -> str | None:
    """The compressor's global state (PowerSGD's warm-start Q): same spec, same tensors, finite."""
    if not isinstance(got, dict) or got.get("spec") != own.get("spec") or not isinstance(got.get("q"), dict):
        return f"compressor state is not for this site's codec {own.get('spec')!r}"
    q, own_q = got["q"], own.get("q", {})
    if own_q and set(q) != set(own_q):
        return "compressor state holds other tensors than this site's"
    for k, t in q.items():
        if not isinstance(t, torch.Tensor) or not bool(torch.isfinite(t).all()):
            return f"compressor state {k!r} is not a finite tensor"
        if k in own_q and t.shape != own_q[k].shape:
            return f"compressor state {k!r} is {tuple(t.shape)}, this site's is {tuple(own_q[k].shape)}"
    return None


@dataclass(kw_only=True)
class HealGuard:
    """One site's heal screening: what its quorums and commit votes said, and whom it refused."""

    own_state: Callable[[], dict]  # the site's own heal state now (trainer.modes.loop's _ft_state)
    limits: HealLimits
    live_step: int | None = None  # the manager step after this process's last commit; None: last vote failed
    view: QuorumView | None = None  # the last quorum
    refused: dict[str, str] = field(default_factory=dict)  # source site -> why it was first refused
    before: dict = field(default_factory=dict)  # the manager's state_dict when it asked for the last quorum

    def note_quorum(self, own_step: int, result) -> None:
        self.view = quorum_view(own_step, result)

    def note_commit(self, step: int, committed: bool) -> None:
        self.live_step = step + 1 if committed else None

    def live(self) -> bool:
        """Whether this site committed its previous round and nothing moved its step since."""
        return self.view is not None and self.live_step is not None and self.view.own_step == self.live_step

    def cap(self) -> int:
        return expected_heal_bytes(self.own_state())

    def screen(self, got: Any, step: int) -> None:
        """Raise HealRefused unless `got` (received for claimed `step`) may be installed."""
        view = self.view
        source = view.source if view is not None and view.source else "the heal source"
        if source in self.refused:
            raise HealRefused(source, f"refused before ({self.refused[source]})")
        live = self.live()
        why = check_claim(view, live) if view is not None else None
        far_behind = False
        if why and view is not None and view.max_step <= (self.limits.commits or self.limits.planned_rounds):
            if view.participants >= 3:
                # a step the run can reach that the quorum's majority does not report: refused this time,
                # not for good; a later quorum may vouch for it
                raise HealRefused(source, why)
            why, far_behind = None, True  # a quorum of two: nobody to ask (see the module docstring)
        live = live and not far_behind and not (view is not None and corroborated(view))
        ahead = view.max_step - view.own_step if view is not None else 0
        why = why or check_state(got, step, self.own_state(), self.limits, live, far_behind, ahead)
        if why:
            self.refused[source] = why
            raise HealRefused(source, why)


def screened_transport(inner, guard: HealGuard):
    """`inner` (a torchft CheckpointTransport), except that what it receives is screened by `guard`
    before torchft sees it."""
    from torchft.checkpointing.transport import CheckpointTransport

    class _Screened(CheckpointTransport):
        def metadata(self) -> str:
            return inner.metadata()

        def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
            inner.send_checkpoint(dst_ranks, step, state_dict, timeout)

        def disallow_checkpoint(self) -> None:
            inner.disallow_checkpoint()

        def recv_checkpoint(self, src_rank, metadata, step, timeout):
            got = inner.recv_checkpoint(src_rank, metadata, step, timeout)  # read whole: the stream stays in step
            guard.screen(got, step)
            return got

        def shutdown(self, wait: bool = True) -> None:
            inner.shutdown(wait)

    t = _Screened()
    t.inner, t.guard = inner, guard
    return t

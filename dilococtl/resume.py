"""`dilococtl resume`: find what died in a run and relaunch it from its newest complete checkpoint.

A site is dead when any of its nodes is no longer running (process gone, exit code written, node
unreachable): a torchrun job cannot go on without one of its nodes, so the whole site job is
stopped and started again. The trainer itself loads the newest checkpoint that verifies and, while
other sites are alive, heals to the current global parameters through torchft. When every site is
dead (the Lighthouse is stopped with the last one), the run restarts as a whole from the newest
round every site has a complete checkpoint of (trainer `run.resume_round`), and the sites wait for
each other as at a fresh start.

Checkpoints are inspected on each site's leader node with a stdlib-only script (`CKPT_PROBE`) that
applies the trainer's own completeness rules (trainer.checkpoints.checkpoint_trust.verify) without importing torch.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dilococtl import procs as procs_mod
from dilococtl import runs as runs_mod
from dilococtl.coordinators import is_ours, lighthouse_alive, stop_lighthouse
from dilococtl.errors import BadInput, DilocoError, Unreachable
from dilococtl.nodes import NodePool, node_python
from dilococtl.states import RunState, SiteState
from dilococtl.store import Run, Store

Progress = Callable[[str], None]
KILL_GRACE_S = 10.0  # leftovers of a dead site get SIGTERM, then SIGKILL after this long
PROBE_TIMEOUT_S = 60.0  # checksumming a site's checkpoints on its leader node
ALIVE_STATES = (SiteState.RUNNING, SiteState.STARTING)  # node states of a process that is still there

# Lists RUN_DIR/SITE/checkpoints/round-* newest first as [{"round": R, "why": ""}] ("" = complete).
# Mirrors trainer.checkpoints.checkpoint_trust.verify (manifest, HMAC-SHA256 signature, sizes, SHA-256) with the stdlib
# only; the integration test checks both give the same verdicts on real checkpoints. argv[2], the path
# of the run's checkpoint key on the node, is what the signature is checked with (the trainer checks
# it again before loading; without argv[2] only completeness is checked).
CKPT_PROBE = r'''
import hashlib, hmac, json, os, re, sys
root = sys.argv[1]
key = None
if len(sys.argv) > 2:
    try:
        with open(sys.argv[2], "rb") as f:
            key = f.read(33)
    except OSError as e:
        if not os.path.isdir(root):  # an empty machine (work_dir gone): no key, and nothing local to vouch for
            print("[]")
            sys.exit(0)
        sys.exit(f"no checkpoint key at {sys.argv[2]}: {e.strerror or e}")

def signature_problem(manifest):
    if not isinstance(manifest, dict):
        return "manifest unreadable: not a JSON object"
    if manifest.get("format") != 2 or "signature" not in manifest:
        return (f"unsigned checkpoint (manifest format {manifest.get('format', 1)}, made before checkpoints were "
                f"signed): refused, nothing vouches for who wrote it")
    if key is None:
        return ""
    body = json.dumps({k: v for k, v in manifest.items() if k != "signature"}, sort_keys=True,
                      separators=(",", ":")).encode()
    if not hmac.compare_digest(hmac.new(key, body, hashlib.sha256).hexdigest(), str(manifest["signature"])):
        return "signature does not verify under this run's checkpoint key: refused"
    return ""

def why(path):
    mpath = os.path.join(path, "manifest.json")
    if not os.path.isfile(mpath):
        return "no manifest (the save did not finish)"
    try:
        if os.stat(mpath).st_size > (16 << 20):
            return f"manifest unreadable: over {16 << 20} bytes"
        with open(mpath) as f:
            manifest = json.load(f)
        files = manifest["files"]
        mround = int(manifest["round"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return "manifest unreadable: " + ((str(e).strip() or type(e).__name__).splitlines()[0])
    problem = signature_problem(manifest)
    if problem:
        return problem
    m = re.match(r"^round-(\d+)$", os.path.basename(path))
    if m and int(m.group(1)) != mround:
        return f"manifest is for round {mround}, directory for round {int(m.group(1))}"
    if not isinstance(files, dict) or ".metadata" not in files:
        return "manifest lists no DCP .metadata"
    for name, want in files.items():
        if not isinstance(want, dict) or "/" in name or name in ("", ".", "..", "manifest.json"):
            return f"manifest entry {name!r} is not a file of this directory"
        try:
            size = os.stat(os.path.join(path, name)).st_size
        except OSError:
            return f"file {name} is missing"
        if size != want.get("size"):
            return f"file {name} has {size} bytes, manifest says {want.get('size')}"
    for name, want in files.items():
        h = hashlib.sha256()
        try:
            with open(os.path.join(path, name), "rb") as f:
                while chunk := f.read(8 << 20):
                    h.update(chunk)
        except OSError as e:
            return f"file {name} unreadable: " + ((str(e).strip() or type(e).__name__).splitlines()[0])
        digest = h.hexdigest()
        if digest != want.get("sha256"):
            return f"file {name} checksum mismatch (sha256 {digest[:16]}..., manifest says {str(want.get('sha256'))[:16]}...)"
    return ""

out = []
for name in (os.listdir(root) if os.path.isdir(root) else []):
    m = re.match(r"^round-(\d+)$", name)
    if m and os.path.isdir(os.path.join(root, name)):
        out.append({"round": int(m.group(1)), "why": why(os.path.join(root, name))})
print(json.dumps(sorted(out, key=lambda c: -c["round"])))
'''


def _noop(_msg: str) -> None:
    pass


@dataclass(kw_only=True, slots=True)
class Checkpoint:
    round: int  # the round directory's number
    why: str  # why it cannot be used ("" = complete and intact)


@dataclass(kw_only=True, slots=True)
class SiteDiagnosis:
    site: str
    dead: bool  # its job must be started again
    why: str  # what died, one line ("" when alive)
    finished: bool = False  # it completed every round: never relaunched
    leftovers: list[tuple[str, int]] = field(default_factory=list)  # (host, pid) still running in a dead site
    unreachable: dict[str, str] = field(default_factory=dict)  # host -> the error, for hosts that did not answer
    checkpoints: list[Checkpoint] = field(default_factory=list)  # newest first (empty when not read)

    @property
    def newest(self) -> int | None:
        """The newest complete checkpoint's round."""
        return next((c.round for c in self.checkpoints if not c.why), None)

    def skipped(self, upto: int | None = None) -> list[Checkpoint]:
        """Broken checkpoints newer than the one the trainer will load (the newest complete one <= `upto`)."""
        use = self.load_round(upto)
        return [c for c in self.checkpoints if c.why and (use is None or c.round > use)]

    def load_round(self, upto: int | None = None) -> int | None:
        """The round the trainer will load: the newest complete one, at most `upto`."""
        return next((c.round for c in self.checkpoints if not c.why and (upto is None or c.round <= upto)), None)


@dataclass(kw_only=True, slots=True)
class Diagnosis:
    run_id: str
    sites: list[SiteDiagnosis]
    lighthouse_alive: bool

    @property
    def dead(self) -> list[SiteDiagnosis]:
        return [s for s in self.sites if s.dead]

    @property
    def whole_run(self) -> bool:
        """Every site is dead: the run restarts as a whole."""
        return bool(self.sites) and all(s.dead for s in self.sites)


@dataclass(kw_only=True, slots=True)
class SiteResume:
    site: str
    why: str  # what had died
    round: int | None  # checkpoint round the trainer loads (None: from scratch / heals)
    skipped: list[Checkpoint]  # broken newer checkpoints passed over
    attempt: int  # launch attempt number of the site


@dataclass(kw_only=True, slots=True)
class ResumeResult:
    run: Run
    relaunched: list[SiteResume] = field(default_factory=list)
    blocked: dict[str, str] = field(default_factory=dict)  # site -> why it could not be relaunched now
    resume_round: int | None = None  # whole-run restart: the common round
    whole_run: bool = False
    coordinator: str = ""  # a dead coordinator this resume restarted (its coordinator_restart event), else ""

    def to_json(self) -> dict[str, Any]:
        return {"id": self.run.id, "state": self.run.state, "whole_run": self.whole_run,
                "coordinator_restarted": self.coordinator,
                "resume_round": self.resume_round, "blocked": self.blocked,
                "relaunched": [{"site": r.site, "why": r.why, "round": r.round, "attempt": r.attempt,
                                "skipped": [{"round": c.round, "why": c.why} for c in r.skipped]}
                               for r in self.relaunched]}


# --- diagnosis -----------------------------------------------------------------------------------

def read_checkpoints(run: Run, site: str, *, store: Store, pool: NodePool) -> list[Checkpoint]:
    """The checkpoints of `site` as its leader node sees them, newest first (Unreachable if it does not answer)."""
    spec = run.spec()
    leader = next(n for n in store.nodes(run.id, site) if n.rank == 0)
    section = next(s for s in spec.sites if s.name == site)
    cmd = (f"{shlex.quote(node_python(section, leader.host))} -c {shlex.quote(CKPT_PROBE)} "
           f"{shlex.quote(f'{leader.run_dir}/{site}/checkpoints')} {shlex.quote(_checkpoint_key_there(run, leader))}")
    r = pool.get(leader.host).run(cmd, timeout=PROBE_TIMEOUT_S)
    if r.rc != 0:
        raise DilocoError(f"{site}: cannot list checkpoints on {leader.host}: {(r.stderr or r.stdout).strip()[-300:]}")
    return [Checkpoint(round=int(c["round"]), why=str(c["why"])) for c in json.loads(r.stdout.strip().splitlines()[-1])]


def _checkpoint_key_there(run: Run, leader) -> str:
    """Where the site's leader reads the run's checkpoint key (as plan.build delivered it)."""
    from dilococtl import run_ca
    from dilococtl.plan import run_ca_dir
    from dilococtl.spec_sites import is_local

    if is_local(leader.host):
        return str(run_ca_dir(run.id) / run_ca.CHECKPOINT_KEY)
    return f"{leader.run_dir}/_keys/{run_ca.CHECKPOINT_KEY}"


def diagnose(run: Run, *, store: Store, pool: NodePool, sites: list[str] | None = None) -> Diagnosis:
    """Refresh the run, then say per site whether it is dead, why, and what checkpoints it has."""
    run = runs_mod.refresh(run, store=store, pool=pool)
    known = [s.name for s in store.sites(run.id)]
    for name in sites or []:
        if name not in known:
            raise BadInput(f"run {run.id} has no site {name!r} (sites: {', '.join(known)})")
    out = []
    for s in store.sites(run.id):
        nodes = store.nodes(run.id, s.name)
        gone = [n for n in nodes if n.state not in ALIVE_STATES]
        d = SiteDiagnosis(site=s.name, dead=False, why="")
        if nodes and all(n.state == SiteState.FINISHED for n in nodes):
            d.finished = True
        elif gone:
            d.dead = True
            d.why = "; ".join(_node_why(n) for n in gone)
            d.leftovers = [(n.host, n.pid) for n in nodes if n.state in ALIVE_STATES and n.pid]
        if d.dead and (sites is None or s.name in sites):
            for host in sorted({n.host for n in nodes}):
                try:
                    pool.get(host).run("true", timeout=30)
                except Unreachable as e:
                    d.unreachable[host] = str(e)
            if not d.unreachable:
                d.checkpoints = with_stored(run, s.name, read_checkpoints(run, s.name, store=store, pool=pool))
        out.append(d)
    return Diagnosis(run_id=run.id, sites=out, lighthouse_alive=lighthouse_alive(run, pool))


def with_stored(run: Run, site: str, local: list[Checkpoint]) -> list[Checkpoint]:
    """`local` plus the rounds that verify in the site's object stores (the trainer fetches those when its
    own copy is gone or broken), newest first; a store that cannot be listed adds nothing."""
    from dilococtl import checkpoints as ck

    if not ck.has_stores(run):
        return local
    stored = set().union(*(e.verified() for e in ck.list_run(run, sites=[site])))
    by_round = {c.round: c for c in local}
    for r in stored:
        if r not in by_round or by_round[r].why:
            by_round[r] = Checkpoint(round=r, why="")
    return sorted(by_round.values(), key=lambda c: -c.round)


def _forget_lost_metrics(run: Run, site: str, *, store: Store, pool: NodePool) -> None:
    """A site whose machines came back empty writes a new metrics file: read it from its start again."""
    for n in store.nodes(run.id, site):
        if n.rank != 0:
            continue
        path = runs_mod.metrics_path(n.run_dir, site)
        if store.offset(run.id, site, n.host, path) and pool.get(n.host).run(f"test -e {shlex.quote(path)}").rc != 0:
            store.ingest(run.id, site, n.host, path, 0, [])


def _node_why(n) -> str:
    what = {SiteState.FAILED: "process gone (failed)", SiteState.PREEMPTED: "preempted (checkpoint saved on SIGTERM)",
            SiteState.LOST: "node unreachable", SiteState.STOPPED: "stopped",
            SiteState.PENDING: "never started"}.get(n.state, n.state)
    return f"node{n.rank} {n.host}: {what}"


# --- relaunch ------------------------------------------------------------------------------------

def common_round(diags: list[SiteDiagnosis], upto: int | None = None) -> int | None:
    """The newest round (<= `upto`) that every site of `diags` has a complete checkpoint of, or None."""
    sets = [{c.round for c in d.checkpoints if not c.why and (upto is None or c.round <= upto)} for d in diags]
    common = set.intersection(*sets) if sets else set()
    return max(common) if common else None


def resume(run: Run, *, store: Store, sites: list[str] | None = None, accept_new: bool = False,
           progress: Progress = _noop, upto: int | None = None) -> ResumeResult:
    """Relaunch the dead sites of `run` (only `sites` if given) under the same run id.

    Sites with a node that does not answer are left out (`blocked`); the others are relaunched.
    Every relaunch is recorded as a launch attempt and a `resume` event that names the checkpoint
    round the site restarts from and any broken newer checkpoint it passes over.
    """
    if run.state == RunState.FINISHED:
        raise BadInput(f"run {run.id} finished: nothing to resume")
    spec = run.spec()
    with NodePool(spec.ssh, accept_new=accept_new) as pool:
        seen = max((e.id for e in store.events(run.id, kinds=["coordinator_restart"])), default=0)
        # a dead coordinator is dead too: diagnose's refresh restarts it at its address (dilococtl.supervise)
        diag = diagnose(run, store=store, pool=pool, sites=sites)
        run = store.get_run(run.id)
        result = ResumeResult(run=run)
        restarted = store.events(run.id, kinds=["coordinator_restart"], after_id=seen)
        if restarted:
            result.coordinator = restarted[-1].message
            progress(result.coordinator)
        todo = [d for d in diag.dead if sites is None or d.site in sites]
        for d in todo:
            if d.unreachable:
                result.blocked[d.site] = f"{', '.join(sorted(d.unreachable))} unreachable: " \
                                         f"{next(iter(d.unreachable.values()))}"
        todo = [d for d in todo if d.site not in result.blocked]
        if not todo:
            return result
        result.whole_run = diag.whole_run and len(todo) == len(diag.sites)
        if upto is not None and not result.whole_run:
            raise BadInput(f"--round {upto}: only a whole-run restart (every site stopped) starts from a chosen round")
        if result.whole_run:
            result.resume_round = common_round(todo, upto)
            if upto is not None and result.resume_round is None:
                raise BadInput(f"--round {upto}: no round <= {upto} is checkpointed at every site")
        if (result.whole_run or run.state not in (RunState.LAUNCHING, RunState.RUNNING)) and diag.lighthouse_alive:
            # a whole restart gets a fresh Lighthouse; an ended run's was told to stop: it must be
            # gone before launch starts a new one on its port
            stop_lighthouse(run, pool)
            _wait_gone(pool, run.id, [(run.lighthouse["host"], int(run.lighthouse["pid"]))], KILL_GRACE_S)
        for d in todo:
            _forget_lost_metrics(run, d.site, store=store, pool=pool)
            if d.leftovers:
                progress(f"{d.site}: stopping what is left of its job ({len(d.leftovers)} process(es))")
                for host, pid in d.leftovers:
                    _signal(pool, run.id, host, pid, "TERM")
                _wait_gone(pool, run.id, d.leftovers, KILL_GRACE_S)
                for host, pid in d.leftovers:  # what is still the run's after the grace
                    _signal(pool, run.id, host, pid, "KILL")
                for n in store.nodes(run.id, d.site):
                    if n.state in ALIVE_STATES:
                        store.set_node(run.id, d.site, n.host, state=SiteState.STOPPED)
    if result.whole_run:
        msg = (f"every site had stopped: the run restarts from round {result.resume_round}, the newest round "
               f"every site has a complete checkpoint of" if result.resume_round is not None else
               "every site had stopped and no round is checkpointed at every site: each site restarts "
               "from its own newest checkpoint and the ones behind heal from the others")
        progress(msg)
        store.add_event(run.id, "resume", msg, detail={"resume_round": result.resume_round, "whole_run": True})
    if run.state in (RunState.FAILED, RunState.STOPPED, RunState.PREEMPTED):
        run = store.set_run_state(run.id, RunState.LAUNCHING)
    names = [d.site for d in todo]
    alive_elsewhere = any(not d.dead and not d.finished for d in diag.sites)
    try:
        res = runs_mod.launch(spec, store=store, accept_new=accept_new, progress=progress, sites=names,
                              run=run, reason="resume", resume_round=result.resume_round)
    except DilocoError as e:
        # a relaunch that failed leaves the run as it was; it has failed only if nothing trains any more
        if not alive_elsewhere:
            store.set_run_state(run.id, RunState.FAILED, reason=f"resume failed: {e}")
        raise
    for d in todo:
        rnd = d.load_round(result.resume_round)
        skipped = d.skipped(result.resume_round)
        attempt = store.launches(run.id, site=d.site)[-1].attempt
        msg = f"relaunched {d.site} (attempt {attempt}) after: {d.why}; " + (
            f"from its checkpoint of round {rnd}" if rnd is not None else "with no complete checkpoint: from scratch")
        if skipped:
            msg += "; skipped " + "; ".join(f"round {c.round} ({c.why})" for c in skipped)
        if not result.whole_run and alive_elsewhere:
            msg += "; heals from a live site"
        progress(msg)
        store.add_event(run.id, "resume", msg, site=d.site, round=rnd, detail={
            "why": d.why, "round": rnd, "attempt": attempt, "whole_run": result.whole_run,
            "skipped": [{"round": c.round, "why": c.why} for c in skipped]})
        result.relaunched.append(SiteResume(site=d.site, why=d.why, round=rnd, skipped=skipped, attempt=attempt))
    result.run = res.run
    return result


def _signal(pool: NodePool, run_id: str, host: str, pid: int, sig: str) -> None:
    """Signal `pid` only while it is still the run's process (dilococtl.procs)."""
    try:
        procs_mod.signal_if_ours(pool.get(host), pid, run_id, sig)
    except DilocoError:
        pass


def _wait_gone(pool: NodePool, run_id: str, procs: list[tuple[str, int]], timeout_s: float) -> None:
    """Until none of `procs` is the run's any more (a pid the OS gave to another process counts as gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(is_ours(pool, run_id, h, p) for h, p in procs):
        time.sleep(0.2)


# --- --auto --------------------------------------------------------------------------------------

@dataclass(kw_only=True, slots=True)
class AutoConfig:
    poll_s: float = 5.0  # seconds between two looks at the run
    max_attempts: int = 3  # relaunch tries per site before giving up on it (reset once it trains again)
    backoff_s: float = 10.0  # wait before the second try of a site; doubles with every further try
    max_backoff_s: float = 300.0  # the wait between tries never grows past this
    timeout_s: float = 0.0  # stop watching after this long (0: until the run ends)


@dataclass(kw_only=True, slots=True)
class _Budget:
    tries: int = 0  # relaunch tries since the site last trained
    next_at: float = 0.0  # monotonic time of the next allowed try
    round_at_try: int = -1  # the site's newest round when it was last relaunched
    last_why: str = ""  # why the last try did not bring it back
    gave_up: str = ""  # why we stopped trying ("" = still trying)


def auto(run: Run, *, store: Store, cfg: AutoConfig | None = None, accept_new: bool = False,
         progress: Progress = _noop, sleep: Callable[[float], None] = time.sleep) -> Run:
    """Watch `run` and resume its dead sites by themselves until the run ends.

    Each site gets `max_attempts` tries with exponential backoff; a site that trains again (a new
    round record) gets its budget back. A site whose tries are spent is given up with an event and
    a message, and the others keep training. Returns the run once it left the running states;
    raises DilocoError when every site that is left has been given up.
    """
    cfg = cfg or AutoConfig()
    budgets: dict[str, _Budget] = {}
    deadline = time.monotonic() + cfg.timeout_s if cfg.timeout_s else None
    spec = run.spec()
    while True:
        with NodePool(spec.ssh, accept_new=accept_new) as pool:
            run = runs_mod.refresh(store.get_run(run.id), store=store, pool=pool)
        if run.state in (RunState.FINISHED, RunState.STOPPED):
            return run
        latest = {k: v.round for k, v in store.latest_rounds(run.id).items()}
        site_state = {s.name: s.state for s in store.sites(run.id)}
        for name, b in budgets.items():
            if b.tries and not b.gave_up and latest.get(name, -1) > b.round_at_try and site_state[name] == SiteState.RUNNING:
                budgets[name] = _Budget()  # it trains again: a later death gets a fresh budget
        dead = [n.site for n in _dead_nodes(run, store)]
        now = time.monotonic()
        todo = []
        for name in dict.fromkeys(dead):
            b = budgets.setdefault(name, _Budget())
            if b.gave_up or now < b.next_at:
                continue
            if b.tries >= cfg.max_attempts:
                b.gave_up = b.last_why or "it died again after every relaunch"
                msg = (f"giving up on {name} after {b.tries} relaunch tries: {b.gave_up}; "
                       f"the other sites keep training")
                progress(msg)
                store.add_event(run.id, "error", msg, site=name, detail={"tries": b.tries, "why": b.gave_up})
                continue
            todo.append(name)
        if todo:
            try:
                res = resume(run, store=store, sites=todo, accept_new=accept_new, progress=progress)
            except DilocoError as e:
                progress(f"resume of {', '.join(todo)} failed: {e}")
                blocked = {name: str(e) for name in todo}
            else:
                blocked = res.blocked
            now = time.monotonic()
            for name in todo:
                b = budgets[name]
                b.tries += 1
                b.round_at_try = latest.get(name, -1)
                b.next_at = now + min(cfg.max_backoff_s, cfg.backoff_s * 2 ** (b.tries - 1))
                b.last_why = blocked.get(name, "")
                if name in blocked:
                    wait_s = b.next_at - now
                    left = cfg.max_attempts - b.tries
                    msg = (f"{name} cannot be relaunched: {blocked[name]}; " + (
                        f"retrying in {wait_s:.0f}s ({left} tries left)" if left > 0 else "no tries left"))
                    progress(msg)
                    store.add_event(run.id, "error", msg, site=name, detail={"tries": b.tries})
            run = store.get_run(run.id)
        given_up = {n: b.gave_up for n, b in budgets.items() if b.gave_up}
        others = [st for s, st in site_state.items() if s not in given_up]
        retrying = [n for n in dead if n not in given_up]
        if given_up and not todo and not retrying and not any(st in (SiteState.RUNNING, SiteState.PENDING) for st in others):
            why = "; ".join(f"{n}: {w}" for n, w in sorted(given_up.items()))
            rest = "the other sites finished" if others and all(st == SiteState.FINISHED for st in others) \
                else "no other site is training"
            raise DilocoError(f"run {run.id}: gave up on {why}; {rest} (see `dilococtl status {run.id}`)")
        if deadline and time.monotonic() > deadline:
            raise DilocoError(f"run {run.id} still {run.state} after {cfg.timeout_s:.0f}s of --auto")
        sleep(cfg.poll_s)


def _dead_nodes(run: Run, store: Store) -> list:
    """Nodes of sites that are not finished whose process is no longer running."""
    out = []
    for s in store.sites(run.id):
        nodes = store.nodes(run.id, s.name)
        if nodes and all(n.state == SiteState.FINISHED for n in nodes):
            continue
        out += [n for n in nodes if n.state not in ALIVE_STATES]
    return out

"""The async mode's parameter service without its network: θ, the outer optimizer, versions, pushes.

`OuterService` applies each site's encoded pseudo-gradient as one site's share of an outer step
(trainer.outer.optimizer.apply_push, the simulator's math too), refuses replays, non-finite pushes and a
second push by a site from a θ older than its own last push made, bounds a push's norm by the OTHER
sites' recent norms and an absolute cap, and checkpoints itself. trainer.service.outer_service serves it
over HTTP and TLS.

Why the bound looks only at the other sites: with one window shared by every site, a site that
pushes often at just under 3x the median becomes the median, and its bound grows without end (a
certificate holder raised it from 3 to 5570 in 60 pushes). A site's own pushes never widen its own
bound now, and each other site counts once (the median of the sites' medians), so one fast site
cannot outvote the rest of the run either.

Its checkpoints are round directories like a site's (trainer.checkpoints.checkpoint): STATE_FILE and its JSON
index, then a manifest with each file's size and SHA-256, signed with the run's checkpoint key and
renamed into place last. A round is verified before torch.load reads a byte of it; one that does not
verify is skipped in one line naming it, and the one before is used. With the run's object stores,
each round is also uploaded (trainer.checkpoints.uploader, site SERVICE_SITE) so that a run whose machines are all
lost comes back with its θ, momentum and version.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import struct
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.codecs.compression import Compressor, split_flat
from trainer.codecs.norms import sq_sum_all
from trainer.collectives import SoloComm
from trainer.outer.optimizer import OuterState, apply_push, dampening
from trainer.rules.codec_spec import WirePlan
from trainer.rules.config import TrainConfig
from trainer.rules.diloco_config import DilocoConfig
from trainer.rules.outer_rule import async_alpha

RECENT_PUSHES = 16  # each site's last pushes whose norms (as received) set the OTHER sites' bound
MIN_REFERENCE = 2  # pushes by the other sites needed before their norms bound a push (else: the cap)
ADAM_CAP_MARGIN = 2.0  # slack of the absolute cap over what H AdamW steps can move θ (push_norm_cap)
SEEN_PUSHES = 65536  # push ids remembered to refuse replays
KEEP_CHECKPOINTS = 3  # newest service rounds kept on the service's disk (its stores keep checkpoint.keep)
SERVICE_SITE = "_outer_service"  # the service's rounds in the run's stores: RUN_ID/_outer_service/round-…
# (a site name cannot start with "_", so no site's rounds mix with them)
STATE_FILE = "state.pt"  # θ, momentum and the bookkeeping (torch.save; loaded with weights_only=True)
# the round's JSON index (kind, version, codec, shapes), named as DCP's index is: one verifier
# (trainer.checkpoints.checkpoint_trust.verify, trainer.checkpoints.store_rounds) then checks the sites' rounds and the service's
INDEX_FILE = ".metadata"
_ROUND_RE = re.compile(r"^round-(\d+)$")
_LEGACY_PREFIX = "service-v"  # unsigned `service-v<version>.pt` files of before issue 35: never loaded


class ServiceError(ValueError):
    """A request the service refuses; `status` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# --- wire helpers shared with the client (trainer.modes.async_mode) ------------------------------------


def flat_bytes(tensors: Sequence[torch.Tensor]) -> bytes:
    """Concatenated little-endian fp32 values of `tensors` (the /params and /init body)."""
    if not tensors:
        return b""
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]).numpy().tobytes()


def from_flat(data: bytes, shapes: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
    """Inverse of `flat_bytes` for these shapes; ValueError when the length does not fit."""
    want = 4 * sum(math.prod(s) for s in shapes)
    if len(data) != want:
        raise ValueError(f"expected {want} bytes of fp32 parameters, got {len(data)}")
    return split_flat(torch.frombuffer(bytearray(data), dtype=torch.float32) if data else torch.zeros(0), shapes)


class CaptureComm(SoloComm):
    """A group of one that keeps a copy of every buffer handed to it: the site's wire form of Δ."""

    def __init__(self):
        self.sent: list[bytes] = []

    def allreduce_sum(self, t: torch.Tensor) -> None:
        self.sent.append(t.detach().contiguous().view(torch.uint8).numpy().tobytes())

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.sent.append(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
        return [t.detach().clone()]


class ReplayComm(SoloComm):
    """A group of one whose only member is the remote site: each collective returns its buffer."""

    def __init__(self, phases: Sequence[bytes]):
        self.phases = list(phases)

    def _next(self, like: torch.Tensor) -> torch.Tensor:
        got = torch.frombuffer(bytearray(self.phases.pop(0)), dtype=torch.uint8)
        return got.view(like.dtype).view(like.shape)

    def allreduce_sum(self, t: torch.Tensor) -> None:
        t.copy_(self._next(t))

    def allgather(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [self._next(t)]


def encode_delta(comp: Compressor, deltas: Sequence[torch.Tensor]) -> tuple[list[bytes], list[torch.Tensor]]:
    """The wire form of one site's Δ (one bytes per codec phase) and what it decodes to.

    Runs the codec as a group of one, so error feedback and PowerSGD's warm start work as in sync mode.
    """
    comm = CaptureComm()
    decoded, _ = comp.average(list(deltas), comm, 1.0)
    return comm.sent, decoded


def split_phases(body: bytes, plan: WirePlan) -> list[bytes]:
    """Cut a push body into the codec's phase buffers; ServiceError(400) when it does not fit."""
    sizes = [p.nbytes for p in plan.phases]
    if len(body) != sum(sizes):
        raise ServiceError(400, f"push body is {len(body)} bytes; codec {plan.spec!r} sends {sum(sizes)}")
    out, off = [], 0
    for n in sizes:
        out.append(body[off:off + n])
        off += n
    return out


def push_norm_cap(train: TrainConfig, d: DilocoConfig, numel: int, theta_norm: float) -> float:
    """The largest norm an honest site's Δ can have: the absolute bound on a push.

    Derived from the sites' own optimizer, not from anything a site sends: AdamW with β1 = 0.9 <
    1 − sqrt(1 − β2) moves a coordinate by at most about lr per step (Kingma & Ba, section 2.1), and
    its decoupled weight decay by lr·wd·|θ|; H steps then move θ by at most H·lr·(sqrt(N) + wd·‖θ_0‖).
    Error feedback adds the residual carried over, a geometric sum of at most 1/(1 − decay) rounds
    (decay 1, classic error feedback: no cap; guard_max_norm and the other sites' norms still bound).
    ADAM_CAP_MARGIN covers bias correction's first steps. θ_0's norm (not the current θ's) keeps a
    liar from widening the cap by growing θ. A loose bound: honest Δs are far below it (their
    coordinates do not all move a full lr the same way); the other sites' norms bound a push first.
    """
    lossy = d.error_feedback and d.compression != "none"  # a lossless codec carries no residual
    if not lossy:
        carry = 1.0
    elif d.error_feedback_decay < 1:
        carry = 1.0 / (1.0 - d.error_feedback_decay)
    else:  # classic error feedback: the residual's sum has no bound of this kind, so no cap from it
        return math.inf
    per_step = train.lr * (math.sqrt(numel) + train.weight_decay * theta_norm)
    return ADAM_CAP_MARGIN * carry * d.h * per_step


# --- the service's logic (no HTTP) ---------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class PushResult:
    version: int  # θ's version after this push
    staleness: int  # γ = t − τ
    scale: float  # ψ(γ)
    lr: float  # outer lr the step used
    clip: float = 1.0  # the factor the push's Δ was clipped by (1: as sent)
    norm: float = 0.0  # the norm of the decoded Δ as received (before clipping)
    bound: float = math.inf  # the bound it was clipped to: the other sites' reference or the cap
    params: bytes | None = None  # θ right after this push (flat fp32), when the pusher asked for it


class OuterService:
    """θ, the outer Nesterov SGD and the version counter; thread-safe."""

    def __init__(self, cfg: DilocoConfig, *, state_dir: str | Path | None = None, checkpoint_every: int = 0,
                 train: TrainConfig | None = None, key: bytes | None = None, stores: list | None = None,
                 store_keep: int = KEEP_CHECKPOINTS):
        """`train`: the sites' inner optimizer, which sets the absolute cap on a push's norm
        (push_norm_cap; the service's main always passes it). Without it only diloco.guard_max_norm
        caps a push, and a single site's pushes are then unbounded.

        `key`: the run's checkpoint key the rounds in `state_dir` are signed and checked with (None:
        trainer.checkpoints.checkpoint_trust.default_key(), read only when there is a state_dir). `stores`: the run's
        object stores (trainer.checkpoints.snapshot_store); each saved round is uploaded to them in the background
        (kept to `store_keep` rounds), and a start whose stores hold a newer verified round than
        state_dir (every machine lost) fetches it first."""
        dampening(0, async_alpha(cfg), cfg.async_dampening)  # a bad kind fails here
        self.cfg = cfg
        self.train = train
        self.state_dir = Path(state_dir) if state_dir else None
        self.checkpoint_every = checkpoint_every
        self.version = 0
        self.shapes: list[tuple[int, ...]] | None = None
        self.outer: OuterState | None = None
        self.decoder: Compressor | None = None
        self.per_site: dict[str, dict[str, int]] = {}  # site -> {"pushes", "staleness_sum", "staleness_max"}
        self.joined: set[str] = set()  # sites that called /init since this process started
        self.started = time.time()
        self._lock = threading.Lock()
        self._site_norms: dict[str, deque[float]] = {}  # site -> its last pushes' norms, as received
        self._last_version: dict[str, int] = {}  # site -> the version its last applied push made
        self.theta0_norm = 0.0  # ‖θ_0‖, for the absolute cap
        self._seen: OrderedDict[str, None] = OrderedDict()  # the last SEEN_PUSHES push ids
        self._key = key
        self.stores = list(stores or [])
        self.store_keep = store_keep
        self._uploader: Any = None  # trainer.checkpoints.uploader.Uploader, made at the first save with stores
        self._saved_version: int | None = None  # the version whose round this process wrote or loaded
        self.restored: int | None = None  # the version fetched from the stores at start, if any
        self.loaded_from: Path | None = self._load_latest()

    @property
    def initialized(self) -> bool:
        return self.outer is not None

    def _setup(self, params: list[torch.Tensor]) -> None:
        self.shapes = [tuple(p.shape) for p in params]
        self.theta0_norm = math.sqrt(sq_sum_all(params))
        self.outer = OuterState(params, self.cfg)
        # decode-only: error feedback lives at the sites; its PowerSGD Q is overwritten by each replay
        self.decoder = Compressor(spec=self.cfg.compression, error_feedback=False, options=self.cfg.codec_options())
        self.decoder.prepare(self.shapes)

    def init(self, params: list[torch.Tensor], site: str = "") -> bool:
        """Set θ_0 if nothing set it yet; True if this call did. Shapes must match an existing θ.

        Every site calls it when it starts (`site` is recorded as joined: fresh sites wait for each other).
        """
        with self._lock:
            if site:
                self.joined.add(site)
            if self.outer is not None:
                shapes = [tuple(p.shape) for p in params]
                if shapes != self.shapes:
                    raise ServiceError(409, f"θ has {len(self.shapes or [])} parameters of other shapes than "
                                            f"the {len(shapes)} sent; is this the same model?")
                return False
            self._setup([p.detach().float().cpu() for p in params])
            return True

    def params(self) -> tuple[int, bytes]:
        """(version, θ as flat fp32 bytes)."""
        with self._lock:
            if self.outer is None:
                raise ServiceError(409, "not initialized: no site has sent θ_0 yet")
            return self.version, flat_bytes(self.outer.params)

    def push(self, site: str, base_version: int, phases: Sequence[bytes], codec: str | None = None,
             push_id: str | None = None, with_params: bool = False) -> PushResult:
        """Apply one site's encoded Δ computed from θ at `base_version`.

        `with_params`: also return θ as this push left it, taken under the same lock (the pusher's
        next round starts from exactly version `result.version`, and saves a pull's round trip).

        `push_id`: the push's unique id; an id seen before is a replay and is refused. A site pushes
        at most once per version: its base must be at least the version its own last push made (an
        honest site always starts from that θ or a newer one), else 409. The decoded Δ is refused
        when non-finite, and clipped to the smallest of: guard_norm_ratio x the median of the OTHER
        sites' median recent norms, guard_max_norm, and push_norm_cap (see _norm_bound).
        """
        with self._lock:
            if push_id is not None and push_id in self._seen:
                raise ServiceError(409, f"replayed push {push_id!r}: already applied; not applied again")
            if self.outer is None or self.decoder is None or self.shapes is None:
                raise ServiceError(409, "not initialized: no site has sent θ_0 yet")
            if codec is not None and codec != self.cfg.compression:
                raise ServiceError(400, f"push encoded with {codec!r}; this run uses {self.cfg.compression!r}")
            if base_version > self.version or base_version < 0:
                raise ServiceError(409, f"base version {base_version} is not in [0, {self.version}]")
            last = self._last_version.get(site)
            if last is not None and base_version < last:
                raise ServiceError(409, f"site {site!r} already pushed: its last push made version {last}, so "
                                        f"its next push must start from version {last} or later, not "
                                        f"{base_version} (one push per site per version)")
            gamma = self.version - base_version
            self._check_weights(phases)
            zeros = [torch.zeros(s) for s in self.shapes]
            try:
                delta, _ = self.decoder.average(zeros, ReplayComm(phases), 0.0)
            except (RuntimeError, ValueError) as e:
                raise ServiceError(400, f"push does not decode with codec {self.cfg.compression!r}: {e}") from None
            norm = math.sqrt(sq_sum_all(delta))
            if not math.isfinite(norm):
                raise ServiceError(400, "push holds NaN/Inf (or overflows); not applied")
            bound = self._norm_bound(site)
            clip = bound / norm if norm > bound else 1.0
            step = apply_push(self.outer, delta, gamma, weight=clip)  # the simulator's math too
            scale, lr = step.scale, step.lr
            self.version += 1
            # as received, not as clipped: an honest site clipped by a liar's tiny reference (2 sites)
            # keeps its true norms, so the others' bounds recover once the liar stops; what a liar
            # sends counts for the others only through its one median
            self._site_norms.setdefault(site, deque(maxlen=RECENT_PUSHES)).append(norm)
            self._last_version[site] = self.version
            if push_id is not None:
                self._seen[push_id] = None
                while len(self._seen) > SEEN_PUSHES:
                    self._seen.popitem(last=False)
            st = self.per_site.setdefault(site, {"pushes": 0, "staleness_sum": 0, "staleness_max": 0})
            if clip < 1.0:
                st["clipped"] = st.get("clipped", 0) + 1
            st["pushes"] += 1
            st["staleness_sum"] += gamma
            st["staleness_max"] = max(st["staleness_max"], gamma)
            if self.checkpoint_every and self.version % self.checkpoint_every == 0:
                self._save_locked()
            return PushResult(version=self.version, staleness=gamma, scale=scale, lr=lr, clip=clip, norm=norm,
                              bound=bound, params=flat_bytes(self.outer.params) if with_params else None)

    def _check_weights(self, phases: Sequence[bytes]) -> None:
        """A site pushes as a group of one with weight 1 (encode_delta): the codec's weight field, the
        divisor of its average, must say exactly that (1e-30 there would multiply Δ by 1e30)."""
        assert self.decoder is not None and self.decoder.plan is not None
        for phase, raw in zip(self.decoder.plan.phases, phases, strict=False):
            try:
                f = phase.field(-1, "weight")
            except KeyError:
                continue
            if len(raw) < f.offset + 4:
                raise ServiceError(400, "push is shorter than its codec's weight field")
            (w,) = struct.unpack_from("<f", raw, f.offset)
            if w != 1.0:
                raise ServiceError(400, f"push's weight field is {w!r}; a site pushes with weight 1")

    def reference_norm(self, site: str) -> float | None:
        """The median of the other sites' median recent norms (None: they pushed too little yet).

        One value per other site: a site that pushes ten times as often still counts once."""
        others = [q for s, q in self._site_norms.items() if s != site and q]
        if sum(len(q) for q in others) < MIN_REFERENCE:
            return None
        return statistics.median(statistics.median(q) for q in others)

    def absolute_cap(self) -> float:
        """guard_max_norm when set, and push_norm_cap from the sites' optimizer when known (inf: none)."""
        caps = [math.inf]
        if self.cfg.guard_max_norm > 0:
            caps.append(self.cfg.guard_max_norm)
        if self.train is not None and self.shapes is not None:
            numel = sum(math.prod(s) for s in self.shapes)
            caps.append(push_norm_cap(self.train, self.cfg, numel, self.theta0_norm))
        return min(caps)

    def _norm_bound(self, site: str) -> float:
        """What `site`'s push is clipped to: never wider than the absolute cap, and once the other
        sites pushed, guard_norm_ratio x their reference. A single site has only the cap."""
        bound = self.absolute_cap()
        ref = self.reference_norm(site)
        if self.cfg.guard_norm_ratio > 0 and ref is not None:
            bound = min(bound, self.cfg.guard_norm_ratio * ref)
        return bound

    def state(self) -> dict:
        """Counters for metrics: version, pushes (total and per site), staleness."""
        with self._lock:
            pushes = sum(s["pushes"] for s in self.per_site.values())
            return {"version": self.version, "initialized": self.outer is not None, "pushes": pushes,
                    "joined": sorted(self.joined),
                    "per_site": {k: dict(v) for k, v in self.per_site.items()},
                    "staleness_sum": sum(s["staleness_sum"] for s in self.per_site.values()),
                    "staleness_max": max((s["staleness_max"] for s in self.per_site.values()), default=0),
                    "codec": self.cfg.compression, "alpha": async_alpha(self.cfg),
                    "dampening": self.cfg.async_dampening, "uptime_s": time.time() - self.started,
                    "loaded_from": str(self.loaded_from) if self.loaded_from else None,
                    "restored_from_store": self.restored}

    # -- its own checkpoints -------------------------------------------------------------------

    def save(self) -> Path | None:
        with self._lock:
            return self._save_locked()

    def _save_locked(self) -> Path | None:
        """Write θ's state as a signed round directory (module doc of trainer.checkpoints.checkpoint: manifest last,
        renamed into place), prune old rounds, and hand it to the uploader; its path."""
        if self.state_dir is None or self.outer is None:
            return None
        from trainer.checkpoints.checkpoint_trust import write_manifest
        from trainer.checkpoints.manifest_sign import MANIFEST, MANIFEST_FORMAT, round_dir, sha256_file, sign

        path = round_dir(self.state_dir, self.version)
        if self._saved_version == self.version and (path / MANIFEST).is_file():
            return path  # this version is on disk already (SIGTERM right after a periodic save)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if path.exists():  # a leftover of an abandoned timeline: it stops counting before it is replaced
            (path / MANIFEST).unlink(missing_ok=True)
            shutil.rmtree(path)
        path.mkdir()
        torch.save({"version": self.version, "shapes": self.shapes, "outer": self.outer.state_dict(),
                    "per_site": self.per_site, "codec": self.cfg.compression, "theta0_norm": self.theta0_norm,
                    "last_version": dict(self._last_version),
                    "site_norms": {k: list(q) for k, q in self._site_norms.items()}}, path / STATE_FILE)
        index = {"kind": SERVICE_SITE, "version": self.version, "codec": self.cfg.compression,
                 "shapes": [list(s) for s in self.shapes or []]}
        (path / INDEX_FILE).write_text(json.dumps(index))
        files = {name: {"size": (path / name).stat().st_size, "sha256": sha256_file(path / name)}
                 for name in sorted((STATE_FILE, INDEX_FILE))}
        for name in files:  # the data is on disk before the manifest that vouches for it
            with open(path / name, "rb") as f:
                os.fsync(f.fileno())
        write_manifest(path, sign({"format": MANIFEST_FORMAT, "round": self.version, "kind": SERVICE_SITE,
                                    "files": files, "created": time.time()}, self._signing_key()))
        self._saved_version = self.version
        self._prune(self.version)
        if self.stores:
            if self._uploader is None:
                from trainer.checkpoints.uploader import Uploader

                self._uploader = Uploader(self.stores, SERVICE_SITE, self.store_keep, on_event=_say_event)
            self._uploader.submit(self.version, path)  # in the background: pushes never wait for the store
        return path

    def _signing_key(self) -> bytes:
        if self._key is None:
            from trainer.checkpoints.checkpoint_trust import default_key

            self._key = default_key()
        return self._key

    def _round_dirs(self) -> list[tuple[int, Path]]:
        """(version, directory) of every round directory under state_dir, newest first."""
        if self.state_dir is None or not self.state_dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.state_dir.iterdir()
                 if (m := _ROUND_RE.match(p.name)) and p.is_dir()]
        return sorted(found, reverse=True)

    def _prune(self, just_saved: int) -> None:
        """Keep the KEEP_CHECKPOINTS newest rounds up to `just_saved` and those still going up; rounds
        newer than it are from an abandoned timeline (or were refused at start) and go."""
        from trainer.checkpoints.manifest_sign import MANIFEST

        busy = self._uploader.busy() if self._uploader is not None else set()
        older = [v for v, p in self._round_dirs() if v <= just_saved and (p / MANIFEST).is_file()]
        kept = set(older[:KEEP_CHECKPOINTS]) | busy | {just_saved}
        for v, path in self._round_dirs():
            if v not in kept:
                (path / MANIFEST).unlink(missing_ok=True)  # never complete while half-deleted
                shutil.rmtree(path, ignore_errors=True)

    def close(self, upload_timeout_s: float | None = None) -> bool:
        """Wait (up to `upload_timeout_s`) for the last round's upload; False if it was still going."""
        up, self._uploader = self._uploader, None
        if up is None:
            return True
        done = up.flush(upload_timeout_s)
        if not done:
            print(f"outer service: upload of version {max(up.busy(), default=-1)} not finished within "
                  f"{upload_timeout_s or 0:.1f} s: the store keeps its previous rounds", file=sys.stderr, flush=True)
        up.close(0.0)
        return done

    def _load_latest(self) -> Path | None:
        """Load the newest round that verifies, locally or (when newer) from the stores; its directory."""
        if self.state_dir is None:
            return None
        from trainer.checkpoints.checkpoint_trust import verify

        for old in sorted(self.state_dir.glob(f"{_LEGACY_PREFIX}*.pt")) if self.state_dir.is_dir() else []:
            _say(f"ignoring {old}: an unsigned checkpoint (made before the service's checkpoints were signed); "
                 f"refused, nothing vouches for who wrote it")
        key = self._signing_key()
        rounds = self._round_dirs()
        newest: int | None = None  # the newest local round that verifies
        for v, path in rounds:
            why = verify(path, key)
            if not why:
                newest = v
                break
            _say(f"skipping checkpoint {path}: {why}")
        if self.stores:
            got = self._restore(newer_than=newest)
            if got is not None:
                newest, rounds = got, self._round_dirs()
        for v, path in rounds:
            if newest is None or v > newest:
                continue  # refused above
            why = "" if v == newest else verify(path, key)  # the newest was just checked (or fetched)
            if not why:
                try:
                    self._load_round(path)
                    return path
                except Exception as e:  # a foreign or torn state: try the one before
                    why = (str(e) or type(e).__name__).splitlines()[0]
            _say(f"skipping checkpoint {path}: {why}")
            self.outer = self.decoder = self.shapes = None
        return None

    def _restore(self, newer_than: int | None) -> int | None:
        """Fetch the newest stored round newer than `newer_than` that verifies into state_dir; its version."""
        from trainer.checkpoints import store_rounds

        def skipped(r: int, why: str) -> None:
            _say(f"stored round {r} skipped: {why}" if r >= 0 else why)

        assert self.state_dir is not None
        self.state_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        got = store_rounds.restore_newest(self.stores, SERVICE_SITE, self.state_dir, self._signing_key(),
                                          newer_than=newer_than, on_skip=skipped)
        if got is not None:
            self.restored = got
            urls = ", ".join(s.url for s in self.stores)
            _say(f"restored version {got} from the checkpoint store ({urls}) in {time.monotonic() - t0:.2f} s")
        return got

    def _load_round(self, path: Path) -> None:
        """Load a verified round directory: its index first (JSON), then the state (weights_only)."""
        index = json.loads((path / INDEX_FILE).read_text())
        if index.get("kind") != SERVICE_SITE:
            raise ValueError(f"{path / INDEX_FILE}: not an outer service round")
        if index["codec"] != self.cfg.compression:
            raise ValueError(f"saved for codec {index['codec']!r}")
        sd = torch.load(path / STATE_FILE, weights_only=True)
        if int(sd["version"]) != int(index["version"]) or sd["codec"] != index["codec"]:
            raise ValueError(f"{path / STATE_FILE} does not match its index")
        # everything read before anything is set: a state that fails half-way leaves the service as it was
        per_site = {str(k): {str(n): int(x) for n, x in v.items()} for k, v in sd["per_site"].items()}
        theta0_norm = float(sd["theta0_norm"])
        last_version = {str(k): int(v) for k, v in sd["last_version"].items()}
        site_norms = {str(k): deque((float(x) for x in v), maxlen=RECENT_PUSHES) for k, v in sd["site_norms"].items()}
        self._setup([torch.zeros(s) for s in sd["shapes"]])
        assert self.outer is not None
        self.outer.load_state_dict(sd["outer"])
        self.version = self._saved_version = int(sd["version"])
        self.per_site, self.theta0_norm, self._last_version, self._site_norms = \
            per_site, theta0_norm, last_version, site_norms


def _say(line: str) -> None:
    print(f"outer service: {line}", file=sys.stderr, flush=True)


def _say_event(kind: str, message: str, detail: dict) -> None:
    """The uploader's events: the service has no metrics file, its log is where they go. A version
    passed over because a newer one was saved before its upload began is the rule when pushes come
    faster than uploads, not news."""
    if kind != "checkpoint_upload_skipped":
        _say(message)


# --- HTTP ------------------------------------------------------------------------------------------

"""doctor's checks of one node, and of a site's nodes together.

Per node (`check_node`, one interpreter start on the node): reachable, interpreter, torch /
torchft / trainer versions, CUDA and GPU count against the spec, free disk under work_dir, clock
skew against this machine. Per site: whether a site of several nodes sees one work_dir on all of
them (`check_shared_dirs`), and whether the run's fixed ports are free where they will be bound
(`check_run_ports`). Each finding is a Check (dilococtl.doctor_check) in the node's NodeReport.
"""

from __future__ import annotations

import json
import secrets
import shlex
import time
from dataclasses import dataclass, field

from dilococtl import __version__
from dilococtl.doctor_check import FAIL, OK, WARN, Check
from dilococtl.errors import DilocoError, Unreachable
from dilococtl.nodes import Node, NodePool, node_python
from dilococtl.spec_sites import is_local
from dilococtl.spec_types import RunSpec, SiteSection

MIN_FREE_GIB = 1.0  # below this under work_dir: fail (checkpoints and logs will not fit)
LOW_FREE_GIB = 10.0  # below this: warn
SKEW_WARN_S = 1.0  # clock skew that makes cross-site timelines misleading
SKEW_FAIL_S = 30.0  # clock skew that breaks timeouts and certificate checks
PROBE_TIMEOUT_S = 120.0  # importing torch on a cold node can be slow


@dataclass(kw_only=True, slots=True)
class NodeReport:
    site: str
    host: str
    reachable: bool
    python: str = ""  # the interpreter's resolved path ("" when it could not be run)
    checks: list[Check] = field(default_factory=list)
    facts: dict = field(default_factory=dict)  # raw probe output (versions, bytes free, skew)

    @property
    def status(self) -> str:
        return _worst(c.status for c in self.checks)


def _worst(statuses) -> str:
    order = {OK: 0, WARN: 1, FAIL: 2}
    return max(statuses, key=lambda s: order[s], default=OK)


# Runs on the node with its interpreter: everything doctor needs in one process start.
_PROBE = r"""
import json, os, shutil, sys
out = {"executable": sys.executable, "python_version": "%d.%d.%d" % tuple(sys.version_info[:3])}
for mod in ("trainer", "torch", "torchft"):
    try:
        m = __import__(mod)
        out[mod] = getattr(m, "__version__", None)
        if out[mod] is None:
            from importlib.metadata import version
            out[mod] = version(mod)
        out[mod] = str(out[mod])
    except Exception as e:
        out[mod] = None
        out[mod + "_error"] = (type(e).__name__ + ": " + str(e)).splitlines()[0][:200]
if out.get("torch"):
    try:
        import torch
        out["cuda"] = bool(torch.cuda.is_available())
        out["gpus"] = torch.cuda.device_count() if out["cuda"] else 0
    except Exception as e:
        out["cuda"], out["gpus"] = False, 0
        out["cuda_error"] = str(e)[:200]
d = sys.argv[1]
while not os.path.exists(d) and d != os.path.dirname(d):
    d = os.path.dirname(d)
out["disk_path"] = d
out["disk_free"] = shutil.disk_usage(d).free
print("DOCTOR " + json.dumps(out))
"""


def py_command(python: str, script: str, *args: object) -> str:
    """The command line that runs `script` with `python -c`, its arguments quoted."""
    return " ".join([shlex.quote(python), "-c", shlex.quote(script), *(shlex.quote(str(a)) for a in args)])


def check_node(node: Node, site: SiteSection) -> NodeReport:
    """All per-node checks on a connected node."""
    rep = NodeReport(site=site.name, host=node.host, reachable=True)
    rep.checks.append(Check(name="reachable", status=OK, detail="local" if is_local(node.host) else "ssh"))
    rep.checks.append(_clock(node, rep))
    py = node_python(site, node.host)
    r = node.run(py_command(py, _PROBE, site.work_dir), timeout=PROBE_TIMEOUT_S)
    line = next((x for x in r.stdout.splitlines() if x.startswith("DOCTOR ")), None)
    if line is None:
        why = (r.stderr.strip().splitlines() or [f"exit {r.rc}"])[-1][:200]
        rep.checks.append(Check(name="python", status=FAIL, detail=f"{py}: {why}"))
        return rep
    f = json.loads(line.removeprefix("DOCTOR "))
    rep.facts.update(f)
    rep.python = f["executable"]
    rep.checks.append(Check(name="python", status=OK, detail=f"{f['executable']} {f['python_version']}",
                            short=f["python_version"]))
    for mod in ("torch", "torchft"):
        if f.get(mod):
            rep.checks.append(Check(name=mod, status=OK, detail=f[mod], short=f[mod]))
        else:
            rep.checks.append(Check(name=mod, status=FAIL, detail=f"missing ({f.get(mod + '_error')})"))
    if site.scheduler != "slurm":  # a Slurm site's GPUs are its partition's nodes': check_slurm_sites
        rep.checks.append(_gpus(f, site))
    rep.checks.append(_disk(f))
    rep.checks.append(_trainer(f))
    return rep


def _clock(node: Node, rep: NodeReport) -> Check:
    # The midpoint of the round trip estimates when the node read its clock.
    t0 = time.time()
    r = node.run("date +%s.%N", timeout=30)
    t1 = time.time()
    try:
        remote = float(r.stdout.strip())
    except ValueError:
        return Check(name="clock", status=WARN, detail=f"could not read the clock ({r.stderr.strip()[:100]})")
    skew = remote - (t0 + t1) / 2
    rep.facts["clock_skew_s"] = round(skew, 3)
    rep.facts["clock_rtt_s"] = round(t1 - t0, 3)
    status = OK if abs(skew) <= SKEW_WARN_S else WARN if abs(skew) <= SKEW_FAIL_S else FAIL
    return Check(name="clock", status=status, detail=f"skew {skew:+.3f}s (±{(t1 - t0) / 2:.3f}s)",
                 short=f"{skew:+.2f}s")


def _gpus(f: dict, site: SiteSection) -> Check:
    have, want = int(f.get("gpus") or 0), site.gpus_per_node
    if want == 0:
        return Check(name="gpus", status=OK, detail=f"CPU run ({have} GPU(s) present)", short="CPU")
    if not f.get("cuda"):
        return Check(name="gpus", status=FAIL, detail=f"CUDA not available, spec wants {want} GPU(s)")
    status = OK if have >= want else FAIL
    return Check(name="gpus", status=status, detail=f"{have} GPU(s), spec wants {want}", short=f"{have}/{want}")


def _disk(f: dict) -> Check:
    gib = f["disk_free"] / 2**30
    status = FAIL if gib < MIN_FREE_GIB else WARN if gib < LOW_FREE_GIB else OK
    return Check(name="disk", status=status, detail=f"{gib:.1f} GiB free at {f['disk_path']}", short=f"{gib:.1f} GiB")


def _trainer(f: dict) -> Check:
    v = f.get("trainer")
    if not v:
        return Check(name="trainer", status=FAIL, detail="not installed (run `dilococtl provision`)")
    if v != __version__:
        return Check(name="trainer", status=FAIL,
                     detail=f"{v}, this dilococtl is {__version__} (run `dilococtl provision`)")
    return Check(name="trainer", status=OK, detail=v, short=v)


def check_shared_dirs(spec: RunSpec, pool: NodePool, reports: dict[tuple[str, str], NodeReport]) -> None:
    """Add a `shared` check to each follower node of every multi-node site: does it see the file its
    leader writes under work_dir? Every node of a site writes its shards of the site's checkpoints
    into one directory there and a restart reads them back whole, so it must be one filesystem."""
    for s in spec.sites:
        if len(s.hosts) < 2 or not all(reports[(s.name, h)].reachable for h in s.hosts):
            continue
        leader = s.hosts[0]
        path = f"{s.work_dir.rstrip('/')}/.dilococtl/shared-check-{secrets.token_hex(8)}"
        token = secrets.token_hex(16)
        try:
            pool.get(leader).write_text(path, token + "\n")
        except DilocoError as e:  # a node that cannot write reports it; doctor goes on
            for h in s.hosts[1:]:
                reports[(s.name, h)].checks.append(Check(name="shared", status=FAIL, detail=f"not checked: {e}"))
            continue
        # without checkpoints nothing is read back across nodes: a warning only
        missing = FAIL if spec.checkpoint.every_rounds > 0 else WARN
        try:
            for h in s.hosts[1:]:
                check = Check(name="shared", status=OK, detail=f"{s.work_dir} shared with {leader}", short="yes")
                try:
                    if pool.get(h).read_from(path, 0, max_bytes=64).decode("ascii", "replace").strip() != token:
                        check = Check(name="shared", status=missing,
                                      detail=f"{s.work_dir} is not shared with {leader}: a site of several nodes "
                                             f"needs it on one filesystem (its checkpoints are written by every "
                                             f"node and read back whole)")
                except DilocoError as e:
                    check = Check(name="shared", status=missing, detail=str(e))
                reports[(s.name, h)].checks.append(check)
        finally:
            try:
                pool.get(leader).run(f"rm -f {shlex.quote(path)}", timeout=30)
            except DilocoError:  # a leftover marker is harmless
                pass


def check_run_ports(spec: RunSpec, pool: NodePool, reports: dict[tuple[str, str], NodeReport]) -> None:
    """Add a `ports` check to each node that will bind one of the run's fixed ports (dilococtl.ports): free,
    or taken by a listener that would make that process exit at start (launch refuses it the same way)."""
    from dilococtl import ports

    for host, wanted in ports.run_ports(spec).items():
        reps = [r for (_, h), r in reports.items() if h == host and r.reachable]
        if not reps:  # unreachable (already failed), or a Lighthouse host outside every site
            continue
        try:
            busy = ports.listening_on(pool.get(host))
        except DilocoError as e:
            reps[0].checks.append(Check(name="ports", status=FAIL, detail=f"not checked: {e}"))
            continue
        taken = [f"{port} ({what})" for port, what in sorted(wanted.items()) if port in busy]
        reps[0].checks.append(
            Check(name="ports", status=FAIL, detail=f"already in use: {', '.join(taken)}") if taken else
            Check(name="ports", status=OK, detail=f"{', '.join(str(p) for p in sorted(wanted))} free",
                  short="free"))


def failed_node(site: SiteSection, host: str, e: Exception) -> NodeReport:
    """The report of a node whose checks raised `e` (unreachable, or a check that failed outright)."""
    reachable = not isinstance(e, Unreachable)
    rep = NodeReport(site=site.name, host=host, reachable=reachable)
    name = "check" if reachable else "reachable"
    rep.checks.append(Check(name=name, status=FAIL, detail=str(e) or type(e).__name__))
    rep.facts["error_type"] = type(e).__name__
    return rep


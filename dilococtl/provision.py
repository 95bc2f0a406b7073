"""`dilococtl provision`: install this project's wheel (the bundled trainer) on every node, idempotently.

The wheel is built once per source state (a hash of the package files) and cached under
`paths.home()/wheels`. On each remote node: upload it to work_dir, create or reuse the venv, install
with `--no-deps` when torch and torchft are already there (else with its dependencies, from the
index or from an uploaded --wheelhouse), verify the imports and record the hash in a marker file.
A node whose marker matches and whose imports work is left alone ("up to date"). Local hosts
use this machine's installation: they are only verified. A Slurm site is provisioned once, through
its login node, into its venv on the cluster's shared filesystem (the compute nodes run it from there).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from dilococtl import paths
from dilococtl.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, DilocoError, Unreachable
from dilococtl.nodes import CmdResult, Node, NodePool, node_python
from dilococtl.spec_sites import is_local
from dilococtl.spec_types import RunSpec, SiteSection

PACKAGES = ("dilococtl", "trainer")  # the import packages the wheel carries
TOP_FILES = ("pyproject.toml", "README.md", "LICENSE")  # files beside them the build reads
VERIFY = "import trainer, torch, torchft; print(trainer.__version__)"
# Prints the source URL when the interpreter's own environment holds an editable (development)
# install of dilococtl: provision must not replace a checkout someone works in.
EDITABLE_PROBE = r"""
import json, os, sys
try:
    from importlib.metadata import distribution
    d = distribution("dilococtl")
    url = json.loads(d.read_text("direct_url.json") or "{}")
    mine = os.path.realpath(str(d.locate_file(""))).startswith(os.path.realpath(sys.prefix) + os.sep)
    if url.get("dir_info", {}).get("editable") and mine:
        print("EDITABLE", url.get("url", "?"))
except Exception:
    pass
"""
LOG_TAIL_LINES = 20  # lines of a failed node's log shown in the report
PIP_TIMEOUT_S = 1800.0  # installing torch with its dependencies from an index can take long


@dataclass(kw_only=True, slots=True)
class NodeResult:
    site: str
    host: str
    status: str  # installed | up to date | verified | failed | unreachable
    python: str  # the interpreter provisioned (as called on the node)
    detail: str  # one line
    log_tail: str = ""  # the last lines of the node's provision log, on failure


@dataclass(kw_only=True, slots=True)
class ProvisionReport:
    wheel: str  # the wheel file used
    wheel_hash: str  # hash of the sources it was built from; the marker on each node holds it
    nodes: list[NodeResult]

    @property
    def exit_code(self) -> int:
        if any(n.status == "unreachable" for n in self.nodes):
            return EXIT_UNREACHABLE
        if any(n.status == "failed" for n in self.nodes):
            return EXIT_FAILED
        return EXIT_OK

    def to_json(self) -> dict:
        return {"ok": self.exit_code == EXIT_OK, "exit_code": self.exit_code, "wheel": self.wheel,
                "wheel_hash": self.wheel_hash, "nodes": [asdict(n) for n in self.nodes]}


# --- the wheel ----------------------------------------------------------------------------------

def source_root() -> Path:
    """The source tree this dilococtl runs from (the wheel is built from it)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file() or not (root / "trainer").is_dir():
        raise DilocoError(f"cannot build the trainer wheel: no source tree (pyproject.toml) at {root}; "
                          "run dilococtl from a checkout or an editable install")
    return root


def _source_files(root: Path) -> list[Path]:
    files = [root / f for f in TOP_FILES if (root / f).is_file()]
    for pkg in PACKAGES:
        for p in sorted((root / pkg).rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"):
                files.append(p)
    return files


def source_hash(root: Path | None = None) -> str:
    """A hash of every file the wheel is built from (paths and contents)."""
    root = root or source_root()
    h = hashlib.sha256()
    for p in _source_files(root):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def build_wheel(cache: Path | None = None, root: Path | None = None) -> tuple[Path, str]:
    """(wheel path, source hash): the cached wheel for the sources under `root`, built if missing."""
    root = root or source_root()
    digest = source_hash(root)
    cache = cache or paths.home() / "wheels"
    out = cache / digest
    found = sorted(out.glob("*.whl")) if out.is_dir() else []
    if found:
        return found[0], digest
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".build-") as tmp:
        # Build from a copy of exactly the hashed files: no build/ litter in the checkout, and the
        # wheel matches the hash even while the tree is being edited.
        src = Path(tmp) / "src"
        for p in _source_files(root):
            dest = src / p.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dest)
        dist = Path(tmp) / "dist"
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "--disable-pip-version-check", "--no-input", "-q", "-w", str(dist), str(src)],
                           capture_output=True, text=True)
        wheels = sorted(dist.glob("*.whl"))
        if r.returncode != 0 or not wheels:
            tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
            raise DilocoError(f"building the wheel failed: {' | '.join(tail)}")
        staged = Path(tmp) / digest
        staged.mkdir()
        shutil.move(str(wheels[0]), staged / wheels[0].name)
        try:
            os.rename(staged, out)
        except OSError:  # another process built it meanwhile
            if not list(out.glob("*.whl")):
                raise
    return sorted(out.glob("*.whl"))[0], digest


# --- one node -----------------------------------------------------------------------------------

class _Log:
    """Every command run on a node and its output, kept for the report and the node's log file."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.lines: list[str] = []

    def run(self, cmd: str, timeout: float = 120) -> CmdResult:
        r = self.node.run(cmd, timeout=timeout)
        self.lines.append(f"$ {cmd}")
        self.lines += [x for x in (r.stdout + r.stderr).splitlines() if x.strip()]
        if r.rc != 0:
            self.lines.append(f"(exit {r.rc})")
        return r

    def note(self, msg: str) -> None:
        self.lines.append(f"# {msg}")

    def tail(self, n: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.lines[-n:])


def _marker_path(site: SiteSection) -> str:
    return f"{site.work_dir.rstrip('/')}/.dilococtl/provisioned.json"


def _q(s: str) -> str:
    return shlex.quote(s)


def provision_node(node: Node, site: SiteSection, wheel: Path, digest: str,
                   wheelhouse: Path | None = None) -> NodeResult:
    """Install the wheel on one node (or only verify a local one); failures come back as results."""
    py = node_python(site, node.host)
    log = _Log(node)

    def result(status: str, detail: str) -> NodeResult:
        tail = log.tail() if status == "failed" else ""
        return NodeResult(site=site.name, host=node.host, status=status, python=py, detail=detail, log_tail=tail)

    if is_local(node.host):
        r = log.run(f"{_q(py)} -c {_q(VERIFY)}")
        if r.rc != 0:
            return result("failed", f"{py} cannot import trainer, torch and torchft")
        return result("verified", f"local: trainer {r.stdout.strip()} importable by {py}")

    marker = _marker_path(site)
    want = {"hash": digest, "python": py}
    r = log.run(f"cat {_q(marker)} 2>/dev/null")
    try:
        have = json.loads(r.stdout) if r.rc == 0 else {}
    except ValueError:
        have = {}
    if {k: have.get(k) for k in want} == want and log.run(f"{_q(py)} -c {_q(VERIFY)}").rc == 0:
        return result("up to date", f"wheel {digest} already installed for {py}")

    try:
        return _install(node, site, py, wheel, digest, wheelhouse, log, result)
    except Unreachable:
        raise
    except DilocoError as e:  # e.g. an upload refused: this node failed, the others go on
        log.note(str(e))
        return result("failed", str(e))
    finally:
        try:
            # one log per host: the nodes of a site may share work_dir
            name = re.sub(r"[^\w.-]", "_", node.host)
            node.write_text(f"{site.work_dir.rstrip('/')}/.dilococtl/provision-{name}.log", "\n".join(log.lines) + "\n")
        except DilocoError:
            pass


def _install(node: Node, site: SiteSection, py: str, wheel: Path, digest: str, wheelhouse: Path | None,
             log: _Log, result) -> NodeResult:
    wd = site.work_dir.rstrip("/")
    if site.venv and log.run(f"test -x {_q(py)}").rc != 0:
        base = site.python or "python3"
        log.note(f"creating venv {site.venv} from {base}")
        r = log.run(f"{_q(base)} -m venv --system-site-packages {_q(site.venv)}", timeout=300)
        if r.rc != 0:
            return result("failed", f"could not create the venv {site.venv} with {base}")
    elif log.run(f"command -v {_q(py)}").rc != 0:
        return result("failed", f"interpreter {py} not found")

    r = log.run(f"{_q(py)} -c {_q(EDITABLE_PROBE)}")
    if r.stdout.startswith("EDITABLE"):
        where = r.stdout.split(maxsplit=1)[1].strip()
        if where.removeprefix("file://").rstrip("/") == str(source_root()):
            # the node runs this very checkout (a lab node, or this machine): nothing to install
            if log.run(f"{_q(py)} -c {_q(VERIFY)}", timeout=300).rc != 0:
                return result("failed", f"{py} runs this checkout but cannot import trainer, torch, torchft")
            return result("up to date", f"{py} runs this checkout ({where}) as an editable install")
        return result("failed", f"{py} has an editable install of dilococtl ({where}); not replacing it: "
                                f"set a venv for site {site.name}")

    remote_wheel = f"{wd}/wheels/{wheel.name}"
    log.note(f"uploading {wheel.name} to {remote_wheel}")
    node.put(wheel, remote_wheel)
    pip = f"{_q(py)} -m pip install --disable-pip-version-check --no-input"
    # --force-reinstall: same version number, new contents. --no-deps keeps it from touching torch.
    r = log.run(f"{pip} --no-deps --force-reinstall {_q(remote_wheel)}", timeout=600)
    if r.rc != 0:
        return result("failed", "pip could not install the wheel")
    if log.run(f"{_q(py)} -c 'import torch, torchft'").rc != 0:
        extra = ""
        if wheelhouse is not None:
            remote_wh = f"{wd}/wheelhouse"
            files = sorted(p for p in wheelhouse.iterdir() if p.is_file())
            log.note(f"uploading {len(files)} file(s) from {wheelhouse} to {remote_wh}")
            for p in files:
                node.put(p, f"{remote_wh}/{p.name}")
            extra = f" --no-index --find-links {_q(remote_wh)}"
        log.note("torch/torchft missing: installing the wheel's dependencies")
        r = log.run(f"{pip}{extra} {_q(remote_wheel)}", timeout=PIP_TIMEOUT_S)
        if r.rc != 0:
            return result("failed", "pip could not install the dependencies"
                          + (" from the wheelhouse" if wheelhouse else ""))
    r = log.run(f"{_q(py)} -c {_q(VERIFY)}", timeout=300)
    if r.rc != 0:
        return result("failed", "installed, but `import trainer, torch, torchft` fails")
    node.write_text(_marker_path(site), json.dumps({"hash": digest, "python": py, "wheel": wheel.name}) + "\n")
    return result("installed", f"trainer {r.stdout.strip()} ({wheel.name}, {digest}) into {py}")


# --- entry --------------------------------------------------------------------------------------

def run_provision(spec: RunSpec, wheelhouse: Path | None = None, accept_new: bool = False,
                  progress=None, source: Path | None = None) -> ProvisionReport:
    """Provision every node of `spec`; one node's failure does not stop the others.

    `source`: the tree to build the wheel from (default: the one this dilococtl runs from).
    """
    say = progress or (lambda msg: None)
    if wheelhouse is not None and not wheelhouse.is_dir():
        from dilococtl.errors import BadInput

        raise BadInput(f"--wheelhouse: {wheelhouse} is not a directory")
    sites_of: dict[str, list[SiteSection]] = {}
    for s in spec.sites:
        for h in _hosts(s):
            sites_of.setdefault(h, []).append(s)
    wheel, digest = Path(), ""
    if any(not is_local(h) for h in sites_of):  # local hosts use this installation as it is
        say("building the trainer wheel")
        wheel, digest = build_wheel(root=source)
    out: dict[tuple[str, str], NodeResult] = {}
    with NodePool(spec.ssh, accept_new=accept_new) as pool:
        say(f"provisioning {len(sites_of)} node(s)" + (f" with {wheel.name}" if digest else ""))
        # Each site's first node goes first, the rest after it: the nodes of a site may share the
        # work_dir and venv (NFS), and two pip installs into one venv at once break it. On a shared
        # filesystem the others then find the leader's install and only verify it.
        for leaders in (True, False):
            wave = {h: [s for s in ss if (_hosts(s)[0] == h) == leaders] for h, ss in sites_of.items()}
            wave = {h: ss for h, ss in wave.items() if ss}
            res = pool.map(lambda node, wave=wave: [provision_node(node, s, wheel, digest, wheelhouse)
                                                    for s in wave[node.host]], list(wave))
            for h, r in res.items():
                for i, s in enumerate(wave[h]):
                    if isinstance(r, list):
                        out[(s.name, h)] = r[i]
                    else:
                        status = "unreachable" if isinstance(r, Unreachable) else "failed"
                        out[(s.name, h)] = NodeResult(site=s.name, host=h, status=status,
                                                      python=node_python(s, h), detail=str(r) or type(r).__name__)
    return ProvisionReport(wheel=str(wheel) if digest else "", wheel_hash=digest,
                           nodes=[out[(s.name, h)] for s in spec.sites for h in _hosts(s)])


def _hosts(site: SiteSection) -> list[str]:
    """Where a site is provisioned: its nodes, or a Slurm site's login node, once for the whole cluster
    (its venv and work_dir are on the cluster's shared filesystem, which every compute node mounts)."""
    return [site.login] if site.scheduler == "slurm" else site.hosts

"""Lab operations behind the CLI: up, down, status, shape, cut, heal, kill."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from dilococtl.errors import BadInput, DilocoError
from dilococtl.lab import MARKER, cpu, model, netns, shaping, sshd
from dilococtl.lab.model import ROUTE_PROTO, UNREACHABLE_METRIC, LabState, LinkSpec
from dilococtl.lab.netns import in_ns, run

REGISTRY = Path("/run/dilococtl-lab")  # one file per live lab, machine-wide: tells leftovers from labs in use
CUT_CHAIN = "DLAB-CUT"  # core FORWARD: DROP rules of `lab cut`
CHAOS_CHAIN = "DLAB-CHAOS"  # core FORWARD, first: per-pair DROP and random-loss rules of `lab chaos`
DELAY_CHAIN = "DLAB-DELAY"  # core FORWARD: NFQUEUE per ordered site pair
DELAYER_READY_S = 10.0  # wait this long for the delayer to bind its queues

Say = Callable[[str], None]


def _quiet(msg: str) -> None:
    pass


# --- registry: which labs are owned by a live state file -----------------------------------------

@contextlib.contextmanager
def _machine_lock() -> Iterator[None]:
    """Serialise block choice across concurrent `lab up`s (other homes, other users' tests)."""
    REGISTRY.mkdir(parents=True, exist_ok=True)
    with open(REGISTRY / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _register(state: LabState) -> None:
    (REGISTRY / f"{state.id}.json").write_text(json.dumps({"state": str(model.state_path()), "block": state.block}))


def _unregister(lab_id: str) -> None:
    (REGISTRY / f"{lab_id}.json").unlink(missing_ok=True)


def live_labs() -> dict[str, str]:
    """id -> block of every registered lab whose state file still exists and names it."""
    out = {}
    for f in REGISTRY.glob("*.json") if REGISTRY.exists() else []:
        try:
            reg = json.loads(f.read_text())
            st = json.loads(Path(reg["state"]).read_text())
            if st["id"] == f.stem:
                out[f.stem] = reg["block"]
        except (OSError, ValueError, KeyError):
            continue
    return out


# --- up ------------------------------------------------------------------------------------------

def up(*, sites: int, nodes_per_site: int, rate: str, rtt: str, links: list[str], python: str,
       tcp_buffer: str = "", cpus_per_node: float = 0.0, spec_out: Path | None = None, say: Say = _quiet) -> LabState:
    """Build a lab; on any failure everything built so far is removed again."""
    netns.require_root()
    cpu.check(cpus_per_node)
    rate_bit, rtt_ms = model.parse_rate(rate), model.parse_duration_ms(rtt)
    link_specs = [model.parse_link(text) for text in links]
    buffer = model.parse_size(tcp_buffer) if tcp_buffer else 0
    existing = model.load()
    if existing is not None:
        raise BadInput(f"a lab (id {existing.id}) is already up in this DILOCOCTL_HOME: `dilococtl lab down` first")
    if not Path(python).is_absolute() or not os.access(python, os.X_OK):
        raise BadInput(f"--python: {python!r} is not an absolute path to an executable")
    with _machine_lock():
        used = {ns.split("-")[1] for ns in netns.namespaces() if ns.startswith(f"{MARKER}-") and ns.count("-") >= 2}
        lab_id = next(i for i in iter(lambda: secrets.token_hex(2), None) if i not in used)
        block = model.choose_block(netns.root_routes(), netns.root_addresses())
        state = model.plan(lab_id=lab_id, block=block, sites=sites, nodes_per_site=nodes_per_site,
                           rate_bit=rate_bit, rtt_ms=rtt_ms, links=link_specs, python=python, created=time.time())
        state.tcp_buffer = buffer
        state.cpus_per_node = cpus_per_node
        _register(state)
        model.save(state)
        try:
            # First of all: nothing addressed to the block may leave the machine, whatever fails later.
            run(["ip", "route", "add", "unreachable", block, "metric", str(UNREACHABLE_METRIC),
                 "proto", str(ROUTE_PROTO)])
        except BaseException:
            _forget(state)
            raise
    try:
        _build(state, say)
        if spec_out is not None:
            from dilococtl.lab.runspec import write_spec

            write_spec(state, spec_out)
            say(f"wrote run spec {spec_out}")
    except BaseException:
        say("lab up failed: removing what was built")
        teardown(state)
        raise
    return state


def _build(state: LabState, say: Say) -> None:
    core = state.core_ns
    say(f"lab {state.id}: block {state.block}, {len(state.sites)} sites, {len(state.nodes)} nodes")
    netns.add_ns(core)
    run(in_ns(core, ["sysctl", "-qw", "net.ipv4.ip_forward=1"]))
    # Bridged (intra-site) frames need not walk the core's iptables.
    run(in_ns(core, ["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0"]), check=False)
    run(["ip", "link", "add", state.host_if, "type", "veth", "peer", "name", "mgmt", "netns", core])
    run(["ip", "addr", "add", f"{state.host_addr}/30", "dev", state.host_if])
    run(["ip", "link", "set", state.host_if, "up"])
    run(["ip", "-n", core, "addr", "add", f"{state.core_addr}/30", "dev", "mgmt"])
    run(["ip", "-n", core, "link", "set", "mgmt", "up"])
    run(["ip", "route", "add", state.block, "via", state.core_addr, "dev", state.host_if, "proto", str(ROUTE_PROTO)])
    for site in state.sites:
        run(["ip", "-n", core, "link", "add", site.bridge, "txqueuelen", "1000", "type", "bridge"])
        run(["ip", "-n", core, "addr", "add", f"{site.gateway}/24", "dev", site.bridge])
        run(["ip", "-n", core, "link", "set", site.bridge, "up"])
    for k, node in enumerate(state.nodes):
        site = state.sites[node.site_index]
        netns.add_ns(node.netns)
        port = f"p{k}"
        run(["ip", "-n", core, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", node.netns])
        run(["ip", "-n", core, "link", "set", port, "master", site.bridge, "up"])
        run(["ip", "-n", node.netns, "addr", "add", f"{node.address}/24", "dev", "eth0"])
        run(["ip", "-n", node.netns, "link", "set", "eth0", "up"])
        run(["ip", "-n", node.netns, "route", "add", "default", "via", site.gateway])
        if state.tcp_buffer:
            netns.cap_tcp_buffers(node.netns, state.tcp_buffer)
    say("shaping: one tbf per ordered site pair")
    for site in state.sites:
        shaping.setup_site(state, site)
    _start_delayer(state)
    _iptables_base(state)
    say("sshd: one per node")
    sshd.prepare(state)
    for node in state.nodes:
        node.sshd_pid = sshd.start(node)
        if state.cpus_per_node:
            cpu.cap(state, node, node.sshd_pid)
    model.save(state)
    sshd.wait_listening(state)
    sshd.trust(state)
    state.status = "up"
    model.save(state)


def _ipt(state: LabState, args: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return run(in_ns(state.core_ns, ["iptables", "-w", "5", *args]), check=check)


def _iptables_base(state: LabState) -> None:
    _ipt(state, ["-N", CUT_CHAIN])
    _ipt(state, ["-N", DELAY_CHAIN])
    _ipt(state, ["-A", "FORWARD", "-j", CUT_CHAIN])
    _ipt(state, ["-A", "FORWARD", "-j", DELAY_CHAIN])
    for src in state.sites:
        for dst in state.sites:
            if src is not dst:
                _ipt(state, ["-A", DELAY_CHAIN, "-s", src.subnet, "-d", dst.subnet, "-j", "NFQUEUE",
                             "--queue-num", str(model.queue_num(src.index, dst.index))])


def _delayer_files() -> tuple[Path, Path, Path]:
    d = model.lab_dir()
    return d / "delayer.json", d / "delayer-stats.json", d / "delayer.log"


def _write_delayer_config(state: LabState) -> None:
    cfg, _, _ = _delayer_files()
    tmp = cfg.with_suffix(".tmp")
    tmp.write_text(json.dumps(model.delayer_config(state)))
    tmp.replace(cfg)


def _start_delayer(state: LabState) -> None:
    cfg, stats, log = _delayer_files()
    stats.unlink(missing_ok=True)
    _write_delayer_config(state)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            in_ns(state.core_ns, [sys.executable, "-m", "dilococtl.lab.delayer", str(cfg), str(stats)]),
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, close_fds=True,
            cwd=str(Path(__file__).resolve().parents[2]))
    state.delayer_pid = proc.pid
    model.save(state)
    deadline = time.monotonic() + DELAYER_READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise DilocoError(f"lab delayer exited at start: {tail[0]}")
        try:
            if json.loads(stats.read_text()).get("ready"):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise DilocoError(f"lab delayer did not bind its queues within {DELAYER_READY_S:g}s (see {log})")


# --- down ----------------------------------------------------------------------------------------

def teardown(state: LabState, grace_s: float = 2.0) -> None:
    """Remove one lab entirely: processes, namespaces (and their links, qdiscs, iptables), routes,
    known_hosts lines, registry entry and its files under home()/lab."""
    nss = [n.netns for n in state.nodes] + [state.core_ns]
    netns.kill_ns_processes([ns for ns in nss if ns in netns.namespaces()], grace_s)
    for pid in [n.sshd_pid for n in state.nodes] + [state.delayer_pid]:
        if netns.alive(pid) and netns.exe_of(pid) in (netns.SSHD, state.python, sys.executable):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for ns in nss:
        netns.delete_ns(ns)
    cpu.remove(state.id)
    run(["ip", "link", "del", state.host_if], check=False)
    _delete_routes(state.block)
    sshd.untrust("", {state.known_hosts_marker})
    _forget(state)


def _forget(state: LabState) -> None:
    _unregister(state.id)
    d = model.lab_dir()
    loaded = None
    with contextlib.suppress(BadInput):
        loaded = model.load()
    if loaded is None or loaded.id == state.id:
        shutil.rmtree(d, ignore_errors=True)


def _delete_routes(block: str) -> None:
    for r in netns.root_routes():
        if r.get("dst") == block and str(r.get("protocol")) == str(ROUTE_PROTO):
            args = ["ip", "route", "del", r.get("type", "unicast"), block, "proto", str(ROUTE_PROTO)]
            if "metric" in r:
                args += ["metric", str(r["metric"])]
            run(args, check=False)


def sweep(all_labs: bool = False) -> list[str]:
    """Remove leftovers of labs no live state file owns (every lab with `all_labs`); returns what."""
    with _machine_lock():  # a concurrent `lab up` registers and saves its state under this lock
        return _sweep(all_labs)


def _sweep(all_labs: bool) -> list[str]:
    live = {} if all_labs else live_labs()
    removed = []
    ids: dict[str, list[str]] = {}
    for ns in netns.namespaces():
        parts = ns.split("-")
        if len(parts) >= 3 and parts[0] == MARKER and parts[1] not in live:
            ids.setdefault(parts[1], []).append(ns)
    for lab_id, nss in sorted(ids.items()):
        netns.kill_ns_processes(nss, 1.0)
        for ns in nss:
            netns.delete_ns(ns)
        removed.append(f"lab {lab_id}: {len(nss)} namespaces")
    for link in netns.root_links():
        lab_id = link[len(MARKER):]
        if link.startswith(MARKER) and len(lab_id) == 4 and lab_id not in live:
            run(["ip", "link", "del", link], check=False)
            removed.append(f"link {link}")
    live_blocks = set(live.values())
    for r in netns.root_routes():
        if str(r.get("protocol")) == str(ROUTE_PROTO) and r.get("dst") not in live_blocks:
            _delete_routes(r["dst"])
            removed.append(f"route {r.get('type', '')} {r['dst']}".replace("  ", " "))
    known = {f"dilococtl-lab-{i}" for i in live}
    n = sshd.untrust("dilococtl-lab-") if not known else _untrust_except(known)
    if n:
        removed.append(f"{n} known_hosts lines")
    for f in REGISTRY.glob("*.json") if REGISTRY.exists() else []:
        if f.stem not in live:
            f.unlink(missing_ok=True)
    groups = {g for lab_id in ids for g in cpu.remove(lab_id)} if not all_labs else set(cpu.remove())
    if groups:
        removed.append(f"{len(groups)} cpu cgroups")
    return sorted(set(removed), key=removed.index)


def _untrust_except(keep: set[str]) -> int:
    from dilococtl import paths

    path = paths.known_hosts_path()
    if not path.exists():
        return 0
    tags = {line.split()[-1] for line in path.read_text().splitlines() if line.split()}
    return sshd.untrust("", {t for t in tags if t.startswith("dilococtl-lab-") and t not in keep})


def down(all_labs: bool = False, say: Say = _quiet) -> list[str]:
    """Tear down this home's lab (if any) and sweep leftovers; idempotent."""
    netns.require_root()
    removed = []
    state = None
    try:
        state = model.load()
    except BadInput:
        model.state_path().unlink(missing_ok=True)
        removed.append("unreadable state file")
    if state is not None:
        say(f"removing lab {state.id}")
        teardown(state)
        removed.append(f"lab {state.id}")
    removed += sweep(all_labs)
    return removed


# --- status, shape, cut, heal, kill --------------------------------------------------------------

def delayer_stats() -> dict:
    _, stats, _ = _delayer_files()
    try:
        return json.loads(stats.read_text())
    except (OSError, ValueError):
        return {}


def status(state: LabState) -> dict:
    """Nodes (sshd alive and answering), links (configured, tbf counters), delayer."""
    counters = shaping.counters(state)
    nodes = [{"name": n.name, "site": n.site, "address": n.address, "netns": n.netns, "sshd_pid": n.sshd_pid,
              "sshd_alive": netns.alive(n.sshd_pid) and sshd.listening(n.address)} for n in state.nodes]
    links = []
    for key, shape in state.links.items():
        src, dst = key.split(">")
        links.append({"link": key, "rate": model.format_rate(shape.rate_bit), "rate_bit": shape.rate_bit,
                      "delay_ms": shape.delay_ms, "cut": src in state.cut or dst in state.cut,
                      "measured": counters.get(key, {})})
    stats = delayer_stats()
    return {"id": state.id, "status": state.status, "block": state.block, "core_ns": state.core_ns,
            "nodes": nodes, "links": links, "cut": state.cut, "tcp_buffer": state.tcp_buffer,
            "chaos_rules": [rule for rule, _ in chaos_counters(state)],  # what a `lab chaos` holds now
            "delayer": {"pid": state.delayer_pid, "alive": netns.alive(state.delayer_pid), **{
                k: stats.get(k) for k in ("queued", "released", "held", "held_max", "overflows", "errors", "sched")}}}


def shape(spec: LinkSpec) -> list[str]:
    """Change a link while the lab runs: tbf in place, delayer delays live (SIGHUP)."""
    netns.require_root()
    state = model.require()
    keys = model.apply_link(state, spec)
    for key in keys:
        shaping.change(state, key)
    _write_delayer_config(state)
    if netns.alive(state.delayer_pid):
        os.kill(state.delayer_pid, signal.SIGHUP)
    model.save(state)
    return keys


def _cut_rules(state: LabState, site_name: str) -> list[list[str]]:
    site = state.site(site_name)
    rules = []
    for other in state.sites:
        if other is not site:
            rules.append(["-s", site.subnet, "-d", other.subnet, "-j", "DROP"])
            rules.append(["-s", other.subnet, "-d", site.subnet, "-j", "DROP"])
    return rules


def cut(site_name: str) -> bool:
    """Drop all traffic between a site and the others; False if it was already cut."""
    netns.require_root()
    state = model.require()
    name = state.site(site_name).name
    if name in state.cut:
        return False
    for rule in _cut_rules(state, name):
        _ipt(state, ["-A", CUT_CHAIN, *rule])
    state.cut.append(name)
    model.save(state)
    return True


def heal(site_name: str) -> bool:
    """Undo `cut`; False if the site was not cut."""
    netns.require_root()
    state = model.require()
    name = state.site(site_name).name
    if name not in state.cut:
        return False
    for rule in _cut_rules(state, name):
        _ipt(state, ["-D", CUT_CHAIN, *rule], check=False)
    state.cut.remove(name)
    model.save(state)
    return True


def kill(target: str, grace_s: float) -> list[int]:
    """A spot preemption: SIGTERM every process of the node(s) but sshd, SIGKILL after the grace."""
    netns.require_root()
    if grace_s < 0:
        raise BadInput(f"--grace: must be >= 0, got {grace_s:g}")
    state = model.require()
    nodes = state.targets(target)
    return netns.kill_ns_processes([n.netns for n in nodes], grace_s,
                                   spare=lambda pid: netns.exe_of(pid) == netns.SSHD)


# --- per-pair faults of `lab chaos` (their own chain: `lab cut`/`heal` never touch them) ---------

def chaos_chain(state: LabState) -> None:
    """Create CHAOS_CHAIN and hook it first in the core's FORWARD chain (idempotent)."""
    netns.require_root()
    if _ipt(state, ["-S", CHAOS_CHAIN], check=False).returncode != 0:
        _ipt(state, ["-N", CHAOS_CHAIN])
    if _ipt(state, ["-C", "FORWARD", "-j", CHAOS_CHAIN], check=False).returncode != 0:
        _ipt(state, ["-I", "FORWARD", "1", "-j", CHAOS_CHAIN])


def _pair_rules(state: LabState, a: str, b: str, match: list[str]) -> list[list[str]]:
    sa, sb = state.site(a), state.site(b)
    return [["-s", sa.subnet, "-d", sb.subnet, *match, "-j", "DROP"],
            ["-s", sb.subnet, "-d", sa.subnet, *match, "-j", "DROP"]]


def _loss_match(percent: float) -> list[str]:
    # iptables keeps the probability as a 32-bit fraction: the same text adds and deletes the same rule
    return ["-m", "statistic", "--mode", "random", "--probability", f"{percent / 100:.6f}"]


def cut_pair(state: LabState, a: str, b: str) -> None:
    """Drop every packet between sites a and b, both directions (the operator's SSH is not between sites)."""
    for rule in _pair_rules(state, a, b, []):
        _ipt(state, ["-A", CHAOS_CHAIN, *rule])


def heal_pair(state: LabState, a: str, b: str) -> None:
    """Undo one `cut_pair` (a rule already gone is no error)."""
    for rule in _pair_rules(state, a, b, []):
        _ipt(state, ["-D", CHAOS_CHAIN, *rule], check=False)


def add_loss(state: LabState, a: str, b: str, percent: float) -> None:
    """Drop `percent` % of the packets between a and b at random, each direction (xt_statistic)."""
    for rule in _pair_rules(state, a, b, _loss_match(percent)):
        _ipt(state, ["-A", CHAOS_CHAIN, *rule])


def remove_loss(state: LabState, a: str, b: str, percent: float) -> int:
    """Undo one `add_loss`; returns the packets its rules dropped."""
    dropped = sum(c for rule, c in chaos_counters(state) if "statistic" in rule and _pair_in(state, a, b, rule))
    for rule in _pair_rules(state, a, b, _loss_match(percent)):
        _ipt(state, ["-D", CHAOS_CHAIN, *rule], check=False)
    return dropped


def _pair_in(state: LabState, a: str, b: str, rule: str) -> bool:
    sa, sb = state.site(a).subnet, state.site(b).subnet
    return any(f"-s {x} -d {y} " in rule + " " for x, y in ((sa, sb), (sb, sa)))


def chaos_counters(state: LabState) -> list[tuple[str, int]]:
    """Each rule of CHAOS_CHAIN (as `iptables -S` writes it) with the packets it matched; [] without the chain."""
    r = _ipt(state, ["-S", CHAOS_CHAIN, "-v"], check=False)
    out = []
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        if not line.startswith("-A "):
            continue
        words = line.split()
        packets = 0
        if "-c" in words:  # `-c PACKETS BYTES`
            i = words.index("-c")
            packets = int(words[i + 1]) if words[i + 1].isdigit() else 0
            words = words[:i] + words[i + 3:]
        out.append((" ".join(words), packets))
    return out

"""`dilococtl lab` end to end: rates, delays, cuts, preemptions, SSH and a clean `lab down`.

Each test is independent of the order the tests run in: a test that changes a link sets the
shape it measures itself, and `cut` heals in a finally.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import paramiko
import pytest

from tests.e2e.conftest import Lab, dctl, lab_skip_reason, write_probe

pytestmark = [pytest.mark.e2e, pytest.mark.timed, pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.mark.parametrize("mbit", [10, 50, 200])
def test_shaping_holds_between_sites(lab: Lab, mbit: int):
    dctl(lab.home, "shape", "site0-site1", f"{mbit}mbit/20ms")
    # tbf counts Ethernet frames: TCP goodput is ~96% of the configured rate. A stall of this shared
    # machine (one CI run read 80% and 88% at 10 and 50 Mbit/s, over 90% when re-run) can only lower
    # a reading: the link's rate is the best of two, and no reading may exceed it
    runs = [lab.bulk_mbit("site0-n0", "site1-n0")]
    if runs[0] < 0.90 * mbit:
        runs.append(lab.bulk_mbit("site0-n0", "site1-n0"))
    assert 0.90 * mbit <= max(runs) and max(runs) <= 1.00 * mbit, f"{runs} Mbit/s through a {mbit}mbit link"


def test_rates_are_per_direction(lab: Lab):
    dctl(lab.home, "shape", "site0-site1", "50mbit/20ms")
    dctl(lab.home, "shape", "site1>site0", "10mbit")
    try:
        forward = lab.bulk_mbit("site0-n0", "site1-n1")
        backward = lab.bulk_mbit("site1-n1", "site0-n0")
    finally:
        dctl(lab.home, "shape", "site0-site1", "50mbit/20ms")
    assert 45 <= forward <= 50, forward
    assert 9 <= backward <= 10, backward


def test_inside_a_site_is_not_shaped(lab: Lab):
    assert lab.rtt_ms("site1-n0", "site1-n1") < 3.0
    # Far above the 50mbit WAN rate: the site's LAN is a plain bridge.
    assert lab.bulk_mbit("site1-n0", "site1-n1", warm_s=0.5, measure_s=1.0) > 300


def test_round_trip_is_the_configured_rtt(lab: Lab):
    # site0<->site2 was given 80ms at `lab up`; the other pairs 20ms.
    assert abs(lab.rtt_ms("site0-n0", "site2-n1") - 80) <= 5
    assert abs(lab.rtt_ms("site1-n1", "site2-n0") - 20) <= 5
    # Changed live: the delayer picks the new delay up without a restart.
    dctl(lab.home, "shape", "site0-site2", "50mbit/40ms")
    try:
        assert abs(lab.rtt_ms("site2-n0", "site0-n1") - 40) <= 5
    finally:
        dctl(lab.home, "shape", "site0-site2", "50mbit/80ms")
    st = json.loads(dctl(lab.home, "status", "--json").stdout)
    assert st["delayer"]["alive"] and st["delayer"]["overflows"] == 0


WIRETAP = Path(__file__).with_name("wiretap_agent.py")


def _in_ns(lab: Lab, node: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", lab.node(node)["netns"], sys.executable, str(WIRETAP), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _tapped(lab: Lab, tmp: Path, arm: str, *pair_args: str) -> tuple[bytes, list[str]]:
    """Every frame site0-n0's namespace saw while site0-n0 and site1-n0 allreduce the motif over `arm`."""
    out = tmp / f"{arm}.cap"
    cap = _in_ns(lab, "site0-n0", "capture", "8", str(out))
    try:
        assert cap.stdout.readline().strip() == "ready", cap.stderr.read()
        members = [_in_ns(lab, node, arm, str(r), *pair_args) for r, node in enumerate(("site0-n0", "site1-n0"))]
        said = []
        for m in members:
            o, e = m.communicate(timeout=60)
            assert m.returncode == 0, e[-2000:]
            said.append(o.strip())
        cap.communicate(timeout=30)
    finally:
        cap.kill()
    return out.read_bytes(), said


def test_a_wiretap_on_a_lab_link_sees_no_pseudo_gradient_bytes(lab: Lab, tmp_path: Path):
    """The trainer's listeners (clear_loopback on) between two lab sites: every stream stays in TLS,
    since neither end is a loopback address, and a capture holds no copy of the tensor's bytes; gloo's
    capture of the same allreduce holds it many times (so the capture works)."""
    import torch

    from dilococtl import run_ca

    dctl(lab.home, "shape", "site0-site1", "50mbit/20ms")
    a0, a1 = lab.node("site0-n0")["address"], lab.node("site1-n0")["address"]
    motif = torch.randn(16, generator=torch.Generator().manual_seed(4242)).numpy().tobytes()  # the agent's
    gloo_wire, _ = _tapped(lab, tmp_path, "gloo", a0, "29611")
    assert gloo_wire.count(motif) > 100
    run_ca.ensure(tmp_path / "ca", "wiretap", ["s0", "s1"])
    tls_wire, said = _tapped(lab, tmp_path, "tls", a0, a1, "29612", str(tmp_path / "ca"))
    assert said == ["lanes 2", "lanes 2"]  # both streams of each direction kept TLS
    assert len(tls_wire) > 512 * 1024  # the exchange crossed the tapped namespace ...
    assert tls_wire.count(motif) == 0 and tls_wire.count(motif[:16]) == 0  # ... and shows none of it


def test_cut_drops_a_site_and_heal_restores_it(lab: Lab):
    assert lab.can_connect("site0-n0", "site1-n0")
    r = dctl(lab.home, "cut", "site1")
    assert "cut site1" in r.stdout
    try:
        assert not lab.can_connect("site0-n0", "site1-n0")
        assert not lab.can_connect("site1-n1", "site2-n0")
        assert lab.can_connect("site0-n0", "site2-n0")  # the others still talk
        assert lab.can_connect("site1-n0", "site1-n1")  # and so does the cut site inside
        st = json.loads(dctl(lab.home, "status", "--json").stdout)
        assert {link["link"] for link in st["links"] if link["cut"]} == {
            "site0>site1", "site1>site0", "site1>site2", "site2>site1"}
        assert all(n["sshd_alive"] for n in st["nodes"])  # the operator still reaches the cut site
    finally:
        r = dctl(lab.home, "heal", "site1")
    assert "healed site1" in r.stdout
    assert lab.can_connect("site0-n0", "site1-n0")
    assert lab.can_connect("site2-n0", "site1-n1")


def test_kill_is_a_preemption_that_spares_sshd(lab: Lab):
    ns = lab.node("site2-n1")["netns"]
    polite = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "300"])
    stubborn = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c",
                                 "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                 "print('up', flush=True); time.sleep(300)"], stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen(["ip", "netns", "exec", lab.node("site2-n0")["netns"], "sleep", "300"])
    try:
        assert stubborn.stdout.readline().strip() == "up"
        t0 = time.monotonic()
        r = dctl(lab.home, "kill", "site2-n1", "--grace", "1")
        elapsed = time.monotonic() - t0
        assert "signalled 2 process(es)" in r.stdout
        assert polite.wait(timeout=5) == -signal.SIGTERM
        assert stubborn.wait(timeout=5) == -signal.SIGKILL
        assert elapsed >= 1.0
        assert other.poll() is None  # another node of the same site is untouched
        st = json.loads(dctl(lab.home, "status", "--json").stdout)
        assert next(n for n in st["nodes"] if n["name"] == "site2-n1")["sshd_alive"]
    finally:
        for p in (polite, stubborn, other):
            p.kill()
            p.wait()


def test_ssh_with_the_labs_known_hosts(lab: Lab):
    spec = tomllib.loads((lab.home / "spec.toml").read_text())
    assert [s["hosts"] for s in spec["sites"]] == [
        [n["address"] for n in lab.status["nodes"] if n["site"] == f"site{i}"] for i in range(3)]
    assert spec["run"]["lighthouse"] == lab.node("site0-n0")["address"]
    assert spec["sites"][0]["python"] == sys.executable
    node = lab.node("site1-n1")
    client = paramiko.SSHClient()
    client.load_host_keys(str(lab.home / "known_hosts"))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())  # no trust on first use
    client.connect(node["address"], username=spec["ssh"]["user"], key_filename=spec["ssh"]["identity_file"],
                   look_for_keys=False, allow_agent=False, timeout=10)
    try:
        _, out, _ = client.exec_command("hostname; getent hosts site0-n0 site1-n1")
        lines = out.read().decode().split("\n")
    finally:
        client.close()
    assert lines[0] == "site1-n1"
    resolved = {line.split()[1]: line.split()[0] for line in lines[1:] if line.strip()}
    assert resolved == {"site0-n0": lab.node("site0-n0")["address"], "site1-n1": node["address"]}


def _traces(home: Path, state: dict) -> list[str]:
    """Everything of lab `state` still present on the machine."""
    lab_id, block = state["id"], state["block"]
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found += [f"netns {line.split()[0]}" for line in netns.splitlines() if f"dlab-{lab_id}-" in line]
    links = json.loads(subprocess.run(["ip", "-j", "link"], capture_output=True, text=True).stdout)
    found += [f"link {link['ifname']}" for link in links if lab_id in link["ifname"]]
    routes = json.loads(subprocess.run(["ip", "-j", "route", "show", "table", "all"], capture_output=True,
                                       text=True).stdout or "[]")
    found += [f"route {r.get('type', '')} {r['dst']}" for r in routes if r.get("dst") == block]
    rules = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    prefix = ".".join(block.split(".")[:2]) + "."  # "10.210."
    found += [f"iptables {line}" for line in rules.splitlines() if f"dlab-{lab_id}" in line or prefix in line]
    pids = [n["sshd_pid"] for n in state["nodes"]] + [state["delayer_pid"]]
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] != "Z":
                found.append(f"process {pid}")
        except OSError:
            pass
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    found += [f"process {line.strip()}" for line in ps.splitlines() if str(home) in line]
    kh = home / "known_hosts"
    if kh.exists():
        found += [f"known_hosts {line}" for line in kh.read_text().splitlines() if lab_id in line]
    if Path(f"/run/dilococtl-lab/{lab_id}.json").exists():
        found.append("registry entry")
    return found


def _small_lab(home: Path) -> dict:
    dctl(home, "up", "--sites", "2", "--rate", "20mbit", "--rtt", "10ms", timeout=120)
    return json.loads((home / "lab" / "state.json").read_text())


@pytest.fixture
def own_home(tmp_path):
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    home = tmp_path / "own"
    home.mkdir()
    try:
        yield home
    finally:
        dctl(home, "down", check=False, timeout=120)


def test_down_removes_everything(own_home: Path):
    state = _small_lab(own_home)
    probe = write_probe(own_home)
    worker = subprocess.Popen(["ip", "netns", "exec", state["nodes"][1]["netns"], sys.executable, str(probe),
                               "server", state["nodes"][1]["address"], "5999"], stdout=subprocess.PIPE, text=True)
    assert worker.stdout.readline().strip() == "ready"
    assert len(_traces(own_home, state)) >= 8  # namespaces, links, routes, processes, known_hosts
    r = dctl(own_home, "down")
    assert f"lab {state['id']}" in r.stdout
    assert worker.wait(timeout=5) in (-signal.SIGTERM, -signal.SIGKILL)
    assert _traces(own_home, state) == []
    assert not (own_home / "lab").exists()
    again = dctl(own_home, "down")  # idempotent
    assert "no lab to remove" in again.stdout


def test_down_finds_a_crashed_labs_leftovers_without_state(own_home: Path):
    state = _small_lab(own_home)
    # The operator's records are gone (a crash, a deleted home): only the name marker is left.
    for f in (own_home / "lab").iterdir():
        if f.name in ("state.json",):
            f.unlink()
    r = dctl(own_home, "down")
    assert f"lab {state['id']}: 3 namespaces" in r.stdout, r.stdout
    assert _traces(own_home, state) == []


def test_cpus_per_node_caps_what_runs_on_a_node_and_down_removes_the_cap(own_home: Path):
    """A site capped below its share of the host computes as fast alone as beside the others (the goodput
    ledger of a chaos run would otherwise count the host's sharing as the run's loss)."""
    spec_path = own_home / "spec.toml"
    dctl(own_home, "up", "--sites", "2", "--rate", "20mbit", "--rtt", "10ms", "--cpus-per-node", "0.25",
         "--spec-out", str(spec_path), timeout=120)
    state = json.loads((own_home / "lab" / "state.json").read_text())
    spec = tomllib.loads(spec_path.read_text())
    node = state["nodes"][0]
    client = paramiko.SSHClient()
    client.load_host_keys(str(own_home / "known_hosts"))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(node["address"], username=spec["ssh"]["user"], key_filename=spec["ssh"]["identity_file"],
                   look_for_keys=False, allow_agent=False, timeout=10)
    busy = ("import time; t = time.time()\nwhile time.time() - t < 2: pass\n"
            "print(time.process_time() / (time.time() - t)); print(open('/proc/self/cgroup').read())")
    try:
        _, out, _ = client.exec_command(f"{sys.executable} -c \"{busy}\"")
        share, groups = out.read().decode().split("\n", 1)
    finally:
        client.close()
    assert f"dilococtl-lab-{state['id']}/{node['name']}" in groups
    assert float(share) < 0.4, share  # 0.25 of a core (a 2 s busy loop alone would take ~1)
    dctl(own_home, "down")
    assert not list(Path("/sys/fs/cgroup/cpu").glob(f"dilococtl-lab-{state['id']}*"))


def test_a_cpu_cap_the_host_cannot_give_is_refused_in_one_line(own_home: Path):
    for bad in ("nan", "-1", "1000"):
        r = dctl(own_home, "up", "--sites", "2", "--cpus-per-node", bad, check=False, timeout=60)
        assert r.returncode == 2 and "--cpus-per-node: must be 0 (no cap) or between 0.05" in r.stderr, r.stderr
        assert not (own_home / "lab" / "state.json").exists()

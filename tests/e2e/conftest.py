"""End-to-end fixtures: a `dilococtl lab` brought up through the real CLI and ALWAYS taken down.

Every command runs as a user types it (`python -m dilococtl lab ...` in a subprocess) with its own
DILOCOCTL_HOME. Test traffic goes only between lab namespaces (and from the root namespace to the
lab's sshds through the lab's own management link).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomlkit

from dilococtl.metrics import sync_share
from dilococtl.store import Store
from dilococtl.tune.history import rounds_against_model

# A tiny TCP tool run inside node namespaces: a server (sink or echo), a bulk sender, a ping-pong.
# The sink measures at the receiver, so bytes still sitting in socket buffers are never counted.
PROBE = r'''
import json, socket, statistics, struct, sys, time

def server(addr, port):
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((addr, int(port)))
    ls.listen(1)
    print("ready", flush=True)
    ls.settimeout(20)
    c, _ = ls.accept()
    c.settimeout(20)
    mode = c.recv(1)
    if mode == b"E":
        while True:
            d = c.recv(65536)
            if not d:
                return
            c.sendall(d)
    hdr = b""
    while len(hdr) < 64:
        hdr += c.recv(64 - len(hdr))
    warm, meas = (float(x) for x in hdr.split(b","))
    c.settimeout(0.05)
    buf = bytearray(1 << 20)
    t0 = time.monotonic()
    marks = []  # (time, bytes the kernel received): immune to this process being descheduled
    while len(marks) < 2:
        try:
            if not c.recv_into(buf):
                break
        except socket.timeout:
            pass
        if time.monotonic() >= t0 + warm + meas * len(marks):
            info = c.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            marks.append((time.monotonic(), struct.unpack_from("=Q", info, 128)[0]))  # tcpi_bytes_received
    (ta, ba), (tb, bb) = marks
    print(json.dumps({"mbit": (bb - ba) * 8 / (tb - ta) / 1e6}), flush=True)

def bulk(host, port, warm, meas):
    s = socket.create_connection((host, int(port)), timeout=5)
    s.sendall(b"S" + f"{warm},{meas}".encode().ljust(64))
    data = b"\0" * (1 << 16)
    end = time.monotonic() + float(warm) + float(meas) + 1.0
    try:
        while time.monotonic() < end:
            s.sendall(data)
    except OSError:
        pass

def pingpong(host, port, n, size):
    s = socket.create_connection((host, int(port)), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(b"E")
    msg = b"x" * int(size)
    rtts = []
    for _ in range(int(n)):
        t = time.monotonic()
        s.sendall(msg)
        got = 0
        while got < len(msg):
            got += len(s.recv(65536))
        rtts.append((time.monotonic() - t) * 1000)
    print(json.dumps({"median_ms": statistics.median(rtts[1:]), "min_ms": min(rtts)}), flush=True)

def connect(host, port, timeout):
    try:
        socket.create_connection((host, int(port)), timeout=float(timeout)).close()
        print("ok")
    except OSError as e:
        print(f"fail {e}")

{"server": server, "bulk": bulk, "pingpong": pingpong, "connect": connect}[sys.argv[1]](*sys.argv[2:])
'''


def lab_skip_reason() -> str | None:
    """Why `dilococtl lab` cannot run here, or None."""
    if os.geteuid() != 0:
        return "dilococtl lab needs root (network namespaces, tc, iptables)"
    missing = [t for t in ("ip", "tc", "iptables", "unshare", "ssh-keygen", "sysctl") if shutil.which(t) is None]
    if missing or not os.access("/usr/sbin/sshd", os.X_OK):
        return f"dilococtl lab needs {', '.join(missing) or '/usr/sbin/sshd'}"
    probe = f"dlabprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"network namespaces unavailable: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def dctl(home: Path, *args: str, timeout: float = 90, check: bool = True) -> subprocess.CompletedProcess:
    """`python -m dilococtl lab ARGS` with DILOCOCTL_HOME=home."""
    env = {**os.environ, "DILOCOCTL_HOME": str(home)}
    r = subprocess.run([sys.executable, "-m", "dilococtl", "lab", *args], env=env, capture_output=True,
                       text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"dilococtl lab {' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")
    return r


def cli(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m dilococtl ARGS` as a user types it, with DILOCOCTL_HOME=home."""
    env = {**os.environ, "DILOCOCTL_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "dilococtl", *args], cwd=Path(__file__).resolve().parents[2],
                          env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)  # no terminal: launch does not ask


def lab_up(tmp_path_factory, name: str, *up_args: str, runs: tuple[str, ...] = ()):
    """Body of a module fixture: `lab up UP_ARGS --spec-out`, yield (home, spec), always `lab down`.

    `runs`: run names stopped first at teardown, so a run that outlived a failed assertion does not
    keep the namespaces busy.
    """
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    home = tmp_path_factory.mktemp(name)
    spec = home / "spec.toml"
    try:
        dctl(home, "up", *up_args, "--spec-out", str(spec), timeout=120)
        yield home, spec
    finally:
        for run in runs:
            cli(home, "stop", run, "--grace", "5", timeout=60)
        dctl(home, "down", check=False, timeout=120)


# --max-h for the e2e tune-h calls. The H a budget needs grows as the host's step time shrinks (a
# faster CPU halved the tiny model's step and the H needed at 10 Mbit/s passed the default 1000),
# but the compute a tuned run does, rounds * H * step = rounds * sync / budget, does not depend on
# the host: so no host-speed-dependent cap. The over-max answer is unit-tested.
E2E_MAX_H = 1_000_000


def group_rounds(rows) -> dict[int, list]:
    """Round records grouped by round, in round order."""
    per: dict[int, list] = {}
    for x in sorted(rows, key=lambda x: x.round):
        per.setdefault(x.round, []).append(x)
    return per


def wan_share(rows) -> float | None:
    """The share of round time a run spent on the WAN, as tune-h models it: per round, the exchange of
    the site that arrived last (it waited least) over the slowest site's compute plus that exchange.
    `sync_share` also counts what the first site waited for the other's compute, and two sites sharing
    this machine's 2 cores end their rounds 0.5-1 s apart (a ~5 s round): straggler time, not WAN."""
    per = group_rounds(rows)
    ex = sum(min(x.sync_s for x in rs) for rs in per.values())
    compute = sum(max(x.compute_s for x in rs) for rs in per.values())
    return ex / (ex + compute) if ex + compute > 0 else None


def tune_then_run(home, spec, name: str, budget: float, rounds: int,
                  by_round: bool = False) -> tuple[dict, dict, list[float]]:
    """`tune-h --write` then `launch --wait` of the lab spec: (tune-h's JSON, the run's summary, the
    exchange of each round after the first, sorted; in round order with by_round)."""
    doc = tomlkit.parse(spec.read_text())
    doc["run"]["name"] = name
    doc["diloco"]["rounds"] = rounds
    doc["train"]["eval_every"] = 0  # evaluation is neither compute nor sync: keep it out of the rounds
    # the run's transport is the spec's (the lab's leaves it to "auto": TLS) with its default congestion
    # control (loss-based: the lab's nodes run BBR, under which rounds ran 1.2-1.6x the prediction)
    spec.write_text(tomlkit.dumps(doc))

    r = cli(home, "tune-h", str(spec), "--budget", str(budget), "--max-h", str(E2E_MAX_H), "--write",
            "--duration", "3", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    tuned = json.loads(r.stdout)
    h = tomlkit.parse(spec.read_text())["diloco"]["h"]
    assert h == tuned["h"] and h % 10 == 0 and h > 5

    r = cli(home, "launch", str(spec), "--wait", "--json", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(r.stdout)
    assert summary["state"] == "finished" and summary["h"] == h
    # tune-h predicts a steady round; the first exchange also opens the sites' connections (and
    # leaves TCP slow start behind), so the checks look at the rounds after it. A round's exchange
    # is what the last site to arrive waited.
    with Store.open(home / "state.db") as store:
        rows = [x for x in store.rounds(summary["id"]) if x.round > 1]
    per_round = group_rounds(rows)
    summary["steady_sync_share"] = sync_share(rows)
    summary["wan_share"] = wan_share(rows)
    # each round's exchange past its quorum (the weight gather, payload, outer step), the longest site's:
    # what waiting for a slower site's compute never enters, since that wait is spent in the quorum
    summary["past_quorum_s"] = [max(x.sync_s - x.quorum_s for x in rs) for _, rs in sorted(per_round.items())]
    last = [min(rs, key=lambda x: x.sync_s) for _, rs in sorted(per_round.items())]
    summary["last_site"] = [x.site for x in last]  # who arrived last in each round, in round order
    summary["last_parts"] = [(x.quorum_s, x.weight_s, x.payload_s) for x in last]  # its exchange, split
    with Store.open(home / "state.db") as store:  # each round replayed in tune-h's model from its arrivals
        summary["replay"] = [g for g in rounds_against_model(store, store.get_run(summary["id"])) or []
                             if g["round"] > 1]
    print("\nper round, replayed from the arrivals (measured/predicted; quorum, weight, payload): " + "; ".join(
        f"r{g['round']} {g['site']} {g['sync_s']:.3f}/{g['predicted_s']:.3f} ({g['sync_s'] / g['predicted_s']:.2f}x; "
        + " ".join(f"{g['measured'][k]:.3f}/{g['predicted'][k]:.3f}" for k in ("quorum_s", "weight_s", "payload_s"))
        + ")" for g in summary["replay"]))
    exchange = [x.sync_s for x in last]
    return tuned, summary, exchange if by_round else sorted(exchange)


@dataclass
class Lab:
    home: Path
    status: dict  # `lab status --json` right after `lab up`
    probe: Path
    _port: int = 5100

    def node(self, name: str) -> dict:
        return next(n for n in self.status["nodes"] if n["name"] == name)

    def run_in(self, node: str, *args: str, timeout: float = 30) -> str:
        r = subprocess.run(["ip", "netns", "exec", self.node(node)["netns"], *args], capture_output=True,
                           text=True, timeout=timeout)
        assert r.returncode == 0, f"{args} in {node}: {r.stderr.strip()}"
        return r.stdout

    def _server(self, node: str) -> tuple[subprocess.Popen, int]:
        self._port += 1
        srv = subprocess.Popen(["ip", "netns", "exec", self.node(node)["netns"], sys.executable, str(self.probe),
                                "server", self.node(node)["address"], str(self._port)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert srv.stdout.readline().strip() == "ready", srv.stderr.read()
        return srv, self._port

    def bulk_mbit(self, src: str, dst: str, warm_s: float = 1.0, measure_s: float = 3.0) -> float:
        """Goodput of one TCP stream src -> dst, measured at the receiver after a warm-up."""
        srv, port = self._server(dst)
        try:
            self.run_in(src, sys.executable, str(self.probe), "bulk", self.node(dst)["address"], str(port),
                        str(warm_s), str(measure_s))
            out, err = srv.communicate(timeout=10)
        finally:
            srv.kill()
        return json.loads(out.strip().splitlines()[-1])["mbit"]

    def rtt_ms(self, src: str, dst: str, n: int = 25) -> float:
        """Median round trip of a 64-byte TCP request/response src -> dst -> src."""
        srv, port = self._server(dst)
        try:
            out = self.run_in(src, sys.executable, str(self.probe), "pingpong", self.node(dst)["address"],
                              str(port), str(n), "64")
        finally:
            srv.kill()
            srv.wait()
        return json.loads(out)["median_ms"]

    def can_connect(self, src: str, dst: str, timeout_s: float = 1.0) -> bool:
        """TCP connect src -> dst's sshd."""
        out = self.run_in(src, sys.executable, str(self.probe), "connect", self.node(dst)["address"], "22",
                          str(timeout_s))
        return out.startswith("ok")


def write_probe(home: Path) -> Path:
    p = home / "probe.py"
    p.write_text(PROBE)
    return p


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Lab:
    """3 sites x 2 nodes, 50mbit / 20ms between sites, site0<->site2 at 80ms. Always torn down."""
    reason = lab_skip_reason()
    if reason:
        pytest.skip(reason)
    home = tmp_path_factory.mktemp("labhome")
    try:
        t0 = time.monotonic()
        r = dctl(home, "up", "--sites", "3", "--nodes-per-site", "2", "--rate", "50mbit", "--rtt", "20ms",
                 "--link", "site0-site2=50mbit/80ms", "--spec-out", str(home / "spec.toml"), "--json", timeout=120)
        status = json.loads(r.stdout)
        status["up_seconds"] = time.monotonic() - t0
        yield Lab(home=home, status=status, probe=write_probe(home))
    finally:
        dctl(home, "down", check=False, timeout=120)

"""Per-link pacing on the asymmetric 3-site lab: each round against its replay, paced and unpaced side by side.

    sudo .venv/bin/python bench/link_pace.py [--repeats 3] [--rounds 8] [--out bench/results/link_pace_asym_3repeats.json]

Through the real CLI, with its own DILOCOCTL_HOME: `lab up --sites 3 --rate 50mbit --rtt 80ms --link
site0-site1=20mbit/40ms --link site1-site2=100mbit/120ms`, `tune-h SPEC --budget 0.3 --write` (which
derives S and each link's pace, diloco.transport_link_pace_mbit), then the same run `--repeats` times
per arm, the arms alternating: "paced" (the spec as tune-h wrote it) and "unpaced" (the same spec with
an empty transport_link_pace_mbit table), each written over the spec file in turn. Every round after the first is replayed in tune-h's model
from the sites' arrivals (dilococtl.tune.history.rounds_against_model, which models each arm's own pacing);
the TCP segments each site's namespace retransmitted during the run come from its /proc/net/snmp.
`lab down` always runs at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomlkit

ROOT = Path(__file__).resolve().parents[1]
LINKS = ("site0-site1=20mbit/40ms", "site1-site2=100mbit/120ms")  # site2-site0 takes --rate/--rtt: 50mbit/80ms


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def dctl(home: Path, *args: str, timeout: float = 600) -> str:
    r = subprocess.run([sys.executable, "-m", "dilococtl", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "DILOCOCTL_HOME": str(home)}, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise SystemExit(f"dilococtl {' '.join(args)} exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return r.stdout


def retrans(netns: list[str]) -> dict[str, int]:
    """TcpRetransSegs of each namespace."""
    out = {}
    for ns in netns:
        lines = [x.split() for x in subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/snmp"],
                                                     capture_output=True, text=True, check=True).stdout.splitlines()
                 if x.startswith("Tcp:")]
        out[ns] = int(lines[1][lines[0].index("RetransSegs")])
    return out


def run_arm(home: Path, spec: Path, name: str, pace: dict | None, site_ns: dict[str, str]) -> dict:
    from dilococtl.store import Store
    from dilococtl.tune.history import rounds_against_model

    doc = tomlkit.parse(spec.read_text())
    doc["run"]["name"] = name
    doc["diloco"]["transport_link_pace_mbit"] = pace
    spec.write_text(tomlkit.dumps(doc))  # in place: the replay looks up the tune of this spec file and H
    before = retrans(list(site_ns.values()))
    summary = json.loads(dctl(home, "launch", str(spec), "--wait", "--force", "--yes", "--json"))
    after = retrans(list(site_ns.values()))
    with Store.open(home / "state.db") as store:
        replay = [g for g in rounds_against_model(store, store.get_run(summary["id"])) or [] if g["round"] > 1]
    ratios = [g["sync_s"] / g["predicted_s"] for g in replay]
    return {"name": name, "state": summary["state"], "h": summary["h"],
            "retrans": {s: after[ns] - before[ns] for s, ns in site_ns.items()},
            "ratios": [round(r, 3) for r in ratios], "median": round(statistics.median(ratios), 3),
            "within_10pct": sum(abs(r - 1) <= 0.10 for r in ratios), "rounds": len(ratios), "replay": replay}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--budget", type=float, default=0.3)
    ap.add_argument("--out", default="bench/results/link_pace_asym_3repeats.json")
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="dlt-linkpace-"))
    spec = home / "spec.toml"
    try:
        dctl(home, "lab", "up", "--sites", "3", "--rate", "50mbit", "--rtt", "80ms",
             *[x for link in LINKS for x in ("--link", link)], "--spec-out", str(spec), timeout=300)
        status = json.loads(dctl(home, "lab", "status", "--json"))
        site_ns = {n["site"]: n["netns"] for n in status["nodes"]}  # one node per site
        doc = tomlkit.parse(spec.read_text())
        doc["diloco"]["rounds"] = a.rounds
        doc["train"]["eval_every"] = 0
        spec.write_text(tomlkit.dumps(doc))
        log("tune-h")
        tuned = json.loads(dctl(home, "tune-h", str(spec), "--budget", str(a.budget), "--max-h", "1000000",
                                "--write", "--duration", "3", "--json"))
        log(f"H = {tuned['h']}, S = {tuned['streams']}, link pace {tuned['link_pace']}")
        arms = []
        for i in range(a.repeats):
            for arm, pace in (("paced", dict(tuned["link_pace"])), ("unpaced", {})):
                res = run_arm(home, spec, f"{arm}-{i}", pace, site_ns)
                res["arm"] = arm
                arms.append(res)
                log(f"{res['name']}: {res['within_10pct']}/{res['rounds']} rounds within 10% of the replay, "
                    f"median {res['median']}x, {res['ratios']}; retransmitted {res['retrans']}")
    finally:
        subprocess.run([sys.executable, "-m", "dilococtl", "lab", "down"], cwd=ROOT, capture_output=True,
                       env={**os.environ, "DILOCOCTL_HOME": str(home)}, timeout=300)
    for arm in ("paced", "unpaced"):
        rs = [r for r in arms if r["arm"] == arm]
        ratios = [x for r in rs for x in r["ratios"]]
        print(f"{arm}: {sum(r['within_10pct'] for r in rs)} of {len(ratios)} rounds within 10% of their replay "
              f"(median {statistics.median(ratios):.3f}x, max {max(ratios):.3f}x); segments retransmitted per run: "
              f"{[sum(r['retrans'].values()) for r in rs]}")
    if a.out:
        Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
                                           "code": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                                  capture_output=True, text=True).stdout.strip(),
                                           "tune": {k: tuned[k] for k in ("h", "streams", "link_pace")},
                                           "arms": arms}, indent=1) + "\n")


if __name__ == "__main__":
    main()

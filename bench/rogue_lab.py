"""The e2e rogue (tests/e2e/rogue_agent.py) against one transport, for the side-by-side in BENCHMARKS.md.

A 3-site lab (root); a 2-site run of site0 and site1 over `--transport`; the rogue in site2's namespace
with no certificate of the run, from round 2 on, for `--seconds` or until its crafted checkpoint
has run somewhere (the marker file appears). Prints what it got: quorums joined, checkpoint metadata,
HTTP answers, bytes back over TLS, requests for its pickle, whether the marker appeared.
tests/e2e/test_rogue_lab.py asserts the TLS side (with a kill and resume meanwhile); this shows the
gloo side, where the same rogue gets in.

    sudo .venv/bin/python bench/rogue_lab.py --transport gloo
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomlkit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from dilococtl import run_ca
    from dilococtl.spec import load_spec
    from tests.e2e.conftest import cli, dctl
    from tests.e2e.test_rogue_lab import listening_ports, node, records, until

    ap = argparse.ArgumentParser()
    ap.add_argument("--transport", choices=["tls", "gloo"], default="gloo")
    ap.add_argument("--seconds", type=float, default=90.0, help="longest the rogue is given")
    a = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="rogue-bench-"))
    spec = home / "spec.toml"
    dctl(home, "up", "--sites", "3", "--rate", "200mbit", "--rtt", "10ms", "--spec-out", str(spec), timeout=120)
    run_id = None
    try:
        doc = tomlkit.parse(spec.read_text())
        doc["run"]["name"] = "rogue-bench"
        doc["diloco"].update(rounds=80, h=30, transport=a.transport, sites=2)
        doc["sites"] = doc["sites"][:2]
        spec.write_text(tomlkit.dumps(doc))
        s0, s1, rogue = node(home, "site0-n0"), node(home, "site1-n0"), node(home, "site2-n0")
        r = cli(home, "launch", str(spec), "--json")
        assert r.returncode == 0, r.stderr
        run_id = json.loads(r.stdout)["id"]
        site1 = Path(doc["sites"][1]["work_dir"]) / "runs" / run_id / "site1" / "metrics.jsonl"
        until(lambda: len(records(site1, "round")) >= 2, 180, "site1 never finished round 2")
        targets = [[s0["address"], p] for p in listening_ports(s0["netns"])] + \
                  [[s1["address"], p] for p in listening_ports(s1["netns"])]
        foreign = run_ca.ensure(home / "foreign_ca", "foreign", ["site1"])["site1"]
        marker = home / "rogue-was-here"
        cfg = {"me": rogue["address"], "lighthouse": f"http://{s0['address']}:{load_spec(spec).run.lighthouse_port}",
               "targets": targets, "marker": str(marker), "out": str(home / "rogue.json"), "stop": str(home / "stop"),
               "foreign": {"cert": str(foreign.cert), "key": str(foreign.key)}, "max_s": a.seconds + 60}
        p = subprocess.Popen(["ip", "netns", "exec", rogue["netns"], sys.executable, "-m", "tests.e2e.rogue_agent",
                              json.dumps(cfg)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert p.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        while not marker.exists() and time.monotonic() - t0 < a.seconds:
            time.sleep(0.5)
        took = time.monotonic() - t0
        (home / "stop").touch()
        p.communicate(timeout=120)
        res = json.loads((home / "rogue.json").read_text())
        print(json.dumps({
            "transport": a.transport,
            "quorums_joined": f"{res['join']['joined']} of {res['join']['attempts']} attempts",
            "participants_seen": sorted(set(res["join"]["participants"])),
            "checkpoint_metadata": [m["answer"] for m in res["metadata"]],
            "http_answers": [f"{h['port']}: {h['status']}" for h in res["http"]],
            "tls_bytes_back": sum(t["app_bytes"] for t in res["tls"]),
            "pickle_requests": res["http_requests"],
            "marker": f"created {took:.1f} s after the rogue started" if marker.exists() else "never created",
        }, indent=1))
    finally:
        if run_id:
            cli(home, "stop", run_id, "--grace", "5", timeout=60)
        dctl(home, "down", check=False, timeout=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Issue 38, point 5: the bytes of a round over the whole sync time it pays, as a share of a window-limited
lab link, launched as the README's lab flow writes the spec (untuned), after `doctor --links`, and tuned.

    sudo .venv/bin/python bench/lab_wire.py [--rate 50mbit] [--rtt 80ms] [--tcp-buffer 128k] [--h 20]
        [--rounds 5] [--src HEAD|worktree] [--out bench/results/lab_wire.json]

Through the real CLI only: `lab up --sites 2 --rate R --rtt T --tcp-buffer B --spec-out SPEC` with the
small preset (10.8M parameters, int8-free fp32 payload of 43.3 MB: the transport issue's lab case), then in
one lab, one after another at the same H and rounds: (1) `launch` with nothing measured (the defaults: 4
streams, unpaced); (2) `doctor --links`, then `launch` of the same untuned spec (launch derives streams and
pacing from doctor's links); (3) `tune-h --write` (its streams and pacing), H set back, `launch`. A round's
share is its payload bytes over the sync seconds of the later-arriving site (whose sync is no straggler
wait: quorum, weight gather, payload, outer step), against the link rate; rounds after the first (which
opens the connections), median and range. `lab down` always runs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import tomlkit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab_modes import ROOT, Cli, edit_spec, finish, log, snapshot  # noqa: E402

sys.path.insert(0, str(ROOT))
from dilococtl.lab.model import parse_rate  # noqa: E402
from dilococtl.store import Store  # noqa: E402


def shares(home: Path, name: str, mbit: float) -> dict:
    """Per round after the first: the later site's link share over its sync and over its payload phase."""
    with Store.open(home / "state.db") as store:
        run = next(r for r in store.list_runs() if r.name == name)
        by_round: dict[int, list] = {}
        for r in store.rounds(run.id):
            by_round.setdefault(r.round, []).append(r)
        state = run.state
    rows = []
    for n, rs in sorted(by_round.items()):
        if n == 1 or len(rs) < 2 or any(r.exchange_t is None for r in rs):
            continue
        last = max(rs, key=lambda r: r.exchange_t)
        rows.append({"round": n, "site": last.site, "sync_s": last.sync_s, "payload_s": last.payload_s,
                     "quorum_s": last.quorum_s, "weight_s": last.weight_s, "bytes": last.bytes_sent,
                     "share": last.bytes_sent * 8 / last.sync_s / (mbit * 1e6),
                     "payload_share": last.bytes_sent * 8 / last.payload_s / (mbit * 1e6) if last.payload_s else None})
    s = [r["share"] for r in rows]
    return {"run_id": run.id, "state": state, "rounds": rows, "share_median": statistics.median(s) if s else None,
            "share_range": [min(s), max(s)] if s else None,
            "payload_share_median": statistics.median(r["payload_share"] for r in rows) if rows else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="50mbit", help="the inter-site link, each direction")
    ap.add_argument("--rtt", default="80ms", help="round trip between the sites")
    ap.add_argument("--tcp-buffer", default="128k", help="the nodes' TCP buffer cap (window-limited streams)")
    ap.add_argument("--h", type=int, default=20, help="inner steps per round of every arm")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of every arm")
    ap.add_argument("--src", default="HEAD", help="git revision the runs use, or 'worktree'")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lab_wire.json"), help="JSON ('' for none)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("error: `dilococtl lab up` needs root", file=sys.stderr)
        return 2
    if args.h < 1 or args.rounds < 2:
        print("error: --h must be >= 1 and --rounds >= 2 (the first round opens the connections)", file=sys.stderr)
        return 2
    mbit = parse_rate(args.rate) / 1e6
    command = (".venv/bin/python bench/lab_wire.py " + shlex.join(sys.argv[1:] if argv is None else argv)).rstrip()
    home = Path(tempfile.mkdtemp(prefix="lab-wire-"))
    src, commit, python = snapshot(args.src, home)
    cli = Cli(home, src)
    spec = home / "lab.toml"
    out: dict = {"benchmark": "lab_wire", "date": datetime.date.today().isoformat(), "command": command,
                 "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.system()}",
                 "link": {"rate": args.rate, "rtt": args.rtt, "tcp_buffer": args.tcp_buffer}, "h": args.h,
                 "rounds": args.rounds, "commit": commit, "arms": []}

    def arm(name: str, arm_spec: Path, how: str, predicted_sync_s: float | None = None) -> None:
        log(f"launch {name}")
        r = cli("launch", str(arm_spec), "--wait", "--yes", "--json", "--accept-new-host-keys", timeout=1800,
                check=False)
        derived = [line for line in r.stderr.splitlines() if "derived from the links" in line]
        got = {"arm": name, "how": how, "exit": r.returncode, "transport_line": derived[0] if derived else None,
               "predicted_sync_s": predicted_sync_s, **shares(home, name, mbit)}
        if predicted_sync_s and got["rounds"]:  # tune-h's exchange against the later site's, round by round
            got["sync_over_predicted"] = statistics.median(x["sync_s"] for x in got["rounds"]) / predicted_sync_s
        out["arms"].append(got)
        log(f"{name}: link share over the sync {got['share_median']}, payload phase {got['payload_share_median']}")

    try:
        log(f"lab up: 2 sites, {args.rate}, {args.rtt}, TCP buffers {args.tcp_buffer}")
        cli("lab", "up", "--sites", "2", "--rate", args.rate, "--rtt", args.rtt, "--tcp-buffer", args.tcp_buffer,
            "--spec-out", str(spec), timeout=300)
        edit_spec(spec, spec, {"model": {"preset": "small"}, "diloco": {"h": args.h, "rounds": args.rounds}})
        if python:  # the nodes share this filesystem: they run the snapshot through the wrapper
            doc = tomlkit.parse(spec.read_text())
            for site in doc["sites"]:
                site["python"] = python
            spec.write_text(tomlkit.dumps(doc))
        for name, how in [("untuned", "the lab's spec, nothing measured: 4 streams, unpaced"),
                          ("doctor", "the same spec after doctor --links: launch derives them"),
                          ("tuned", "tune-h --write's streams and pacing, H set back")]:
            arm_spec = home / f"{name}.toml"
            edit_spec(spec, arm_spec, {"run": {"name": f"wire-{name}"}})
            if name == "doctor":
                log("doctor --links")
                cli("doctor", str(arm_spec), "--links", "--accept-new-host-keys", timeout=600)
            predicted = None
            if name == "tuned":
                log("tune-h --write")
                tuned = cli.json("tune-h", str(arm_spec), "--budget", "0.1", "--duration", "3", "--write",
                                 "--accept-new-host-keys", timeout=900)
                predicted = tuned["choice"]["sync_s"]
                edit_spec(arm_spec, arm_spec, {"diloco": {"h": args.h, "rounds": args.rounds}})
            arm(f"wire-{name}", arm_spec, how, predicted)
    finally:
        log("lab down")
        cli("lab", "down", timeout=300, check=False)

    print(f"\n{args.rate} / {args.rtt}, TCP buffers {args.tcp_buffer}, small preset, H = {args.h}, rounds 2-{args.rounds}\n")
    print("| arm | transport | round bytes / later site's sync (median, range) | over its payload phase "
          "| sync / tune-h's |")
    print("| --- | --- | ---: | ---: | ---: |")
    for a in out["arms"]:
        rng = a["share_range"] or [float("nan")] * 2
        vs = f"{a['sync_over_predicted']:.2f}x" if a.get("sync_over_predicted") else ""
        print(f"| {a['arm']} | {a['how']} | {a['share_median']:.1%} ({rng[0]:.1%}-{rng[1]:.1%}) | "
              f"{a['payload_share_median']:.1%} | {vs} |")
    return finish(out, command, args.out)


if __name__ == "__main__":
    raise SystemExit(main())

"""WAN rates: on each site bridge in the core, an HTB that only classifies by source site, and one
tbf per (source site -> this site) that does the shaping. tbf changes in place (`lab shape`)."""

from __future__ import annotations

import json

from dilococtl.lab.model import LabSite, LabState
from dilococtl.lab.netns import run

TBF_LATENCY_MS = 50  # longest a packet may queue in a tbf: about half the BDP at 80 ms, enough for cubic
MIN_BURST_BYTES = 16 * 1024  # tbf bucket floor: several MTUs, so low rates still pass full frames
BURST_MS = 4  # bucket = this many ms of the rate, above the floor (timer slack at high rates)
PASS_RATE = "10gbit"  # HTB class rate where HTB only classifies and tbf shapes
DEFAULT_MINOR = 1  # class for traffic from no lab site (the operator's SSH): never shaped


def tbf_args(rate_bit: int) -> list[str]:
    """The tbf parameters for `rate_bit` (bits/s)."""
    burst = max(MIN_BURST_BYTES, rate_bit // 8 * BURST_MS // 1000)
    return ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]


def class_minor(src_index: int) -> str:
    return f"{src_index + 16:x}"  # tc reads class minors as hex


def tbf_handle(src_index: int) -> str:
    return f"{src_index + 16:x}:"


def _tc(state: LabState, args: list[str]) -> None:
    run(["tc", "-n", state.core_ns, *args])


def setup_site(state: LabState, dst: LabSite) -> None:
    """HTB + per-source tbf on `dst`'s bridge: traffic routed into site `dst` is shaped per source."""
    dev = dst.bridge
    _tc(state, ["qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", str(DEFAULT_MINOR)])
    _tc(state, ["class", "add", "dev", dev, "parent", "1:", "classid", f"1:{DEFAULT_MINOR}", "htb",
                "rate", PASS_RATE, "quantum", "60000"])
    _tc(state, ["qdisc", "add", "dev", dev, "parent", f"1:{DEFAULT_MINOR}", "pfifo", "limit", "10000"])
    for src in state.sites:
        if src is dst:
            continue
        minor = class_minor(src.index)
        shape = state.links[f"{src.name}>{dst.name}"]
        _tc(state, ["class", "add", "dev", dev, "parent", "1:", "classid", f"1:{minor}", "htb",
                    "rate", PASS_RATE, "quantum", "60000"])
        _tc(state, ["qdisc", "add", "dev", dev, "parent", f"1:{minor}", "handle", tbf_handle(src.index),
                    *tbf_args(shape.rate_bit)])
        _tc(state, ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                    "match", "ip", "src", src.subnet, "flowid", f"1:{minor}"])


def change(state: LabState, key: str) -> None:
    """Apply `state.links[key]`'s rate to its tbf in place (packets queued in it stay)."""
    src_name, dst_name = key.split(">")
    src, dst = state.site(src_name), state.site(dst_name)
    _tc(state, ["qdisc", "change", "dev", dst.bridge, "parent", f"1:{class_minor(src.index)}",
                "handle", tbf_handle(src.index), *tbf_args(state.links[key].rate_bit)])


def counters(state: LabState) -> dict[str, dict[str, int]]:
    """Per link "src>dst": bytes and packets its tbf sent, drops, and bytes queued now."""
    out: dict[str, dict[str, int]] = {}
    for dst in state.sites:
        r = run(["tc", "-n", state.core_ns, "-s", "-j", "qdisc", "show", "dev", dst.bridge], check=False)
        try:
            qdiscs = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else []
        except ValueError:
            continue
        for q in qdiscs:
            if q.get("kind") != "tbf":
                continue
            src_index = int(q["handle"].rstrip(":"), 16) - 16
            src = next((s for s in state.sites if s.index == src_index), None)
            if src is None:
                continue
            out[f"{src.name}>{dst.name}"] = {"bytes": q.get("bytes", 0), "packets": q.get("packets", 0),
                                              "drops": q.get("drops", 0), "backlog": q.get("backlog", 0)}
    return out

"""Loopback ports for tests, picked below the kernel's ephemeral range.

A port picked by binding port 0 comes from the ephemeral range, where any process's outgoing
connection may take it between the pick and the bind of whatever the test starts (a site's torchrun
failed with EADDRINUSE in CI under three xdist workers). Below that range only listeners bind, and
a random pick keeps parallel workers apart.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

PORT_BLOCK = 16  # a run binds base_port + k: lighthouse, relay, each site's rendezvous


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port(block: int = PORT_BLOCK, host: str = "127.0.0.1") -> int:
    """A port on `host` free with the `block` - 1 after it, below the kernel's ephemeral range."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    pick = random.SystemRandom()  # not the test's seeded random: every xdist worker would draw alike
    for _ in range(500):
        base = pick.randrange(10000, low - block)
        if all(_bindable(base + k, host) for k in range(block)):
            return base
    raise RuntimeError(f"no {block} free ports in a row on {host} below {low}")

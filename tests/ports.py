"""Loopback ports for tests, picked below the kernel's ephemeral range (dilococtl.ports.free_base).

A port picked by binding port 0 comes from the ephemeral range, where any process's outgoing
connection may take it between the pick and the bind of whatever the test starts (a site's torchrun
failed with EADDRINUSE in CI under three xdist workers).
"""

from __future__ import annotations

from dilococtl.ports import free_base

PORT_BLOCK = 16  # a run binds base_port + k: lighthouse, relay, each site's rendezvous


def free_port(block: int = PORT_BLOCK, host: str = "127.0.0.1") -> int:
    """A port on `host` free with the `block` - 1 after it."""
    return free_base(range(block), host)

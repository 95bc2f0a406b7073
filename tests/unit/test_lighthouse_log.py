"""What launch reads from the Lighthouse's log: its port and its door, whatever torchft's logger (the same
file) writes around them. CI, twice: a torchft timestamp glued before our lines hid the door, the relay
dialled the Lighthouse's port in its private namespace, and every quorum was refused for minutes."""

from __future__ import annotations

import pytest

from dilococtl import coordinators
from dilococtl.errors import DilocoError

OURS = "lighthouse door /tmp/lh-x/door.sock\nlighthouse listening on 127.0.0.1:32991\n"
TORCHFT = "2026-12-06T04:01:47.120 [INFO] [torchft::lighthouse] - Lighthouse listening on: http://vm:32991\n"


@pytest.mark.parametrize("log", [
    OURS,
    TORCHFT + OURS,
    "2026-12-06T04:01:47.123" + OURS + " [INFO] [torchft::lighthouse] - Lighthouse listening on: http://vm:32991\n",
    "lighthouse WARNING: no private network namespace (x)\n" + OURS,
])
def test_the_port_and_the_door_are_found_in_any_log(log):
    assert coordinators._LISTENING.search(log).group(1) == "32991"
    assert coordinators.relay_target(log, door=True) == "/tmp/lh-x/door.sock"
    assert coordinators.relay_target(log, door=False) is None  # started without one: the port


def test_torchfts_own_line_is_not_ours_and_a_missing_door_is_an_error():
    assert coordinators._LISTENING.search(TORCHFT) is None
    with pytest.raises(DilocoError, match="started with a door but its log names none"):
        coordinators.relay_target("lighthouse listening on 127.0.0.1:32991\n", door=True)


def test_the_relays_loopback_port_is_found_after_a_glued_timestamp():
    head = b"2026-12-06 04:01:47,1relay listening on 0.0.0.0:29511 for unix:/tmp/lh-x/door.sock as lh; local 127.0.0.1:40123\n"
    assert coordinators._RELAY_LOCAL.search(head).group(1) == b"40123"

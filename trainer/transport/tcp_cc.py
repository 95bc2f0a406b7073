"""The TCP congestion control of the TLS transport's streams, and of the probe that measures for them.

"auto" (the transport's default) means a loss-based algorithm: CUBIC, else Reno, which Linux lets
every process use. BBR, the default of many hosts, estimates the link from what a stream delivers;
an exchange's streams send a chunk and wait, and on BBR the rounds after the first steady one ran
1.2-1.6x tune-h's prediction where Reno's ran 0.85-1.04x and CUBIC's 0.85-1.12x, 17 of 21 within
10% (asymmetric 3-site lab; BENCHMARKS.md, "The TLS transport's model").
"""

from __future__ import annotations

import socket

AUTO = "auto"
LOSS_BASED = ("cubic", "reno")  # "auto" takes the first the kernel allows; Reno is never restricted


class Refused(OSError):
    """The kernel refused a named congestion control; the message says what to change."""


def current(sock: socket.socket) -> str | None:
    """The socket's congestion control (Linux), or None."""
    opt = getattr(socket, "TCP_CONGESTION", None)
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, opt, 16).split(b"\0", 1)[0].decode() if opt else None
    except OSError:
        return None


def apply(sock: socket.socket, name: str) -> str | None:
    """Set congestion control `name` on `sock` and return the one in effect.

    "" leaves the host's default; "auto" takes the first of LOSS_BASED this process may set (and
    keeps the default if none may be); a named algorithm the kernel refuses raises Refused.
    """
    opt = getattr(socket, "TCP_CONGESTION", None)
    if not name or opt is None:
        return current(sock)
    for cc in (LOSS_BASED if name == AUTO else (name,)):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, opt, cc.encode())
            return cc
        except OSError as e:
            if name != AUTO:
                raise Refused(f"TCP congestion control {name!r} refused ({e.strerror or e}); it must be in "
                              "net.ipv4.tcp_allowed_congestion_control (or run as root)") from None
    return current(sock)

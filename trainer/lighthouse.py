"""`python -m trainer.lighthouse --min_replicas N --bind HOST:PORT --join_timeout_ms MS`.

torchft's Lighthouse, run in-process so the control plane can start it through the node's
interpreter by absolute path (a console script may not be on a remote PATH). Stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import os

from trainer.signals import wait_for_stop


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.lighthouse")
    ap.add_argument("--min_replicas", type=int, required=True, help="sites needed to form a quorum")
    ap.add_argument("--bind", required=True, help="HOST:PORT to listen on")
    ap.add_argument("--join_timeout_ms", type=int, default=5000, help="wait this long for more sites")
    ap.add_argument("--heartbeat_timeout_ms", type=int, default=5000, help="a silent site is dropped after this")
    args = ap.parse_args(argv)

    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=args.bind, min_replicas=args.min_replicas,
                              join_timeout_ms=args.join_timeout_ms,
                              heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    # one write(2): under PYTHONUNBUFFERED print() writes the text and its newline apart, and torchft's
    # logger (the same file) can land between them, gluing its timestamp onto the port launch reads
    os.write(1, f"lighthouse listening on {server.address()}\n".encode())
    wait_for_stop()
    server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How the detached servers (Lighthouse, relay, outer service) wait to be stopped."""

from __future__ import annotations

import signal
import threading


def wait_for_stop() -> None:
    """Block the main thread until SIGTERM (dilococtl's stop) or SIGINT arrives."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()

"""`torchrun ... -m trainer --config FILE`: parse, check, train, exit with a code that tells.

Exit codes: 0 finished, 1 failed, 2 bad config or data (before any process group is formed),
143 preempted (SIGTERM; a checkpoint was saved).
"""

from __future__ import annotations

import argparse
import os
import sys


def die_with_torchrun() -> None:
    """Be killed when the torchrun agent dies.

    torchrun starts workers in their own sessions, so a SIGKILL to the agent's process group
    (a preemption, `dilococtl stop` escalating) would leave the workers running, orphaned.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() == 1:  # the agent died before the prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer", description="DiLoCo trainer (one site process)")
    ap.add_argument("--config", required=True, help="trainer TOML written by `dilococtl launch`")
    args = ap.parse_args(argv)
    die_with_torchrun()

    from trainer.data import DataError, load_tokens
    from trainer.rules import config as config_mod
    from trainer.rules.tables import ConfigError

    try:
        cfg = config_mod.load(args.config)
        load_tokens(cfg.data)  # a missing corpus fails here, before any process group
    except (ConfigError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from trainer.modes.loop import train

    try:
        return train(cfg)
    except Exception as e:
        if os.environ.get("DILOCOCTL_DEBUG"):
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())

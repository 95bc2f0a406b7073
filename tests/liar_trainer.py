"""A lying site, for bench/byzantine_lab.py: the real trainer, but the pseudo-gradient it sends is forged.

Run in place of `python -m trainer` on the liar's node only (`python -m tests.liar_trainer --config
FILE`, same arguments). Test-only on purpose: no production flag or config knob can make a site lie.
Everything else (quorum, compression, error feedback, the guard every site runs, the outer step,
metrics) is the trainer's own; only what `deltas_fn()` hands the exchange is replaced, after the
quorum and before encoding, so the liar's bytes go through the same codec as an honest site's.

The attack comes from the environment variable LIAR_ATTACK (read only here):
    flip3      -3 x the honest Δ (default): sign flipped and scaled, just under the norm screen's 3x
    sign_flip  -1 x the honest Δ: the same size as an honest contribution, pointing away
    x10        10 x the honest Δ: the right direction, too big
    scale:F    F x the honest Δ, any float F
"""

from __future__ import annotations

import os
import sys

ATTACK_ENV = "LIAR_ATTACK"
NAMED = {"flip3": -3.0, "sign_flip": -1.0, "x10": 10.0}


def attack_scale(name: str) -> float:
    """The factor an attack name applies to the honest pseudo-gradient; ValueError names a bad one."""
    if name in NAMED:
        return NAMED[name]
    if name.startswith("scale:"):
        try:
            return float(name.removeprefix("scale:"))
        except ValueError:
            pass
    raise ValueError(f"{ATTACK_ENV}={name!r}: expected one of {', '.join(NAMED)} or scale:FLOAT")


def install(scale: float) -> None:
    """Make trainer.modes.loop build lying versions of the sync and overlap exchanges."""
    from trainer.modes import loop
    from trainer.modes.ft_exchange import OverlapExchange, SyncExchange

    def forged(deltas_fn):
        return lambda: [scale * d for d in deltas_fn()]

    class LyingSync(SyncExchange):
        def exchange(self, deltas_fn, contribute):
            return super().exchange(forged(deltas_fn), contribute)

    class LyingOverlap(OverlapExchange):
        def exchange(self, deltas_fn, contribute):
            return super().exchange(forged(deltas_fn), contribute)

    honest_make = loop.make_exchange

    def make_exchange(run):
        ex = honest_make(run)
        lying = {SyncExchange: LyingSync, OverlapExchange: LyingOverlap}.get(type(ex))
        if lying is None:
            raise SystemExit(f"liar: no lying version of {type(ex).__name__} (sync and overlap modes only)")
        ex.close()
        return lying(run)

    loop.make_exchange = make_exchange  # train() looks it up at call time


def main() -> int:
    try:
        scale = attack_scale(os.environ.get(ATTACK_ENV, "flip3"))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"liar: sending {scale:g} x the honest pseudo-gradient", file=sys.stderr, flush=True)
    install(scale)
    from trainer.entry import main as trainer_main

    return trainer_main()


if __name__ == "__main__":
    raise SystemExit(main())

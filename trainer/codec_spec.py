"""Parse compression specs such as "int8", "topk:0.01+int8", "powersgd:16+int8" (no torch).

A spec is a chain of stages joined by "+": the first stage transforms the pseudo-gradient
(powersgd, topk), later stages quantize what the first one sends (int8, fp8).
"""

from __future__ import annotations

from dataclasses import dataclass

# stage name -> (takes an argument, argument type)
STAGES = {"int8": None, "fp8": None, "topk": float, "powersgd": int}
QUANTIZERS = ("int8", "fp8")


@dataclass(frozen=True, slots=True)
class Stage:
    name: str  # one of STAGES
    arg: float | int | None = None  # topk: kept fraction in (0, 1]; powersgd: rank >= 1


def parse_codec_spec(spec: str) -> list[Stage]:
    """Parse a codec chain; raises ValueError naming the bad stage. "none" gives []."""
    spec = spec.strip().lower()
    if spec in ("", "none"):
        return []
    stages: list[Stage] = []
    for part in spec.split("+"):
        name, _, arg = part.strip().partition(":")
        if name not in STAGES:
            raise ValueError(f"unknown codec {name!r} in {spec!r} (known: {', '.join(STAGES)})")
        kind = STAGES[name]
        if kind is None:
            if arg:
                raise ValueError(f"codec {name!r} takes no argument in {spec!r}")
            stages.append(Stage(name))
            continue
        try:
            value = kind(arg)
        except ValueError:
            raise ValueError(f"codec {name!r} needs a {kind.__name__} argument, e.g. {name}:"
                             f"{'0.01' if kind is float else '16'} (got {spec!r})") from None
        if name == "topk" and not 0 < value <= 1:
            raise ValueError(f"topk fraction must be in (0, 1], got {value}")
        if name == "powersgd" and value < 1:
            raise ValueError(f"powersgd rank must be >= 1, got {value}")
        stages.append(Stage(name, value))
    for i, st in enumerate(stages):
        if i > 0 and st.name not in QUANTIZERS:
            raise ValueError(f"{st.name!r} can only come first in {spec!r}; int8/fp8 may follow")
    if len(stages) > 2 or (len(stages) == 2 and stages[0].name in QUANTIZERS):
        raise ValueError(f"unsupported chain {spec!r}: use one stage, or powersgd/topk followed by int8/fp8")
    return stages

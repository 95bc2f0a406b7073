"""`dilococtl tune-h`: measure the links and the step time (measure.py), model the round and choose H
(choose.py, on model.py), record the tune in the store and, with --write, write H into the spec.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path

from dilococtl.errors import BadInput
from dilococtl.spec_types import RunSpec
from dilococtl.tune.choose import TuneResult, check_limits, plan
from dilococtl.tune.defaults import DEFAULT_BUDGET, DEFAULT_MAX_H
from dilococtl.tune.measure import ProbeSettings, Say, measure_links, measure_steps


def tune(spec: RunSpec, *, store, budget: float = DEFAULT_BUDGET, max_h: int = DEFAULT_MAX_H,
         settings: ProbeSettings | None = None, step_source: str = "auto", write: bool = False,
         accept_new: bool = False, say: Say = lambda m: None) -> TuneResult:
    """Measure, choose H, record the tune in the store, and (write=True, H within max_h) write H.

    Bad input and unreachable sites raise before anything is measured or written.
    """
    from dilococtl.errors import Unreachable
    from dilococtl.nodes import NodePool

    settings = settings or ProbeSettings()
    check_limits(budget, max_h)
    settings.check()
    if step_source not in ("auto", "bench", "records"):
        raise BadInput(f"--step-source: must be auto, bench or records, got {step_source!r}")
    with NodePool(spec.ssh, accept_new=accept_new) as pool:
        leaders = list(dict.fromkeys(s.hosts[0] for s in spec.sites))
        say(f"connecting to {len(leaders)} site leader(s)")
        for host, res in pool.map(lambda n: n.host, leaders).items():
            if isinstance(res, Unreachable):
                site = next(s.name for s in spec.sites if s.hosts[0] == host)
                raise Unreachable(f"site {site}: {res}")
            if isinstance(res, Exception):
                raise res
        links = measure_links(spec, pool, settings, say)
        steps = measure_steps(spec, pool, source=step_source, store=store, say=say)
    res = plan(spec, links, steps, budget=budget, max_h=max_h)
    if write and res.choice.within_max:
        write_h(spec.path, res.choice.h, res.streams if res.streams_derived else None,
                res.link_pace if res.pace_derived else None)
        res.written = True
    t = store.add_tune(spec_path=res.spec_path, links=[dataclasses.asdict(x) for x in links],
                       step_s=res.choice.step_s, payload_bytes=res.payload_bytes, h=res.choice.h, budget=budget,
                       prediction=res.prediction())
    res.tune_id = t.id
    return res




# --- spec writing and the self-check -------------------------------------------------------------

def write_h(path: str | Path, h: int, streams: int | None = None, link_pace: dict[str, float] | None = None) -> None:
    """Set diloco.h (and diloco.transport_streams, diloco.transport_link_pace_mbit when given) in the spec
    file, keeping its comments and layout (tomlkit); atomic."""
    import tomlkit

    from dilococtl.spec import spec_from_dict

    p = Path(path)
    doc = tomlkit.parse(p.read_text())
    if "diloco" not in doc:
        doc["diloco"] = tomlkit.table()
    doc["diloco"]["h"] = int(h)
    if streams is not None:
        doc["diloco"]["transport_streams"] = int(streams)
    if link_pace is not None:
        doc["diloco"]["transport_link_pace_mbit"] = {k: float(v) for k, v in link_pace.items()}
    text = tomlkit.dumps(doc)
    spec_from_dict(tomllib.loads(text), str(p))  # never leave an invalid spec behind
    tmp = p.with_name(p.name + ".tune-h.tmp")
    tmp.write_text(text)
    os.replace(tmp, p)

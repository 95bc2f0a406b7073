"""What a run spec would run, and what to know about it: the summary `spec check` prints (sites, nodes,
processes, model size, tokens per round), notes on valid settings that measured worse than an
alternative, and whether the sites' checkpoint uploads cross the WAN links of the exchange.
"""

from __future__ import annotations

from typing import Any

from dilococtl.spec_sites import lighthouse_url, nproc_per_node, site_nodes, site_stores
from dilococtl.spec_types import RunSpec
from trainer.rules.model_config import param_count


def summary(spec: RunSpec) -> dict[str, Any]:
    """What the spec would run: sites, nodes, processes, model size, tokens per round.

    Data-parallel replicas per site = processes / (tp * pp); each takes data.batch_size sequences
    of data.seq_len tokens per inner step, so a round trains sum(replicas) * batch * seq * h tokens.
    """
    sites = []
    for s in spec.sites:
        nproc = nproc_per_node(s)
        procs = site_nodes(s) * nproc
        sites.append({"name": s.name, "hosts": list(s.hosts), "nodes": site_nodes(s), "gpus_per_node": s.gpus_per_node,
                      "nproc_per_node": nproc, "processes": procs, "tp": s.tp, "pp": s.pp,
                      "dp_shard": s.dp_shard, "dp": procs // (s.tp * s.pp), "scheduler": s.scheduler, "login": s.login})
    tokens_per_step = sum(s["dp"] for s in sites) * spec.data.batch_size * spec.data.seq_len
    per_round = tokens_per_step * spec.diloco.h
    return {
        "path": spec.path,
        "name": spec.run.name,
        "sites": sites,
        "nodes": sum(s["nodes"] for s in sites),
        "processes": sum(s["processes"] for s in sites),
        "preset": spec.model.preset,
        "params": param_count(spec.model),
        "h": spec.diloco.h,
        "rounds": spec.diloco.rounds,
        "algorithm": spec.diloco.algorithm,
        "mode": spec.diloco.mode,
        "compression": spec.diloco.compression,
        "tokens_per_round": per_round,
        "tokens_total": per_round * spec.diloco.rounds,
        "lighthouse": lighthouse_url(spec),
        "data": spec.data.source,
        "notes": notes(spec),
    }


def notes(spec: RunSpec) -> list[str]:
    """Valid settings that measured worse than an alternative: one line each, with the fix."""
    from trainer.rules.codec_spec import codec_max_h, parse_codec_spec  # no torch
    from trainer.rules.outer_rule import outer_hparams  # no torch

    d = spec.diloco
    out = []
    stages = parse_codec_spec(d.compression)  # valid: load_spec checked it
    momentum = outer_hparams(d)[1]  # unset: the default rule's
    if stages and stages[0].name in ("topk", "sparse") and d.algorithm == "diloco" and d.error_feedback \
            and (momentum > 0 or d.error_feedback_decay < 0.9):
        codec = "top-k" if stages[0].name == "topk" else "the sparse codec"
        out.append(f"diloco: {codec} did best with outer_momentum = 0, outer_lr = 1.0, error_feedback_decay = "
                   f"0.95 (BENCHMARKS.md, compression); this spec has outer_momentum = {momentum:g}, "
                   f"error_feedback_decay = {d.error_feedback_decay:g}")
    cap = codec_max_h(d.compression)
    longest = d.h_max if d.h_auto else d.h
    if cap is not None and d.algorithm == "diloco" and longest > cap:
        knob = "h_max" if d.h_auto else "h"
        out.append(f"diloco: {knob} = {longest} is past {cap}, the most the sparse codec keeps its quality at (it sends "
                   f"a few values a round and its residual holds the rest: simulator, tiny, H 1000 ended at 60.6 ppl "
                   f"where 100 ended 4.9; BENCHMARKS.md); keep H <= {cap}, with mode = \"overlap\" on a slow link")
    k, majority = len(spec.sites), len(spec.sites) // 2 + 1
    if k >= 3 and d.mode != "async" and d.min_sites < majority:
        out.append(f"diloco: min_sites = {d.min_sites} of {k} sites lets a straggler or a cut-off site form a quorum "
                   f"of its own and commit a round the others also commit: the sites then hold different θ for good "
                   f"(3 sites, min_sites 1, one site 6x slower: it ended on its own θ); min_sites = {majority} keeps "
                   f"one quorum and still trains through the loss of {k - majority}")
    if note := store_note(spec):
        out.append(note)
    return out


# Checkpoint uploads across the WAN (issue 35).
# Whether a run's checkpoint uploads share the WAN links with the exchange (tune-h and the plan say so).
# A site's own `[[sites]] checkpoint_store` is taken to be in its region (that is what the field is for):
# its uploads stay on the site's network. Every other store a site uploads to is not: a replica is by
# definition another site's own store, and a store several sites name (the run-wide `[checkpoint] store`
# among them) is in at most one of their regions. Uploads to those cross links the exchange also uses,
# and a round-boundary upload then competes with the round's exchange for the link.


def crossing(spec: RunSpec) -> dict[str, list[str]]:
    """site -> the stores it uploads to outside its region ({} when every upload stays in its region)."""
    if len(spec.sites) < 2:
        return {}
    own = {i: s.checkpoint_store or spec.checkpoint.store for i, s in enumerate(spec.sites)}
    named_by = {u: sum(1 for v in own.values() if v == u) for u in own.values()}
    out: dict[str, list[str]] = {}
    for i, site in enumerate(spec.sites):
        stores = site_stores(spec, i)
        far = list(stores["replica_stores"])
        if stores["store"] and (not site.checkpoint_store or named_by[stores["store"]] > 1):
            far.insert(0, stores["store"])
        if far:
            out[site.name] = far
    return out


def store_note(spec: RunSpec) -> str | None:
    """One line when some site's checkpoint uploads cross the WAN links of the exchange, else None."""
    far = crossing(spec)
    if not far:
        return None
    who = ", ".join(f"{site} ({len(urls)} store{'s' if len(urls) > 1 else ''})" for site, urls in far.items())
    return (f"checkpoint: uploads share the WAN links with the exchange: {who} upload outside their region "
            f"(replicas, or a store several sites share); tune-h's H does not count that traffic")

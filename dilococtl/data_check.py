"""doctor's data check: on every node, the shards exist, meta.json is the same everywhere (by hash),
and each process's share of the training tokens covers the planned steps (or says how many epochs
they read)."""

from __future__ import annotations

import json
import posixpath
import shlex
from dataclasses import dataclass
from typing import Any

MAX_EPOCHS = 1.0  # the planned steps may read a process's share of the data this many times before a warning

# Runs on the node with its interpreter; plain Python (no numpy, no torch): fast on a cold node.
_PROBE = r"""
import hashlib, json, os, sys
p = sys.argv[1]
out = {"exists": os.path.isdir(p)}
if out["exists"]:
    try:
        raw = open(os.path.join(p, "meta.json"), "rb").read()
        out["meta_sha256"] = hashlib.sha256(raw).hexdigest()
        meta = json.loads(raw)
        out["vocab_size"] = meta.get("vocab_size")
        size = {"uint16": 2, "uint32": 4}.get(meta.get("dtype"))
        if size is None:
            raise ValueError("dtype must be uint16 or uint32, got %r" % (meta.get("dtype"),))
        for split in ("train", "val"):
            n, missing = 0, []
            for name in meta.get(split) or []:
                try:
                    n += os.path.getsize(os.path.join(p, name)) // size
                except OSError:
                    missing.append(name)
            out[split + "_tokens"], out[split + "_missing"] = n, missing[:3] + (["..."] if len(missing) > 3 else [])
        tok = meta.get("tokenizer")
        if isinstance(tok, dict) and tok.get("file"):
            f = os.path.join(p, tok["file"])
            out["tokenizer"] = tok["file"]
            if not os.path.isfile(f):
                out["tokenizer_error"] = "missing"
            elif tok.get("sha256") and hashlib.sha256(open(f, "rb").read()).hexdigest() != tok["sha256"]:
                out["tokenizer_error"] = "sha256 differs from meta.json's"
    except Exception as e:
        out["meta_error"] = (type(e).__name__ + ": " + str(e)).splitlines()[0][:200]
print("DATA " + json.dumps(out))
"""


@dataclass(kw_only=True, slots=True)
class Plan:
    """What one site's run will read."""

    path: str  # data.path
    sites: int  # partitions of the training tokens
    dp: int  # data-parallel processes of the site: each reads 1/dp of the site's partition
    steps: int  # inner steps per process (TrainerConfig.total_steps)
    batch_size: int
    seq_len: int
    vocab_size: int  # the model's


def plan_for(spec, site_index: int) -> Plan | None:
    """The data plan of a site, or None when the run reads the bundled corpus."""
    from dilococtl.spec_sites import nproc_per_node, site_nodes, site_run_dir, trainer_config

    s = spec.sites[site_index]
    cfg = trainer_config(spec, site_index, "doctor", site_run_dir(spec, site_index, "doctor"))
    if cfg.data.source != "shards":
        return None
    procs = nproc_per_node(s) * site_nodes(s)
    par = cfg.parallel
    return Plan(path=cfg.data.path, sites=len(spec.sites), dp=max(1, procs // (par.tp * par.pp)), steps=cfg.total_steps,
                batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, vocab_size=cfg.model.vocab_size)


def probe_command(python: str, path: str) -> str:
    return " ".join([shlex.quote(python), "-c", shlex.quote(_PROBE), shlex.quote(path)])


def parse_probe(stdout: str) -> dict[str, Any] | None:
    line = next((x for x in stdout.splitlines() if x.startswith("DATA ")), None)
    return json.loads(line.removeprefix("DATA ")) if line else None


def judge(plan: Plan, host: str, probe: dict[str, Any], reference: tuple[str, str] | None) -> tuple[str, str, str]:
    """(status, detail, short) of one node's data; `reference` is (host, meta sha256) of the first node seen."""
    p = plan.path
    if not posixpath.isabs(p):
        return "fail", f"data.path {p!r} must be absolute (the trainer runs inside its run directory)", "relative"
    if not probe.get("exists"):
        return "fail", f"data.path {p} does not exist on {host}", "missing"
    if "meta_error" in probe:
        return "fail", f"{p}/meta.json on {host}: {probe['meta_error']}", "bad meta"
    missing = probe.get("train_missing", []) + probe.get("val_missing", [])
    if missing:
        return "fail", f"{p} on {host} lacks shard(s) {', '.join(missing)} that meta.json lists", "shards missing"
    sha = probe["meta_sha256"]
    if reference is not None and reference[1] != sha:
        return ("fail", f"{p}/meta.json on {host} differs from {reference[0]}'s (sha256 {sha[:12]} vs "
                f"{reference[1][:12]}): every node must read the same data", "differs")
    vocab = probe.get("vocab_size")
    if isinstance(vocab, int) and vocab > plan.vocab_size:
        return "fail", f"the data's vocab_size {vocab} exceeds model.vocab_size {plan.vocab_size}", "vocab"
    if probe.get("tokenizer_error"):
        return ("fail", f"{p}/{probe['tokenizer']} on {host} (the tokenizer meta.json names): {probe['tokenizer_error']}",
                "tokenizer")
    if probe.get("val_tokens", 0) and probe["val_tokens"] < plan.seq_len + 1:
        return ("fail", f"data.seq_len {plan.seq_len}: the validation split of {p} has {probe['val_tokens']} tokens, "
                f"fewer than seq_len + 1", "val short")
    windows = probe["train_tokens"] // plan.sites // plan.dp // (plan.seq_len + 1)
    need = plan.steps * plan.batch_size
    if windows < plan.batch_size:
        return ("fail", f"data.seq_len/data.batch_size: {probe['train_tokens']:,} train tokens give each of {plan.sites} site(s) x {plan.dp} "
                f"process(es) {windows} sequences of {plan.seq_len + 1}, fewer than a batch of {plan.batch_size}",
                "too few")
    epochs = need / windows
    detail = (f"{probe['train_tokens']:,} train tokens (meta {sha[:12]}); {plan.steps} steps read {epochs:.2f} "
              f"epoch(s) of each process's share")
    if epochs > MAX_EPOCHS:
        return "warn", detail + f", more than {MAX_EPOCHS:g}: the data repeats", f"{epochs:.1f} ep"
    return "ok", detail, f"{epochs:.2f} ep"


def check_data(spec, pool, reports: dict, check_cls) -> None:
    """Add a `data` check to every reachable node of a site that reads token shards."""
    reference: tuple[str, str] | None = None
    for i, s in enumerate(spec.sites):
        try:
            plan = plan_for(spec, i)
        except Exception as e:  # a config the trainer would refuse: say so on the site's nodes
            for h in s.hosts:
                reports[(s.name, h)].checks.append(check_cls(name="data", status="fail", detail=str(e)))
            continue
        if plan is None:
            continue
        for h in s.hosts:
            rep = reports[(s.name, h)]
            if not rep.reachable or not rep.python:
                continue
            try:
                r = pool.get(h).run(probe_command(rep.python, plan.path), timeout=60)
                probe = parse_probe(r.stdout)
            except Exception as e:  # one node's failure is its own check; doctor goes on
                probe, r = None, None
                why = str(e)
            if probe is None:
                why = why if r is None else (r.stderr.strip().splitlines() or [f"exit {r.rc}"])[-1][:200]
                rep.checks.append(check_cls(name="data", status="fail", detail=f"data probe failed on {h}: {why}"))
                continue
            status, detail, short = judge(plan, h, probe, reference)
            if reference is None and "meta_sha256" in probe:
                reference = (h, probe["meta_sha256"])
            rep.checks.append(check_cls(name="data", status=status, detail=detail, short=short))


def check_local(spec) -> list[str]:
    """Before a launch and in `spec check`: the data checks of every site whose hosts are all this
    machine, run here with this interpreter (the same probe and judge doctor uses on a node).
    Returns the warnings; raises BadInput with doctor's one line at the first failure."""
    import subprocess
    import sys

    from dilococtl.errors import BadInput
    from dilococtl.spec_sites import is_local

    warnings: list[str] = []
    seen: dict[str, tuple[str, str, str]] = {}  # path -> judged (status, detail, short): sites often share one
    for i, s in enumerate(spec.sites):
        if not s.hosts or not all(is_local(h) for h in s.hosts):
            continue  # a remote node's files (a Slurm site's too: no hosts) are doctor's to check
        plan = plan_for(spec, i)  # a config the trainer would refuse raises its own one line
        if plan is None:
            continue
        key = f"{plan.path}\0{plan.vocab_size}\0{plan.seq_len}\0{plan.batch_size}\0{plan.steps}\0{plan.dp}"
        if key not in seen:
            r = subprocess.run([sys.executable, "-c", _PROBE, plan.path], capture_output=True, text=True, timeout=60)
            probe = parse_probe(r.stdout)
            if probe is None:
                why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][:200]
                raise BadInput(f"data.path {plan.path}: the data check failed: {why}")
            seen[key] = judge(plan, "this machine", probe, None)
        status, detail, _ = seen[key]
        if status == "fail":
            raise BadInput(f"site {s.name}: {detail}")
        if status == "warn":
            warnings.append(f"site {s.name}: {detail}")
    return list(dict.fromkeys(warnings))

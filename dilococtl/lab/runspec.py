"""`lab up --spec-out`: a run spec that trains the tiny preset across the lab's sites."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dilococtl import paths
from dilococtl.lab import sshd
from dilococtl.lab.model import LabState


def spec_dict(state: LabState, *, key: Path, known_hosts: Path, work_root: Path) -> dict[str, Any]:
    """The run spec's tables. Nodes share this host's filesystem: they reuse `state.python` (and
    its torch) as it is, so no venv is asked for and provisioning installs no torch."""
    slowest = min(s.rate_bit for s in state.links.values()) if state.links else 10**9
    return {
        "run": {"name": f"lab-{state.id}", "lighthouse": state.nodes[0].address},
        "model": {"preset": "tiny"},
        "data": {"seq_len": 64, "batch_size": 4, "val_plays": 2},
        "train": {"warmup_steps": 2, "threads": 1, "eval_batches": 2, "device": "cpu"},
        # h is a placeholder for `tune-h --write`, which measures the links and writes H (and the
        # streams); 10 rounds: fewer average too seldom (tune-h's note), and round 1's connection
        # setup is then a small part of each site's efficiency
        "diloco": {"h": 5, "rounds": 10, "sites": len(state.sites), "min_sites": 1,
                   "link_mbit": round(slowest / 1e6, 3)},
        "checkpoint": {"every_rounds": 1, "keep": 2},
        "ssh": {"user": "root", "port": 22, "identity_file": str(key), "known_hosts": str(known_hosts),
                "connect_timeout_s": 5.0},
        "sites": [{"name": s.name, "hosts": [n.address for n in state.nodes_of(s.name)],
                   "python": state.python, "work_dir": str(work_root / s.name)} for s in state.sites],
    }


def write_spec(state: LabState, path: Path) -> None:
    import tomlkit

    doc = spec_dict(state, key=sshd.client_key(), known_hosts=paths.known_hosts_path(),
                    work_root=paths.home() / "lab-work" / state.id)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# written by `dilococtl lab up` for lab {state.id}; valid until `dilococtl lab down`\n"
              f"# `dilococtl tune-h {path.name} --write` measures the links and writes diloco.h\n")
    path.write_text(header + tomlkit.dumps(doc))

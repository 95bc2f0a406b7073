"""Run trainer sites as real torchrun jobs on loopback, with an in-process torchft Lighthouse."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.ports import free_port
from trainer.rules import config as config_mod


def tiny_config(run_dir: Path, site_index: int, sites: int = 2, **over) -> config_mod.TrainerConfig:
    """A tiny, fast config; `over` maps "section.key" to a value."""
    data: dict = {
        "model": {"preset": "tiny"},
        "data": {"seq_len": 32, "batch_size": 4},
        "train": {"lr": 3e-3, "warmup_steps": 2, "eval_batches": 2, "threads": 1},
        # gloo named explicitly: these sites have no identity, and "auto" never falls back to it
        "diloco": {"h": 4, "rounds": 3, "sites": sites, "min_sites": 1, "link_mbit": 1000.0, "transport": "gloo"},
        "checkpoint": {"every_rounds": 1, "async_save": False},
        "run": {"run_id": "t", "run_dir": str(run_dir), "site": f"site{site_index}", "site_index": site_index},
    }
    for key, value in over.items():
        section, name = key.split(".")
        data.setdefault(section, {})[name] = value
    return config_mod.from_dict(data)


def start_site(cfg: config_mod.TrainerConfig, lighthouse: str, log: Path, nproc: int = 1) -> subprocess.Popen:
    """torchrun with `nproc` processes for one site; its output goes to `log`."""
    site_dir = Path(cfg.run.run_dir) / cfg.run.site
    site_dir.mkdir(parents=True, exist_ok=True)
    path = site_dir / "config.toml"
    path.write_text(config_mod.dump_toml(cfg))
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse, OMP_NUM_THREADS="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", "--master_addr=127.0.0.1", "-m", "trainer", "--config", str(path)]
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)

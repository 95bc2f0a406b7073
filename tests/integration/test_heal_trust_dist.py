"""Issue 34, finding 2 across real processes: three torchrun sites over the TLS transport, one of which lies
in its heal state (θ = 1e30) and claims step 1e9, so torchft's quorum makes it the heal source of the
other two. They refuse it (an event naming it), install nothing, keep refusing it, and finish the run.

The liar is this module run as a trainer (`-m tests.integration.test_heal_trust_dist`): the real trainer
with SiteRun subclassed, never a production flag.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dilococtl import run_ca
from tests.integration.dist_helpers import tiny_config
from tests.integration.test_trainer_dist import final_params, records, wait_all
from tests.ports import free_port
from trainer.rules import config as config_mod

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LIE_STEP = 10**9


def _liar_main(argv: list[str]) -> int:
    """The trainer, except that the site claims step 1e9 and offers θ = 1e30 to whoever heals from it."""
    from trainer.modes import loop

    class LiarRun(loop.SiteRun):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.manager.load_state_dict({"step": LIE_STEP, "batches_committed": 0})

        def _ft_state(self) -> dict:
            sd = super()._ft_state()
            if self.rank == 1 or os.environ.get("LIE") != "split":
                sd["outer"] = {**sd["outer"], "params": [torch.full_like(p, 1e30) for p in sd["outer"]["params"]]}
            else:  # "split": rank 0 gets a plausible state one round ahead, which alone would pass screening
                sd = {**sd, "round": sd["round"] + 1, "step": sd["step"] + sd["h"]}
            return sd

    loop.SiteRun = LiarRun
    from trainer.entry import main

    return main(argv)


def _start(cfg: config_mod.TrainerConfig, lighthouse: str, log: Path, liar: bool, nproc: int = 1,
           lie: str = "theta") -> subprocess.Popen:
    site_dir = Path(cfg.run.run_dir) / cfg.run.site
    site_dir.mkdir(parents=True, exist_ok=True)
    path = site_dir / "config.toml"
    path.write_text(config_mod.dump_toml(cfg))
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), LIE=lie)
    module = "tests.integration.test_heal_trust_dist" if liar else "trainer"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", "--master_addr=127.0.0.1", "-m", module, "--config", str(path)]
    return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


SITES = ["site0", "site1", "site2"]


def _three_tls_sites(tmp_path):
    """Configs of 3 sites over the TLS transport under one run CA, 2 rounds, no checkpoints."""
    ids = run_ca.ensure(tmp_path / "ca", "t", SITES)
    return [tiny_config(tmp_path, i, sites=3, **{
        "diloco.transport": "tls", "diloco.transport_streams": 1, "diloco.min_sites": 3, "diloco.rounds": 2,
        "run.tls_ca": str(ids[n].ca), "run.tls_cert": str(ids[n].cert), "run.tls_key": str(ids[n].key),
        "run.transport_host": "127.0.0.1", "checkpoint.every_rounds": 0}) for i, n in enumerate(SITES)]


def test_a_site_claiming_step_1e9_with_theta_1e30_is_refused_as_heal_source(tmp_path):
    from torchft.coordination import LighthouseServer

    cfgs = _three_tls_sites(tmp_path)
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=3, join_timeout_ms=1000)
    procs: list[subprocess.Popen] = []
    try:
        procs = [_start(c, lh.address(), tmp_path / f"{c.run.site}.log", liar=c.run.site == "site2") for c in cfgs]
        codes = wait_all(procs, 240)
    finally:
        for p in procs:  # a site left waiting for a crashed peer must not outlive the test
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        lh.shutdown()
    logs = {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in SITES}
    assert codes == [0, 0, 0], logs
    for site in ("site0", "site1"):
        events = records(tmp_path, site, "event")
        refused = [e for e in events if e.event == "rejected" and e.detail.get("heal")]
        assert refused and all(e.detail["site_rejected"] == "site2" for e in refused), [e.message for e in events]
        assert "θ is" in refused[0].detail["reason"] and "x ||θ|| from this site's own" in refused[0].detail["reason"]
        assert all("refused before" in e.detail["reason"] for e in refused[1:])  # excluded as a source from then on
        assert not any(e.event == "heal" for e in events)  # nothing was installed
        rounds = records(tmp_path, site, "round")
        assert [r.round for r in rounds] == [1, 2] and all(r.committed for r in rounds), rounds
    honest = [final_params(tmp_path, s) for s in ("site0", "site1")]
    for x, y in zip(*honest, strict=True):
        assert torch.equal(x, y) and bool(torch.isfinite(x).all()) and float(x.abs().max()) < 100
    assert math.isfinite(records(tmp_path, "site0", "round")[-1].val_ppl)


def test_a_source_that_fools_one_rank_of_a_site_is_refused_by_every_rank(tmp_path):
    """Two processes per site: the liar sends rank 1 θ = 1e30 and rank 0 a plausible state a round ahead.
    Rank 0 alone would install it (the site's ranks would then disagree on θ and the round); the ranks
    agree first, so neither installs anything."""
    from torchft.coordination import LighthouseServer

    cfgs = _three_tls_sites(tmp_path)
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=3, join_timeout_ms=1000)
    procs: list[subprocess.Popen] = []
    try:
        procs = [_start(c, lh.address(), tmp_path / f"{c.run.site}.log", liar=c.run.site == "site2", nproc=2,
                        lie="split") for c in cfgs]
        codes = wait_all(procs, 240)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        lh.shutdown()
    assert codes == [0, 0, 0], {n: (tmp_path / f"{n}.log").read_text()[-3000:] for n in SITES}
    for site in ("site0", "site1"):
        events = records(tmp_path, site, "event")
        refused = [e for e in events if e.event == "rejected" and e.detail.get("heal")]
        assert refused and refused[0].detail["reason"] == "another rank of this site refused its heal state", \
            [e.message for e in events]
        assert not any(e.event == "heal" for e in events)
        assert [r.round for r in records(tmp_path, site, "round")] == [1, 2]
    for x, y in zip(final_params(tmp_path, "site0"), final_params(tmp_path, "site1"), strict=True):
        assert torch.equal(x, y) and bool(torch.isfinite(x).all())


if __name__ == "__main__":
    raise SystemExit(_liar_main(sys.argv[1:]))

"""`dilococtl export` merges a site's TP, FSDP and pipeline shards: the export equals the whole model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_parallel import _cfg, _corpus, _full, _init, _run, _site_state
from trainer.rules import config as config_mod

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers", reason="the export extra: pip install 'dilococtl[export]'")

LAYOUTS = {"tp2": {"tp": 2}, "fsdp2": {"dp_shard": 2}, "pp2": {"pp": 2, "microbatches": 2, "pp_schedule": "gpipe"}}


def _save_layouts(rank: int, world: int, port: int, cfgs: dict, roots: dict) -> dict:
    """Train each 2-process layout a few steps, save its DCP checkpoint, return its whole model."""
    import os

    from trainer.checkpoints.checkpoint import Checkpointer
    from trainer.outer.optimizer import OuterState
    from trainer.site import SiteTrainer

    _init(rank, world, port)
    os.environ["RANK"] = str(rank)
    out = {}
    for name, cfg in cfgs.items():
        site = SiteTrainer(cfg, _corpus(cfg), 0, torch.device("cpu"), shard=rank, shards=world)
        hook = site.grad_hook()
        for _ in range(3):
            site.inner_step(hook)
        Checkpointer(Path(roots[name]), async_save=False).save(4, _site_state(site, OuterState(site.params, cfg.diloco)))
        out[name] = {n: _full(p) for n, p in site.model.named_parameters()}  # with pp: this stage's only
    return out


def test_export_of_sharded_checkpoints_equals_the_whole_model(tmp_path):
    from dilococtl.export import export
    from trainer.model import Transformer

    cfgs = {name: _cfg(tmp_path, par) for name, par in LAYOUTS.items()}
    sites = {name: tmp_path / name / "site0" for name in LAYOUTS}
    for name, d in sites.items():
        d.mkdir(parents=True)
        (d / "config.toml").write_text(config_mod.dump_toml(cfgs[name]))
    res = _run(tmp_path, 2, _save_layouts, cfgs, {n: str(d / "checkpoints") for n, d in sites.items()})
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    for name, d in sites.items():
        whole = {**res[0][name], **res[1][name]}  # pp: the two stages' parameters; else equal copies
        r = export(str(d), tmp_path / f"hf-{name}")
        assert r.round == 4 and r.parameters == sum(t.numel() for t in whole.values())
        ours = Transformer(cfgs[name].model)
        ours.load_state_dict(whole)
        hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / f"hf-{name}", torch_dtype=torch.float32).eval()
        with torch.no_grad():
            diff = (hf(input_ids=x).logits - ours.eval()(x)).abs().max().item()
        assert diff <= 1e-4, (name, diff)

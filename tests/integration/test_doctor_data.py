"""doctor's data check on real nodes (local ones): the probe runs with each node's interpreter."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dilococtl.doctor import run_doctor
from dilococtl.spec_types import RunSection, RunSpec, SiteSection
from trainer.data import write_shards
from trainer.rules.config import DataConfig, TrainConfig
from trainer.rules.diloco_config import DilocoConfig
from trainer.rules.model_config import ModelConfig

pytestmark = pytest.mark.slow


def _spec(tmp_path, data_path: str, steps: int) -> RunSpec:
    sites = [SiteSection(name=n, hosts=["local"], work_dir=str(tmp_path / n)) for n in ("a", "b")]
    spec = RunSpec(path=str(tmp_path / "spec.toml"), run=RunSection(name="t", lighthouse_port=0, base_port=0),
                   sites=sites)
    spec.data = DataConfig(source="shards", path=data_path, seq_len=31, batch_size=4)
    spec.model = ModelConfig(preset="tiny", vocab_size=1000)
    spec.train = TrainConfig(steps=steps)
    spec.diloco = dataclasses.replace(DilocoConfig(), h=10, rounds=1)
    return spec


def test_doctor_reports_the_data_of_every_node(tmp_path):
    shards = write_shards(np.arange(2 * 32 * 40) % 1000, np.arange(100) % 1000, tmp_path / "shards", 1000,
                          shard_tokens=500)
    rep = run_doctor(_spec(tmp_path, str(shards), steps=5))
    data = [c for n in rep.nodes for c in n.checks if c.name == "data"]
    # each site: 2560 / 2 = 1280 tokens = 40 sequences of 32; 5 steps x 4 = 20: half an epoch
    assert [(c.status, c.short) for c in data] == [("ok", "0.50 ep"), ("ok", "0.50 ep")]
    (shards / "train_000002.bin").unlink()
    rep = run_doctor(_spec(tmp_path, str(shards), steps=5))
    data = [c for n in rep.nodes for c in n.checks if c.name == "data"]
    assert [c.status for c in data] == ["fail", "fail"] and "lacks shard(s) train_000002.bin" in data[0].detail
    assert rep.exit_code == 1

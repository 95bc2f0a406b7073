"""[checkpoint] store / replicas and [[sites]] checkpoint_store: what each site's trainer is told (issue 35)."""

from __future__ import annotations

import pytest
import tomlkit

from dilococtl.spec import load_spec
from dilococtl.spec_sites import trainer_config
from dilococtl.spec_types import SpecError
from trainer.checkpoints.snapshot_store import run_stores
from trainer.rules import config as tconfig


def _spec(tmp_path, checkpoint: dict, stores: list[str]):
    doc = {"run": {"name": "t"}, "model": {"preset": "tiny"}, "diloco": {"h": 10, "rounds": 2},
           "checkpoint": checkpoint,
           "sites": [{"name": f"s{i}", "hosts": ["local"], **({"checkpoint_store": u} if u else {})}
                     for i, u in enumerate(stores)]}
    p = tmp_path / "spec.toml"
    p.write_text(tomlkit.dumps(doc))
    return load_spec(p)


def test_each_site_writes_near_itself_and_replicates_to_the_next(tmp_path):
    spec = _spec(tmp_path, {"store": "s3://global/ck", "replicas": 2}, ["s3://eu/ck", "", "file:///nfs/ck"])
    got = [(c.checkpoint.store, c.checkpoint.replica_stores)
           for c in (trainer_config(spec, i, "r1", "/w") for i in range(3))]
    assert got == [("s3://eu/ck", ["s3://global/ck"]), ("s3://global/ck", ["file:///nfs/ck"]),
                   ("file:///nfs/ck", ["s3://eu/ck"])]
    cfg = trainer_config(spec, 2, "r1", "/w")
    out = tmp_path / "trainer.toml"
    out.write_text(tconfig.dump_toml(cfg))
    assert tconfig.load(out) == cfg  # the list survives the trainer's TOML
    stores = run_stores(cfg.checkpoint.store, cfg.checkpoint.replica_stores[:0], "r1")
    assert [s.url for s in stores] == ["file:///nfs/ck/r1"]  # one run's rounds never mix with another's


def test_store_config_errors_are_one_line_without_the_secret(tmp_path):
    with pytest.raises(SpecError, match="replicas") as e:
        _spec(tmp_path, {"store": "s3://one/ck", "replicas": 2}, ["", ""])  # only one distinct store
    with pytest.raises(SpecError, match="no credentials") as e:
        _spec(tmp_path, {"store": "s3://AKIAXX:hunter2@bucket/ck"}, [""])
    assert "hunter2" not in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SpecError, match="unknown scheme"):
        _spec(tmp_path, {}, ["gs://b/ck"])
    assert _spec(tmp_path, {}, ["", ""]).checkpoint.store == ""  # off by default


def test_resume_round_is_the_newest_common_one_at_most_n():
    from dilococtl.resume import Checkpoint, SiteDiagnosis, common_round

    def site(name, good, bad=()):
        cps = [Checkpoint(round=r, why="") for r in good] + [Checkpoint(round=r, why="x") for r in bad]
        return SiteDiagnosis(site=name, dead=True, why="", checkpoints=sorted(cps, key=lambda c: -c.round))

    diags = [site("a", [3, 4, 5]), site("b", [4, 5, 6], bad=[3])]
    assert common_round(diags) == 5
    assert common_round(diags, upto=4) == 4
    assert common_round(diags, upto=3) is None  # b's round 3 is broken everywhere

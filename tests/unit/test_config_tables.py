"""The one table loader (trainer.rules.tables): the trainer's config and the run spec read a table the same
way and word a bad key or value the same way, `KEY: problem`."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Literal

import pytest

from dilococtl.spec import spec_from_dict
from dilococtl.spec_types import SpecError
from trainer.rules import config as C
from trainer.rules.tables import ConfigError, check_values, table_from_dict

SPEC = {
    "run": {"name": "t"},
    "model": {"preset": "tiny"},
    "diloco": {"h": 10, "rounds": 2},
    "sites": [{"name": "a", "hosts": ["10.0.0.1"], "work_dir": "/w"},
              {"name": "b", "hosts": ["10.0.1.1"], "work_dir": "/w"}],
}


@pytest.mark.parametrize("table, key, value, problem", [
    ("diloco", "roundz", 3, "diloco.roundz: unknown key 'roundz' (did you mean 'rounds'?)"),
    ("train", "learning_rate_xyz", 1, "train.learning_rate_xyz: unknown key (known: beta1, beta2, bf16, "),
    ("diloco", "h", "20", "diloco.h: expected int, got '20'"),
    ("train", "lr", "fast", "train.lr: expected float, got 'fast'"),
    ("train", "bf16", 1, "train.bf16: expected bool, got 1"),
    ("diloco", "mode", "later", "diloco.mode: expected 'sync', 'overlap', 'async', got 'later'"),
    ("diloco", "outer_lr", "x", "diloco.outer_lr: expected float | None, got 'x'"),
    ("diloco", "transport_link_pace_mbit", 5, "diloco.transport_link_pace_mbit: expected a table of numbers, got 5"),
    ("checkpoint", "replica_stores", "s3://b", "checkpoint.replica_stores: expected a list of str, got 's3://b'"),
    ("checkpoint", "replica_stores", ["s3://b", 7], "checkpoint.replica_stores[1]: expected str, got 7"),
    ("model", "dim", "x" * 500, f"model.dim: expected int, got '{'x' * 199}..."),
])
def test_the_trainer_and_the_spec_word_a_bad_trainer_table_alike(table, key, value, problem):
    with pytest.raises(ConfigError) as trainer_err:
        C.from_dict({table: {key: value}}, "FILE")
    doc = copy.deepcopy(SPEC)
    doc.setdefault(table, {})[key] = value
    with pytest.raises(SpecError) as spec_err:
        spec_from_dict(doc, "FILE")
    assert str(trainer_err.value).startswith(f"FILE: {problem}")
    assert str(spec_err.value).startswith(f"FILE: {problem}")


def test_a_section_that_is_not_a_table_and_an_unknown_section():
    for doc, problem in (({"diloco": 3}, "diloco: expected a table, got int"),
                         ({"modle": {}}, "modle: unknown key 'modle' (did you mean 'model'?)")):
        with pytest.raises(ConfigError, match=f"^FILE: {re.escape(problem)}$"):
            C.from_dict(doc, "FILE")


@dataclass(kw_only=True, slots=True)
class Inner:
    rate: float = 1.0
    names: list[str] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class Outer:
    name: str
    kind: Literal["a", "b"] = "a"
    inner: Inner = field(default_factory=Inner)
    limits: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def expand_table(table: dict) -> dict:
        return {**table, "kind": "b"} if table.get("kind") == "B" else table


def test_the_loader_builds_nested_tables_and_converts_numbers():
    got = table_from_dict(Outer, {"name": "x", "kind": "B", "inner": {"rate": 2, "names": ["p"]},
                                  "limits": {"l": 3}}, "top")
    assert got == Outer(name="x", kind="b", inner=Inner(rate=2.0, names=["p"]), limits={"l": 3.0})
    assert isinstance(got.inner.rate, float) and isinstance(got.limits["l"], float)


@pytest.mark.parametrize("table, problem", [
    ({}, "top.name: required key is missing"),
    ({"name": "x", "inner": {"rte": 1}}, "top.inner.rte: unknown key 'rte' (did you mean 'rate'?)"),
    ({"name": "x", "inner": {"names": ["p", 2]}}, "top.inner.names[1]: expected str, got 2"),
    ({"name": "x", "inner": 1}, "top.inner: expected a table, got int"),
    ({"name": True}, "top.name: expected str, got True"),
])
def test_the_loader_names_the_key_path(table, problem):
    with pytest.raises(ConfigError, match=f"^{re.escape(problem)}$"):
        table_from_dict(Outer, table, "top")


def test_values_are_finite_and_printable_list_items_included():
    with pytest.raises(ConfigError, match=r"^s\.rate: must be a finite number, got inf$"):
        check_values([("s", Inner(rate=float("inf")))])
    with pytest.raises(ConfigError, match=r"^s\.names\[1\]: control characters are not allowed, got 'b\\n'$"):
        check_values([("s", Inner(names=["a", "b\n"]))])

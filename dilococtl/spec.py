"""Reading a run spec (TOML): what to train, where, and how to reach the nodes.

Sections: [run], [model], [data], [train], [diloco], [checkpoint], [parallel], [ssh], [[sites]], [metrics].
[model]/[data]/[train]/[diloco]/[checkpoint]/[parallel] are the trainer's own config sections
(trainer.rules.config, trainer.rules.model_config, trainer.rules.diloco_config), read by the same table loader
(trainer.rules.tables) and held to the same rules; the rest belongs to the control plane (dilococtl.spec_types).

Every problem is a `SpecError` with one line, `FILE: KEY: problem`; KEY names the table and key,
with sites indexed from 0 in file order (`sites[1].hosts` is the second [[sites]] table). The rules
beyond the types are dilococtl.spec_checks; what a spec says about its sites, dilococtl.spec_sites.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from dilococtl.spec_checks import validate_spec
from dilococtl.spec_sites import default_work_dir
from dilococtl.spec_types import MetricsSection, RunSection, RunSpec, SiteSection, SpecError, SSHSection
from trainer.rules.config import CheckpointConfig, DataConfig, ParallelConfig, TrainConfig
from trainer.rules.diloco_config import DilocoConfig
from trainer.rules.model_config import ModelConfig
from trainer.rules.tables import ConfigError, table_from_dict, unknown_key

# top-level table -> its dataclass, read in this order by trainer.rules.tables.table_from_dict
_TABLES = {"run": RunSection, "ssh": SSHSection, "metrics": MetricsSection, "model": ModelConfig,
           "data": DataConfig, "train": TrainConfig, "diloco": DilocoConfig, "checkpoint": CheckpointConfig,
           "parallel": ParallelConfig}
_TOP_KEYS = ("run", "model", "data", "train", "diloco", "checkpoint", "parallel", "ssh", "sites", "metrics")
SPEC_MAX_BYTES = 1 << 20  # a run spec is a small TOML file; refuse to read more


def load_spec(path: str | Path) -> RunSpec:
    """Read and validate a run spec; every problem raises SpecError (`FILE: KEY: problem`)."""
    p = Path(path)
    text = _read_spec_text(p)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(f"{p}: invalid TOML: {e}") from None
    except RecursionError:
        raise SpecError(f"{p}: invalid TOML: arrays or tables nested too deeply") from None
    return spec_from_dict(data, str(p))


def _read_spec_text(p: Path) -> str:
    """The spec file's text; only a regular file of at most SPEC_MAX_BYTES is read. Opened without
    blocking and checked on the open descriptor: a FIFO (or a device) is refused, not waited on."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SpecError(f"{p}: no such run spec") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise SpecError(f"{p}: cannot read: {getattr(e, 'strerror', None) or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
            raise SpecError(f"{p}: {kind}; a run spec is a TOML file")
        data = os.read(fd, SPEC_MAX_BYTES + 1)
        while len(data) <= SPEC_MAX_BYTES and (more := os.read(fd, SPEC_MAX_BYTES + 1 - len(data))):
            data += more
    except OSError as e:
        raise SpecError(f"{p}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > SPEC_MAX_BYTES:
        raise SpecError(f"{p}: larger than {SPEC_MAX_BYTES} bytes; a run spec is a small TOML file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{p}: cannot read: not UTF-8 text ({e.reason} at byte {e.start})") from None


def spec_from_dict(data: dict[str, Any], path: str) -> RunSpec:
    """Build and validate a RunSpec from a parsed TOML document; `path` prefixes the errors."""
    try:
        spec = _parse(data, path)
    except ConfigError as e:
        raise SpecError(f"{path}: {e}") from None
    validate_spec(spec)
    return spec


def spec_to_json(spec: RunSpec) -> str:
    """The spec as JSON text (what the store keeps: the run as launched, even if the file changes)."""
    return json.dumps(dataclasses.asdict(spec), sort_keys=True)


def spec_from_json(text: str) -> RunSpec:
    """Inverse of `spec_to_json` (validated again).

    A run recorded before a validation rule was added may break it (a site name longer than names
    may now be): its record stays readable (status, stop, report), with the types checked but not the
    newer rules, so the run can still be seen and ended."""
    try:
        data = json.loads(text)
    except (TypeError, ValueError) as e:
        raise SpecError(f"<stored spec>: not valid JSON ({e}); the run's record is damaged") from None
    if not isinstance(data, dict):
        raise SpecError("<stored spec>: not a JSON object; the run's record is damaged")
    data, path = {k: v for k, v in data.items() if k != "path"}, str(data.get("path", "<stored spec>"))
    try:
        return spec_from_dict(data, path)
    except SpecError:
        try:
            return _parse(data, path)
        except ConfigError as e:
            raise SpecError(f"{path} (stored): {e}") from None


def _parse(data: dict[str, Any], path: str) -> RunSpec:
    """The RunSpec a parsed document holds, its keys and types checked (ConfigError `KEY: problem`), not its rules."""
    for key in data:
        if key not in _TOP_KEYS:
            raise ConfigError(unknown_key(key, key, _TOP_KEYS))
    if "run" not in data:
        raise ConfigError("run: required table [run] is missing")
    kwargs: dict[str, Any] = {key: table_from_dict(cls, data[key], key) for key, cls in _TABLES.items() if key in data}
    raw_sites = data.get("sites")
    if raw_sites is None:
        raise ConfigError("sites: at least one [[sites]] table is required")
    if not isinstance(raw_sites, list) or not all(isinstance(s, dict) for s in raw_sites):
        raise ConfigError("sites: expected an array of [[sites]] tables")
    kwargs["sites"] = [table_from_dict(SiteSection, s, f"sites[{i}]") for i, s in enumerate(raw_sites)]
    for i, s in enumerate(raw_sites):
        if "hosts" not in s and kwargs["sites"][i].scheduler == "ssh":  # required in SSH sites
            raise ConfigError(f"sites[{i}].hosts: required key is missing")
    spec = RunSpec(path=path, **kwargs)
    for site in spec.sites:
        site.work_dir = site.work_dir or default_work_dir(site, spec.ssh)
    if "sites" not in data.get("diloco", {}):
        spec.diloco.sites = len(spec.sites)
    return spec

"""tune-h's numeric flags are finite and bounded: one line, exit 2, nothing probed or written."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from dilococtl.cli import app

SPEC = """[run]
name = "t"

[[sites]]
name = "a"
hosts = ["local"]
work_dir = "{root}/w"

[[sites]]
name = "b"
hosts = ["local"]
work_dir = "{root}/w"
"""


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--duration", "inf", "--duration: must be in (0, 600] seconds, got inf"),
    ("--duration", "1e9", "--duration: must be in (0, 600] seconds"),
    ("--warmup", "nan", "--warmup: must be in [0, 600] seconds, got nan"),
    ("--warmup", "inf", "--warmup: must be in [0, 600] seconds, got inf"),
    ("--streams", "100000", "--streams: must be in [0, 256]"),
])
def test_hostile_probe_flags_are_refused_before_anything_runs(tmp_path, flag, value, expected):
    # before: inf/nan reached the probe ("internal error: OverflowError: cannot convert float infinity
    # to integer", exit 1) after it had started probing
    p = tmp_path / "spec.toml"
    p.write_text(SPEC.format(root=tmp_path))
    r = CliRunner().invoke(app, ["tune-h", str(p), flag, value])
    assert r.exit_code == 2, r.output
    assert r.stderr == f"error: {expected}\n" or (r.stderr.startswith(f"error: {expected}")
                                                 and r.stderr.count("\n") == 1), r.stderr
    assert "probing" not in r.stderr

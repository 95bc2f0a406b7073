"""tune-h's exit 1 (no H under --max-h meets the budget) says why in one line on stderr, with --json too."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dilococtl.cli import app
from dilococtl.spec import load_spec
from dilococtl.tune import tune_h as tune_cmd
from dilococtl.tune.choose import plan
from dilococtl.tune.measure import Link

SPEC = """[run]
name = "tuned"

[diloco]
h = 5
compression = "none"

[[sites]]
name = "a"
hosts = ["local"]
work_dir = "{root}/a"

[[sites]]
name = "b"
hosts = ["local"]
work_dir = "{root}/b"
"""


def _links(mbit: float, rtt: float) -> list[Link]:
    return [Link(src=a, dst=b, src_host="local", dst_host="local", mbit=mbit, rtt_ms=rtt)
            for a, b in (("a", "b"), ("b", "a"))]


@pytest.mark.parametrize("json_out", [False, True])
@pytest.mark.parametrize("step_s", [0.05, 0.0005])  # a codec brings H under 50 / none does
def test_tune_h_over_max_h_exits_1_with_the_reason_on_stderr(tmp_path, monkeypatch, json_out, step_s):
    p = tmp_path / "spec.toml"
    p.write_text(SPEC.format(root=tmp_path))
    # the measurements are replaced, the rest of the command is real: a 10 Mbit/s link needs an H above 50
    planned = plan(load_spec(p), _links(10, 20), {"source": "bench", "per_site": {"a": step_s, "b": step_s}},
                        budget=0.1, max_h=50)
    assert not planned.choice.within_max
    monkeypatch.setattr(tune_cmd, "tune", lambda *a, **k: planned)
    r = CliRunner().invoke(app, ["tune-h", str(p), "--max-h", "50", *(["--json"] if json_out else [])])
    assert r.exit_code == 1, r.output
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1, r.stderr
    line = errors[0]
    assert f"sync budget 0.1 of compute cannot be met below H = 50 (--max-h): it needs H = {planned.choice.h}" \
        in line
    assert f"raise --max-h to {planned.choice.h}" in line
    s = planned.suggestion
    if step_s == 0.05:
        assert s is not None and f'or set diloco.compression = "{s["compression"]}" (H = {s["h"]}' in line
    else:
        assert s is None and "or allow a larger --budget" in line
    if json_out:
        assert json.loads(r.stdout)["within_max"] is False  # stdout is still one JSON document

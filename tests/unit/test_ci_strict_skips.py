"""CI's guard against tests that lean on the host: with DILOCOCTL_STRICT_SKIPS=1 (.ci/run) a test that
skips for a missing tool or privilege fails the session; GPU-only skips do not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = '''
import pytest

def test_host_tool():
    pytest.skip("/usr/sbin/sshd is missing")

def test_gpu_only():
    pytest.skip("needs a CUDA GPU")

def test_fine():
    pass
'''


@pytest.mark.parametrize(("strict", "select", "rc"), [
    ("1", "host_tool or fine", 1),  # the host lacks a tool: CI fails
    ("1", "gpu_only or fine", 0),  # GPU-only tests may skip on a CPU CI
    ("", "host_tool or fine", 0),  # a developer's machine: a skip stays a skip
])
def test_strict_skips_fail_the_session(tmp_path, strict, select, rc):
    (tmp_path / "test_x.py").write_text(TESTS)
    env = {**os.environ, "PYTHONPATH": str(REPO), "DILOCOCTL_STRICT_SKIPS": strict}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), "-k", select, str(tmp_path / "test_x.py")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == rc, r.stdout + r.stderr
    assert ("counted as a failure: test_x.py::test_host_tool: Skipped: /usr/sbin/sshd is missing" in r.stdout) \
        == (rc == 1), r.stdout

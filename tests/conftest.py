import os

import pytest


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Every test gets its own DILOCOCTL_HOME: no test touches the user's records."""
    monkeypatch.setenv("DILOCOCTL_HOME", str(tmp_path / "home"))
    yield


def is_root() -> bool:
    return os.geteuid() == 0

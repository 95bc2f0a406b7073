import pytest

from dilococtl.store import Store


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "state.db"


@pytest.fixture
def store(store_path):
    s = Store.open(store_path)
    yield s
    s.close()


@pytest.fixture
def anyio_backend():
    """Async tests run on asyncio (Textual's loop), through anyio's pytest plugin."""
    return "asyncio"

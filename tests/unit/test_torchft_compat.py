"""trainer.modes.torchft_compat: the version check, each helper on real torchft objects, and a scan that keeps
every other module of dilococtl/, trainer/ and bench/ off torchft's private names."""

from __future__ import annotations

import ast
import importlib.util
import tomllib
from datetime import timedelta
from pathlib import Path

import pytest

from trainer.modes import torchft_compat as compat

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("dilococtl", "trainer", "bench")
COMPAT = ROOT / "trainer" / "modes" / "torchft_compat.py"


# -- the version check ---------------------------------------------------------------------------------


def test_the_expected_version_is_pyprojects_pin():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torchft=={compat.TORCHFT_VERSION}" in deps


def test_the_check_passes_on_the_installed_torchft():
    from importlib.metadata import version

    assert compat.installed_version() == version("torchft")
    compat.check_version()


def test_another_version_fails_in_one_line_naming_both(monkeypatch):
    installed = compat.installed_version()
    monkeypatch.setattr(compat, "TORCHFT_VERSION", "9.9.9")
    with pytest.raises(RuntimeError) as e:
        compat.check_version()
    assert isinstance(e.value, compat.TorchftVersionError)
    msg = str(e.value)
    assert "\n" not in msg and f"torchft {installed} is installed" in msg and "torchft 9.9.9" in msg
    assert "torchft==9.9.9" in msg

    monkeypatch.setattr(compat, "installed_version", lambda: None)
    with pytest.raises(compat.TorchftVersionError, match="^torchft is not installed, .*torchft 9.9.9"):
        compat.check_version()


def test_the_module_imports_neither_torch_nor_torchft():
    import subprocess
    import sys

    code = ("import sys, trainer.modes.torchft_compat, dilococtl.cli; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'torchft'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_lighthouse_and_the_relay_run_without_torch():
    # a run's coordinator processes: torchft's Lighthouse (its native extension alone) and the TLS relay
    import subprocess
    import sys

    code = ("import sys, trainer.transport.relay, trainer.service.lighthouse\n"
            "from trainer.modes.torchft_compat import lighthouse_server_class\n"
            "server = lighthouse_server_class()(bind='127.0.0.1:0', min_replicas=1)\n"
            "print(server.address().startswith('http://'), sorted({m.split('.')[0] for m in sys.modules} & {'torch'}))\n"
            "server.shutdown()\n"
            "from torchft.coordination import LighthouseServer\n"
            "print(LighthouseServer is type(server))")  # torchft, imported later, shares the one extension
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["True []", "True"], out.stdout


# -- the helpers, on real torchft objects ---------------------------------------------------------------


def test_dummy_work_is_a_completed_torch_work():
    import torch.distributed as dist

    w = compat.dummy_work([1, 2])
    assert isinstance(w, dist.Work)
    assert w.wait() is True and w.wait(timedelta(seconds=1)) is True
    assert w.get_future().value() == [1, 2]


def test_the_loopback_server_rewrites_only_the_bind():
    seen = {}
    make = compat.LoopbackManagerServer(lambda **kw: seen.update(kw) or "server")
    assert make(bind="[::]:4242", replica_id="s0") == "server"
    assert seen == {"bind": "127.0.0.1:4242", "replica_id": "s0"}


def test_a_real_manager_through_every_helper(monkeypatch):
    """torchft's Manager, built by its own code through the swapped ManagerServer and ManagerClient, with
    a one-site Lighthouse: its process group, a quorum and a commit vote through a ManagerClientProxy,
    and an error withdrawn."""
    import torchft.manager as tm
    from torch.distributed import TCPStore
    from torchft import Manager
    from torchft.coordination import LighthouseServer
    from torchft.process_group import ProcessGroupDummy

    monkeypatch.setattr(tm, "ManagerServer", tm.ManagerServer)  # restored after the test
    monkeypatch.setattr(tm, "ManagerClient", tm.ManagerClient)
    monkeypatch.setattr(compat.MetadataLocalClient, "real_cls", compat.MetadataLocalClient.real_cls)
    monkeypatch.setattr(compat.MetadataLocalClient, "metadata", compat.MetadataLocalClient.metadata)
    real_server, real_client = tm.ManagerServer, tm.ManagerClient
    compat.confine_manager_server("m1")
    compat.confine_manager_server("m2")  # twice: one wrapper each, the newest metadata
    assert isinstance(tm.ManagerServer, compat.LoopbackManagerServer) and tm.ManagerServer.real is real_server
    assert tm.ManagerClient is compat.MetadataLocalClient and compat.MetadataLocalClient.real_cls is real_client
    far = tm.ManagerClient("http://192.0.2.1:1", connect_timeout=timedelta(seconds=1))
    assert far._checkpoint_metadata(0, timeout=timedelta(seconds=1)) == "m2" and far._real is None  # no dial

    class Recording(compat.ManagerClientProxy):
        def __init__(self, real):
            super().__init__(real)
            self.quorums, self.votes = [], []

        def quorum(self, **kw):
            result = self.real_quorum(**kw)
            self.quorums.append((kw["step"], result.replica_world_size))
            return result

        def should_commit(self, group_rank, step, should_commit, timeout):
            ok = super().should_commit(group_rank, step, should_commit, timeout=timeout)
            self.votes.append((step, ok))
            return ok

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupDummy(0, 1)
    state = {"w": 0}
    manager = Manager(pg=pg, load_state_dict=state.update, state_dict=lambda: dict(state), min_replica_size=1,
                      use_async_quorum=False, timeout=timedelta(seconds=10), rank=0, world_size=1,
                      store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lh.address(),
                      replica_id="s0", hostname="127.0.0.1", init_sync=False)
    try:
        assert compat.manager_process_group(manager) is pg
        client = compat.wrap_manager_client(manager, Recording)
        assert isinstance(client, Recording) and isinstance(client.real, compat.MetadataLocalClient)
        manager.start_quorum()
        assert client.quorums == [(0, 1)] and manager.errored() is None
        assert manager.should_commit() is True and client.votes == [(0, True)]
        manager.start_quorum()
        manager.report_error(RuntimeError("a refused heal"))
        assert manager.errored() is not None
        compat.clear_manager_error(manager)
        assert manager.errored() is None
        assert manager.should_commit() is True and client.votes[-1] == (1, True)
    finally:
        manager.shutdown(wait=False)
        lh.shutdown()


# -- no torchft internals outside torchft_compat ------------------------------------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def torchft_private_names() -> tuple[set[str], set[str]]:
    """(the underscore attributes and methods of torchft's Manager, the underscore methods of its
    ManagerClient/ManagerServer), read from the installed torchft's source without importing it: what a
    module would reach into on a Manager or its client."""
    src = Path(importlib.util.find_spec("torchft").submodule_search_locations[0])
    manager: set[str] = set()
    for cls in ast.parse((src / "manager.py").read_text()).body:
        if isinstance(cls, ast.ClassDef) and cls.name == "Manager":
            for n in ast.walk(cls):
                if isinstance(n, ast.FunctionDef) and _private(n.name):
                    manager.add(n.name)
                elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _private(n.attr) \
                        and isinstance(n.value, ast.Name) and n.value.id == "self":
                    manager.add(n.attr)
    client = {n.name for n in ast.walk(ast.parse((src / "_torchft.pyi").read_text()))
              if isinstance(n, ast.FunctionDef) and _private(n.name)}
    return manager | client, client


def internals_used(source: str, where: str = "<src>") -> list[str]:
    """Each use of a torchft internal in `source`, as "WHERE:LINE: what", in line order."""
    private_attrs, client_methods = torchft_private_names()
    tree = ast.parse(source, where)
    found: list[tuple[int, str]] = []
    torchft_names: set[str] = set()  # names bound to torchft modules, classes and functions

    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] == "torchft":
                    if any(_private(p) for p in a.name.split(".")):
                        found.append((n.lineno, f"imports {a.name}"))
                    torchft_names.add(a.asname or "torchft")
        elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torchft" and not n.level:
            for a in n.names:
                if any(_private(p) for p in n.module.split(".")) or _private(a.name):
                    found.append((n.lineno, f"imports {a.name} from {n.module}"))
                torchft_names.add(a.asname or a.name)

    def of_torchft(e: ast.expr) -> bool:
        while isinstance(e, ast.Attribute):
            e = e.value
        return isinstance(e, ast.Name) and e.id in torchft_names

    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute):
            if of_torchft(n.value) and (_private(n.attr) or not isinstance(n.ctx, ast.Load)):
                found.append((n.lineno, f"{'reads' if isinstance(n.ctx, ast.Load) else 'patches'} torchft's "
                                        f"{ast.unparse(n)}"))
            elif n.attr in private_attrs and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")):
                found.append((n.lineno, f"uses torchft's private {ast.unparse(n)}"))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("setattr", "delattr") \
                and n.args and of_torchft(n.args[0]):
            found.append((n.lineno, f"patches torchft's {ast.unparse(n.args[0])}"))
        elif isinstance(n, ast.ClassDef):
            for f in n.body:
                if isinstance(f, ast.FunctionDef) and f.name in client_methods:
                    found.append((f.lineno, f"{n.name} stands in for torchft's private {f.name}"))
    return [f"{where}:{line}: {what}" for line, what in sorted(found)]


def test_no_module_but_torchft_compat_uses_torchft_internals():
    found = []
    for pkg in SCANNED:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path != COMPAT:
                found += internals_used(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "torchft internals outside trainer/modes/torchft_compat.py:\n" + "\n".join(found)


def test_torchft_compat_itself_is_what_the_scan_finds():
    found = "\n".join(internals_used(COMPAT.read_text()))
    for what in ("_DummyWork from torchft.work", "tm.ManagerServer", "tm.ManagerClient", "manager._pg",
                 "manager._errored", "manager._client", "self.real._quorum", "stands in for torchft's private _quorum",
                 "stands in for torchft's private _checkpoint_metadata"):
        assert what in found, what


@pytest.mark.parametrize("source", [
    "from torchft.work import _DummyWork",
    "from torchft._torchft import ManagerClient",
    "import torchft._torchft",
    "import torchft.manager as tm\ntm.ManagerClient = object",
    "import torchft.manager as tm\nsetattr(tm, 'ManagerServer', object)",
    "import torchft\ntorchft.manager._something()",
    "from torchft import Manager\nManager._async_quorum",
    "def f(manager):\n    return manager._pg",
    "def f(run):\n    run.manager._errored = None",
    "def f(manager, w):\n    manager._client = w",
    "class W:\n    def q(self, **kw):\n        return self._real._quorum(**kw)",
    "class C:\n    def _checkpoint_metadata(self, rank, timeout):\n        return ''",
])
def test_the_scan_finds_each_kind_of_use(source):
    assert internals_used(source)


def test_the_scan_leaves_public_torchft_and_own_private_names_alone():
    source = ("from torchft import Manager, ProcessGroupGloo\n"
              "from torchft.process_group import ProcessGroup, create_store_client\n"
              "from torchft.checkpointing.transport import CheckpointTransport\n"
              "class G(ProcessGroup):\n"
              "    def __init__(self):\n        self._pg = None\n        self._rank = 0\n"
              "    def size(self):\n        return self._pg.size()\n"
              "def f(manager):\n    manager._dilococtl_heal = 1\n    return manager.errored(), Manager, ProcessGroupGloo\n")
    assert internals_used(source) == []

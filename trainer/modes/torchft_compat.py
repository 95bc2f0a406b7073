"""Every use of torchft's internals, in one place, checked against the torchft version they were written for.

The trainer needs a few things torchft has no public API for: the Manager's process group (for
allgather and alltoall), withdrawing an error the Manager recorded, watching each quorum and commit
vote its ManagerClient carries, keeping its ManagerServer on loopback, and a completed Work for a
synchronous process group. Each reaches into a private name (an underscore attribute, a class
swapped in torchft's module), so it can break silently on any torchft release. They all live here,
each in a function or class that says which internal it touches; the rest of the trainer (and the
scan in tests/unit/test_torchft_compat.py) uses torchft's public API only.

`TORCHFT_VERSION` is the release this module was written and tested against (pyproject.toml pins
it); `check_version()` refuses any other, so an upgrade starts by re-reading this file. The module
imports neither torch nor torchft at import time: the control plane imports trainer modules that
must stay torch-free.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

TORCHFT_VERSION = "0.2.0"  # pyproject.toml: torchft==0.2.0


class TorchftVersionError(RuntimeError):
    """The installed torchft is not the one this module was written against."""


def installed_version() -> str | None:
    """The installed torchft's version (package metadata), None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchft")
    except PackageNotFoundError:
        return None


def check_version() -> None:
    """TorchftVersionError (one line) unless the installed torchft is TORCHFT_VERSION."""
    got = installed_version()
    if got != TORCHFT_VERSION:
        have = f"torchft {got} is installed" if got else "torchft is not installed"
        raise TorchftVersionError(f"{have}, but the trainer is written against torchft {TORCHFT_VERSION} "
                                  f"(pyproject.toml's pin; its internals are used in trainer/modes/torchft_compat.py): "
                                  f"install torchft=={TORCHFT_VERSION}")


# -- the Lighthouse ----------------------------------------------------------------------------------


def lighthouse_server_class() -> type:
    """torchft's LighthouseServer. In a process that has not imported torchft, loaded from torchft's
    native extension alone (torchft: the private module `torchft._torchft`, which torchft.coordination
    re-exports): the package's __init__ imports torch, ~2 CPU-s and ~200 MB a Lighthouse never uses.
    The module goes into sys.modules under its own name, so a later `import torchft` reuses it."""
    import importlib.machinery
    import importlib.util
    import os
    import sys

    name = "torchft._torchft"
    if name not in sys.modules and "torchft" not in sys.modules:
        pkg = importlib.util.find_spec("torchft")  # locates the package without running its __init__
        for folder in (pkg.submodule_search_locations or []) if pkg else []:
            for suffix in importlib.machinery.EXTENSION_SUFFIXES:
                path = os.path.join(folder, "_torchft" + suffix)
                if os.path.exists(path):
                    spec = importlib.util.spec_from_file_location(name, path)
                    native = importlib.util.module_from_spec(spec)
                    sys.modules[name] = native
                    spec.loader.exec_module(native)
                    return native.LighthouseServer
    from torchft.coordination import LighthouseServer

    return LighthouseServer


# -- the Manager -------------------------------------------------------------------------------------


def manager_process_group(manager) -> Any:
    """The process group the Manager reconfigures at each quorum (torchft: `Manager._pg`); torchft
    exposes no public handle for collectives other than its allreduce."""
    return manager._pg


def clear_manager_error(manager) -> None:
    """Withdraw the error the Manager recorded for this quorum (torchft: `Manager._errored`, which
    `errored()` returns and `should_commit()` votes on); torchft has no public way to do it."""
    manager._errored = None


def wrap_manager_client(manager, wrap):
    """Replace the Manager's ManagerClient (torchft: `Manager._client`, through which it asks for
    each quorum and carries each commit vote) by `wrap(client)`, normally a ManagerClientProxy; the
    wrapper is returned."""
    manager._client = wrap(manager._client)
    return manager._client


class ManagerClientProxy:
    """Stands in for torchft's ManagerClient on a Manager (wrap_manager_client): the real client
    (`self.real`), except where a subclass overrides `quorum` or `should_commit`.

    torchft's Manager asks for a quorum with the client's private `_quorum(group_rank=, step=,
    checkpoint_metadata=, shrink_only=, timeout=, init_sync=, commit_failures=)` (keywords only),
    which returns a QuorumResult, and votes with `should_commit(group_rank, step, should_commit,
    timeout=)`. This class receives `_quorum` and hands it to `quorum(**kw)`; a subclass reaches the
    real RPC with `real_quorum(**kw)`. Every other attribute is the real client's.
    """

    def __init__(self, real):
        self.real = real

    def _quorum(self, **kw):  # the name torchft's Manager calls
        return self.quorum(**kw)

    def quorum(self, **kw):
        return self.real_quorum(**kw)

    def real_quorum(self, **kw):
        """The real client's quorum RPC (torchft: `ManagerClient._quorum`)."""
        return self.real._quorum(**kw)

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        return self.real.should_commit(group_rank, step, should_commit, timeout=timeout)

    def __getattr__(self, name: str):
        return getattr(self.real, name)


# -- the ManagerServer on loopback (a site on one node, TLS transport) ---------------------------------


class LoopbackManagerServer:
    """Builds torchft's ManagerServer bound to 127.0.0.1 instead of every interface (torchft's Manager
    passes `bind="[::]:PORT"`): for a site on one node, whose ranks all dial it over loopback."""

    def __init__(self, real):
        self.real = real

    def __call__(self, **kw):
        kw["bind"] = "127.0.0.1:" + kw["bind"].rsplit(":", 1)[1]
        return self.real(**kw)


class MetadataLocalClient:
    """torchft's ManagerClient, except that checkpoint metadata is answered here, without dialling.

    A healing site asks its heal source's ManagerServer for the metadata that tells it where to fetch
    the state (torchft: `ManagerClient(addr, connect_timeout=)._checkpoint_metadata(rank, timeout=)`).
    Over the TLS transport it is the same constant at every site ("dilococtl-tls": the state comes
    over the quorum's mesh), so the answer needs no connection to another site, and the ManagerServer
    can stay on loopback. Every other call goes to the real client, made on first use.
    """

    real_cls = None  # torchft's ManagerClient
    metadata = ""  # what every site's checkpoint transport announces

    def __init__(self, addr: str, connect_timeout: timedelta):
        self._addr, self._connect_timeout, self._real = addr, connect_timeout, None

    def _checkpoint_metadata(self, rank: int, timeout: timedelta) -> str:  # the name torchft's Manager calls
        return self.metadata

    def __getattr__(self, name: str):
        if self._real is None:
            self._real = type(self).real_cls(self._addr, connect_timeout=self._connect_timeout)
        return getattr(self._real, name)


def confine_manager_server(metadata: str) -> None:
    """Keep this process's torchft ManagerServer off the network (single-node site, TLS transport),
    with `metadata` the checkpoint metadata every heal source announces.

    Its RPCs take no credentials (Kill makes the trainer exit, ShouldCommit false vetoes the round;
    trainer.modes.ft's docstring), and other sites use it only for the checkpoint metadata, which
    MetadataLocalClient answers. torchft offers no hook for either the bind address or the metadata
    request, so the two names torchft's Manager builds them from (torchft:
    `torchft.manager.ManagerServer` and `torchft.manager.ManagerClient`) are replaced in this
    process by LoopbackManagerServer and MetadataLocalClient. Calling it again only updates the
    metadata.
    """
    import torchft.manager as tm

    if not isinstance(tm.ManagerServer, LoopbackManagerServer):
        tm.ManagerServer = LoopbackManagerServer(tm.ManagerServer)
    if not (isinstance(tm.ManagerClient, type) and issubclass(tm.ManagerClient, MetadataLocalClient)):
        MetadataLocalClient.real_cls = tm.ManagerClient
        tm.ManagerClient = MetadataLocalClient
    MetadataLocalClient.metadata = metadata


# -- process groups -------------------------------------------------------------------------------------


def dummy_work(result: object):
    """A Work already completed with `result`, for a process group whose collectives are synchronous
    (torchft: `torchft.work._DummyWork`, what torchft's own synchronous groups return)."""
    from torchft.work import _DummyWork

    return _DummyWork(result)


__all__ = ["TORCHFT_VERSION", "LoopbackManagerServer", "ManagerClientProxy", "MetadataLocalClient",
           "TorchftVersionError", "check_version", "clear_manager_error", "confine_manager_server",
           "dummy_work", "installed_version", "manager_process_group", "wrap_manager_client"]

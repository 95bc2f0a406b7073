"""A one-node site's torchft ManagerServer stays on loopback, and its checkpoint metadata is answered
without dialling another site (trainer.modes.torchft_compat.confine_manager_server)."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest

from trainer.modes import torchft_compat


def _non_loopback_ipv4() -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        addr = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if addr.startswith("127.") else addr


def test_the_server_binds_loopback_and_metadata_never_dials(monkeypatch):
    import torchft.manager as tm
    from torchft.coordination import LighthouseServer

    monkeypatch.setattr(tm, "ManagerServer", tm.ManagerServer)  # restored after the test
    monkeypatch.setattr(tm, "ManagerClient", tm.ManagerClient)
    real_client = tm.ManagerClient
    torchft_compat.confine_manager_server("dilococtl-tls")
    torchft_compat.confine_manager_server("dilococtl-tls")  # twice: still one wrapper each
    assert tm.ManagerClient._checkpoint_metadata and torchft_compat.MetadataLocalClient.real_cls is real_client

    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    try:
        server = tm.ManagerServer(replica_id="s0", lighthouse_addr=lh.address(), hostname="127.0.0.1", bind="[::]:0",
                                  store_addr="127.0.0.1:1", world_size=1, heartbeat_interval=timedelta(seconds=1),
                                  connect_timeout=timedelta(seconds=5), quorum_retries=0)
        port = int(server.address().rsplit(":", 1)[1])
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        other = _non_loopback_ipv4()
        if other:  # from another host it would be this address: nothing listens there
            with pytest.raises(OSError):
                socket.create_connection((other, port), timeout=2).close()
        # the site's own client reaches the server through the real client (a one-rank commit vote) ...
        client = tm.ManagerClient(server.address(), connect_timeout=timedelta(seconds=5))
        assert client.should_commit(0, 0, True, timeout=timedelta(seconds=5)) is True
        assert isinstance(client._real, real_client)
        # ... while a healer asking any heal source for its metadata gets the constant, without a connection
        far = tm.ManagerClient("http://192.0.2.1:1", connect_timeout=timedelta(seconds=1))
        assert far._checkpoint_metadata(0, timeout=timedelta(seconds=1)) == "dilococtl-tls"
        assert far._real is None
        server.shutdown()
    finally:
        lh.shutdown()

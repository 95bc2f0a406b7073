"""The transport's congestion control: "auto" is loss-based (never the host's BBR), a name is set or refused."""

import socket

import pytest

from trainer.rules.config import TrainerConfig
from trainer.transport import tcp_cc


def test_auto_is_cubic_or_reno_never_the_hosts_bbr():
    with socket.socket() as s:
        assert tcp_cc.apply(s, "auto") in tcp_cc.LOSS_BASED
        assert tcp_cc.current(s) in tcp_cc.LOSS_BASED


def test_empty_keeps_the_hosts_default():
    default = open("/proc/sys/net/ipv4/tcp_congestion_control").read().strip()
    with socket.socket() as s:
        assert tcp_cc.apply(s, "") == default == tcp_cc.current(s)


def test_a_named_algorithm_is_set_and_an_unknown_one_refused():
    with socket.socket() as s:
        assert tcp_cc.apply(s, "reno") == "reno" == tcp_cc.current(s)
        with pytest.raises(OSError):
            tcp_cc.apply(s, "no_such_cc")
        assert tcp_cc.current(s) == "reno"  # a refusal changes nothing


def test_auto_falls_back_to_reno_where_cubic_is_not_allowed(monkeypatch):
    tried = []

    class Refusing(socket.socket):
        def setsockopt(self, level, opt, value):
            tried.append(value)
            if value == b"cubic":
                raise PermissionError(1, "Operation not permitted")
            return super().setsockopt(level, opt, value)

    with Refusing() as s:
        assert tcp_cc.apply(s, "auto") == "reno" == tcp_cc.current(s)
    assert tried == [b"cubic", b"reno"]


def test_the_transport_default_is_auto():
    assert TrainerConfig().diloco.transport_congestion == "auto"

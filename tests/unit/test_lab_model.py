"""`dilococtl lab` without root: parsing, address planning, state files, the delayer's netlink
messages, tbf parameters, sshd/hosts/known_hosts files and the run spec it writes."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import tomllib

import pytest

from dilococtl import paths
from dilococtl.errors import BadInput
from dilococtl.lab import delayer, model, runspec, shaping, sshd


def _plan(**kw):
    args = dict(lab_id="ab12", block="10.210.0.0/16", sites=3, nodes_per_site=2, rate_bit=50_000_000,
                rtt_ms=80.0, links=[], python="/usr/bin/python3")
    args.update(kw)
    return model.plan(**args)


@pytest.mark.parametrize("parse,text,want", [
    *[(model.parse_rate, t, v) for t, v in [("50mbit", 50_000_000), ("1gbit", 10**9), ("500kbit", 500_000),
                                            ("2.5mbit", 2_500_000), (" 10MBIT ", 10_000_000), ("9000bit", 9000)]],
    *[(model.parse_duration_ms, t, v) for t, v in [("80ms", 80.0), ("0.1s", 100.0), ("500us", 0.5), ("0ms", 0.0)]],
    *[(model.parse_size, t, v) for t, v in [("128k", 131072), ("4m", 4 * 2**20), ("65536", 65536),
                                            (" 1G ", 2**30), ("256KiB", 262144)]]])
def test_parse_units(parse, text, want):
    assert parse(text) == pytest.approx(want)


@pytest.mark.parametrize("parse,text,why", [
    *[(model.parse_rate, t, "bad rate") for t in ["50", "50mbps", "fast", "-1mbit", "1bit", ""]],
    *[(model.parse_duration_ms, t, "bad duration") for t in ["80", "1h", "11s", "ms"]],
    *[(model.parse_size, t, "bad size") for t in ["128kbit", "1.5m", "-4k", "big", "", "8k"]]])
def test_parse_units_refuses(parse, text, why):
    with pytest.raises(BadInput, match=why):
        parse(text)


def test_parse_link_both_ways_and_one_way():
    both = model.parse_link("site0-site1=20mbit/120ms")
    assert (both.src, both.dst, both.both, both.rate_bit, both.rtt_ms) == ("site0", "site1", True, 20_000_000, 120.0)
    one = model.parse_link("2>0=5mbit")
    assert (one.src, one.dst, one.both, one.rate_bit, one.rtt_ms) == ("2", "0", False, 5_000_000, None)
    for bad in ("site0=1mbit", "a-a=1mbit", "a-b", "a-b=1mbit/2ms/3"):
        with pytest.raises(BadInput):
            model.parse_link(bad)


def test_plan_names_addresses_and_links():
    st = _plan(links=[model.parse_link("site0-site2=10mbit/40ms"), model.parse_link("site1>site0=5mbit")])
    assert [n.name for n in st.nodes] == ["site0-n0", "site0-n1", "site1-n0", "site1-n1", "site2-n0", "site2-n1"]
    assert [n.address for n in st.nodes[:3]] == ["10.210.1.10", "10.210.1.11", "10.210.2.10"]
    assert [s.subnet for s in st.sites] == ["10.210.1.0/24", "10.210.2.0/24", "10.210.3.0/24"]
    assert st.sites[2].gateway == "10.210.3.1"
    assert st.nodes[0].netns == "dlab-ab12-site0-n0" and st.core_ns == "dlab-ab12-core"
    assert st.host_if == "dlabab12" and len(st.host_if) <= 15  # an interface name's limit
    assert (st.host_addr, st.core_addr) == ("10.210.255.1", "10.210.255.2")
    assert len(st.links) == 6
    assert st.links["site0>site2"] == model.LinkShape(rate_bit=10_000_000, delay_ms=20.0)
    assert st.links["site2>site0"] == model.LinkShape(rate_bit=10_000_000, delay_ms=20.0)
    # one direction only; its delay stays the default RTT/2
    assert st.links["site1>site0"] == model.LinkShape(rate_bit=5_000_000, delay_ms=40.0)
    assert st.links["site0>site1"] == model.LinkShape(rate_bit=50_000_000, delay_ms=40.0)


def test_plan_refuses_bad_sizes_and_unknown_sites():
    with pytest.raises(BadInput, match="--sites"):
        _plan(sites=0)
    with pytest.raises(BadInput, match="--nodes-per-site"):
        _plan(nodes_per_site=500)
    with pytest.raises(BadInput, match="no lab site 'site9'"):
        _plan(links=[model.parse_link("site0-site9=1mbit")])


def test_targets_and_apply_link():
    st = _plan()
    assert [n.name for n in st.targets("site1")] == ["site1-n0", "site1-n1"]
    assert [n.name for n in st.targets("site2-n1")] == ["site2-n1"]
    with pytest.raises(BadInput, match="no lab node or site"):
        st.targets("site7")
    keys = model.apply_link(st, model.parse_link("1-2=7mbit"))
    assert keys == ["site1>site2", "site2>site1"]
    assert st.links["site1>site2"] == model.LinkShape(rate_bit=7_000_000, delay_ms=40.0)  # delay kept


def test_choose_block_avoids_every_route_and_address():
    routes = [{"dst": "default", "gateway": "192.0.2.1"}, {"dst": "10.210.0.0/16", "type": "unreachable"},
              {"dst": "10.208.0.0/12"}, {"dst": "10.224.5.7"}, {"dst": "fe80::/64"}]
    # 10.208.0.0/12 covers 10.208-10.223; 10.224.5.7 takes 10.224; an address takes 10.225.
    assert model.choose_block(routes, ["10.225.3.4/24", "127.0.0.1/8"]) == "10.226.0.0/16"
    assert model.choose_block([], []) == "10.210.0.0/16"
    with pytest.raises(BadInput, match="no free private /16"):
        model.choose_block([{"dst": "10.0.0.0/8"}, {"dst": "172.16.0.0/12"}], [])


def test_state_round_trip_and_persistence():
    st = _plan()
    st.cut.append("site1")
    st.nodes[0].sshd_pid = 1234
    assert model.from_json(model.to_json(st)) == st
    assert model.load() is None
    with pytest.raises(BadInput, match="no lab is up"):
        model.require()
    model.save(st)
    assert model.state_path() == paths.home() / "lab" / "state.json"
    assert model.require() == st
    model.state_path().write_text("{not json")
    with pytest.raises(BadInput, match="unreadable lab state"):
        model.load()


def test_delayer_config_has_one_queue_per_ordered_pair():
    st = _plan(links=[model.parse_link("site2>site0=1mbit/10ms")])
    cfg = model.delayer_config(st)
    assert cfg == {"1": 40.0, "2": 40.0, "256": 40.0, "258": 40.0, "512": 5.0, "513": 40.0}
    assert model.queue_num(2, 0) == 512


def test_netlink_bind_and_verdict_messages():
    msgs = delayer.bind_messages(258, seq=7)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", msgs[0])
    assert (length, kind, flags, seq) == (len(msgs[0]), (3 << 8) | 2, 1 | 4, 7)
    family, version, queue = struct.unpack_from("=BB", msgs[0], 16) + struct.unpack_from("!H", msgs[0], 18)
    assert (family, version, queue) == (socket.AF_UNSPEC, 0, 258)
    alen, akind, cmd, pf = struct.unpack_from("=HH", msgs[0], 20) + struct.unpack_from("!BxH", msgs[0], 24)
    assert (alen, akind, cmd, pf) == (8, 1, 1, socket.AF_INET)  # CMD_BIND for IPv4
    # copy mode META (no payload), queue length, GSO flag with its mask
    assert struct.unpack_from("!IB", msgs[1], 24) == (0, 1)
    assert struct.unpack_from("!I", msgs[2], 24) == (delayer.QUEUE_MAXLEN,)
    assert struct.unpack_from("=HH", msgs[3], 20) == (8, 5) and struct.unpack_from("!I", msgs[3], 24) == (4,)
    v = delayer.verdict_batch(513, 99)
    assert struct.unpack_from("=IHH", v) == (len(v), (3 << 8) | 3, 1)
    assert struct.unpack_from("!H", v, 18) == (513,)
    assert struct.unpack_from("!II", v, 24) == (1, 99)  # NF_ACCEPT up to id 99
    assert all(len(m) % 4 == 0 for m in msgs + [v])


def _packet_msg(queue: int, packet_id: int, extra_attr_first: bool = False) -> bytes:
    hdr_attr = struct.pack("=HH", 11, 1) + struct.pack("!IHB", packet_id, 0x0800, 2) + b"\0"
    other = struct.pack("=HH", 8, 9) + b"\0\0\0\x05"
    attrs = (other + hdr_attr) if extra_attr_first else (hdr_attr + other)
    body = struct.pack("=BB", socket.AF_INET, 0) + struct.pack("!H", queue) + attrs
    return struct.pack("=IHHII", 16 + len(body), (3 << 8) | 0, 0, 0, 0) + body


def test_netlink_parse_packets_and_acks():
    err = struct.pack("=IHHII", 36, 2, 0, 5, 0) + struct.pack("=i", -16) + b"\0" * 16
    ack = struct.pack("=IHHII", 36, 2, 0, 6, 0) + struct.pack("=i", 0) + b"\0" * 16
    buf = _packet_msg(1, 41) + _packet_msg(512, 42, extra_attr_first=True) + err + ack
    packets, acks = delayer.parse(buf + b"\0" * 64, len(buf))
    assert packets == [(1, 41), (512, 42)]
    assert acks == [(5, 16), (6, 0)]
    # a truncated tail is ignored, not misread
    packets, _ = delayer.parse(buf, len(_packet_msg(1, 41)) + 10)
    assert packets == [(1, 41)]


def test_tbf_args_scale_burst_with_rate():
    assert shaping.tbf_args(10_000_000) == ["tbf", "rate", "10000000bit", "burst", str(16 * 1024), "latency", "50ms"]
    assert shaping.tbf_args(1_000_000_000)[4] == str(1_000_000_000 // 8 * 4 // 1000)
    assert shaping.class_minor(0) == "10" and shaping.tbf_handle(200) == "d8:"


def test_hosts_and_sshd_config(tmp_path):
    st = _plan(sites=2, nodes_per_site=1)
    hosts = sshd.hosts_text(st)
    assert "10.210.1.10\tsite0-n0\n" in hosts and "10.210.2.10\tsite1-n0\n" in hosts
    assert hosts.startswith("127.0.0.1\tlocalhost\n")
    cfg = sshd.sshd_config_text([st.nodes[1].address], tmp_path / "k", tmp_path / "p", tmp_path / "a", tmp_path / "h")
    for line in (f"SetEnv HOME={tmp_path / 'h'}", "ListenAddress 10.210.2.10", f"HostKey {tmp_path / 'k'}", f"PidFile {tmp_path / 'p'}",
                 f"AuthorizedKeysFile {tmp_path / 'a'}", "StrictModes no", "UsePAM no", "PermitRootLogin yes",
                 "Subsystem sftp internal-sftp"):
        assert line in cfg.splitlines()


def _ed25519_blob(seed: int) -> str:
    import base64

    kind = b"ssh-ed25519"
    return base64.b64encode(struct.pack(">I", len(kind)) + kind + struct.pack(">I", 32) + bytes([seed]) * 32).decode()


def test_known_hosts_trust_and_untrust():
    st = _plan(sites=2, nodes_per_site=1)
    kh = paths.known_hosts_path()
    old, other, k0, k1 = (_ed25519_blob(i) for i in range(4))
    # a stale line for a lab address (an older lab's key) and an unrelated host
    kh.write_text(f"10.210.1.10 ssh-ed25519 {old} dilococtl-lab-0000\nexample.org ssh-ed25519 {other}\n")
    for node, blob in zip(st.nodes, (k0, k1), strict=True):
        (sshd.node_dir(node) / "ssh_host_ed25519_key.pub").write_text(f"ssh-ed25519 {blob} {node.name}\n")
    sshd.trust(st)
    lines = kh.read_text().splitlines()
    assert lines == [f"example.org ssh-ed25519 {other}", f"10.210.1.10 ssh-ed25519 {k0} dilococtl-lab-ab12",
                     f"10.210.2.10 ssh-ed25519 {k1} dilococtl-lab-ab12"]
    assert oct(kh.stat().st_mode & 0o777) == "0o600"
    import paramiko

    keys = paramiko.HostKeys(str(kh))  # the format paramiko (the control plane) reads, tag and all
    assert set(keys.keys()) == {"example.org", "10.210.1.10", "10.210.2.10"}
    assert keys.lookup("10.210.2.10")["ssh-ed25519"].get_base64() == k1
    assert sshd.untrust("", {st.known_hosts_marker}) == 2
    assert kh.read_text() == f"example.org ssh-ed25519 {other}\n"


def test_spec_out_is_a_valid_run_spec(tmp_path):
    from dilococtl.spec import load_spec

    st = _plan(links=[model.parse_link("site0-site1=20mbit")])
    data = runspec.spec_dict(st, key=tmp_path / "id", known_hosts=tmp_path / "kh", work_root=tmp_path / "w")
    import tomlkit

    p = tmp_path / "spec.toml"
    p.write_text(tomlkit.dumps(data))
    spec = load_spec(p)
    assert [s.hosts for s in spec.sites] == [["10.210.1.10", "10.210.1.11"], ["10.210.2.10", "10.210.2.11"],
                                             ["10.210.3.10", "10.210.3.11"]]
    assert all(s.python == "/usr/bin/python3" and s.venv == "" for s in spec.sites)
    assert spec.run.lighthouse == "10.210.1.10"
    assert (spec.ssh.user, spec.ssh.identity_file) == ("root", str(tmp_path / "id"))
    assert spec.diloco.sites == 3 and spec.diloco.link_mbit == 20.0  # the slowest link sizes timeouts
    assert spec.model.preset == "tiny"
    assert tomllib.loads(p.read_text())["sites"][2]["work_dir"] == str(tmp_path / "w" / "site2")


def test_cli_refuses_without_root(tmp_path):
    """Not root: one line and exit 2 from the real CLI entry (euid faked: a real uid drop cannot
    reach this interpreter under /root)."""
    code = "import os, sys; os.geteuid = lambda: 1000; from dilococtl.cli import main; sys.argv[0] = 'dilococtl'; main()"
    env = {**os.environ, "DILOCOCTL_HOME": str(tmp_path / "h")}
    for args in (["up", "--sites", "2"], ["down"], ["kill", "site0", "--grace", "1"], ["cut", "site0"]):
        r = subprocess.run([sys.executable, "-c", code, "lab", *args], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.strip().splitlines() == [
            "error: dilococtl lab needs root (network namespaces, tc, iptables): run it as root"]
    assert not (tmp_path / "h" / "lab" / "state.json").exists()


def test_lab_status_without_a_lab_is_bad_input(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dilococtl", "lab", "status", "--json"], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "DILOCOCTL_HOME": str(tmp_path / "h")})
    assert r.returncode == 2
    assert "no lab is up in this DILOCOCTL_HOME" in r.stderr
    # under --json the error is JSON on stdout too, so a script reads one document either way
    assert json.loads(r.stdout) == {"error": "no lab is up in this DILOCOCTL_HOME (run `dilococtl lab up` first)",
                                    "exit": 2}

"""doctor's progress line counts the spec's nodes (issue 42: two local nodes were "1 node(s)")."""

from __future__ import annotations

from dilococtl.doctor import checking_line
from dilococtl.spec import spec_from_dict


def _spec(*hosts: list[str]):
    return spec_from_dict({"run": {"name": "d"}, "sites": [{"name": f"s{i}", "hosts": h, "work_dir": "/tmp/d42"}
                                                          for i, h in enumerate(hosts)]}, "d.toml")


def test_two_local_nodes_are_two_nodes_on_one_machine():
    assert checking_line(_spec(["local"], ["local"])) == "checking 2 node(s) on 1 machine(s)"
    assert checking_line(_spec(["a", "b"], ["c", "d"])) == "checking 4 node(s)"

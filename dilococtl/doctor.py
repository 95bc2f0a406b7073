"""`dilococtl doctor`: can every node be reached, and does it have what the run needs.

Per node: reachable, interpreter, torch / torchft / trainer versions, CUDA and GPU count against the
spec, free disk under work_dir, clock skew against this machine; for a site of several nodes, whether
its work_dir is one filesystem on all of them (dilococtl.doctor_node); for token shards, that they
are there with one meta.json on every node and enough tokens for the planned steps
(dilococtl.data_check). Between sites: can each site's leader open TCP connections to the ports the
run listens on at the other sites (a short-lived listener on the target node, a connect from the
source node: dilococtl.doctor_links); and, for the TLS transport (diloco.transport "auto" or "tls"),
a real mutual TLS 1.3 handshake from each site's leader to every other's, under a throwaway CA
(dilococtl.doctor_tls). Checkpoint stores are probed from each site's first node
(dilococtl.doctor_store). This module runs them all (`run_doctor`) and holds the Slurm sites' checks
and the bandwidth measurement of `doctor --links`.

A Slurm site (scheduler = "slurm") is checked through its login node: the node checks there (its
interpreter on the cluster's shared filesystem, torch, trainer, disk under work_dir, clock), then the
Slurm checks of dilococtl.slurm.doctor (tools, partition, account, QoS, GPUs per node, time limit,
KillWait against run.grace_s) and, from every node of a short allocation like the site's, whether the
run's coordinator (Lighthouse, its relay, or the outer service) is reachable. Its GPUs are the
partition's, not the login node's. The port and TLS checks between site leaders leave it out: its
nodes are known only once its job runs.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import asdict, dataclass, field

from dilococtl.data_check import check_data
from dilococtl.doctor_check import FAIL, Check
from dilococtl.doctor_links import CONNECT_SCRIPT, LISTEN_SCRIPT, LinkCheck, check_links, link_targets
from dilococtl.doctor_node import (
    NodeReport,
    check_node,
    check_run_ports,
    check_shared_dirs,
    failed_node,
    py_command,
)
from dilococtl.doctor_tls import check_transport, uses_tls_transport
from dilococtl.errors import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, DilocoError
from dilococtl.nodes import Node, NodePool, node_address
from dilococtl.spec_sites import lighthouse_host
from dilococtl.spec_types import RunSpec, SiteSection


@dataclass(kw_only=True, slots=True)
class DoctorReport:
    nodes: list[NodeReport]
    links: list[LinkCheck]
    stores: list = field(default_factory=list)  # dilococtl.doctor_store.StoreCheck: one per site and store
    bandwidth: list = field(default_factory=list)  # --links: dilococtl.tune.Link per direction between leaders

    @property
    def exit_code(self) -> int:
        if any(not n.reachable for n in self.nodes):
            return EXIT_UNREACHABLE
        if any(n.status == FAIL for n in self.nodes) or any(link.status == FAIL for link in self.links):
            return EXIT_FAILED
        if any(s.status == FAIL for s in self.stores):
            return EXIT_FAILED
        return EXIT_OK

    def to_json(self) -> dict:
        nodes = []
        for n in self.nodes:
            d = asdict(n)
            d["status"] = n.status
            nodes.append(d)
        return {"ok": self.exit_code == EXIT_OK, "exit_code": self.exit_code, "nodes": nodes,
                "links": [asdict(link) for link in self.links], "stores": [asdict(s) for s in self.stores],
                "bandwidth": [asdict(x) for x in self.bandwidth]}


def checked_hosts(site: SiteSection) -> list[str]:
    """The hosts doctor checks a site on: its nodes, or a Slurm site's login node."""
    return [site.login] if site.scheduler == "slurm" else site.hosts


def _login_spec(spec: RunSpec) -> RunSpec:
    """`spec` with each Slurm site's login node as its one host (the checkpoint stores are probed there)."""
    import dataclasses

    return dataclasses.replace(spec, sites=[dataclasses.replace(s, hosts=[s.login]) if s.scheduler == "slurm" else s
                                            for s in spec.sites])


def coordinator_targets(spec: RunSpec) -> list[tuple[str, int, str]]:
    """(host, port, what) the trainers of every site dial: the Lighthouse, its relay or the outer service."""
    from dilococtl.spec_sites import lighthouse_relayed

    what = "outer service" if spec.diloco.mode == "async" else \
        "Lighthouse relay" if lighthouse_relayed(spec) else "Lighthouse"
    return [(node_address(lighthouse_host(spec)), spec.run.lighthouse_port, what)]


def check_slurm_sites(spec: RunSpec, pool: NodePool, reports: dict[tuple[str, str], NodeReport],
                      pythons: dict[str, str]) -> None:
    """Each Slurm site's checks (dilococtl.slurm.doctor), added to its login node's report: one line per
    failing check. A login node that is unreachable is reported already. The coordinator's port gets a
    short-lived listener on its host while the compute nodes dial it (before launch nothing listens
    there; where the run's coordinator already does, the listener finds the port busy and steps aside)."""
    from dilococtl.slurm import doctor as slurm_doctor
    from dilococtl.slurm.config import slurm_site

    for s in spec.sites:
        rep = reports.get((s.name, s.login))
        if s.scheduler != "slurm" or rep is None or not rep.reachable:
            continue
        login = pool.get(s.login)
        site = slurm_site(s)
        try:
            checks = slurm_doctor.check_site(login, site, grace_s=spec.run.grace_s)
            if all(c.status != FAIL for c in checks):  # an allocation only for a site Slurm would run
                checks += _reach(spec, pool, pythons, login, site)
        except DilocoError as e:
            checks = [Check(name="slurm", status=FAIL, detail=str(e))]
        rep.checks += checks


def _reach(spec: RunSpec, pool: NodePool, pythons: dict[str, str], login: Node, site) -> list[Check]:
    """slurm.doctor.check_reach of the coordinator, with a listener on its port while the nodes dial."""
    from dilococtl.slurm import doctor as slurm_doctor

    targets = coordinator_targets(spec)
    host, port = lighthouse_host(spec), spec.run.lighthouse_port
    if host not in pythons:  # no interpreter there to listen with: only a running coordinator answers
        return slurm_doctor.check_reach(login, site, targets)
    window = slurm_doctor.REACH_ALLOC_S + slurm_doctor.REACH_CONNECT_S * site.nodes + 60
    addr = node_address(host)
    dst = pool.get(host)
    th = threading.Thread(target=lambda: dst.run(py_command(pythons[host], LISTEN_SCRIPT,
                                                            addr if addr.startswith("127.") else "",
                                                            port, site.nodes, window), timeout=window + 30),
                          daemon=True)
    th.start()
    time.sleep(1.0)  # the listener binds before the first node dials
    try:
        return slurm_doctor.check_reach(login, site, targets)
    finally:
        for _ in range(site.nodes):  # knocks from its own host end the listener whatever came through
            th.join(0.5)
            if not th.is_alive():
                break
            try:
                dst.run(py_command(pythons[host], CONNECT_SCRIPT, "127.0.0.1" if addr.startswith("127.") else addr,
                                   port, 1), timeout=30)
            except DilocoError:
                break
        th.join(window + 60)


# --- entry --------------------------------------------------------------------------------------

def checking_line(spec: RunSpec) -> str:
    """doctor's first progress line: the spec's nodes, and the machines they are when fewer (two
    local nodes are two nodes on one machine, not "1 node(s)")."""
    nodes = sum(len(checked_hosts(s)) for s in spec.sites)
    hosts = len({h for s in spec.sites for h in checked_hosts(s)})
    return f"checking {nodes} node(s)" + (f" on {hosts} machine(s)" if hosts != nodes else "")


def run_doctor(spec: RunSpec, accept_new: bool = False, progress=None, bandwidth: bool = False) -> DoctorReport:
    """Check every node of `spec`, then the links between sites; `bandwidth`: also measure each
    direction between site leaders (measure_bandwidth) once every other link check passed."""
    say = progress or (lambda msg: None)
    # A local host may serve several sites: check it once per site it is in.
    sites_of: dict[str, list[SiteSection]] = {}
    for s in spec.sites:
        for h in checked_hosts(s):
            sites_of.setdefault(h, []).append(s)
    reports: dict[tuple[str, str], NodeReport] = {}
    with NodePool(spec.ssh, accept_new=accept_new) as pool:
        say(checking_line(spec))
        results = pool.map(lambda node: [check_node(node, s) for s in sites_of[node.host]], list(sites_of))
        for h, res in results.items():
            for i, s in enumerate(sites_of[h]):
                reports[(s.name, h)] = res[i] if isinstance(res, list) else failed_node(s, h, res)
        check_shared_dirs(spec, pool, reports)
        check_run_ports(spec, pool, reports)
        check_data(spec, pool, reports, Check)  # shards present, one meta.json everywhere, enough tokens
        # Hosts without a working interpreter (unreachable ones included) are left out of the links.
        pythons = {h: r.python for (_, h), r in reports.items() if r.reachable and r.python}
        if any(s.scheduler == "slurm" for s in spec.sites):
            say("checking Slurm sites through their login nodes (partition, account, QoS, GPUs, time limit, "
                "the coordinator from the compute nodes)")
            check_slurm_sites(spec, pool, reports, pythons)
        links: list[LinkCheck] = []
        if link_targets(spec):
            say("checking ports between sites")
            links = check_links(spec, pool, pythons)
        if uses_tls_transport(spec) and len(spec.sites) > 1:
            say("checking the TLS transport between sites")
            links += check_transport(spec, pool, pythons)
        measured: list = []
        if bandwidth and len(spec.sites) > 1:
            if any(x.status == FAIL for x in links) or any(r.status == FAIL for r in reports.values()):
                say("bandwidth: not measured: fix the failed checks first")
            else:
                measured, failed = measure_bandwidth(spec, pool, say)
                links += failed
        from dilococtl.doctor_store import check_stores, site_probes

        stores = []
        if site_probes(spec):
            say("checking checkpoint stores from each site's first node (write, read, delete a probe object)")
            stores = check_stores(_login_spec(spec), pool, pythons)
    return DoctorReport(nodes=[reports[(s.name, h)] for s in spec.sites for h in checked_hosts(s)], links=links,
                        stores=stores, bandwidth=measured)


BANDWIDTH_PROBE_S = 1.0  # measured seconds per direction and stream count: enough for a 50 Mbit/s link


def measure_bandwidth(spec: RunSpec, pool: NodePool, say) -> tuple[list, list[LinkCheck]]:
    """doctor --links: every direction between the site leaders with tune-h's probe and stream sweep
    (dilococtl.tune.measure.measure_links), for launch to derive the TLS transport from (derive_transport).
    Returns (links, a failed LinkCheck per site pair that could not be measured)."""
    from dilococtl.tune.measure import ProbeSettings, measure_links

    if any(s.scheduler == "slurm" for s in spec.sites):
        say("bandwidth: left out: a Slurm site's nodes are known only once its job runs")
        return [], []
    say("measuring bandwidth and round trip between site leaders (a stream sweep per direction)")
    links, failed = [], []
    for i, a in enumerate(spec.sites):
        for b in spec.sites[i + 1:]:
            try:  # one pair at a time, so a failure names its pair and the others are still measured
                links += measure_links(dataclasses.replace(spec, sites=[a, b]), pool,
                                       ProbeSettings(duration_s=BANDWIDTH_PROBE_S), say)
            except DilocoError as e:
                failed.append(LinkCheck(src_site=a.name, src_host=a.hosts[0], dst_site=b.name, dst_host=b.hosts[0],
                                        port=0, purpose="bandwidth", status=FAIL, detail=str(e)))
    return links, failed

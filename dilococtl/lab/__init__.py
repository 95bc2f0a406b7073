"""`dilococtl lab`: an emulated multi-datacenter WAN on one Linux host.

Layout (one lab, id `ID`, all names carry the marker `dlab`):

    root namespace                 dlab-ID-core  (the "WAN")                 dlab-ID-<node>
    --------------                 -------------------------                 --------------
    dlabID 10.B.255.1/30  <-veth->  mgmt 10.B.255.2/30
    10.B.0.0/16 via core            br<i> 10.B.(i+1).1/24  (site i's LAN)  <-veth->  eth0 10.B.(i+1).(10+j)/24
    unreachable 10.B.0.0/16         routes between site LANs = WAN links       default via 10.B.(i+1).1
      (metric 4242, the fallback)   HTB + one tbf per (source site) on br<dst>
                                    FORWARD: NFQUEUE per (src, dst) -> delayer

- Traffic inside a site is bridged on br<i> and never touches a qdisc or the delayer: unshaped.
- Traffic between sites is routed by the core: the FORWARD chain queues it to the delayer (one
  NFQUEUE number per ordered site pair, one daemon per lab, held one-way delay = RTT/2 per
  direction), then br<dst>'s HTB sends it through the tbf of its source site: one tbf per ordered
  pair, so A->B and B->A are shaped separately.
- The operator's dilococtl (root namespace) reaches every node's sshd through the management veth
  and the core, not through any WAN link: SSH and the control plane are neither shaped nor delayed.
- The whole /16 is `unreachable` in the root namespace: if the lab's veth is gone, no packet to a
  lab address can leave the machine; nodes have no route beyond the lab's /16 at all.

The delay is applied in the core's FORWARD chain rather than in every node's INPUT chain: one
netlink socket and one event loop serve the whole lab, and the kernel hands over TSO/GSO super
packets before tbf segments them, which keeps the daemon's CPU use at a few percent.
"""

# This package must stay light: `python -m dilococtl.lab.delayer` imports it in the core namespace.
MARKER = "dlab"

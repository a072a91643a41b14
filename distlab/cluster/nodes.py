"""A small cluster on one machine: nodes in network namespaces, joined to a switch by links the kernel shapes.

    net = Network.create(nodes=2, link=Link.parse("1gbit"))
    net.node_addr(1), net.exec_prefix(1)       # "198.18.0.2", ["ip", "netns", "exec", ..., "node1", ...]
    net.set_link(Link.parse("100mbit"))
    net.destroy()

The shape is a star, as the ring model assumes: each node is a network namespace with its own
loopback and one interface (``eth0``), whose other end is a port of a bridge in a switch namespace.
Both ends of each node's link are shaped (``tc`` tbf), so a node sends at the link's rate while it
receives at the link's rate. Ranks on one node reach each other through that node's own loopback
(an address of one's own is routed through ``lo``), never through the link.

With racks (``racks=R``, two tiers as in a real cluster's fabric) the nodes' links end at their
rack's switch instead, a bridge in a namespace of the rack's own, and each rack's switch reaches the
top switch (the spine) by one uplink, shaped both ways at its own rate. Traffic between two nodes
of a rack never leaves the rack; traffic between racks crosses the sender's uplink and the
receiver's. It is still one subnet (the switches are bridges, as a rack's top-of-rack switch is to
the hosts below it), so addresses and ranks are placed exactly as in a star.

The controller runs in the top switch's namespace, on the bridge's address: like the head node of a
real cluster, it is reached over each node's link (and its rack's uplink). The addresses live only
on interfaces inside the namespaces made here; nothing is added to this machine's own network, and
there is no route out.

As root (CAP_NET_ADMIN and CAP_SYS_ADMIN) the namespaces are named under /run/netns; a user without
those capabilities gets the same network inside a user namespace of the lab's own, where the kernel
allows one (``cluster.userns``); ``cluster.namespaces`` checks which, and says in one line if neither.

The values a link is described by (``Link``, its rate and latency, ``spread``) live in
``cluster/links.py``, and the lab's subnet is picked in ``cluster/subnets.py``; both are importable
from here as well.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re

from ..errors import DistlabError, LabUsageError
from .links import Link, format_duration, format_rate, parse_duration, parse_rate, spread
from .namespaces import (
    NS_PREFIX,
    NamedNamespaces,
    NamespaceHost,
    namespace_host,
    netem_missing,
    nodes_here,
    remove_namespaces,
    remove_orphans,
    require_namespaces,
    require_netem,
)
from .namespaces import run as _run
from .subnets import DEFAULT_POOL, NetworkLock, check_subnet, pick_subnet

__all__ = [
    "DEFAULT_POOL",
    "Link",
    "Network",
    "check_subnet",
    "format_duration",
    "format_rate",
    "netem_missing",
    "nodes_here",
    "parse_duration",
    "parse_rate",
    "remove_namespaces",
    "remove_orphans",
    "require_namespaces",
    "spread",
]

#: A link's queue: (seconds of it at the link's rate, bursts at least). ``_tbf`` says why they differ.
_LINK_QUEUE = (0.05, 4)
_UPLINK_QUEUE = (0.01, 2)


def _tbf(rate_bps: int, queue: tuple[float, int] = _LINK_QUEUE) -> list[str]:
    """A token bucket at ``rate_bps``: a burst of 1 ms at the rate (32 KiB at least, room for the
    large segments veth passes), and a queue of ``queue`` (seconds at the rate, bursts at least).

    A node's own link is its first hop: TCP's small queues hold its sockets back there, so the queue
    stays short whatever its limit, and 50 ms only keeps it from dropping. An uplink's queue is a
    switch's, which nothing holds back: TCP fills it, and every step of a ring then waits behind it.
    Uplinks get 10 ms, a shallower buffer: a ring across racks then runs about 8% above the ring
    model, as on a star's links, instead of 12-15%, while two flows sharing an uplink (HSDP's replica
    groups) lose 10% of their pace; at 5 ms they lost 40% (benchmarks/RESULTS.md)."""
    per_s = rate_bps / 8
    burst = max(32 * 1024, int(per_s / 1000))
    seconds, bursts = queue
    limit = max(bursts * burst, int(per_s * seconds))
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "limit", str(limit)]


_sequence = 0


class Network:
    """One lab's nodes, switches and links. Made by :meth:`create`; gone after :meth:`destroy`."""

    def __init__(
        self, nodes: int, subnet: ipaddress.IPv4Network, link: Link | None, owner: int, seq: int,
        racks: int | None = None, uplink: Link | None = None, host: NamespaceHost | None = None,
    ) -> None:
        self.nodes = nodes
        #: What holds the namespaces: named ones (root), or a user namespace of the lab's own
        #: (``create`` picks); a network made here directly only names its namespaces, so it starts nothing.
        self.host: NamespaceHost = host or NamedNamespaces()
        self.subnet = subnet
        self.link = link
        #: Racks the nodes are in (None: a star, every node on the one switch), and each rack's
        #: uplink to the spine (None: not shaped).
        self.racks = racks
        self.uplink = uplink
        self._base = f"{NS_PREFIX}{owner}-{seq}"
        hosts = list(subnet.hosts())
        self._node_addrs = [str(hosts[i]) for i in range(nodes)]
        self.switch_addr = str(hosts[-1])
        # Nodes fill racks in order, as ranks fill nodes: the first racks take one more if uneven.
        self._rack_of = [k for k, count in enumerate(spread(nodes, racks or 1)) for _ in range(count)]

    # ----------------------------------------------------------------------- names

    @property
    def switch_ns(self) -> str:
        return f"{self._base}-sw"

    def node_ns(self, node: int) -> str:
        return f"{self._base}-n{node}"

    def rack_ns(self, rack: int) -> str:
        return f"{self._base}-r{rack}"

    def rack_of(self, node: int) -> int | None:
        """The rack ``node`` is in (None without racks)."""
        return self._rack_of[node] if self.racks else None

    def rack_nodes(self) -> list[list[int]]:
        """The nodes of each rack, in order ([] without racks)."""
        return [[i for i in range(self.nodes) if self._rack_of[i] == k] for k in range(self.racks or 0)]

    def node_addr(self, node: int) -> str:
        return self._node_addrs[node]

    @staticmethod
    def hostname(node: int) -> str:
        return f"node{node}"

    def namespaces(self) -> list[str]:
        racks = [self.rack_ns(k) for k in range(self.racks or 0)]
        return [self.switch_ns, *racks] + [self.node_ns(i) for i in range(self.nodes)]

    def exec_prefix(self, node: int | None) -> list[str]:
        """A command prefix that runs a program on ``node`` (None: on the switch), under the node's hostname.

        ``ip netns exec`` and ``unshare`` both exec what follows, so the process's pid is the
        program's own: the launcher's pid is the engine's, and signals reach it.
        """
        if node is None:
            return self.host.exec_prefix(self.switch_ns)
        return [
            *self.host.exec_prefix(self.node_ns(node)),
            "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname(node),
        ]

    # -------------------------------------------------------------------- lifecycle

    @classmethod
    def create(
        cls, nodes: int, link: Link | None, subnet: object = None, flag: str = "nodes",
        racks: int | None = None, uplink: Link | None = None,
    ) -> Network:
        """Make the switches, the nodes and their links; on any failure nothing made is left."""
        global _sequence
        require_namespaces(flag)
        remove_orphans()
        if link is not None and link.latency_s:
            require_netem("latency")
        host = namespace_host()
        try:
            # A user namespace's network is its own: no other lab's subnet can clash with it.
            with NetworkLock() if not host.rootless else contextlib.nullcontext():
                _sequence += 1
                picked = pick_subnet(nodes, subnet, in_use=not host.rootless)
                net = cls(nodes, picked, link, os.getpid(), _sequence, racks, uplink, host)
                try:
                    net._make()
                except BaseException:
                    net.destroy()
                    raise
        except BaseException:
            host.close()
            raise
        return net

    def _bridge(self, ns: str, doing: str, addr: str | None = None) -> None:
        """A namespace holding a switch: a bridge, up, with ``addr`` on it if given."""
        self.host.add(ns)
        steps = [["link", "set", "lo", "up"], ["link", "add", "br0", "type", "bridge"]]
        if addr is not None:
            steps.append(["addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", "br0"])
        for args in (*steps, ["link", "set", "br0", "up"]):
            _run([*self.host.ip(ns), *args], doing)

    def _make(self) -> None:
        sw, plen = self.switch_ns, self.subnet.prefixlen
        self._bridge(sw, "making the switch", self.switch_addr)
        for k in range(self.racks or 0):
            # A rack's switch: a bridge of its own, joined to the spine's by its uplink (up0 here, r<k> there).
            rack = self.rack_ns(k)
            self._bridge(rack, f"making rack {k}")
            ip_rack, ip_sw = self.host.ip(rack), self.host.ip(sw)
            _run([*ip_rack, "link", "add", "up0", "type", "veth", "peer", "name", f"r{k}",
                  "netns", self.host.netns_path(sw)], f"making rack {k}'s uplink")
            _run([*ip_rack, "link", "set", "up0", "master", "br0", "up"], f"making rack {k}'s uplink")
            _run([*ip_sw, "link", "set", f"r{k}", "master", "br0", "up"], f"joining rack {k} to the spine")
        for i in range(self.nodes):
            ns, port, switch = self.node_ns(i), f"p{i}", self._node_switch(i)
            self.host.add(ns)
            # Both ends are made inside their namespaces: nothing ever appears in this machine's own.
            for args in (["link", "set", "lo", "up"],
                         ["link", "add", "eth0", "type", "veth", "peer", "name", port,
                          "netns", self.host.netns_path(switch)],
                         ["addr", "add", f"{self.node_addr(i)}/{plen}", "dev", "eth0"],
                         ["link", "set", "eth0", "up"]):
                _run([*self.host.ip(ns), *args], f"making node {i}")
            _run([*self.host.ip(switch), "link", "set", port, "master", "br0", "up"],
                 f"joining node {i} to its switch")
        self._shape(self._ends(), self.link, replace=False)
        self._shape(self._uplink_ends(), self.uplink, replace=False, queue=_UPLINK_QUEUE)

    def _node_switch(self, node: int) -> str:
        """The namespace of the switch ``node``'s link ends at: its rack's, or the one switch."""
        rack = self.rack_of(node)
        return self.switch_ns if rack is None else self.rack_ns(rack)

    def _ends(self) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of every node's link."""
        ends = []
        for i in range(self.nodes):
            ends += [(self.node_ns(i), "eth0"), (self._node_switch(i), f"p{i}")]
        return ends

    def _uplink_ends(self) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of every rack's uplink: the rack's side first."""
        ends = []
        for k in range(self.racks or 0):
            ends += [(self.rack_ns(k), "up0"), (self.switch_ns, f"r{k}")]
        return ends

    def _shape(
        self, ends: list[tuple[str, str]], link: Link | None, replace: bool, queue: tuple[float, int] = _LINK_QUEUE
    ) -> None:
        for ns, dev in ends:
            tc = self.host.tc(ns)
            if replace:
                with contextlib.suppress(DistlabError):
                    _run([*tc, "qdisc", "del", "dev", dev, "root"], "reshaping a link")
            if link is None:
                continue  # not shaped: the veth's default queue, as fast as the machine copies
            if link.latency_s:
                # Half the delay on each end: node to node crosses two.
                half = f"{link.latency_s / 2 * 1e6:.0f}us"
                _run([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", half],
                     "delaying a link")
                shaper = [*tc, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:"]
                _run([*shaper, *_tbf(link.rate_bps, queue)], "shaping a link")
            else:
                root = [*tc, "qdisc", "add", "dev", dev, "root"]
                _run([*root, *_tbf(link.rate_bps, queue)], "shaping a link")

    def set_link(self, link: Link | None) -> None:
        """Reshape every node's link (both ends) to ``link`` (None: not shaped), between cells."""
        if link is not None and link.latency_s:
            require_netem("latency")
        self._shape(self._ends(), link, replace=True)
        self.link = link

    def set_uplink(self, uplink: Link | None) -> None:
        """Reshape every rack's uplink (both ends) to ``uplink`` (None: not shaped), between cells."""
        if not self.racks:
            raise LabUsageError("an uplink joins racks: this network has none (start it with racks=2)")
        self._shape(self._uplink_ends(), uplink, replace=True, queue=_UPLINK_QUEUE)
        self.uplink = uplink

    def reconnect(self) -> None:
        """Bring every node's link up again: one a rank cut (``distlab.chaos(cut=...)``) stays down
        until the lab starts an engine on the nodes (a replacement, a restart). Its shaping stays."""
        for i in range(self.nodes):
            _run([*self.host.ip(self.node_ns(i)), "link", "set", "eth0", "up"], "bringing a node's link up")

    def _sent(self, ns: str, dev: str) -> int:
        out = _run([*self.host.tc(ns), "-s", "qdisc", "show", "dev", dev], "reading a link's counters")
        match = re.search(r"Sent (\d+) bytes", out)
        return int(match.group(1)) if match else 0

    def sent_bytes(self) -> dict[int, int]:
        """Bytes each node has sent onto its link so far, as its queue counted them (``tc -s``)."""
        return {i: self._sent(self.node_ns(i), "eth0") for i in range(self.nodes)}

    def uplink_bytes(self) -> dict[int, tuple[int, int]]:
        """{rack: (bytes it sent up to the spine, bytes the spine sent down to it)} so far, as the
        queues at the two ends of its uplink counted them."""
        return {k: (self._sent(self.rack_ns(k), "up0"), self._sent(self.switch_ns, f"r{k}"))
                for k in range(self.racks or 0)}

    def queues(self) -> dict[str, str]:
        """``tc``'s own account of each link end's queue (nodes' links, then racks' uplinks)."""
        return {f"{ns}/{dev}": _run([*self.host.tc(ns), "qdisc", "show", "dev", dev], "reading a queue").strip()
                for ns, dev in self._ends() + self._uplink_ends()}

    def describe(self) -> str:
        """The shape in a line: nodes, racks, switch, links."""
        link = f"link {self.link or 'not shaped'} (each way, every node's link)"
        if not self.racks:
            return f"{self.nodes} nodes on {self.subnet}, each linked to a switch at {self.switch_addr}; {link}"
        racks = ", ".join(f"rack{k}: " + " ".join(self.hostname(i) for i in nodes)
                          for k, nodes in enumerate(self.rack_nodes()))
        return (f"{self.nodes} nodes in {self.racks} racks ({racks}) on {self.subnet}, the racks joined by a spine "
                f"switch at {self.switch_addr}; {link}; uplink {self.uplink or 'not shaped'} (each way, every rack's)")

    def destroy(self) -> None:
        """End every process left in the namespaces, then remove them (with their links and queues)."""
        self.host.remove(self.namespaces())
        self.host.close()

    def __repr__(self) -> str:
        racks = f" in {self.racks} racks, uplink {self.uplink}" if self.racks else ""
        return f"<Network {self.nodes} nodes on {self.subnet}, link {self.link}{racks}>"

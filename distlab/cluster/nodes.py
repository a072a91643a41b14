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

The controller runs in the switch namespace, on the bridge's address: like the head node of a real
cluster, it is reached over each node's link. The addresses live only on interfaces inside the
namespaces made here; nothing is added to this machine's own network, and there is no route out.

Everything here needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root, or a container given NET_ADMIN). The
values a link is described by (``Link``, its rate and latency, ``spread``) live in ``cluster/links.py``
and are importable from here as well.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time

from ..errors import DistlabError, LabUsageError
from .links import Link, format_duration, format_rate, parse_duration, parse_rate, spread
from .processes import pid_alive, wait_for

__all__ = [
    "DEFAULT_POOL",
    "Link",
    "Network",
    "check_subnet",
    "format_duration",
    "format_rate",
    "netem_missing",
    "parse_duration",
    "parse_rate",
    "remove_orphans",
    "require_namespaces",
    "spread",
]

#: Where lab subnets come from by default: reserved for benchmarking networks (RFC 2544), so no
#: real network this machine could talk to uses them. Each lab takes one /24 of it.
DEFAULT_POOL = ipaddress.IPv4Network("198.18.0.0/15")
_LAB_PREFIX = 24

_NS_PREFIX = "distlab-"
_NS_PATTERN = re.compile(r"^distlab-(\d+)-(\d+)-(sw|probe|n\d+)$")
_RUN_NETNS = "/run/netns"
_LOCK_FILE = "/run/distlab-netns.lock"
_CMD_TIMEOUT_S = 10.0

# Capability bits (linux/capability.h): making namespaces mounts them (SYS_ADMIN); links, addresses
# and queues need NET_ADMIN.
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21

def _capabilities() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def require_namespaces(flag: str = "nodes") -> None:
    """Raise one line if this process cannot make network namespaces, links and queues (before anything starts)."""
    caps = _capabilities()
    missing = [name for bit, name in ((_CAP_NET_ADMIN, "CAP_NET_ADMIN"), (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
               if not caps >> bit & 1]
    if missing:
        raise LabUsageError(
            f"{flag} needs {' and '.join(missing)} to make network namespaces and links (run as root, or in a "
            f"container given NET_ADMIN); without {flag} every rank runs on loopback and needs none of this"
        )
    tools = [t for t in ("ip", "tc", "unshare") if shutil.which(t) is None]
    if tools:
        raise LabUsageError(
            f"{flag} needs {', '.join(tools)} on PATH (Debian: apt install iproute2 util-linux); "
            f"without {flag} every rank runs on loopback"
        )


def _run(args: list[str], doing: str) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise DistlabError(f"{doing}: {' '.join(args)} took over {_CMD_TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise DistlabError(f"{doing}: {' '.join(args)}: {why}")
    return done.stdout


def _tbf(rate_bps: int) -> list[str]:
    """A token bucket at ``rate_bps``: a burst of 1 ms at the rate (32 KiB at least, room for the
    large segments veth passes), and a queue of 50 ms (TCP keeps it full; a shorter one drops)."""
    per_s = rate_bps / 8
    burst = max(32 * 1024, int(per_s / 1000))
    limit = max(4 * burst, int(per_s * 0.05))
    return ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "limit", str(limit)]


def netem_missing() -> str | None:
    """Why this kernel cannot add delay to a link (no sch_netem), or None if it can.

    Probed in a namespace of its own, made and removed here: the answer is the kernel's.
    """
    name = f"{_NS_PREFIX}{os.getpid()}-0-probe"
    with contextlib.suppress(DistlabError):
        _run(["ip", "netns", "del", name], "removing a probe")
    _run(["ip", "netns", "add", name], "probing for netem")
    try:
        _run(["ip", "-n", name, "link", "set", "lo", "up"], "probing for netem")
        done = subprocess.run(
            ["tc", "-n", name, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False,
        )
        if done.returncode == 0:
            return None
        return (done.stderr.strip().splitlines() or ["netem refused"])[-1]
    finally:
        with contextlib.suppress(DistlabError):
            _run(["ip", "netns", "del", name], "removing a probe")


def _require_netem(flag: str) -> None:
    why = netem_missing()
    if why is not None:
        raise LabUsageError(
            f"{flag} needs the kernel's netem queue (sch_netem), which this kernel lacks ({why}): "
            "leave the latency out; the link's rate is still shaped"
        )


def _lab_namespaces() -> list[str]:
    try:
        return sorted(n for n in os.listdir(_RUN_NETNS) if _NS_PATTERN.match(n))
    except OSError:
        return []


def _subnets_in_use() -> list[ipaddress.IPv4Network]:
    """The subnets of the labs whose switches exist now (read off each switch's bridge)."""
    used: list[ipaddress.IPv4Network] = []
    for name in _lab_namespaces():
        if not name.endswith("-sw"):
            continue
        with contextlib.suppress(DistlabError):
            out = _run(["ip", "-n", name, "-4", "-o", "addr", "show", "dev", "br0"], "reading a lab's subnet")
            for word in out.split():
                if "/" in word and word[0].isdigit():
                    used.append(ipaddress.IPv4Interface(word).network)  # `-4`: IPv4 addresses only
    return used


def check_subnet(
    value: object, nodes: int, spelling: tuple[str, str] = ("subnet", 'subnet="198.18.7.0/24"')
) -> ipaddress.IPv4Network:
    """``value`` as an IPv4 network with room for ``nodes`` nodes and the switch."""
    name, example = spelling
    try:
        net = ipaddress.IPv4Network(value)
    except (ValueError, TypeError):
        raise LabUsageError(f"{name} must be an IPv4 network, like {example} (got {value!r})") from None
    room = max(0, net.num_addresses - 2)
    if room < nodes + 1:
        raise LabUsageError(
            f"{name} {net} has room for {room} addresses, and {nodes} nodes and their switch need {nodes + 1}: "
            f"give a larger one, like {example}"
        )
    return net


def pick_subnet(nodes: int, asked: object = None) -> ipaddress.IPv4Network:
    """The lab's subnet: ``asked`` if given and free, else the first free /24 of 198.18.0.0/15."""
    used = _subnets_in_use()
    if asked is not None:
        net = check_subnet(asked, nodes)
        clash = next((u for u in used if u.overlaps(net)), None)
        if clash is not None:
            raise LabUsageError(
                f"subnet {net} overlaps {clash}, which another lab is using: choose another, or leave it out"
            )
        return net
    for net in DEFAULT_POOL.subnets(new_prefix=_LAB_PREFIX):
        if not any(u.overlaps(net) for u in used):
            return net
    raise DistlabError(f"every /{_LAB_PREFIX} of {DEFAULT_POOL} is taken by a running lab: stop one")


class _Lock:
    """Labs starting at once pick disjoint subnets: the pick and the making happen under one lock."""

    def __enter__(self) -> _Lock:
        self._fd = os.open(_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + 30
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self._fd)
                    raise DistlabError(f"another lab held {_LOCK_FILE} for 30 s while making its network") from None
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


_sequence = 0


class Network:
    """One lab's nodes, switch and links. Made by :meth:`create`; gone after :meth:`destroy`."""

    def __init__(self, nodes: int, subnet: ipaddress.IPv4Network, link: Link | None, owner: int, seq: int) -> None:
        self.nodes = nodes
        self.subnet = subnet
        self.link = link
        self._base = f"{_NS_PREFIX}{owner}-{seq}"
        hosts = list(subnet.hosts())
        self._node_addrs = [str(hosts[i]) for i in range(nodes)]
        self.switch_addr = str(hosts[-1])

    # ----------------------------------------------------------------------- names

    @property
    def switch_ns(self) -> str:
        return f"{self._base}-sw"

    def node_ns(self, node: int) -> str:
        return f"{self._base}-n{node}"

    def node_addr(self, node: int) -> str:
        return self._node_addrs[node]

    @staticmethod
    def hostname(node: int) -> str:
        return f"node{node}"

    def namespaces(self) -> list[str]:
        return [self.switch_ns] + [self.node_ns(i) for i in range(self.nodes)]

    def exec_prefix(self, node: int | None) -> list[str]:
        """A command prefix that runs a program on ``node`` (None: on the switch), under the node's hostname.

        ``ip netns exec`` and ``unshare`` both exec what follows, so the process's pid is the
        program's own: the launcher's pid is the engine's, and signals reach it.
        """
        if node is None:
            return ["ip", "netns", "exec", self.switch_ns]
        return [
            "ip", "netns", "exec", self.node_ns(node),
            "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname(node),
        ]

    # -------------------------------------------------------------------- lifecycle

    @classmethod
    def create(cls, nodes: int, link: Link | None, subnet: object = None, flag: str = "nodes") -> Network:
        """Make the switch, the nodes and their links; on any failure nothing made is left."""
        global _sequence
        require_namespaces(flag)
        remove_orphans()
        if link is not None and link.latency_s:
            _require_netem("latency")
        with _Lock():
            _sequence += 1
            net = cls(nodes, pick_subnet(nodes, subnet), link, os.getpid(), _sequence)
            try:
                net._make()
            except BaseException:
                net.destroy()
                raise
        return net

    def _make(self) -> None:
        sw, plen = self.switch_ns, self.subnet.prefixlen
        _run(["ip", "netns", "add", sw], "making the switch")
        for args in (["link", "set", "lo", "up"], ["link", "add", "br0", "type", "bridge"],
                     ["addr", "add", f"{self.switch_addr}/{plen}", "dev", "br0"], ["link", "set", "br0", "up"]):
            _run(["ip", "-n", sw, *args], "making the switch")
        for i in range(self.nodes):
            ns, port = self.node_ns(i), f"p{i}"
            _run(["ip", "netns", "add", ns], f"making node {i}")
            # Both ends are made inside their namespaces: nothing ever appears in this machine's own.
            for args in (["link", "set", "lo", "up"],
                         ["link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", sw],
                         ["addr", "add", f"{self.node_addr(i)}/{plen}", "dev", "eth0"],
                         ["link", "set", "eth0", "up"]):
                _run(["ip", "-n", ns, *args], f"making node {i}")
            _run(["ip", "-n", sw, "link", "set", port, "master", "br0", "up"], f"joining node {i} to the switch")
        self._shape(self.link, replace=False)

    def _ends(self) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of every node's link."""
        ends = []
        for i in range(self.nodes):
            ends += [(self.node_ns(i), "eth0"), (self.switch_ns, f"p{i}")]
        return ends

    def _shape(self, link: Link | None, replace: bool) -> None:
        for ns, dev in self._ends():
            if replace:
                with contextlib.suppress(DistlabError):
                    _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], "reshaping a link")
            if link is None:
                continue  # not shaped: the veth's default queue, as fast as the machine copies
            if link.latency_s:
                # Half the delay on each end: node to node crosses two.
                half = f"{link.latency_s / 2 * 1e6:.0f}us"
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", half],
                     "delaying a link")
                shaper = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:"]
                _run([*shaper, *_tbf(link.rate_bps)], "shaping a link")
            else:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *_tbf(link.rate_bps)], "shaping a link")

    def set_link(self, link: Link | None) -> None:
        """Reshape every node's link (both ends) to ``link`` (None: not shaped), between cells."""
        if link is not None and link.latency_s:
            _require_netem("latency")
        self._shape(link, replace=True)
        self.link = link

    def reconnect(self) -> None:
        """Bring every node's link up again: one a rank cut (``distlab.chaos(cut=...)``) stays down
        until the lab starts an engine on the nodes (a replacement, a restart). Its shaping stays."""
        for i in range(self.nodes):
            _run(["ip", "-n", self.node_ns(i), "link", "set", "eth0", "up"], "bringing a node's link up")

    def sent_bytes(self) -> dict[int, int]:
        """Bytes each node has sent onto its link so far, as its queue counted them (``tc -s``)."""
        sent = {}
        for i in range(self.nodes):
            out = _run(["tc", "-s", "-n", self.node_ns(i), "qdisc", "show", "dev", "eth0"], "reading a link's counters")
            match = re.search(r"Sent (\d+) bytes", out)
            sent[i] = int(match.group(1)) if match else 0
        return sent

    def queues(self) -> dict[str, str]:
        """``tc``'s own account of each link end's queue: what the kernel is really doing."""
        return {f"{ns}/{dev}": _run(["tc", "-n", ns, "qdisc", "show", "dev", dev], "reading a queue").strip()
                for ns, dev in self._ends()}

    def destroy(self) -> None:
        """End every process left in the namespaces, then remove them (with their links and queues)."""
        remove_namespaces(self.namespaces())

    def __repr__(self) -> str:
        return f"<Network {self.nodes} nodes on {self.subnet}, link {self.link}>"


def remove_namespaces(names: list[str]) -> None:
    """Kill what runs in each namespace and delete it; wait (bounded) until the kernel has let go."""
    present = [n for n in names if os.path.exists(os.path.join(_RUN_NETNS, n))]
    for name in present:
        with contextlib.suppress(DistlabError):
            for pid in _run(["ip", "netns", "pids", name], "listing a node's processes").split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
    for name in present:
        with contextlib.suppress(DistlabError):
            _run(["ip", "netns", "del", name], "removing a node")
    wait_for(lambda: not any(os.path.exists(os.path.join(_RUN_NETNS, n)) for n in present), 5.0)


def remove_orphans() -> list[str]:
    """Remove the namespaces of labs whose notebook died with them still up (their owner pid is gone)."""
    orphans = []
    for name in _lab_namespaces():
        match = _NS_PATTERN.match(name)
        if match and not pid_alive(int(match.group(1))):
            orphans.append(name)
    if orphans:
        remove_namespaces(orphans)
    return orphans

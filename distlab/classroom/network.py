"""A learner's own network: a namespace in which their server, kernels and labs live, reachable by the hub alone.

On one machine every user shares loopback, and a lab listens on it: ipyparallel's controller (its
messages are signed, but it accepts the connection), torch's TCPStore and gloo's pairs (neither
asks who connects). So a learner's server runs in a network namespace of its own,
``distlab-<hub pid>-<k>-learner``: its loopback is the learner's alone, and every port a lab opens
there is out of every other learner's reach, whatever distlab or the learner's code binds to.

The namespace has one link, a veth pair, addressed point to point:

    host (the hub's netns)                         the learner's namespace
    hub address 198.19.24x.1 (on lo)  ----veth---- learner address 198.19.24x.(k+2)

The hub listens on the hub address for the servers' API calls, and the proxy reaches each server
at its learner address. Each namespace has a route to the hub address and to nothing else: no
default route, so one learner's namespace cannot address another's (nor the machine's network;
the host does not forward). Each hub claims a /24 of its own (``claim_network``: the first whose hub
address is not on loopback yet) from the top of RFC 2544's benchmarking block, below which distlab's
own lab subnets are taken from the bottom up (``cluster.subnets.DEFAULT_POOL``).

The namespace goes with the server (``remove``): the kernel removes the veth pair with it. If the
hub is killed, ``cluster.namespaces.remove_orphans`` finds it by the hub's pid in its name.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os

from ..cluster.namespaces import RUN_NETNS, remove_namespaces, run
from ..errors import DistlabError
from ..host import enter_network_namespace

__all__ = ["BLOCK", "LearnerNetwork", "claim_network", "hub_address", "release_network"]

#: Where hubs' networks come from: a /24 each, its first address the hub's, learner k the (k+2)th.
BLOCK = ipaddress.IPv4Network("198.19.240.0/20")


def hub_address(network: ipaddress.IPv4Network) -> str:
    return str(network[1])


def claim_network() -> ipaddress.IPv4Network:
    """A /24 of ``BLOCK`` no other hub of this machine holds, its hub address put on loopback (where
    every learner's link reaches it). Adding the address is the claim: the kernel refuses a second."""
    for network in BLOCK.subnets(new_prefix=24):
        try:
            run(["ip", "addr", "add", f"{hub_address(network)}/32", "dev", "lo"], "giving the hub its address")
        except DistlabError as exc:
            if "File exists" in str(exc) or "already assigned" in str(exc):
                continue  # another hub's
            raise
        return network
    raise DistlabError(f"every /24 of {BLOCK} is held by a hub of this machine: stop one")


def release_network(network: ipaddress.IPv4Network) -> None:
    with contextlib.suppress(DistlabError):
        run(["ip", "addr", "del", f"{hub_address(network)}/32", "dev", "lo"], "removing the hub's address")


class LearnerNetwork:
    """Learner ``index``'s namespace of hub ``owner``: made, entered by the server's process, removed."""

    def __init__(self, owner: int, index: int, network: ipaddress.IPv4Network) -> None:
        if not 0 <= index < network.num_addresses - 3:
            raise ValueError(f"learner index {index} is outside {network} (at most {network.num_addresses - 3})")
        self.name = f"distlab-{owner}-{index}-learner"
        self.address = str(network[index + 2])
        self.hub = hub_address(network)
        # Interface names are at most 15 characters.
        self.host_side = f"dlc{index}-{owner % 100_000}"

    def make(self) -> None:
        """The namespace, its loopback up, and its one link to the hub."""
        run(["ip", "netns", "add", self.name], f"making {self.name}")
        try:
            ns = ["ip", "-n", self.name]
            run([*ns, "link", "set", "lo", "up"], "bringing the learner's loopback up")
            run(["ip", "link", "add", self.host_side, "type", "veth", "peer", "name", "hub0", "netns", self.name],
                "linking the learner's namespace to the hub")
            run(["ip", "link", "set", self.host_side, "up"], "bringing the hub's end of the link up")
            # The hub's replies leave from the hub address, the one route the learner has back.
            run(["ip", "route", "add", f"{self.address}/32", "dev", self.host_side, "src", self.hub],
                "routing the hub to the learner")
            run([*ns, "addr", "add", f"{self.address}/32", "dev", "hub0"], "addressing the learner")
            run([*ns, "link", "set", "hub0", "up"], "bringing the learner's end of the link up")
            run([*ns, "route", "add", f"{self.hub}/32", "dev", "hub0", "src", self.address],
                "routing the learner to the hub")
        except BaseException:
            self.remove()
            raise

    def enter(self) -> None:
        """Move the calling process into the namespace (run after fork, while it is still root)."""
        enter_network_namespace(os.path.join(RUN_NETNS, self.name), self.name)

    def remove(self) -> None:
        """Kill what still runs in the namespace and remove it (and with it the link)."""
        remove_namespaces([self.name])

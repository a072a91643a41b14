"""The network of a lab on emulated nodes (``nodes=K``): the links between nodes and the racks'
uplinks, read and reshaped between cells (``cluster.nodes`` makes them; ``processes`` holds them).

:class:`NetworkControls` answers for the lab's ``link``, ``set_link``, ``uplink``, ``racks`` and the
bytes counted on the links. A reshape is checked as the lab's own configuration is, and returns the
configuration with it (the lab keeps that, and tells its views)."""

from __future__ import annotations

from dataclasses import replace

from ..cluster.nodes import Link, Network
from ..errors import LabUsageError
from .config import LabConfig
from .processes import LabProcesses
from .world import RankTable

__all__ = ["NetworkControls"]


class NetworkControls:
    """A lab's emulated network, when ``processes`` has one."""

    def __init__(self, processes: LabProcesses) -> None:
        self._processes = processes

    @property
    def _network(self) -> Network | None:
        return self._processes.network

    def caption(self) -> str:
        """What the rank table says under it: the nodes and their links ("" without nodes)."""
        return "" if self._network is None else self._network.describe()

    @property
    def link(self) -> Link | None:
        """The link between nodes now (``.rate_bps``, ``.latency_s``; prints as "1gbit"); None where
        nothing is shaped (no nodes, or nodes with an unshaped link)."""
        return self._network.link if self._network is not None else None

    def set_link(self, config: LabConfig, rate: str | None, latency: str | float | None = None) -> LabConfig:
        """Reshape every node's link, both ways: the lab's ``config`` with the new link."""
        self.require("set_link")
        assert self._network is not None
        config = replace(config, link=rate, latency=latency)  # checked as the lab's own config is
        self._network.set_link(config.node_link())
        return config

    @property
    def uplink(self) -> Link | None:
        """Each rack's uplink to the spine now; None where nothing is shaped there (no racks, or not shaped)."""
        return self._network.uplink if self._network is not None else None

    def racks(self, table: RankTable) -> list[list[int]]:
        """The ranks of ``table`` in each rack, rack by rack ([] for a lab without racks)."""
        network = self._network
        if network is None or not network.racks:
            return []
        rack_of = {Network.hostname(node): k for k, nodes in enumerate(network.rack_nodes()) for node in nodes}
        racks: list[list[int]] = [[] for _ in range(network.racks)]
        for r in table:
            racks[rack_of[r.host]].append(r.rank)
        return racks

    def set_uplink(self, config: LabConfig, rate: str | None) -> LabConfig:
        """Reshape every rack's uplink to the spine, both ways: the lab's ``config`` with the new uplink."""
        self.require("set_uplink")
        assert self._network is not None
        if not self._network.racks:
            raise LabUsageError(
                "set_uplink needs a lab in racks: start one like distlab.start(ranks=4, nodes=4, racks=2, "
                'uplink="1gbit") (%dist start -n 4 --nodes 4 --racks 2 --uplink 1gbit)'
            )
        config = replace(config, uplink=rate)  # checked as the lab's own config is
        self._network.set_uplink(config.rack_uplink())
        return config

    def uplink_bytes(self) -> dict[int, tuple[int, int]]:
        """{rack: (bytes it sent up to the spine, bytes it received down from it)} so far, as the
        kernel's queues counted them. Take it before and after a cell to see what crossed between racks."""
        self.require("uplink_bytes")
        assert self._network is not None
        return self._network.uplink_bytes()

    def link_bytes(self) -> dict[int, int]:
        """{node: bytes it has sent onto its link so far}, as the kernel's queue counted them (frames,
        headers included). Take it before and after a cell to see what crossed the links."""
        self.require("link_bytes")
        assert self._network is not None
        return self._network.sent_bytes()

    def require(self, what: str) -> None:
        """Refuse ``what`` (one line, how to get nodes) in a lab without emulated nodes."""
        if self._network is None:
            raise LabUsageError(
                f"{what} needs a lab on emulated nodes: start one like distlab.start(ranks=4, nodes=2, link=\"1gbit\") "
                "(%dist start -n 4 --nodes 2 --link 1gbit)"
            )

"""The network half of a lab on emulated nodes (``nodes=K``), mixed into ``LabCore``: the links
between nodes, read and reshaped between cells (``cluster.nodes`` makes them)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..cluster.nodes import Link, Network
from ..errors import LabUsageError
from .config import LabConfig

__all__ = ["HasNodes"]


class HasNodes:
    """A lab's emulated network, when it has one (the state is ``LabCore``'s)."""

    config: LabConfig
    _network: Network | None

    if TYPE_CHECKING:  # what LabCore provides

        def _require_running(self) -> None: ...
        def _tell(self, event: str) -> None: ...
        @property
        def table(self) -> Any: ...

    def _network_caption(self) -> str:
        return "" if self._network is None else self._network.describe()

    @property
    def link(self) -> Link | None:
        """The link between nodes now (``.rate_bps``, ``.latency_s``; prints as "1gbit"); None where
        nothing is shaped (no nodes, or nodes with an unshaped link)."""
        return self._network.link if self._network is not None else None

    def set_link(self, rate: str | None, latency: str | float | None = None) -> Link | None:
        """Reshape every node's link, both ways, between cells: ``lab.set_link("100mbit")``.

        ``latency`` adds a one-way delay between nodes where the kernel has netem. ``None`` as the
        rate takes the shaping off. Returns the new link.
        """
        self._require_nodes("set_link")
        assert self._network is not None
        config = replace(self.config, link=rate, latency=latency)  # checked as the lab's own config is
        link = config.node_link()
        self._network.set_link(link)
        self.config = config
        self._tell("changed")
        return link

    @property
    def uplink(self) -> Link | None:
        """Each rack's uplink to the spine now; None where nothing is shaped there (no racks, or not shaped)."""
        return self._network.uplink if self._network is not None else None

    @property
    def racks(self) -> list[list[int]]:
        """The ranks in each rack, rack by rack ([] for a lab without racks): who shares the fast links."""
        network = self._network
        if network is None or not network.racks:
            return []
        rack_of = {Network.hostname(node): k for k, nodes in enumerate(network.rack_nodes()) for node in nodes}
        racks: list[list[int]] = [[] for _ in range(network.racks)]
        for r in self.table:
            racks[rack_of[r.host]].append(r.rank)
        return racks

    def set_uplink(self, rate: str | None) -> Link | None:
        """Reshape every rack's uplink to the spine, both ways, between cells: ``lab.set_uplink("100mbit")``.
        ``None`` takes the shaping off. Returns the new uplink."""
        self._require_nodes("set_uplink")
        assert self._network is not None
        if not self._network.racks:
            raise LabUsageError(
                "set_uplink needs a lab in racks: start one like distlab.start(ranks=4, nodes=4, racks=2, "
                'uplink="1gbit") (%dist start -n 4 --nodes 4 --racks 2 --uplink 1gbit)'
            )
        config = replace(self.config, uplink=rate)  # checked as the lab's own config is
        uplink = config.rack_uplink()
        self._network.set_uplink(uplink)
        self.config = config
        self._tell("changed")
        return uplink

    def uplink_bytes(self) -> dict[int, tuple[int, int]]:
        """{rack: (bytes it sent up to the spine, bytes it received down from it)} so far, as the
        kernel's queues counted them. Take it before and after a cell to see what crossed between racks."""
        self._require_nodes("uplink_bytes")
        assert self._network is not None
        return self._network.uplink_bytes()

    def link_bytes(self) -> dict[int, int]:
        """{node: bytes it has sent onto its link so far}, as the kernel's queue counted them (frames,
        headers included). Take it before and after a cell to see what crossed the links."""
        self._require_nodes("link_bytes")
        assert self._network is not None
        return self._network.sent_bytes()

    def _require_nodes(self, what: str) -> None:
        self._require_running()
        if self._network is None:
            raise LabUsageError(
                f"{what} needs a lab on emulated nodes: start one like distlab.start(ranks=4, nodes=2, link=\"1gbit\") "
                "(%dist start -n 4 --nodes 2 --link 1gbit)"
            )

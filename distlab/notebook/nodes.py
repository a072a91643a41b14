"""The network half of a lab on emulated nodes (``nodes=K``), mixed into ``LabCore``: the links
between nodes, read and reshaped between cells (``cluster.nodes`` makes them)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

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

    def _network_caption(self) -> str:
        network = self._network
        if network is None:
            return ""
        return (
            f"{network.nodes} nodes on {network.subnet}, each linked to a switch at {network.switch_addr}; "
            f"link {network.link or 'not shaped'} (each way, every node's link)"
        )

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

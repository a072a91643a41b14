"""Freeing ranks stuck in a collective, from the notebook.

SIGINT cannot reach a rank blocked inside a C++ collective. Two ways free it: the ranks that are
free tear their group down, cutting their connections to the stuck ones (``rank.group.abort_group``);
and each stuck rank is asked, on ipyparallel's control channel, to cut its own connections to its
peers (``rank.release``): its control thread serves the request while its main thread waits. Either
way the stuck collective fails and the rank's cell returns, its namespace intact. Both travel as
ipyparallel's own messages do, so they reach ranks on any host, not only the notebook's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from .. import ipycompat
from ..wire import RELEASE_REQUEST
from . import rpc
from .world import RankInfo

__all__ = ["Releaser"]

# How long the stuck ranks get to cut their connections and say so.
RELEASE_WAIT_S = 1.0


class Releaser:
    """Frees one world's stuck ranks."""

    def __init__(self) -> None:
        self._client: ipycompat.IppClient = None

    def listen(self, client: ipycompat.IppClient, table: Sequence[RankInfo], timeout_s: float) -> None:
        """Have each rank answer release requests on its control channel (once per world)."""
        self._client = client
        asks = [rpc.serve_release(client[r.engine_id]) for r in table]
        for ar in asks:
            with contextlib.suppress(Exception):  # without it, stuck ranks are killed instead
                ar.get(timeout=timeout_s)

    def release(self, ranks: Sequence[RankInfo]) -> None:
        """Ask stuck ranks to drop their connections to their peers; wait up to 1 s for their answers."""
        client = self._client
        alive = set(client.ids) if client is not None else set()
        targets = [r.engine_id for r in ranks if r.engine_id in alive]
        if not targets:
            return
        # No answer in time (or a rank gone meanwhile) is no error: the caller kills what is still stuck.
        # An ipyparallel whose control request changed raises here, rather than silently freeing nothing.
        ipycompat.control_request(client, targets, RELEASE_REQUEST, {}, RELEASE_WAIT_S)

    def abort_on_free_ranks(self, client: ipycompat.IppClient, table: Sequence[RankInfo], stuck: Sequence[int]) -> bool:
        """Tear down the group on every live rank not in ``stuck``; True if any rank did."""
        alive = set(client.ids)
        free = [r for r in table if r.rank not in stuck and r.engine_id in alive]
        aborts = [rpc.abort_group(client[r.engine_id]) for r in free]
        for ar in aborts:
            with contextlib.suppress(Exception):  # a rank gone or slow: the caller kills what stays stuck
                ar.get(timeout=0.5)
        return bool(free)

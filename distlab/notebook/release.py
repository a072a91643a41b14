"""Freeing ranks stuck in a collective, from the notebook.

SIGINT cannot reach a rank blocked inside a C++ collective. Two ways free it: the ranks that are
free tear their group down, cutting their connections to the stuck ones (``rank.group.abort_group``);
and each stuck rank on this host is asked, through a private UNIX socket its side thread serves
(``rank.release``), to cut its own connections to its peers. Either way the stuck collective fails
and the rank's cell returns, its namespace intact.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from . import rpc
from .world import RankInfo

__all__ = ["Releaser"]


class Releaser:
    """The release sockets of one world's ranks on this host."""

    def __init__(self) -> None:
        self._dir: str | None = None

    def open(self) -> str:
        """The private folder (mode 0700) the release sockets go in, made on first use."""
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="distlab-release-")
        return self._dir

    def listen(self, client: Any, table: Sequence[RankInfo], timeout_s: float) -> None:
        """Have each rank on this host serve release requests (once per world)."""
        here = socket.gethostname()
        local = [r for r in table if r.host == here]
        if not local or not hasattr(socket, "AF_UNIX"):
            return
        self.open()
        pids = [r.pid for r in local]
        asks = [rpc.listen_for_release(client[r.engine_id], self._path(r), pids) for r in local]
        for ar in asks:
            with contextlib.suppress(Exception):  # without it, stuck ranks are killed instead
                ar.get(timeout=timeout_s)

    def release(self, ranks: Sequence[RankInfo]) -> None:
        """Ask stuck ranks on this host to drop their connections to their peers; wait up to 1 s for them."""
        if self._dir is None:
            return
        here = socket.gethostname()
        connections = []
        for r in ranks:
            if r.host != here:
                continue
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(1.0)
            try:
                sock.connect(self._path(r))
                sock.sendall(b"release")
                connections.append(sock)
            except OSError:
                sock.close()
        deadline = time.monotonic() + 1.0
        for sock in connections:  # every rank works on its release at once; wait for their answers
            with sock, contextlib.suppress(OSError):
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                sock.recv(16)

    def abort_on_free_ranks(self, client: Any, table: Sequence[RankInfo], stuck: Sequence[int]) -> bool:
        """Tear down the group on every live rank not in ``stuck``; True if any rank did."""
        alive = set(client.ids)
        free = [r for r in table if r.rank not in stuck and r.engine_id in alive]
        here = free[0].host if free else ""
        # Connections to stuck ranks on the same host are shut down too (see rank.group.abort_group).
        stuck_pids = [table[r].pid for r in stuck if table[r].host == here]
        aborts = [rpc.abort_group(client[r.engine_id], stuck_pids) for r in free]
        for ar in aborts:
            with contextlib.suppress(Exception):
                ar.get(timeout=0.5)
        return bool(free)

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _path(self, info: RankInfo) -> str:
        assert self._dir is not None
        return os.path.join(self._dir, f"{info.pid}.sock")

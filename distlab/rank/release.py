"""Releasing a rank stuck in a collective: its connections to its peers are shut down under it.

A rank blocked in a C++ collective cannot be interrupted (SIGINT waits for the call to return).
Shutting down its TCP connections to its peers makes the collective fail at once, while the
process and its namespace live on.

Which connections are the peers'? Those the engine did not have when it first described itself
(``remember_controller_connections``, before any store or process group existed): those first ones
are ipyparallel's, to its controller. Everything opened since (the rendezvous store, gloo's pairs in
every group and subgroup) belongs to the ranks' own traffic, on this host or any other.

The request reaches a stuck rank on ipyparallel's control channel (``serve_release``): the engine
serves it from its control thread, which runs while the main thread waits in C++ (collectives
release the GIL). It travels like every other message to the engine, so it works for ranks on any
host the controller reaches, not only on the notebook's.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

from .. import ipycompat_engine
from ..wire import RELEASE_REPLY, RELEASE_REQUEST

__all__ = [
    "remember_controller_connections",
    "serve_release",
    "shutdown_peer_connections",
]

# Remote endpoints of the connections the engine had before any process group: ipyparallel's.
_controller_endpoints: set[tuple[str, int]] | None = None


def _established() -> list[Any]:
    import psutil

    proc = psutil.Process()
    listing = getattr(proc, "net_connections", None) or proc.connections  # psutil < 6 names it connections
    return [c for c in listing(kind="tcp") if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.fd >= 0]


def remember_controller_connections() -> None:
    """Note the connections this engine has now, before any rendezvous: they are ipyparallel's."""
    global _controller_endpoints
    if _controller_endpoints is None:
        _controller_endpoints = {(c.raddr.ip, c.raddr.port) for c in _established()}


def shutdown_peer_connections() -> int:
    """Shut down every TCP connection of this process that is not ipyparallel's; return how many.

    ``shutdown`` acts on the socket itself (every descriptor of it), so gloo's own threads see the
    connection fail at once. The descriptor is left to its owner to close.
    """
    keep = _controller_endpoints if _controller_endpoints is not None else set()
    closed = 0
    for c in _established():
        if (c.raddr.ip, c.raddr.port) in keep:
            continue
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(c.fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
            closed += 1
    return closed


def serve_release() -> bool:
    """Answer release requests on this engine's control channel (from its control thread).

    When every rank is stuck there is no free one to tear the group down from outside; the control
    thread still runs. On a request it shuts down this rank's connections to its peers and answers
    when done: the notebook rebuilds the group only after that, so a late release can never cut
    the new group's connections.
    """

    def answer(request: dict[str, object]) -> dict[str, object]:
        closed = 0
        with contextlib.suppress(Exception):  # whatever failed, the notebook hears back and goes on
            closed = shutdown_peer_connections()
        return {"status": "ok", "closed": closed}

    return ipycompat_engine.serve_control_request(RELEASE_REQUEST, RELEASE_REPLY, answer)

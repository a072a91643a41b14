"""Releasing a rank stuck in a collective: its connections to its peers are shut down under it.

A rank blocked in a C++ collective cannot be interrupted (SIGINT waits for the call to return).
Shutting down its TCP connections to its peers makes the collective fail at once, while the
process and its namespace live on. The notebook asks for it through a private UNIX socket
(``listen_for_release``) or through a free rank's ``group.abort_group``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading

__all__ = ["listen_for_release", "shutdown_connections_to"]


def shutdown_connections_to(peer_pids: set[int]) -> int:
    """Shut down this process's established TCP connections to the processes ``peer_pids``."""
    if not peer_pids:
        return 0
    import psutil

    me = os.getpid()
    connections = psutil.net_connections(kind="tcp")
    owner = {(c.laddr.ip, c.laddr.port): c.pid for c in connections if c.pid and c.laddr}
    closed = 0
    for c in connections:
        if c.pid != me or c.status != psutil.CONN_ESTABLISHED or not c.raddr or c.fd < 0:
            continue
        if owner.get((c.raddr.ip, c.raddr.port)) in peer_pids:
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(c.fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)  # shutdown acts on the socket, not just this fd
                closed += 1
    return closed


def listen_for_release(path: str, peer_pids: list[int]) -> bool:
    """Serve release requests on a private UNIX socket, from a side thread.

    When every rank is stuck there is no free one to tear the group down from outside. This thread
    can still run (collectives release the GIL while they wait): on b"release" it shuts down this
    rank's connections to its peers on this host, the stuck collective fails, and the cell returns
    with its namespace intact.
    """
    peers = {int(p) for p in peer_pids} - {os.getpid()}
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)  # in a directory only this user can enter (the notebook made it 0700)
    server.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                with contextlib.suppress(OSError):
                    if conn.recv(16) == b"release":
                        closed = 0
                        with contextlib.suppress(Exception):
                            closed = shutdown_connections_to(peers)
                        # Answer when done: the notebook rebuilds the group only after this, so a
                        # late release can never cut the new group's connections.
                        conn.sendall(str(closed).encode())

    threading.Thread(target=serve, name="distlab-release", daemon=True).start()
    return True

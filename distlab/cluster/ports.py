"""The ports of a local lab's controller: a block below the range the kernel hands out by itself.

ipyparallel's controller picks each of its ports (about twenty) by binding port 0 and closing the
socket at once; its schedulers and its heart monitor, processes of their own, bind those numbers
again only later. Port 0 and every outgoing TCP connection draw from the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), so on a machine busy with connections (notebook
servers, kernels, other labs: a test suite beside a notebook) a port can be taken in between. When
it is the heart monitor's, that process dies at its bind, no engine hears a heartbeat and the hub
never finishes a registration: the start ends at its deadline with every engine running and
logging "No heartbeat in the last 600 ms (49 time(s) in a row)". Seen twice in the suite's runs.

A port below the ephemeral range is only ever taken by a process that binds it by number, so a
block of them, each checked free just before the controller starts, leaves nothing to chance
but another controller choosing the same block at the same moment (one in hundreds of blocks).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["CONTROLLER_PORTS", "controller_ports"]

#: Ports in a controller's block: ipyparallel needs 14 at least (17 for its default broadcast
#: tree) and draws random ones again if a block runs out.
CONTROLLER_PORTS = 32
# The lowest port a block starts at: above the well-known and the usual fixed service ports
# (Jupyter's 8888, ...) and below the ephemeral range of every common kernel configuration.
_LOWEST = 10_000
_TRIES = 64


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The kernel's range for port 0 and outgoing connections (Linux's default where unreadable)."""
    try:
        low, high = (int(v) for v in Path(path).read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def controller_ports(ip: str, count: int = CONTROLLER_PORTS, rng: random.Random | None = None,
                     ephemeral: tuple[int, int] | None = None) -> range | None:
    """``count`` consecutive ports below the ephemeral range, each free on ``ip`` now ("*": every
    interface); None where the range leaves no room below it (ipyparallel then picks its own)."""
    rng = rng or random.Random()
    low, _ = ephemeral or ephemeral_range()
    top = low - count
    if top <= _LOWEST:
        return None
    host = "" if ip in ("*", "0.0.0.0") else ip
    for _ in range(_TRIES):
        start = rng.randrange(_LOWEST, top)
        block = range(start, start + count)
        if all(_free(host, port) for port in block):
            return block
    return None


def _free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        # As zmq binds a listening socket: a port whose earlier connection lingers in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True

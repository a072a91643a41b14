"""Who an engine is before it has a rank: host, pid, the address others reach it at, its GPUs."""

from __future__ import annotations

import os
import socket
import sys

import torch

from ..host import machine_id
from ..wire import EngineIdentity
from . import release

__all__ = ["address_toward", "describe", "interface_of", "machine_id"]

# Environment variables through which launchers tell a process its rank; the first one set wins.
_LAUNCHER_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


def describe(controller_ip: str) -> EngineIdentity:
    """This engine's identity, from which the notebook builds the rank table."""
    release.remember_controller_connections()  # before any group: what this engine has now is ipyparallel's
    launcher_rank = next((int(os.environ[v]) for v in _LAUNCHER_RANK_VARS if v in os.environ), None)
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "addr": address_toward(controller_ip),
        "machine": machine_id(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "launcher_rank": launcher_rank,
        "python": sys.version.split()[0],
        "torch": str(torch.__version__),  # a plain str: torch's TorchVersion would import torch where it is read
    }


def address_toward(peer_ip: str) -> str:
    """The local address this host uses to reach ``peer_ip``: how other hosts on that network reach us.

    A UDP connect sends nothing; it only asks the kernel which interface routes to the peer.
    """
    if not peer_ip or peer_ip in ("*", "0.0.0.0"):
        peer_ip = "8.8.8.8"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer_ip, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def interface_of(peer: str) -> str | None:
    """The name of the interface this host reaches ``peer`` through (the one holding that local address)."""
    import psutil

    try:
        peer_ip = socket.gethostbyname(peer)
    except OSError:
        return None
    local = address_toward(peer_ip)
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            return name
    return None

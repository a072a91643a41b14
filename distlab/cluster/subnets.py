"""Which subnet a lab's emulated nodes take: one the user asked for, checked, or the first free /24 of
a range reserved for benchmarking networks; labs starting at once pick theirs under one lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import time

from ..errors import DistlabError, LabUsageError
from .namespaces import lab_namespaces
from .namespaces import run as _run

__all__ = ["DEFAULT_POOL", "NetworkLock", "check_subnet", "pick_subnet"]

#: Where lab subnets come from by default: reserved for benchmarking networks (RFC 2544), so no
#: real network this machine could talk to uses them. Each lab takes one /24 of it.
DEFAULT_POOL = ipaddress.IPv4Network("198.18.0.0/15")
_LAB_PREFIX = 24

_LOCK_FILE = "/run/distlab-netns.lock"


def _subnets_in_use() -> list[ipaddress.IPv4Network]:
    """The subnets of the labs whose switches exist now (read off each switch's bridge)."""
    used: list[ipaddress.IPv4Network] = []
    for name in lab_namespaces():
        if not name.endswith("-sw"):
            continue
        with contextlib.suppress(DistlabError):
            out = _run(["ip", "-n", name, "-4", "-o", "addr", "show", "dev", "br0"], "reading a lab's subnet")
            for word in out.split():
                if "/" in word and word[0].isdigit():
                    used.append(ipaddress.IPv4Interface(word).network)  # `-4`: IPv4 addresses only
    return used


def check_subnet(
    value: object, nodes: int, spelling: tuple[str, str] = ("subnet", 'subnet="198.18.7.0/24"')
) -> ipaddress.IPv4Network:
    """``value`` as an IPv4 network with room for ``nodes`` nodes and the switch."""
    name, example = spelling
    try:
        net = ipaddress.IPv4Network(value)
    except (ValueError, TypeError):
        raise LabUsageError(f"{name} must be an IPv4 network, like {example} (got {value!r})") from None
    room = max(0, net.num_addresses - 2)
    if room < nodes + 1:
        raise LabUsageError(
            f"{name} {net} has room for {room} addresses, and {nodes} nodes and their switch need {nodes + 1}: "
            f"give a larger one, like {example}"
        )
    return net


def pick_subnet(nodes: int, asked: object = None, in_use: bool = True) -> ipaddress.IPv4Network:
    """The lab's subnet: ``asked`` if given and free, else the first free /24 of 198.18.0.0/15
    (``in_use``: among other labs' named namespaces; a user namespace's network is its own)."""
    used = _subnets_in_use() if in_use else []
    if asked is not None:
        net = check_subnet(asked, nodes)
        clash = next((u for u in used if u.overlaps(net)), None)
        if clash is not None:
            raise LabUsageError(
                f"subnet {net} overlaps {clash}, which another lab is using: choose another, or leave it out"
            )
        return net
    for net in DEFAULT_POOL.subnets(new_prefix=_LAB_PREFIX):
        if not any(u.overlaps(net) for u in used):
            return net
    raise DistlabError(f"every /{_LAB_PREFIX} of {DEFAULT_POOL} is taken by a running lab: stop one")


class NetworkLock:
    """Labs starting at once pick disjoint subnets: the pick and the making happen under one lock."""

    def __enter__(self) -> NetworkLock:
        self._fd = os.open(_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + 30
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self._fd)
                    raise DistlabError(f"another lab held {_LOCK_FILE} for 30 s while making its network") from None
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)

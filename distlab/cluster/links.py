"""What joins emulated nodes: a link's rate and latency, spelled as ``tc`` spells them, and how ranks spread over nodes.

Pure values, checked and printed without a process: ``cluster/nodes.py`` shapes the links they
describe, and ``notebook/config.py`` checks a user's ``link=``/``latency=`` with them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .. import checks
from ..errors import LabUsageError

__all__ = ["Link", "format_duration", "format_rate", "parse_duration", "parse_rate", "spread"]

# tc's rate units are SI: 1mbit is 10**6 bits per second.
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$")
_DURATION_RE = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*([a-z]+)\s*$")


def parse_rate(value: object, name: str = "link", example: str = 'link="1gbit"') -> int:
    """Bits per second from tc's spelling: "100mbit", "1gbit", "2.5gbit" (SI units, as tc reads them)."""
    match = _RATE_RE.match(value.lower()) if isinstance(value, str) else None
    if not match or match.group(2) not in _RATE_UNITS:
        raise LabUsageError(
            f"{name} must be a bandwidth with a unit, like {example} (units: bit, kbit, mbit, gbit, tbit); "
            f"got {value!r}"
        )
    bits = round(float(match.group(1)) * _RATE_UNITS[match.group(2)])
    if bits < 8000:
        raise LabUsageError(f"{name} must be at least 8kbit (got {value!r})")
    return bits


def parse_duration(value: object, name: str = "latency", example: str = 'latency="200us"') -> float:
    """Seconds from "200us", "1ms", "0.5s", or a number of seconds; >= 0."""
    if isinstance(value, str):
        match = _DURATION_RE.match(value.lower())
        if not match or match.group(2) not in _TIME_UNITS:
            raise LabUsageError(f"{name} must be a time with a unit, like {example} (units: us, ms, s); got {value!r}")
        value = float(match.group(1)) * _TIME_UNITS[match.group(2)]
    if isinstance(value, str) or value is None:
        raise LabUsageError(f"{name} must be a time, like {example} (got {value!r})")
    return checks.non_negative(name, value, example=example)


def format_rate(bits: float) -> str:
    """The shortest of tc's spellings: 1000000000 -> "1gbit"."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bits >= _RATE_UNITS[unit]:
            return f"{bits / _RATE_UNITS[unit]:g}{unit}"
    return f"{bits:g}bit"


def format_duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:g}s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:g}ms"
    return f"{seconds * 1e6:g}us"


@dataclass(frozen=True)
class Link:
    """What every node's link to the switch carries: a rate and, where the kernel can, an added delay."""

    #: Bits per second, each way.
    rate_bps: int
    #: Seconds added one way between two nodes (half on each node's link), or None.
    latency_s: float | None = None

    @classmethod
    def parse(cls, rate: object, latency: object = None, *, magic: bool = False) -> Link:
        """From the user's spelling (``link="1gbit", latency="200us"`` or ``--link 1gbit --latency 200us``)."""
        names = ("--link", "--link 1gbit", "--latency", "--latency 200us") if magic else (
            "link", 'link="1gbit"', "latency", 'latency="200us"')
        bits = parse_rate(rate, names[0], names[1])
        delay = None if latency is None else parse_duration(latency, names[2], names[3])
        return cls(bits, delay or None)

    @property
    def bytes_per_s(self) -> float:
        return self.rate_bps / 8

    def __str__(self) -> str:
        text = format_rate(self.rate_bps)
        return text if self.latency_s is None else f"{text}, latency {format_duration(self.latency_s)}"

    def as_dict(self) -> dict[str, object]:
        return {"rate": format_rate(self.rate_bps), "rate_bps": self.rate_bps, "latency_s": self.latency_s}


def spread(ranks: int, nodes: int) -> list[int]:
    """How many of ``ranks`` each of ``nodes`` runs: as even as can be, the first nodes taking one more."""
    return [ranks // nodes + (1 if i < ranks % nodes else 0) for i in range(nodes)]

"""Rates and sizes as distlab prints and plots them: three significant digits, in the unit that fits.

A fixed unit misleads at the ends of its range: a gloo link between two namespaces moves a few MB/s,
which GB/s with two decimals prints as "0.00 GB/s", a bandwidth of nothing.

Plain text, imported by every side that prints bytes (the dashboard; a healing record's heals): a
module of its own, so that what prints a size imports no view.
"""

from __future__ import annotations

import math

__all__ = ["rate", "rate_unit", "size"]

#: Decimal units, largest first (as the theory's GB/s: 1 GB = 1e9 bytes).
_RATE_UNITS = (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3), ("B/s", 1.0))


def rate_unit(largest: float) -> tuple[str, float]:
    """(unit, bytes per second in one of it) for values up to ``largest`` bytes/s: the largest unit
    ``largest`` has at least one of (B/s below 1 B/s, and for no value at all)."""
    for name, scale in _RATE_UNITS:
        if largest >= scale:
            return name, scale
    return _RATE_UNITS[-1]


def rate(bytes_per_s: float) -> str:
    """``bytes_per_s`` as text: "1.23 GB/s", "45.6 MB/s", "789 KB/s"; why there is none when it is not a rate."""
    if not math.isfinite(bytes_per_s) or bytes_per_s <= 0:
        return f"no rate ({bytes_per_s} bytes/s: no transfer was timed)"
    rounded = float(f"{bytes_per_s:.3g}")  # rounded first: 999.7 MB/s is "1.00 GB/s", not "1000 MB/s"
    name, scale = rate_unit(rounded)
    value = rounded / scale
    decimals = max(0, 2 - math.floor(math.log10(value))) if value >= 1 else 2
    return f"{value:.{decimals}f} {name}"


def size(nbytes: float) -> str:
    """``nbytes`` as text in the same units: "144 B", "1.23 KB", "45.6 MB"."""
    if nbytes < 1000:
        return f"{nbytes:.0f} B"
    return rate(nbytes)[: -len("/s")]

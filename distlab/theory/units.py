"""Units and quantities: what "400 MB" or "5 us" is in base units (bytes, seconds), and the
dimension a name carries by its suffix (``_s``, ``_bytes``, ``_bytes_per_s``)."""

from __future__ import annotations

import re

from ._checks import checked_number

# --------------------------------------------------------------------------------------------------
# Units
# --------------------------------------------------------------------------------------------------

#: dimension -> how a sentence names it ("'5 MB' is a size in bytes, not a time").
DIMENSIONS: dict[str, str] = {
    "time": "a time",
    "bytes": "a size in bytes",
    "bandwidth": "a bandwidth",
    "number": "a plain number",
}

#: unit -> (dimension, how many base units one of it is). Decimal prefixes (1 GB = 1e9 B) as network and
#: storage vendors quote them; binary ones (GiB) are there for memory as the OS reports it.
UNITS: dict[str, tuple[str, float]] = {
    "s": ("time", 1.0),
    "ms": ("time", 1e-3),
    "us": ("time", 1e-6),
    "µs": ("time", 1e-6),
    "ns": ("time", 1e-9),
    "min": ("time", 60.0),
    "h": ("time", 3600.0),
    "day": ("time", 86400.0),
    "yr": ("time", 365 * 86400.0),
    "B": ("bytes", 1.0),
    "KB": ("bytes", 1e3),
    "kB": ("bytes", 1e3),
    "MB": ("bytes", 1e6),
    "GB": ("bytes", 1e9),
    "TB": ("bytes", 1e12),
    "KiB": ("bytes", 2.0**10),
    "MiB": ("bytes", 2.0**20),
    "GiB": ("bytes", 2.0**30),
    "TiB": ("bytes", 2.0**40),
    "B/s": ("bandwidth", 1.0),
    "KB/s": ("bandwidth", 1e3),
    "MB/s": ("bandwidth", 1e6),
    "GB/s": ("bandwidth", 1e9),
    "TB/s": ("bandwidth", 1e12),
    "Gbit/s": ("bandwidth", 1e9 / 8),
    "": ("number", 1.0),
    "x": ("number", 1.0),
    "%": ("number", 0.01),
    "thousand": ("number", 1e3),
    "million": ("number", 1e6),
    "billion": ("number", 1e9),
}

_QUANTITY = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(\S*(?:\s*/\s*s)?)\s*$")


def unit_dimension(unit: str) -> str:
    """The dimension of ``unit``: "time", "bytes", "bandwidth" or "number"."""
    try:
        return UNITS[unit][0]
    except KeyError:
        known = ", ".join(repr(u) for u in UNITS if u)
        raise ValueError(f"unknown unit {unit!r}; use one of {known}") from None


def to_base_units(value: float, unit: str) -> float:
    """``value`` given in ``unit``, in base units (seconds, bytes, bytes/s, plain numbers)."""
    unit_dimension(unit)  # raises with the list of units
    return checked_number("value", value) * UNITS[unit][1]


def from_base_units(value: float, unit: str) -> float:
    """``value`` given in base units, expressed in ``unit``."""
    unit_dimension(unit)
    return checked_number("value", value) / UNITS[unit][1]


def dimension_of(name: str) -> str:
    """The dimension a name carries by its suffix (``_bytes_per_s``, ``_bytes``, ``_s``), else "number".

    Bytes counted per step or per layer (``fsdp_bytes_per_step``) are bytes; other rates per second
    (``tokens_per_s``, ``peak_flops_per_s``) are plain numbers, not times.
    """
    if name.endswith("_bytes_per_s"):
        return "bandwidth"
    if name.endswith(("_bytes", "_bytes_per_step", "_bytes_per_layer")):
        return "bytes"
    if name.endswith("_per_s"):
        return "number"
    if name.endswith("_s"):
        return "time"
    return "number"


def parse_quantity(text: str, default_unit: str) -> float:
    """Read "24", "24 ms" or "0.024 s" as a number in base units.

    A bare number is taken in ``default_unit``; a unit written after it must have the same dimension.
    """
    if not isinstance(text, str):
        raise ValueError(f"expected text like '24 ms', got {text!r}")
    dimension = unit_dimension(default_unit)
    match = _QUANTITY.match(text)
    if match is None:
        example = f"'24' or '24 {default_unit}'" if default_unit else "'24'"
        raise ValueError(f"cannot read {text!r} as a number; write it like {example}")
    number, unit = match.group(1), re.sub(r"\s+", "", match.group(2)) or default_unit
    same_kind = ", ".join(u for u, (d, _) in UNITS.items() if d == dimension and u)
    if unit not in UNITS:
        raise ValueError(f"unknown unit {unit!r} in {text!r}; use one of {same_kind}")
    if UNITS[unit][0] != dimension:
        raise ValueError(f"{text!r} is {DIMENSIONS[UNITS[unit][0]]}, not {DIMENSIONS[dimension]}; use {same_kind}")
    return float(number) * UNITS[unit][1]

"""A value summarised as plain data, for a notebook that never imports torch: a tensor's type, shape,
dtype, device and statistics (its local shard and placements for a DTensor), a module's size, a
container's length and item types, any other value's short repr. ``rank/postmortem.py`` summarises a
failed frame's locals with it.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from typing import TYPE_CHECKING, TypedDict

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["EXACT_LIMIT", "REPR_CHARS", "SAMPLE", "safe_str", "summarise", "summarise_safely"]

# Tensors up to this many elements get exact statistics; larger contiguous ones a strided sample
# of about SAMPLE elements (a copy of a few MB, whatever the tensor's size).
EXACT_LIMIT = 1 << 22
SAMPLE = 1 << 20
REPR_CHARS = 80


class ValueSummary(TypedDict, total=False):
    """One value as plain data (:func:`summarise`); ``kind`` and ``type`` always, the rest by kind."""

    kind: str  # "tensor" | "module" | "container" | "array" | "value"
    type: str
    name: str  # a postmortem's local: its name
    parameters: int
    training: bool
    length: int
    items: str
    shape: list[int]
    dtype: str
    device: str
    requires_grad: bool
    stats: dict[str, float]
    nan: int
    inf: int
    note: str
    placements: list[str]
    mesh: list[int]
    local_shape: list[int]
    repr: str


def summarise_safely(value: object) -> ValueSummary:
    """:func:`summarise`, or the value's type alone when summarising it raises."""
    try:
        return summarise(value)
    except Exception as exc:  # noqa: BLE001 - one odd object never hides the rest of the frame
        return {"kind": "value", "type": _type_name(value), "repr": f"<not summarised: {type(exc).__name__}>"}


def summarise(value: object) -> ValueSummary:
    """One value as plain data: ``{"kind": "tensor" | "module" | "container" | "array" | "value", "type", ...}``.

    - tensor: ``shape``, ``dtype``, ``device``, ``requires_grad``, ``stats`` (min, max, mean, norm
      for floats; min, max, mean for integers; ``true`` for bools; norm and max_abs for complex),
      ``nan``/``inf`` counts (stats are then of the finite values), ``note`` (sampled, skipped and
      why); a DTensor also ``placements``, ``mesh`` and ``local_shape`` (stats of the local shard).
    - module: ``parameters`` (count of elements), ``training``.
    - container: ``length`` and ``items`` (the items' type when they share one).
    - array (numpy): ``shape``, ``dtype``.  value: ``repr``, cut to about 80 characters.
    """
    if isinstance(value, torch.Tensor):
        return _tensor(value)
    if isinstance(value, torch.nn.Module):
        return {
            "kind": "module",
            "type": _type_name(value),
            "parameters": sum(p.numel() for p in value.parameters()),
            "training": bool(value.training),
        }
    if isinstance(value, (list, tuple, dict, set, frozenset, deque)):
        items = list(value.values()) if isinstance(value, dict) else value
        kinds = {_type_name(item) for _, item in zip(range(50), items)}
        return {
            "kind": "container",
            "type": _type_name(value),
            "length": len(value),
            "items": kinds.pop() if len(kinds) == 1 else "",
        }
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return {"kind": "array", "type": "ndarray", "shape": list(value.shape), "dtype": str(value.dtype)}
    return {"kind": "value", "type": _type_name(value), "repr": _short_repr(value)}


def _tensor(t: torch.Tensor) -> ValueSummary:
    out: ValueSummary = {
        "kind": "tensor",
        "type": _type_name(t),
        "shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "device": str(t.device),
        "requires_grad": bool(t.requires_grad),
        "stats": {},
        "nan": 0,
        "inf": 0,
        "note": "",
    }
    local = t
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        local = t.to_local()
        out["placements"] = [repr(p) for p in t.placements]
        out["mesh"] = list(t.device_mesh.shape)
        out["local_shape"] = list(local.shape)
    try:
        _fill_stats(out, local)
    except Exception as exc:  # noqa: BLE001 - a tensor whose values cannot be read is still described
        out["stats"], out["note"] = {}, f"stats unavailable: {type(exc).__name__}: {safe_str(exc)}"[:REPR_CHARS]
    return out


def _fill_stats(out: ValueSummary, t: torch.Tensor) -> None:
    if t.is_meta:
        out["note"] = "a meta tensor: no values"
        return
    if t.layout != torch.strided or t.is_quantized:
        out["note"] = f"stats skipped: {str(t.layout).removeprefix('torch.')}{', quantized' if t.is_quantized else ''}"
        return
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        # A subclass (a fake or wrapper tensor) may compute on read, or not hold values at all.
        out["note"] = f"stats skipped: a {_type_name(t)}"
        return
    n = t.numel()
    if n == 0:
        out["note"] = "empty"
        return
    if t.device.type == "cuda" and not torch.cuda.current_stream(t.device).query():
        # Reading it would wait for work queued before it, which may be a collective that never ends.
        out["note"] = "stats skipped: its GPU still has work queued (a collective that never finished?)"
        return
    with torch.no_grad():
        x = t.detach()
        if n > EXACT_LIMIT:
            if not x.is_contiguous():
                out["note"] = f"stats skipped: {n} elements, not contiguous"
                return
            step = math.ceil(n / SAMPLE)
            x = x.view(-1)[::step]  # a view: only the sample is read
            out["note"] = f"stats of a sample: 1 element in {step}"
        x = x.reshape(-1)
        if x.dtype == torch.bool:
            out["stats"] = {"true": int(x.sum().item())}
        elif x.is_complex():
            magnitude = x.abs().to(_wide(x))
            out["stats"] = {"norm": float(magnitude.norm().item()), "max_abs": float(magnitude.max().item())}
        elif x.is_floating_point():
            wide = x.to(_wide(x))
            nan, inf = int(wide.isnan().sum().item()), int(wide.isinf().sum().item())
            out["nan"], out["inf"] = nan, inf
            if nan or inf:
                wide = wide[wide.isfinite()]
            if wide.numel():
                out["stats"] = {
                    "min": float(wide.min().item()),
                    "max": float(wide.max().item()),
                    "mean": float(wide.mean().item()),
                    "norm": float(wide.norm().item()),
                }
        else:
            out["stats"] = {
                "min": int(x.min().item()),
                "max": int(x.max().item()),
                "mean": float(x.to(_wide(x)).mean().item()),
            }


def _wide(t: torch.Tensor) -> torch.dtype:
    """float64 for the statistics (half precision overflows a norm), but where the device has none."""
    return torch.float32 if t.device.type == "mps" else torch.float64


def _dtensor_type() -> type[DTensor] | None:
    if "torch.distributed.tensor" not in sys.modules:
        return None  # nothing made one: no need to import it
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def _type_name(value: object) -> str:
    return type(value).__name__


def _short_repr(value: object) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - a broken __repr__ is the object's problem, not the postmortem's
        return f"<{_type_name(value)}: repr raised {type(exc).__name__}>"
    if not isinstance(text, str):
        return f"<{_type_name(value)}>"
    return text if len(text) <= REPR_CHARS else text[: REPR_CHARS - 3] + "..."


def safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - an exception whose str fails still has a name
        return f"<{type(exc).__name__}: str() raised>"

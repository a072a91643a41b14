"""The namespace a rank's cells run in: the engine's IPython namespace, with distlab's names in it."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["LAB_NAMES", "fill", "rebound", "restore_lab_names", "user_namespace"]

#: The names distlab gives every cell (``fill``; kept in step with it).
LAB_NAMES = ("rank", "world_size", "local_rank", "device", "torch", "dist", "distlab")

# Outside an engine (a unit test calling rank functions in-process) cells get a namespace of their own.
_fallback: dict[str, object] = {}

# What ``fill`` gave the cells last: what :func:`restore_lab_names` puts back.
_given: dict[str, object] = {}


def user_namespace() -> dict[str, object]:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return _fallback
    namespace: dict[str, object] = shell.user_ns
    return namespace


def fill(rank: int, world_size: int, local_rank: int, device: torch.device) -> None:
    """Give cells ``rank``, ``world_size``, ``local_rank``, ``device``, ``torch``, ``dist``, ``distlab``."""
    import torch
    import torch.distributed as dist

    # The package itself, for cells to call distlab.watch, log, heal: imported before any of its
    # modules (this one included), so it is taken from there rather than imported back from below.
    distlab = sys.modules[__name__.partition(".")[0]]
    _given.clear()
    _given.update(
        rank=rank, world_size=world_size, local_rank=local_rank, device=device, torch=torch, dist=dist,
        distlab=distlab,
    )
    user_namespace().update(_given)


def rebound(namespace: dict[str, object] | None = None) -> dict[str, object]:
    """The names of :data:`LAB_NAMES` the cells rebound or deleted: {name: what distlab gave}.

    ``rank = dist.get_rank()`` or ``device = torch.device("cpu")`` on a CPU rank gives the same
    value again: that is no rebinding.
    """
    ns = user_namespace() if namespace is None else namespace
    missing = object()
    return {name: given for name, given in _given.items() if not _same(name, ns.get(name, missing), given)}


def restore_lab_names() -> str | None:
    """Put back the names of :data:`LAB_NAMES` a cell rebound; the one line saying so, or None.

    A tutorial's launcher loop pasted into a cell (``for rank in range(size): ...``) rebinds the
    lab's ``rank`` on every rank; left so, a later ``init_process_group(rank=rank)`` would fail,
    and every later cell would compute with another rank's number.
    """
    ns = user_namespace()
    changed = rebound(ns)
    if not changed:
        return None
    missing = object()
    was = ", ".join(
        f"{name} (deleted)" if ns.get(name, missing) is missing else f"{name} (to {_short(ns[name])})"
        for name in changed
    )
    ns.update(changed)
    back = ", ".join(f"{name} = {_short(value)}" for name, value in changed.items())
    return (
        f"distlab: this cell rebound {was}, a name distlab gives every cell; it is this rank's again ({back}): "
        "give your own variables other names (for r in range(size): ...)"
    )


def _same(name: str, value: object, given: object) -> bool:
    if value is given:
        return True
    if name == "device" and isinstance(value, str) and value == str(given):
        return True  # device = "cpu": the same device, named as torch accepts it
    if type(value) is not type(given):
        return False
    try:
        return bool(value == given)
    except Exception:  # noqa: BLE001 - a value that cannot be compared is not the one distlab gave
        return False


def _short(value: object) -> str:
    if hasattr(value, "__name__") and type(value).__name__ == "module":
        return f"module {value.__name__}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

"""The namespace a rank's cells run in: the engine's IPython namespace, with distlab's names in it."""

from __future__ import annotations

from typing import Any

__all__ = ["LAB_NAMES", "fill", "user_namespace"]

#: The names distlab gives every cell (``fill``; kept in step with it).
LAB_NAMES = ("rank", "world_size", "local_rank", "device", "torch", "dist", "distlab")

# Outside an engine (a unit test calling rank functions in-process) cells get a namespace of their own.
_fallback: dict[str, Any] = {}


def user_namespace() -> dict[str, Any]:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return _fallback
    namespace: dict[str, Any] = shell.user_ns
    return namespace


def fill(rank: int, world_size: int, local_rank: int, device: Any) -> None:
    """Give cells ``rank``, ``world_size``, ``local_rank``, ``device``, ``torch``, ``dist``, ``distlab``."""
    import torch
    import torch.distributed as dist

    import distlab

    user_namespace().update(
        rank=rank, world_size=world_size, local_rank=local_rank, device=device, torch=torch, dist=dist,
        distlab=distlab,
    )

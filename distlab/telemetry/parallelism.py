"""How a watched model is laid out across ranks, in the terms ``distlab.theory.sharded_memory`` takes.

The notebook's memory view puts each rank's measured memory next to the theory's prediction for
the same configuration; this reads that configuration from the model and its optimizer on the rank:
DDP, ZeroRedundancyOptimizer (ZeRO-1), FSDP2 (``fully_shard``, ZeRO-3-like), tensor parallelism
(DTensor parameters not managed by FSDP2) and FSDP2 over one dimension of a 2-D mesh with tensor
parallelism over the other. Anything it cannot name gives no prediction rather than a wrong one.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..rank import models
from ..records import Layout

__all__ = ["describe"]

_OPTIMIZERS = {"Adam": "adam", "AdamW": "adam"}


def _optimizer_kind(optimizer: torch.optim.Optimizer) -> str | None:
    inner = getattr(optimizer, "optim", optimizer) if models.is_zero_optimizer(optimizer) else optimizer
    name = type(inner).__name__
    if name in _OPTIMIZERS:
        return _OPTIMIZERS[name]
    if name == "SGD":
        momentum = max((group.get("momentum", 0) for group in inner.param_groups), default=0)
        return "momentum" if momentum else "sgd"
    return None


def _is_fsdp(model: torch.nn.Module) -> bool:
    fsdp = getattr(torch.distributed, "fsdp", None)
    module_type = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    return module_type is not None and any(isinstance(m, module_type) for m in model.modules())


def describe(model: torch.nn.Module, params: list[torch.Tensor], optimizers: Iterable[torch.optim.Optimizer],
             world_size: int) -> Layout | None:
    """{parameters, strategy, data_parallel, tensor_parallel, precision, optimizer} for ``sharded_memory``, or None."""
    opts = list(optimizers)
    if len(opts) != 1 or not params:
        return None
    optimizer = _optimizer_kind(opts[0])
    if optimizer is None:
        return None
    if any(p.dtype != torch.float32 for p in params):
        return None  # 16-bit weights: with or without a master copy, the model cannot tell which
    precision = "fp32"
    meshes = {tuple(p.device_mesh.shape) for p in params if hasattr(p, "device_mesh")}
    if len(meshes) > 1:
        return None
    mesh = meshes.pop() if meshes else None
    if _is_fsdp(model):
        strategy = "fsdp2"
        if mesh is None:
            return None
        data_parallel = mesh[0]
        tensor_parallel = mesh[1] if len(mesh) == 2 else 1
        if len(mesh) > 2:
            return None
    elif mesh is not None:
        strategy, data_parallel, tensor_parallel = "ddp", 1, int(torch.tensor(mesh).prod())
    else:
        strategy = "zero1" if models.is_zero_optimizer(opts[0]) else "ddp"
        data_parallel, tensor_parallel = world_size, 1
    return {
        "parameters": int(sum(p.numel() for p in params)),
        "strategy": strategy,
        "data_parallel": data_parallel,
        "tensor_parallel": tensor_parallel,
        "precision": precision,
        "optimizer": optimizer,
    }

"""What a rank's model and optimizer really are under their wrappers: one answer for every caller.

``distlab.watch`` names layers and ``distlab.checkpoint`` names state-dict keys after the bare model,
and both must treat a ``ZeroRedundancyOptimizer`` as such; asked in two places, the answers drifted
apart (a compiled model watched as ``_orig_mod.0``, saved as ``0``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from typing_extensions import TypeIs

from . import torchcompat_compile

__all__ = ["ddp_of", "is_zero_optimizer", "unwrap"]


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model under any nesting of DDP, DataParallel and ``torch.compile``.

    Its parameter names and state-dict keys carry no wrapper prefix (``module.``, ``_orig_mod.``).
    """
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
            continue
        inner = torchcompat_compile.compiled_original(model)
        if inner is None:
            return model
        model = inner


def ddp_of(model: nn.Module) -> nn.parallel.DistributedDataParallel | None:
    """The DDP module ``model`` is, or wraps under ``torch.compile`` (``torch.compile(DDP(m))``, as
    torch's DDP notes advise: compiled after wrapping, its graphs are split at the buckets); None
    for a model without DDP."""
    while not isinstance(model, nn.parallel.DistributedDataParallel):
        inner = torchcompat_compile.compiled_original(model)
        if inner is None:
            return None
        model = inner
    return model


def is_zero_optimizer(optimizer: object) -> TypeIs[ZeroRedundancyOptimizer]:
    """True for a ``torch.distributed.optim.ZeroRedundancyOptimizer``, subclasses included.

    Its state is sharded across ranks (``consolidate_state_dict`` gathers it) and its ``step`` runs
    the local optimizer it wraps before broadcasting the new shards.
    """
    # An optimizer of that class exists only once its module is imported: looked up, never imported
    # here (importing torch.distributed.optim costs 67 torch.jit deprecation warnings in torch 2.13).
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer)

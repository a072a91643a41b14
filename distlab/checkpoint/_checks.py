"""The checks of ``save``'s and ``load``'s arguments, made before anything changes (through
distlab.checks, one line naming the fix), and this rank's place in the world, which both need."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from .. import checks

# ----------------------------------------------------------------------------------------- checks


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_target(path: str | os.PathLike[str]) -> Path:
    checks.instance("path", path, (str, os.PathLike), what="a file path (str or Path)", error=TypeError)
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{target} is a directory: give a file name, e.g. distlab.checkpoint.path_for(dir, step)")
    return target


def check_model(model: object, verb: str) -> None:
    checks.instance("model", model, nn.Module, what="a torch.nn.Module, plain or DDP-wrapped", error=TypeError)
    if any(c.__name__ == "FullyShardedDataParallel" for c in type(model).__mro__):
        raise TypeError(
            f"FSDP shards the parameters across ranks; {verb} it with torch.distributed.checkpoint instead"
        )


def check_optimizer(optimizer: object) -> None:
    if optimizer is not None:
        checks.instance("optimizer", optimizer, torch.optim.Optimizer, what="a torch.optim.Optimizer or None",
                        error=TypeError)


def check_step(step: object) -> None:
    checks.whole("step", step, minimum=0, example="the number of optimizer steps taken so far", error=TypeError)


def check_sampler(sampler: object) -> None:
    if sampler is not None and not (hasattr(sampler, "epoch") and callable(getattr(sampler, "set_epoch", None))):
        raise TypeError(
            f"sampler must be a DistributedSampler (or have .epoch and .set_epoch), got {type(sampler).__name__}"
        )


def check_scheduler(scheduler: object) -> None:
    if scheduler is not None and not callable(getattr(scheduler, "state_dict", None)):
        raise TypeError(f"scheduler must be an LR scheduler (with state_dict), got {type(scheduler).__name__}")

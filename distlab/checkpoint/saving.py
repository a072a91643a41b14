"""``save``: collective; the ranks send their RNG states to rank 0, rank 0 alone writes the file, and no
rank returns before it is complete (or before each knows why it is not)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Literal, TypedDict

import torch
import torch.distributed as dist
from torch import nn

from ..rank.models import is_zero_optimizer, unwrap
from ._checks import (
    check_model,
    check_optimizer,
    check_sampler,
    check_scheduler,
    check_step,
    check_target,
    rank_world,
)
from .content import (
    FORMAT,
    VERSION,
    Sampler,
    Scheduler,
    WrittenCheckpoint,
    check_plain,
    content_digest,
    sampler_state,
)
from .files import write_atomic
from .rng import RngState, rng_state

# ---------------------------------------------------------------------------------------------- save


class _RankPart(TypedDict):
    """What each rank sends rank 0: what it saves (checked to agree) and its RNG states."""

    step: int
    path: str
    rng: RngState


def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int,
    sampler: Sampler | None = None,
    scheduler: Scheduler | None = None,
    extra: object = None,
) -> Path:
    """Write a checkpoint to ``path`` atomically; returns the path. Collective: call it on every rank.

    ``step`` is the number of optimizer steps taken so far. ``sampler`` (a DistributedSampler, or any
    sampler with ``epoch`` and ``set_epoch``) contributes its epoch. ``extra`` is returned by ``load``
    as it was given; it must be plain data. Rank 0 writes; every rank returns once the file is there.
    """
    target = check_target(path)
    check_model(model, "save")
    check_optimizer(optimizer)
    check_step(step)
    check_sampler(sampler)
    check_scheduler(scheduler)
    rank, world = rank_world()
    if is_zero_optimizer(optimizer):
        # ZeRO shards optimizer state across ranks; this collective brings it whole onto rank 0.
        optimizer.consolidate_state_dict(to=0)
    mine: _RankPart = {"step": step, "path": str(target), "rng": rng_state()}
    gathered = _gather_to_zero(mine, rank, world)
    failure: BaseException | None = None
    if rank == 0:
        assert gathered is not None
        try:
            _check_agreement(gathered)
            payload = _payload(model, optimizer, step, sampler, scheduler, extra, world, [g["rng"] for g in gathered])
            write_atomic(target, payload)
        except Exception as exc:  # noqa: BLE001 - told to every rank below: none waits for a file that won't come
            failure = exc
    if world > 1:
        box = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(box, src=0)  # also the barrier: nobody goes on before the file exists
        if rank != 0 and box[0] is not None:
            raise RuntimeError(f"rank 0 could not write the checkpoint {target}: {box[0]}")
    if failure is not None:
        raise failure
    return target


def _payload(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    sampler: Sampler | None,
    scheduler: Scheduler | None,
    extra: object,
    world: int,
    rng: list[RngState],
) -> WrittenCheckpoint:
    payload: WrittenCheckpoint = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "world_size": world,
        "model": unwrap(model).state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "optimizer_type": None if optimizer is None else type(optimizer).__name__,
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "sampler": None if sampler is None else sampler_state(sampler),
        "rng": rng,
        "extra": extra,
        "saved_by": {"torch": str(torch.__version__), "distlab": _distlab_version(), "time": time.time()},
    }
    for key, value in payload.items():
        check_plain(value, key)
    payload["digest"] = content_digest(payload)
    return payload


def _gather_to_zero(mine: _RankPart, rank: int, world: int) -> list[_RankPart] | None:
    if world == 1:
        return [mine]
    # Every place filled by gather_object on rank 0 (this rank's part until then).
    gathered: list[_RankPart] | None = [mine] * world if rank == 0 else None
    try:
        dist.gather_object(mine, gathered, dst=0)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeError(
            "checkpoint.save is collective: every rank calls it (rank 0 alone writes), not only rank 0 "
            f"inside `if rank == 0:`; gathering the ranks' RNG states failed: {first}"
        ) from exc
    return gathered


def _check_agreement(gathered: list[_RankPart]) -> None:
    fields: tuple[Literal["step", "path"], ...] = ("step", "path")
    for field in fields:
        values = [g[field] for g in gathered]
        if len(set(values)) > 1:
            by_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(f"every rank must save the same {field} ({by_rank})")


def _distlab_version() -> str:
    from ..version import __version__

    return __version__

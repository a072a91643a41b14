"""``load`` and ``read``: each rank by itself; a file is checked (format, version, digest), then what it
is loaded into (model, optimizer, sampler, scheduler), before anything changes."""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Literal, TypedDict, TypeGuard

import torch
from torch import nn
from torch.optim.optimizer import StateDict

from ..rank.models import unwrap
from ._checks import check_model, check_optimizer, check_sampler, check_scheduler, rank_world
from .content import (
    FORMAT,
    VERSION,
    Checkpoint,
    CheckpointError,
    Sampler,
    SamplerState,
    Scheduler,
    WrittenCheckpoint,
    content_digest,
    sampler_state,
)
from .rng import derived_seed, reseed, restore_rng_state

# ---------------------------------------------------------------------------------------------- load


class Loaded(TypedDict):
    """What ``load`` returns (see its docstring)."""

    step: int
    epoch: int | None
    extra: object
    world_size: int
    rng: str  # "restored" or "reseeded"
    path: Path


def read(path: str | os.PathLike[str]) -> Checkpoint:
    """The checkpoint at ``path`` as a dict, checked (format, version, digest) but applied to nothing.

    Tensors are on the CPU. Useful to look inside: ``read(p)["step"]``, ``read(p)["model"].keys()``.
    """
    source = Path(path)
    if not source.exists():
        raise FileNotFoundError(
            f"no checkpoint at {source}: save one first with distlab.checkpoint.save(...), "
            "or find the last one with distlab.checkpoint.latest(directory)"
        )
    if source.is_dir():
        raise CheckpointError(f"{source} is a directory: pass a checkpoint file (distlab.checkpoint.latest finds one)")
    try:
        payload = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a file that is not what it expects
        name = type(exc).__name__
        text = _first_line(exc).split(". ")[0]  # torch's reader adds paragraphs of advice after the cause
        if isinstance(exc, pickle.UnpicklingError) and "weights_only" in str(exc):
            raise CheckpointError(
                f"{source} holds Python objects that weights_only loading refuses to rebuild, so it was not "
                "written by distlab.checkpoint.save (which stores plain data only)"
            ) from None
        raise CheckpointError(
            f"{source} is not a readable checkpoint (truncated, damaged, or not a torch file): {name}: {text}"
        ) from None
    if not _marked(payload):
        keys = sorted(map(str, payload))[:6] if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(
            f"{source} is not a distlab checkpoint (found {keys}); for a plain torch.save file use "
            "torch.load and model.load_state_dict"
        )
    version = payload.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointError(
            f"{source} has checkpoint format version {version!r}; this distlab reads up to {VERSION}: upgrade distlab"
        )
    stored = payload.pop("digest", None)
    if stored != content_digest(payload):
        raise CheckpointError(f"{source} is damaged: its content does not match the digest stored with it")
    return payload


def load(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    sampler: Sampler | None = None,
    scheduler: Scheduler | None = None,
) -> Loaded:
    """Restore a checkpoint into ``model`` (and ``optimizer``, ``sampler``, ``scheduler``) on this rank.

    Nothing is changed unless everything fits. This rank's RNG states are restored (or re-seeded from
    (step, rank) if the checkpoint came from a smaller world). Returns ``step``, ``epoch`` (None when
    saved without a sampler), ``extra``, ``world_size`` (at save time), ``rng`` ("restored" or
    "reseeded") and ``path``. Needs no other rank: it is not collective.
    """
    check_model(model, "load")
    check_optimizer(optimizer)
    check_sampler(sampler)
    check_scheduler(scheduler)
    source = Path(path)
    payload = read(source)
    bare = unwrap(model)
    _check_model_fits(payload["model"], bare, source)
    optimizer_state = None if optimizer is None else _check_optimizer_fits(payload, optimizer, source)
    if sampler is not None:
        _check_sampler_fits(payload["sampler"], sampler, source)
    scheduler_state = payload["scheduler"]
    if scheduler is not None and scheduler_state is None:
        raise CheckpointError(f"{source} holds no scheduler state (saved without scheduler=): load without it")

    bare.load_state_dict(payload["model"])
    if optimizer is not None and optimizer_state is not None:  # both or neither (above)
        optimizer.load_state_dict(optimizer_state)
    if scheduler is not None and scheduler_state is not None:  # the state is there for a scheduler (above)
        scheduler.load_state_dict(scheduler_state)
    epoch = None if payload["sampler"] is None else payload["sampler"]["epoch"]
    if sampler is not None and epoch is not None:  # a sampler is loaded only from a file that has one (above)
        sampler.set_epoch(epoch)
    rank, _ = rank_world()
    states = payload["rng"]
    if rank < len(states):
        restore_rng_state(states[rank])
        how = "restored"
    else:
        reseed(derived_seed(payload["step"], rank))
        how = "reseeded"
    return {
        "step": payload["step"],
        "epoch": epoch,
        "extra": payload["extra"],
        "world_size": payload["world_size"],
        "rng": how,
        "path": source,
    }


def _check_model_fits(saved: Mapping[str, object], bare: nn.Module, source: Path) -> None:
    wanted = bare.state_dict()
    missing = [k for k in wanted if k not in saved]
    unexpected = [k for k in saved if k not in wanted]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected {_few(unexpected)}")
        raise CheckpointError(
            f"{source} does not fit this model: {'; '.join(parts)} (was it saved from another model?)"
        )
    for key, value in wanted.items():
        have = saved[key]
        if isinstance(value, torch.Tensor) and isinstance(have, torch.Tensor) and value.shape != have.shape:
            raise CheckpointError(
                f"{source} does not fit this model: {key} has shape {tuple(have.shape)} in the checkpoint, "
                f"{tuple(value.shape)} in the model"
            )


def _check_optimizer_fits(payload: Checkpoint, optimizer: torch.optim.Optimizer, source: Path) -> StateDict:
    """The optimizer's saved state, if it fits ``optimizer``."""
    saved = payload["optimizer"]
    if saved is None:
        raise CheckpointError(f"{source} holds no optimizer state (saved without optimizer=): load without it")
    kind = type(optimizer).__name__
    if payload["optimizer_type"] != kind:
        raise CheckpointError(f"{source} holds {payload['optimizer_type']} state; this optimizer is a {kind}")
    have = [len(g["params"]) for g in saved["param_groups"]]
    want = [len(g["params"]) for g in optimizer.param_groups]
    if have != want:
        raise CheckpointError(
            f"{source} does not fit this optimizer: parameters per group {have} in the checkpoint, {want} here"
        )
    return saved


def _check_sampler_fits(saved: SamplerState | None, sampler: Sampler, source: Path) -> None:
    if saved is None:
        raise CheckpointError(f"{source} holds no sampler epoch (saved without sampler=): load without it")
    if not isinstance(sampler, torch.utils.data.DistributedSampler) or "seed" not in saved:
        return
    now = sampler_state(sampler)
    # num_replicas may differ (that is the re-sharding); these decide the order of the whole epoch.
    for field, how in _ORDER_FIELDS:
        if now[field] != saved[field]:
            raise CheckpointError(
                f"{source} was saved with a sampler of {how} {saved[field]!r}, this one has {now[field]!r}: "
                "the data order would not continue; build the DistributedSampler as before"
            )


#: A DistributedSampler's settings that decide the order of a whole epoch, and their names in messages.
_ORDER_FIELDS: tuple[tuple[Literal["dataset_len", "seed", "shuffle", "drop_last"], str], ...] = (
    ("dataset_len", "dataset length"), ("seed", "seed"), ("shuffle", "shuffle"), ("drop_last", "drop_last"),
)


def _marked(payload: object) -> TypeGuard[WrittenCheckpoint]:
    """Whether ``payload`` (what torch.load read) is a dict with distlab's format mark: what ``save`` wrote,
    its version and digest still to be checked."""
    return isinstance(payload, dict) and payload.get("format") == FORMAT


def _few(keys: list[str], shown: int = 4) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(keys[:shown]) + more


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""

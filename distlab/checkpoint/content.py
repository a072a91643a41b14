"""What a checkpoint file holds, and what makes it one: the format name and version, the error for a
file that is not usable, the record of a sampler, the plain-data rule that lets it load with
``torch.load(..., weights_only=True)``, and the digest that refuses a file damaged after it was written."""

from __future__ import annotations

import ctypes
import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sized
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, cast

import torch
from torch import nn
from torch.optim.optimizer import StateDict

from .rng import RngState

if TYPE_CHECKING:
    from hashlib import _Hash

FORMAT = "distlab.checkpoint"
VERSION = 1

# Types torch.load(weights_only=True) rebuilds, matched exactly (np.float64 is a float subclass it refuses).
_PLAIN_LEAVES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


class CheckpointError(ValueError):
    """A file that is not a usable distlab checkpoint, or one that does not fit what ``load`` was given."""


class Sampler(Protocol):
    """What ``save`` and ``load`` ask of a sampler: a DistributedSampler's ``epoch`` and ``set_epoch``."""

    epoch: int

    def set_epoch(self, epoch: int) -> None: ...


class Scheduler(Protocol):
    """What ``save`` and ``load`` ask of an LR scheduler: its state dict, out and back in."""

    def state_dict(self) -> dict[str, object]: ...

    def load_state_dict(self, state_dict: dict[str, object]) -> None: ...


class _SamplerStateBase(TypedDict):
    epoch: int
    type: str


class SamplerState(_SamplerStateBase, total=False):
    """A sampler's record: its epoch and type; a DistributedSampler's order-deciding settings too."""

    seed: int
    shuffle: bool
    drop_last: bool
    dataset_len: int
    num_replicas: int


class SavedBy(TypedDict):
    torch: str
    distlab: str
    time: float


class Checkpoint(TypedDict):
    """A checkpoint file's content, as ``read`` returns it (see the package's docstring)."""

    format: str
    version: int
    step: int
    world_size: int
    model: dict[str, object]
    optimizer: StateDict | None
    optimizer_type: str | None
    scheduler: dict[str, object] | None
    sampler: SamplerState | None
    rng: list[RngState]
    extra: object
    saved_by: SavedBy


class WrittenCheckpoint(Checkpoint, total=False):
    """A checkpoint as written: with the digest of the rest, which ``read`` checks and drops."""

    digest: str


def sampler_state(sampler: Sampler) -> SamplerState:
    state: SamplerState = {"epoch": int(sampler.epoch), "type": type(sampler).__name__}
    if isinstance(sampler, torch.utils.data.DistributedSampler):
        state.update({
            "seed": int(sampler.seed),
            "shuffle": bool(sampler.shuffle),
            "drop_last": bool(sampler.drop_last),
            # DistributedSampler takes len() of its dataset itself; torch types it as a bare Dataset.
            "dataset_len": len(cast("Sized", sampler.dataset)),
            "num_replicas": int(sampler.num_replicas),
        })
    return state


def check_plain(obj: Any, where: str) -> None:
    """Refuse, naming where, anything torch.load(weights_only=True) would not rebuild."""
    kind = type(obj)
    if kind in _PLAIN_LEAVES or kind in _PLAIN_TENSORS:
        return
    if kind in (dict, OrderedDict):
        for key, value in obj.items():
            if type(key) not in _PLAIN_LEAVES:
                raise TypeError(f"{where} has a key of type {type(key).__name__}: use strings or numbers as keys")
            check_plain(value, f"{where}[{key!r}]")
        return
    if kind in (list, tuple, torch.Size):
        for i, value in enumerate(obj):
            check_plain(value, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}: a checkpoint holds plain data (tensors, numbers, "
        "strings, lists, tuples, dicts) so that it loads with weights_only=True; convert it first "
        "(e.g. dataclasses.asdict, .tolist(), torch.from_numpy)"
    )


# ---------------------------------------------------------------------------------------- digest


def content_digest(payload: object) -> str:
    h = hashlib.sha256()
    _feed(h, payload)
    return h.hexdigest()


def _feed(h: _Hash, obj: object) -> None:
    """Hash ``obj`` by value: the same content gives the same digest before saving and after loading."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        h.update(f"T{t.dtype}{tuple(t.shape)}|".encode())
        if t.is_meta:  # no data to hash (torch.save stores none either)
            return
        if t.layout != torch.strided:
            t = t.to_dense()
        t = t.cpu().resolve_conj().resolve_neg().contiguous()
        nbytes = t.numel() * t.element_size()
        if nbytes:
            h.update((ctypes.c_char * nbytes).from_address(t.data_ptr()))  # the bytes, without copying them
    elif isinstance(obj, Mapping):
        h.update(b"{%d|" % len(obj))
        for key, value in obj.items():
            _feed(h, key)
            _feed(h, value)
    elif isinstance(obj, (list, tuple)):
        h.update(b"[%d|" % len(obj))
        for value in obj:
            _feed(h, value)
    else:
        h.update(f"{type(obj).__name__}:{obj!r}|".encode())

"""Checkpoints that survive a crash, and resume bit for bit: ``distlab.checkpoint.save`` / ``load``.

A checkpoint holds what a training loop needs to continue as if it had never stopped:

    model        state dict of the bare model (DDP / torch.compile wrappers removed: no ``module.`` keys)
    optimizer    its state dict (a ZeroRedundancyOptimizer is consolidated onto rank 0 first)
    scheduler    an LR scheduler's state dict, if given
    step         optimizer steps already taken: the loop continues from there
    sampler      epoch (and seed, shuffle, drop_last, dataset length) of a DistributedSampler
    rng          every rank's RNG states: torch CPU, CUDA (if in use), python ``random``, numpy (if imported)
    extra        anything else the loop wants back, as plain data

``save`` is collective: every rank calls it with the same path and step. The ranks send their RNG
states to rank 0, rank 0 alone writes the file, and no rank returns before the file is complete:

    write to a hidden temporary file in the same directory -> flush -> fsync
    -> os.replace onto the final name -> fsync the directory

``os.replace`` is atomic, so a crash at any moment leaves either the previous checkpoint or the new
one at the path, never a torn file. A digest of the content is stored too, so a file damaged later
(or copied partially) is refused with a clear error instead of loading wrong numbers. Checkpoints
hold plain data only (tensors, numbers, strings, lists, tuples, dicts) and load with
``torch.load(..., weights_only=True)``, which never runs code from the file.

``load`` runs on each rank by itself (every rank reads the file; across hosts it must be on shared
storage). It checks that the model, optimizer and sampler fit before changing any of them. The world
size may differ from the one that saved: model, optimizer, step and epoch are restored everywhere; a
rank that existed at save time gets its own RNG states back, a new rank is re-seeded from
(step, rank), the same way every time. The data is re-sharded by the sampler you pass, built for
the current world (``DistributedSampler`` fixes ``num_replicas`` when it is made); ``load`` sets its
epoch and refuses one that would shuffle differently (another seed, dataset length, ...).

Resuming in the middle of an epoch: skip the batches already done in it
(``step - epoch * len(loader)`` at the same world size). Give the DataLoader its own generator
(``DataLoader(..., generator=torch.Generator())``): by default each ``iter(loader)`` draws a seed from
the global torch RNG, so the resumed run, which starts its epoch iterator once more, would draw
dropout masks from a different point of the stream than the run that saved. At another world size
the batches per epoch change and a position inside an epoch has no equivalent: for elastic runs,
save when an epoch ends, or run the saved epoch again from its start.

    from distlab import checkpoint
    last = checkpoint.latest("ckpts")
    step = checkpoint.load(last, model=model, optimizer=opt, sampler=sampler)["step"] if last else 0
    ...
    checkpoint.save(checkpoint.path_for("ckpts", step), model=model, optimizer=opt, step=step, sampler=sampler)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pickle
import random
import re
import secrets
import socket
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import checks
from ._procs import pid_alive as _pid_alive
from .rank.models import is_zero_optimizer, unwrap

__all__ = [
    "FORMAT",
    "VERSION",
    "CheckpointError",
    "latest",
    "load",
    "path_for",
    "read",
    "save",
]

FORMAT = "distlab.checkpoint"
VERSION = 1

# path_for / latest: numbered files, so "the last checkpoint" is the highest number, not the newest mtime.
_NAME = "ckpt-{step:08d}.pt"
_NAME_RE = re.compile(r"ckpt-(\d+)\.pt")
_TEMP_TAG = ".tmp-"  # temporary files are ".<final name>.tmp-<host>-<pid>-<random>": hidden, never matched

# Types torch.load(weights_only=True) rebuilds, matched exactly (np.float64 is a float subclass it refuses).
_PLAIN_LEAVES = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


class CheckpointError(ValueError):
    """A file that is not a usable distlab checkpoint, or one that does not fit what ``load`` was given."""


# --------------------------------------------------------------------------------------------- names


def path_for(directory: str | os.PathLike[str], step: int) -> Path:
    """``directory/ckpt-00000120.pt`` for step 120: the names :func:`latest` looks for."""
    _check_step(step)
    return Path(directory) / _NAME.format(step=step)


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint with the highest step number in ``directory`` (named by :func:`path_for`), or None.

    Every such file is complete (they appear only through an atomic rename); temporary files left by a
    writer that was killed are hidden and never returned. None also when the directory does not exist,
    so ``latest(d)`` reads as "is there anything to resume from?".
    """
    folder = Path(directory)
    if not folder.is_dir():
        return None
    numbered = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME_RE.fullmatch(p.name)) and p.is_file()]
    return max(numbered)[1] if numbered else None


# ---------------------------------------------------------------------------------------------- save


def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int,
    sampler: Any = None,
    scheduler: Any = None,
    extra: Any = None,
) -> Path:
    """Write a checkpoint to ``path`` atomically; returns the path. Collective: call it on every rank.

    ``step`` is the number of optimizer steps taken so far. ``sampler`` (a DistributedSampler, or any
    sampler with ``epoch`` and ``set_epoch``) contributes its epoch. ``extra`` is returned by ``load``
    as it was given; it must be plain data. Rank 0 writes; every rank returns once the file is there.
    """
    target = _check_target(path)
    _check_model(model, "save")
    _check_optimizer(optimizer)
    _check_step(step)
    _check_sampler(sampler)
    _check_scheduler(scheduler)
    rank, world = _rank_world()
    if is_zero_optimizer(optimizer):
        # ZeRO shards optimizer state across ranks; this collective brings it whole onto rank 0.
        optimizer.consolidate_state_dict(to=0)  # type: ignore[union-attr]
    mine = {"step": step, "path": str(target), "rng": _rng_state()}
    gathered = _gather_to_zero(mine, rank, world)
    failure: BaseException | None = None
    if rank == 0:
        assert gathered is not None
        try:
            _check_agreement(gathered)
            payload = _payload(model, optimizer, step, sampler, scheduler, extra, world, [g["rng"] for g in gathered])
            _write_atomic(target, payload)
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
    sampler: Any,
    scheduler: Any,
    extra: Any,
    world: int,
    rng: list[dict[str, Any]],
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "world_size": world,
        "model": unwrap(model).state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "optimizer_type": None if optimizer is None else type(optimizer).__name__,
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "sampler": None if sampler is None else _sampler_state(sampler),
        "rng": rng,
        "extra": extra,
        "saved_by": {"torch": str(torch.__version__), "distlab": _distlab_version(), "time": time.time()},
    }
    for key, value in payload.items():
        _check_plain(value, key)
    payload["digest"] = _digest(payload)
    return payload


def _write_atomic(target: Path, payload: dict[str, Any]) -> None:
    """Temporary file in the same directory (same filesystem, so the rename is atomic), fsync, rename."""
    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target)
    host = socket.gethostname()
    temp = directory / f".{target.name}{_TEMP_TAG}{host}-{os.getpid()}-{secrets.token_hex(4)}"
    # os.open applies the umask, so the checkpoint gets the permissions any new file would.
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_directory(directory)  # the rename itself survives a power loss


def _remove_stale_temps(target: Path) -> None:
    """Delete temporary files of ``target`` left by writers on this host that are no longer alive."""
    if os.name != "posix":  # os.kill(pid, 0) is a liveness probe only on POSIX
        return
    prefix = f".{target.name}{_TEMP_TAG}{socket.gethostname()}-"
    for leftover in target.parent.glob(f".{target.name}{_TEMP_TAG}*"):
        pid_text = leftover.name[len(prefix):].split("-")[0] if leftover.name.startswith(prefix) else ""
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            leftover.unlink(missing_ok=True)




def _fsync_directory(directory: Path) -> None:
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _gather_to_zero(mine: dict[str, Any], rank: int, world: int) -> list[dict[str, Any]] | None:
    if world == 1:
        return [mine]
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    try:
        dist.gather_object(mine, gathered, dst=0)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeError(
            "checkpoint.save is collective: every rank calls it (rank 0 alone writes), not only rank 0 "
            f"inside `if rank == 0:`; gathering the ranks' RNG states failed: {first}"
        ) from exc
    return gathered


def _check_agreement(gathered: list[dict[str, Any]]) -> None:
    for field in ("step", "path"):
        values = [g[field] for g in gathered]
        if len(set(values)) > 1:
            by_rank = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(f"every rank must save the same {field} ({by_rank})")


def _sampler_state(sampler: Any) -> dict[str, Any]:
    state: dict[str, Any] = {"epoch": int(sampler.epoch), "type": type(sampler).__name__}
    if isinstance(sampler, torch.utils.data.DistributedSampler):
        state.update(
            seed=int(sampler.seed),
            shuffle=bool(sampler.shuffle),
            drop_last=bool(sampler.drop_last),
            dataset_len=len(sampler.dataset),  # type: ignore[arg-type]
            num_replicas=int(sampler.num_replicas),
        )
    return state


# ---------------------------------------------------------------------------------------------- load


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
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
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
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
    if stored != _digest(payload):
        raise CheckpointError(f"{source} is damaged: its content does not match the digest stored with it")
    return payload


def load(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    sampler: Any = None,
    scheduler: Any = None,
) -> dict[str, Any]:
    """Restore a checkpoint into ``model`` (and ``optimizer``, ``sampler``, ``scheduler``) on this rank.

    Nothing is changed unless everything fits. This rank's RNG states are restored (or re-seeded from
    (step, rank) if the checkpoint came from a smaller world). Returns ``step``, ``epoch`` (None when
    saved without a sampler), ``extra``, ``world_size`` (at save time), ``rng`` ("restored" or
    "reseeded") and ``path``. Needs no other rank: it is not collective.
    """
    _check_model(model, "load")
    _check_optimizer(optimizer)
    _check_sampler(sampler)
    _check_scheduler(scheduler)
    source = Path(path)
    payload = read(source)
    bare = unwrap(model)
    _check_model_fits(payload["model"], bare, source)
    if optimizer is not None:
        _check_optimizer_fits(payload, optimizer, source)
    if sampler is not None:
        _check_sampler_fits(payload["sampler"], sampler, source)
    if scheduler is not None and payload["scheduler"] is None:
        raise CheckpointError(f"{source} holds no scheduler state (saved without scheduler=): load without it")

    bare.load_state_dict(payload["model"])
    if optimizer is not None:
        optimizer.load_state_dict(payload["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(payload["scheduler"])
    epoch = None if payload["sampler"] is None else payload["sampler"]["epoch"]
    if sampler is not None:
        sampler.set_epoch(epoch)
    rank, _ = _rank_world()
    states = payload["rng"]
    if rank < len(states):
        _set_rng_state(states[rank])
        how = "restored"
    else:
        _reseed(_derived_seed(payload["step"], rank))
        how = "reseeded"
    return {
        "step": payload["step"],
        "epoch": epoch,
        "extra": payload["extra"],
        "world_size": payload["world_size"],
        "rng": how,
        "path": source,
    }


def _check_model_fits(saved: Mapping[str, Any], bare: nn.Module, source: Path) -> None:
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


def _check_optimizer_fits(payload: Mapping[str, Any], optimizer: torch.optim.Optimizer, source: Path) -> None:
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


def _check_sampler_fits(saved: Mapping[str, Any] | None, sampler: Any, source: Path) -> None:
    if saved is None:
        raise CheckpointError(f"{source} holds no sampler epoch (saved without sampler=): load without it")
    if not isinstance(sampler, torch.utils.data.DistributedSampler) or "seed" not in saved:
        return
    now = _sampler_state(sampler)
    # num_replicas may differ (that is the re-sharding); these decide the order of the whole epoch.
    for field, how in (("dataset_len", "dataset length"), ("seed", "seed"), ("shuffle", "shuffle"),
                       ("drop_last", "drop_last")):
        if now[field] != saved[field]:
            raise CheckpointError(
                f"{source} was saved with a sampler of {how} {saved[field]!r}, this one has {now[field]!r}: "
                "the data order would not continue; build the DistributedSampler as before"
            )


# ----------------------------------------------------------------------------------------------- rng


def _rng_state() -> dict[str, Any]:
    """This process's RNG states, as plain data (tensors, ints, floats, strings)."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # never start CUDA just to save
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["internal"].tolist()), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"][: torch.cuda.device_count()]
        for device, cuda_state in enumerate(states):
            torch.cuda.set_rng_state(cuda_state, device)
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:  # saved where numpy was in use, loaded where it is not installed
            return
        s = state["numpy"]
        np.random.set_state((s["name"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))


def _derived_seed(step: int, rank: int) -> int:
    """A seed for a rank the checkpoint has no RNG state for: the same (step, rank) gives the same seed."""
    return int.from_bytes(hashlib.sha256(f"distlab:{step}:{rank}".encode()).digest()[:8], "little") >> 1


def _reseed(seed: int) -> None:
    torch.manual_seed(seed)  # also every CUDA device
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % 2**32)


# ----------------------------------------------------------------------------------------- checks


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_target(path: Any) -> Path:
    checks.instance("path", path, (str, os.PathLike), what="a file path (str or Path)", error=TypeError)
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{target} is a directory: give a file name, e.g. distlab.checkpoint.path_for(dir, step)")
    return target


def _check_model(model: Any, verb: str) -> None:
    checks.instance("model", model, nn.Module, what="a torch.nn.Module, plain or DDP-wrapped", error=TypeError)
    if any(c.__name__ == "FullyShardedDataParallel" for c in type(model).__mro__):
        raise TypeError(
            f"FSDP shards the parameters across ranks; {verb} it with torch.distributed.checkpoint instead"
        )


def _check_optimizer(optimizer: Any) -> None:
    if optimizer is not None:
        checks.instance("optimizer", optimizer, torch.optim.Optimizer, what="a torch.optim.Optimizer or None",
                        error=TypeError)


def _check_step(step: Any) -> None:
    checks.whole("step", step, minimum=0, example="the number of optimizer steps taken so far", error=TypeError)


def _check_sampler(sampler: Any) -> None:
    if sampler is not None and not (hasattr(sampler, "epoch") and callable(getattr(sampler, "set_epoch", None))):
        raise TypeError(
            f"sampler must be a DistributedSampler (or have .epoch and .set_epoch), got {type(sampler).__name__}"
        )


def _check_scheduler(scheduler: Any) -> None:
    if scheduler is not None and not callable(getattr(scheduler, "state_dict", None)):
        raise TypeError(f"scheduler must be an LR scheduler (with state_dict), got {type(scheduler).__name__}")


def _check_plain(obj: Any, where: str) -> None:
    """Refuse, naming where, anything torch.load(weights_only=True) would not rebuild."""
    kind = type(obj)
    if kind in _PLAIN_LEAVES or kind in _PLAIN_TENSORS:
        return
    if kind in (dict, OrderedDict):
        for key, value in obj.items():
            if type(key) not in _PLAIN_LEAVES:
                raise TypeError(f"{where} has a key of type {type(key).__name__}: use strings or numbers as keys")
            _check_plain(value, f"{where}[{key!r}]")
        return
    if kind in (list, tuple, torch.Size):
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}: a checkpoint holds plain data (tensors, numbers, "
        "strings, lists, tuples, dicts) so that it loads with weights_only=True; convert it first "
        "(e.g. dataclasses.asdict, .tolist(), torch.from_numpy)"
    )


# ---------------------------------------------------------------------------------------- digest


def _digest(payload: Any) -> str:
    h = hashlib.sha256()
    _feed(h, payload)
    return h.hexdigest()


def _feed(h: Any, obj: Any) -> None:
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


def _few(keys: list[str], shown: int = 4) -> str:
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(keys[:shown]) + more


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _distlab_version() -> str:
    from . import __version__

    return __version__

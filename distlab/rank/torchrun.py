"""What code written for torchrun expects of a process, given by a lab's rank, so that it runs as it is.

- torchrun's environment variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
  GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), matching the lab's world: a script reads its rank
  where torchrun puts it (:func:`set_environment`).
- ``torch.distributed.init_process_group``, called while the lab's group is up, joins that group
  instead of failing with torch's "trying to initialize the default process group twice!": a
  script's ``setup()`` pasted into a ``%%ddp`` cell, or run by ``%dist run``, works. A call that
  cannot mean the lab's group (another world size, another rank, NCCL on CPU ranks) raises one
  error saying what differs and what to change (:func:`mismatch`).
- ``destroy_process_group()`` (the default group) leaves the lab's group up for the next cells:
  ``%dist stop`` ends it. A subgroup passed to it is really destroyed.

distlab's own making and unmaking of the group (``rank.group``) runs inside :func:`lab_owned`,
where torch's functions act as they always do.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from ..wire import GroupSpec
from . import torchcompat

__all__ = ["follow", "lab_owned", "mismatch", "set_environment"]

# The lab's group as this rank joined it last (None: never joined; torch's functions act as always).
_lab: GroupSpec | None = None
# More than 0 while distlab itself makes or tears down the group.
_owned = 0
# torch's init_process_group and destroy_process_group, once replaced.
_torch_functions: tuple[Callable[..., Any], Callable[..., Any]] | None = None


def set_environment(spec: GroupSpec) -> None:
    """Put torchrun's variables for this rank in ``os.environ``, as torchrun gives them to each process.

    GROUP_RANK is the index of the rank's host (node) in the world, LOCAL_WORLD_SIZE the ranks on
    it. Launchers' own variables (OMPI_COMM_WORLD_RANK, SLURM_PROCID, ...) are left as they are.
    """
    os.environ.update(
        MASTER_ADDR=spec.master_addr,
        MASTER_PORT=str(spec.master_port),
        RANK=str(spec.rank),
        WORLD_SIZE=str(spec.world_size),
        LOCAL_RANK=str(spec.local_rank),
        LOCAL_WORLD_SIZE=str(spec.ranks_on_node or spec.local_world_size),
        GROUP_RANK=str(spec.node),
        GROUP_WORLD_SIZE=str(spec.nodes),
    )


@contextlib.contextmanager
def lab_owned() -> Iterator[None]:
    """While distlab itself makes, rebuilds or tears down the group: torch's functions act as always."""
    global _owned
    _owned += 1
    try:
        yield
    finally:
        _owned -= 1


def follow(spec: GroupSpec) -> None:
    """From now on, ``init_process_group`` joins the group ``spec`` describes and ``destroy_process_group()``
    leaves it up. Called each time the rank joins a group (start, rebuild, restart)."""
    global _lab, _torch_functions
    _lab = spec
    if _torch_functions is None:
        _torch_functions = torchcompat.replace_group_functions(_init_process_group, _destroy_process_group)


def mismatch(backend: Any, world_size: Any, rank: Any, lab: GroupSpec) -> str | None:
    """Why ``init_process_group(backend, world_size=, rank=)`` cannot mean the lab's group, or None if it can.

    Left out (None, or torch's default -1), each matches. A backend matches when it is the lab's, or
    a ``"cpu:gloo,cuda:nccl"`` list naming the lab's backend for its ranks' device.
    """
    problems = []
    if backend is not None:
        device = "cuda" if lab.backend == "nccl" else "cpu"
        asked = _backend_for(str(backend), device)
        if asked != lab.backend:
            problems.append(_backend_problem(str(backend), asked, device, lab.backend))
    if world_size not in (None, -1) and world_size != lab.world_size:
        problems.append(
            f"init_process_group(world_size={world_size!r}) but this lab has {lab.world_size} ranks: start the lab "
            f"with %dist start -n {world_size} (or %dist restart -n {world_size}), or pass world_size={lab.world_size} "
            "(os.environ['WORLD_SIZE'])"
        )
    if rank not in (None, -1) and rank != lab.rank:
        problems.append(
            f"init_process_group(rank={rank!r}) but this is rank {lab.rank} of the lab: pass "
            "rank=int(os.environ['RANK']) (distlab sets it as torchrun does), or leave rank out"
        )
    return "; ".join(problems) or None


def _backend_for(backend: str, device: str) -> str | None:
    """The backend ``backend`` gives tensors on ``device``: 'gloo' from 'gloo', or from 'cpu:gloo,cuda:nccl'."""
    text = backend.strip().lower()
    if ":" not in text:
        return text
    for part in text.split(","):
        on, _, name = part.partition(":")
        if on.strip() == device:
            return name.strip()
    return None


def _backend_problem(backend: str, asked: str | None, device: str, lab_backend: str) -> str:
    ranks = "CPU ranks" if device == "cpu" else "GPU ranks"
    head = f"init_process_group({backend!r}) but this lab's process group is {lab_backend}, on {ranks}"
    fix = f"pass {lab_backend!r}, or leave the backend out"
    if asked == "nccl":
        return f"{head} (NCCL needs GPUs): {fix}; or start the lab with %dist start --backend nccl on a machine with GPUs"
    if asked is None:
        return f"{head}, and it names no backend for {device} tensors: {fix}"
    if asked == "gloo":
        return f"{head}: {fix}; or start the lab with %dist start --backend gloo"
    return f"{head}: {fix} (a lab runs gloo or nccl)"


def _joins() -> bool:
    """Whether a call now is the user's, made while the lab's group is up."""
    return not _owned and _lab is not None and dist.is_initialized()


def _note(text: str) -> None:
    if dist.get_rank() == 0:  # one note for the world, not one per rank
        print(f"distlab: {text}", flush=True)


def _init_process_group(*args: Any, **kwargs: Any) -> None:
    """``init_process_group`` on a lab's rank: joins the lab's group (see the module's docstring)."""
    assert _torch_functions is not None
    init = _torch_functions[0]
    if not _joins():
        return init(*args, **kwargs)  # type: ignore[no-any-return]
    assert _lab is not None
    call = _signature(init).bind(*args, **kwargs)  # a TypeError for arguments torch would refuse
    problem = mismatch(
        call.arguments.get("backend"), call.arguments.get("world_size"), call.arguments.get("rank"), _lab
    )
    if problem is not None:
        raise ValueError(problem)
    _note(
        f"the lab's process group is already initialised ({_lab.backend}, world size {_lab.world_size}); "
        "init_process_group joined it"
    )
    return None


def _destroy_process_group(group: Any = None) -> None:
    """``destroy_process_group`` on a lab's rank: the default group stays up for the next cells."""
    assert _torch_functions is not None
    destroy = _torch_functions[1]
    if not _joins() or (group is not None and group is not dist.group.WORLD):
        return destroy() if group is None else destroy(group)  # type: ignore[no-any-return]
    _note("destroy_process_group() left the lab's process group up for the next cells; %dist stop ends it")
    return None


@functools.cache
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)

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
- What the lab accepts but torchrun refuses or hangs on (``device_id`` on the CPU, a fixed
  ``MASTER_PORT``) is said in a warning, so that a script developed in the lab does not break on
  its first torchrun (:func:`torchrun_differences`). Notes and warnings are said once per group
  the rank joined, by rank 0.

distlab's own making and unmaking of the group (``rank.group``) runs inside :func:`lab_owned`,
where torch's functions act as they always do.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections.abc import Callable, Collection, Iterator, Mapping

import torch.distributed as dist

from ..wire import GroupSpec
from . import namespace, torchcompat

__all__ = ["follow", "lab_owned", "mismatch", "set_environment", "torchrun_differences"]

# The lab's group as this rank joined it last (None: never joined; torch's functions act as always).
_lab: GroupSpec | None = None
# More than 0 while distlab itself makes or tears down the group.
_owned = 0
# torch's init_process_group and destroy_process_group, once replaced.
_torch_functions: tuple[Callable[..., None], Callable[..., None]] | None = None
# The notes and warnings said in the group joined last: a tutorial's setup() called in five cells
# is told once that it joined the lab's group, not five times.
_said: set[str] = set()


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
    _said.clear()  # a new group: what is worth saying is worth saying again
    if _torch_functions is None:
        _torch_functions = torchcompat.replace_group_functions(_init_process_group, _destroy_process_group)


def mismatch(
    backend: object, world_size: object, rank: object, lab: GroupSpec, rebound: Collection[str] = ()
) -> str | None:
    """Why ``init_process_group(backend, world_size=, rank=)`` cannot mean the lab's group, or None if it can.

    Left out (None, or torch's default -1), each matches. A backend matches when it is the lab's, or
    a ``"cpu:gloo,cuda:nccl"`` list naming the lab's backend for its ranks' device. ``rebound``: the
    names distlab gives cells (``rank``, ``world_size``) that the cell had rebound to the values
    passed, as a tutorial's launcher loop does: the message then says so, for that is the mistake.
    """
    problems = []
    if backend is not None:
        device = "cuda" if lab.backend == "nccl" else "cpu"
        asked = _backend_for(str(backend), device)
        if asked != lab.backend:
            problems.append(_backend_problem(str(backend), asked, device, lab.backend))
    if world_size not in (None, -1) and world_size != lab.world_size:
        problems.append(
            f"init_process_group(world_size={world_size!r}) but this lab has {lab.world_size} ranks"
            + (_REBOUND.format(name="world_size", value=world_size) if "world_size" in rebound else "")
            + f": start the lab with %dist start -n {world_size} (or %dist restart -n {world_size}), or pass "
            f"world_size={lab.world_size} (os.environ['WORLD_SIZE'])"
        )
    if rank not in (None, -1) and rank != lab.rank:
        problems.append(
            f"init_process_group(rank={rank!r}) but this is rank {lab.rank} of the lab"
            + (_REBOUND.format(name="rank", value=rank) if "rank" in rebound else "")
            + ": pass rank=int(os.environ['RANK']) (distlab sets it as torchrun does), or leave rank out"
        )
    return "; ".join(problems) or None


# Said when the value passed is the cell's rebinding of distlab's name, not the lab's.
_REBOUND = (
    " (this cell rebound distlab's {name} to {value!r}, as a launcher's loop `for {name} in range(size)` does; "
    "in a lab every rank is already one process of the world: drop the loop, or name its variable otherwise)"
)


def torchrun_differences(call: Mapping[str, object], lab: GroupSpec, environ: Mapping[str, str]) -> list[str]:
    """What in ``init_process_group(**call)`` the lab accepts but torchrun would refuse or hang on.

    Checked against torch 2.13 under ``torchrun --standalone``: a ``device_id`` on the CPU raises
    ValueError in torch; a ``MASTER_PORT`` the code set itself makes every process wait for a store
    nobody serves there (torchrun's agent serves the port torchrun sets), until the group's timeout.
    """
    said = []
    device_id = call.get("device_id")
    if device_id is not None and _not_an_accelerator(device_id):
        said.append(
            f"init_process_group(device_id={device_id!r}) joined the lab's group, but under torchrun torch raises "
            "ValueError (device_id must be an accelerator with an index): leave device_id out on the CPU, or pass "
            "it only for a GPU, like device_id=torch.device('cuda', local_rank)"
        )
    port = environ.get("MASTER_PORT")
    from_environment = call.get("store") is None and call.get("init_method") in (None, "env://")
    if from_environment and port not in (None, str(lab.master_port)):
        said.append(
            f"MASTER_PORT is {port} here, set by this code (the lab's is {lab.master_port}): under torchrun every "
            f"process would wait on port {port} for a store nobody serves there (torchrun's own is on the port it "
            "sets), until the timeout: leave MASTER_ADDR and MASTER_PORT to torchrun, e.g. "
            f"os.environ.setdefault('MASTER_PORT', '{port}') for runs without it"
        )
    return said


def _not_an_accelerator(device_id: object) -> bool:
    """Whether torch refuses ``device_id``: an int with no accelerator, or a device on the CPU or with no index."""
    import torch

    if isinstance(device_id, int):
        return torch.accelerator.current_accelerator() is None
    if isinstance(device_id, torch.device):
        return device_id.type == "cpu" or device_id.index is None
    return False


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
        return (
            f"{head} (NCCL needs GPUs): {fix}; or start the lab with %dist start --backend nccl on a machine with GPUs"
        )
    if asked is None:
        return f"{head}, and it names no backend for {device} tensors: {fix}"
    if asked == "gloo":
        return f"{head}: {fix}; or start the lab with %dist start --backend gloo"
    return f"{head}: {fix} (a lab runs gloo or nccl)"


def _joins() -> bool:
    """Whether a call now is the user's, made while the lab's group is up."""
    return not _owned and _lab is not None and dist.is_initialized()


def _note(text: str, warning: bool = False) -> None:
    """Say ``text`` on rank 0 (one note for the world, not one per rank), once in each group joined."""
    if dist.get_rank() != 0 or text in _said:
        return
    _said.add(text)
    if warning:
        print(f"distlab: warning: {text}", file=sys.stderr, flush=True)
    else:
        print(f"distlab: {text}", flush=True)


def _init_process_group(*args: object, **kwargs: object) -> None:
    """``init_process_group`` on a lab's rank: joins the lab's group (see the module's docstring)."""
    assert _torch_functions is not None
    init = _torch_functions[0]
    if not _joins():
        init(*args, **kwargs)  # torch's returns None
        return None
    assert _lab is not None
    call = _signature(init).bind(*args, **kwargs)  # a TypeError for arguments torch would refuse
    rebound = namespace.rebound()  # a cell's rebinding of rank is the likeliest cause of a wrong rank
    problem = mismatch(
        call.arguments.get("backend"), call.arguments.get("world_size"), call.arguments.get("rank"), _lab,
        [name for name in ("rank", "world_size") if name in rebound and _passed_the_cells(name, call.arguments)],
    )
    if problem is not None:
        raise ValueError(problem)
    for difference in torchrun_differences(call.arguments, _lab, os.environ):
        _note(difference, warning=True)
    _note(
        f"the lab's process group is already initialised ({_lab.backend}, world size {_lab.world_size}); "
        "init_process_group joined it"
    )
    return None


def _destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    """``destroy_process_group`` on a lab's rank: the default group stays up for the next cells."""
    assert _torch_functions is not None
    destroy = _torch_functions[1]
    if not _joins() or (group is not None and group is not dist.group.WORLD):
        destroy() if group is None else destroy(group)  # torch's returns None
        return None
    _note("destroy_process_group() left the lab's process group up for the next cells; %dist stop ends it")
    return None


def _passed_the_cells(name: str, arguments: Mapping[str, object]) -> bool:
    """Whether the value passed as ``name`` is what the cell's namespace now holds under that name."""
    passed, held = arguments.get(name), namespace.user_namespace().get(name)
    return passed is held or (type(passed) is type(held) and passed == held)


@functools.cache
def _signature(fn: Callable[..., object]) -> inspect.Signature:
    return inspect.signature(fn)

"""Every private torch API distlab uses, in one place, and the torch versions it is known to work with.

distlab reaches into torch where torch offers no public way to do what it needs: time DDP's
all-reduces without a communication hook, rebuild a process group after a broken one, read the
flight recorder in-process. Private APIs change between releases without notice, so each is called
here and nowhere else, with a comment saying what it does and why no public API does it: a new
torch release is checked against this file and its siblings, each named for what it wraps:
``torchcompat_dispatch.py`` (the watch's view of a step's ops: dispatch modes, collective ops,
FSDP2's internals), ``torchcompat_compile.py`` (torch.compile's wrappers), ``torchcompat_c10d.py``
(torch.distributed's internal module and ``Work``, as graders and the staged sends use them),
``torchcompat_fake.py`` (the scale dry run's fake tensors and groups) and ``torchcompat_torchft.py``
(torchft's DDP, for healing labs).

Importing this module checks the torch it runs on: outside the versions really run (CI and the GPU
machines), it refuses with one line saying what to install, unless ``DISTLAB_ALLOW_ANY_TORCH=1``.
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Sequence
from typing import Protocol, TypedDict, TypeVar, cast

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves as _pytree_leaves  # see tree_leaves

from . import staging

__all__ = [
    "ALLOW_ANY_TORCH",
    "KNOWN_GOOD",
    "check_torch",
    "comm_hook_names",
    "flight_recorder_dump",
    "foreach_copy_",
    "foreach_norm",
    "foreach_sub_",
    "forget_process_groups",
    "local_tensor",
    "observe_point_to_point",
    "replace_group_functions",
    "reset_group_count",
    "set_reducer_group",
    "storage_id",
    "swappable_reducer",
    "torch_version_problem",
    "tree_leaves",
    "version_counter",
    "work_from_future",
]

# The release check (and the 2.11 names) run when this is imported: ``torchcompat_release``.
from .torchcompat_release import ALLOW_ANY_TORCH, KNOWN_GOOD, check_torch, torch_version_problem

# ------------------------------------------------------------------------- tensors and modules


def foreach_norm(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The 2-norm of each tensor, in one batched call.

    ``torch._foreach_norm``: the fused kernel torch's optimizers and ``clip_grad_norm_`` use. The
    public ``torch.nn.utils.get_total_norm`` returns one norm of everything, not one per tensor, and
    ``torch.linalg.vector_norm`` in a loop launches a kernel per tensor.
    """
    return list(torch._foreach_norm(list(tensors)))


def foreach_copy_(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """``destinations[i].copy_(sources[i])`` for every i, in one batched call (``torch._foreach_copy_``;
    no public batched copy)."""
    torch._foreach_copy_(list(destinations), list(sources))


def foreach_sub_(tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor]) -> None:
    """``tensors[i] -= others[i]`` for every i, in one batched call (``torch._foreach_sub_``; no public
    batched subtraction)."""
    torch._foreach_sub_(list(tensors), list(others))


def version_counter(tensor: torch.Tensor) -> int:
    """How many times ``tensor`` has been changed in place (``Tensor._version``).

    Autograd's own counter, bumped by every in-place op: an optimizer's step and ``p -= lr * g`` under
    ``no_grad`` alike. torch has no public way to ask whether a tensor changed, short of a copy.
    """
    return int(tensor._version)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank stores: a DTensor's local shard, any other tensor itself.

    ``DTensor._local_tensor``: the public ``to_local()`` is an op of its own (recorded by autograd,
    and seen by a dispatch mode watching the step), where this only reads an attribute.
    """
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def storage_id(storage: torch.UntypedStorage) -> int:
    """An identity of ``storage``'s C++ object, which every Python wrapper of it shares and a resize keeps.

    ``UntypedStorage._cdata``: ``id()`` differs between two wrappers of one storage (each
    ``untyped_storage()`` call makes one), and ``data_ptr()`` changes when a resize moves the memory.
    """
    return int(storage._cdata)


def tree_leaves(value: object) -> list[object]:
    """The leaves of nested lists, tuples and dicts (an op's arguments or results), in order.

    ``torch.utils._pytree.tree_leaves``: the flattening torch's dispatcher uses for an op's
    arguments; it also opens the containers torch registers (``torch.Size``, named tuples of results).
    """
    return list(_pytree_leaves(value))


# ------------------------------------------------------------------------------------ DDP


def comm_hook_names(model: torch.nn.Module) -> list[str]:
    """The names of the communication hooks registered on a DDP model (empty for none).

    ``DistributedDataParallel._comm_hooks``: DDP keeps the hooks ``register_comm_hook`` was given
    there, and has no public getter (its logger records only the last hook's name).
    """
    return [getattr(hook, "__qualname__", repr(hook)) for hook, _ in getattr(model, "_comm_hooks", None) or ()]


def swappable_reducer(model: torch.nn.Module) -> bool:
    """Whether a DDP model's reducer can be given another process group (see :func:`set_reducer_group`)."""
    reducer = getattr(model, "reducer", None)
    return reducer is not None and hasattr(reducer, "_update_process_group")


def set_reducer_group(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Make a DDP model's reducer run its all-reduces on ``group`` from the next backward on.

    ``Reducer._update_process_group``: the call DDP's own (private) ``_update_process_group`` makes
    to change groups without rebuilding the model, for elastic training. The only public path,
    wrapping the model in DDP again, builds a new reducer and broadcasts the weights once more.
    """
    model.reducer._update_process_group(group)  # type: ignore[union-attr,operator]  # private, unannotated


_T = TypeVar("_T")


class _C10dPrivates(Protocol):
    """What distlab calls in ``torch._C._distributed_c10d`` that torch's stub of it does not list."""

    def _create_work_from_future(self, future: torch.futures.Future[_T], /) -> dist.Work: ...

    def _dump_fr_trace_json(self, include_collectives: bool, only_active: bool, /) -> str: ...


#: The C++ module, typed by what it has at run time (each call below says where it comes from).
_c10d_privates = cast(_C10dPrivates, torch._C._distributed_c10d)


def work_from_future(future: torch.futures.Future[_T]) -> dist.Work:
    """A ``Work`` that completes when ``future`` does, for a Python ``ProcessGroup`` to return.

    ``torch._C._distributed_c10d._create_work_from_future``: a process group's ``allreduce`` must
    return a ``Work``; the public ``Work`` class cannot be made from a future (or at all) in Python.
    """
    return _c10d_privates._create_work_from_future(future)


# ------------------------------------------------------------------------- process groups


def reset_group_count() -> None:
    """Name the next process group as if none had been made yet.

    ``distributed_c10d._world.group_count``: torch names groups by a counter it resets only when a
    destroy completes; ranks whose counters differ wait for each other under different store keys.
    No public API sets it.
    """
    dist.distributed_c10d._world.group_count = 0


def forget_process_groups() -> None:
    """Drop every process group torch knows of, as a clean ``destroy_process_group`` would have.

    For after a ``destroy_process_group`` that raised half-way (a broken backend): torch keeps its
    groups in private tables (``_world``) that only a destroy that succeeds clears, and the next
    ``init_process_group`` refuses while a default group is set. Each step is attempted whatever
    the others do: on a broken group any of them may raise.
    """
    c10d = dist.distributed_c10d
    with contextlib.suppress(Exception):  # a broken group may raise: each step regardless
        c10d._update_default_pg(None)  # the default group: what init_process_group checks
    world = c10d._world
    for table in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
                  "pg_coalesce_state"):
        with contextlib.suppress(Exception):  # as above: each table regardless
            getattr(world, table).clear()
    with contextlib.suppress(Exception):  # as above: each step regardless
        # The C++ registry that resolves groups by name (distributed_c10d imports it from there).
        torch._C._distributed_c10d._unregister_all_process_groups()
    with contextlib.suppress(Exception):  # as above: each step regardless
        reset_group_count()


def replace_group_functions(
    init: Callable[..., None], destroy: Callable[..., None]
) -> tuple[Callable[..., None], Callable[..., None]]:
    """Make ``init_process_group`` call ``init`` and ``destroy_process_group`` call ``destroy``; return torch's two.

    Both are defined in ``torch.distributed.distributed_c10d`` and re-exported by
    ``torch.distributed``: each name is replaced in both modules, so ``dist.init_process_group(...)``
    and a later ``from torch.distributed import init_process_group`` reach the replacement. A module
    that imported torch's function by name before keeps it (``device_mesh`` does, and calls it only
    when no group is up). The replacements show torch's name, signature and documentation.
    """
    c10d = dist.distributed_c10d
    torch_init, torch_destroy = c10d.init_process_group, c10d.destroy_process_group
    replaced = (("init_process_group", init, torch_init), ("destroy_process_group", destroy, torch_destroy))
    for name, ours, theirs in replaced:
        replacement = _forwarding(ours, theirs)
        setattr(c10d, name, replacement)
        setattr(dist, name, replacement)
    return torch_init, torch_destroy


def _forwarding(ours: Callable[..., None], theirs: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(theirs)
    def replacement(*args: object, **kwargs: object) -> None:
        return ours(*args, **kwargs)

    return replacement


#: ``observer(group, op, group_peer, tensors, work)``: see :func:`observe_point_to_point` (``work`` None: an
#: op of a NCCL batch, whose batch holds the work).
PointToPointObserver = Callable[
    [dist.ProcessGroup, str, "int | None", Sequence[torch.Tensor], "dist.Work | None"], None
]

#: The ProcessGroup methods every send and receive goes through, and what each is, for the observer.
_POINT_TO_POINT = (("send", "send"), ("recv", "recv"), ("recv_anysource", "recv"))


def observe_point_to_point(observer: PointToPointObserver) -> None:
    """Call ``observer(group, op, group_peer, tensors, work)`` each time a process group posts a send
    or a receive (``op`` "send" or "recv"; ``group_peer`` the peer's rank in ``group``, None for a
    receive from any source). Once per process; a later call changes nothing.

    torch's flight recorder does not record point-to-point operations on gloo (torch 2.13: a
    ``dist.send`` that waited 6 s for its receive left no entry), so a pipeline's hang would have no
    trace. ``dist.send``, ``recv``, ``isend``, ``irecv`` and ``batch_isend_irecv`` all end in these
    three methods of ``torch._C._distributed_c10d.ProcessGroup`` (a pybind11 class, whose attributes
    may be replaced); wrapping the methods, not the module's functions, also sees a function imported
    by name before (``P2POp`` compares ``op`` to ``dist.isend`` by identity). The observer's failure
    never reaches the caller. The same wrapper sends and receives a CUDA tensor on gloo through a
    host copy (``staging``), which gloo cannot do itself.
    """
    cls = dist.ProcessGroup  # torch._C._distributed_c10d.ProcessGroup, as torch.distributed names it
    if getattr(cls, "_distlab_observed", False):
        return
    for method, op in _POINT_TO_POINT:
        observed = _observed(getattr(cls, method), op, observer)
        # functools' convention, for whoever needs torch's own (a benchmark's baseline): the class's
        # attribute as it was (pybind11's method descriptor, which binds ``self``).
        vars(observed)["__wrapped__"] = cls.__dict__[method]  # a function's attribute, through its __dict__
        setattr(cls, method, observed)
    setattr(cls, "_distlab_observed", True)  # noqa: B010 - a mark of distlab's own on torch's class


def _observed(
    original: Callable[..., dist.Work], op: str, observer: PointToPointObserver
) -> Callable[..., dist.Work]:
    with_peer = op == "send" or original.__name__ == "recv"

    def method(self: dist.ProcessGroup, tensors: Sequence[torch.Tensor], *args: int) -> dist.Work:
        # gloo cannot send or receive a CUDA tensor as it is (ranks sharing a GPU): rank/staging.py.
        work = staging.staged(original, self, op, tensors, *args) if staging.needs_staging(self, tensors) \
            else original(self, tensors, *args)
        with contextlib.suppress(Exception):  # the observer's failure never reaches the caller's send
            observer(self, op, int(args[0]) if with_peer else None, list(tensors), work)
        return work

    method.__doc__ = original.__doc__
    method.__name__ = original.__name__
    return method


def group_members() -> dict[str, list[int]]:
    """Each process group this rank belongs to, by the name its flight-recorder entries carry
    (``_world.pg_names``): the global ranks in it. The recorder's own ``pg_config`` lists them for
    NCCL groups only."""
    world = dist.distributed_c10d._world
    members = {}
    for group, name in list(world.pg_names.items()):
        with contextlib.suppress(Exception):  # a group torn down while we read
            members[str(name)] = sorted(world.pg_group_ranks[group])
    return members


class FlightRecorderEntry(TypedDict, total=False):
    """One entry of torch's flight-recorder dump, the keys distlab reads."""

    process_group: list[str]  # [name, description]
    pg_id: int
    is_p2p: bool
    collective_seq_id: int
    profiling_name: str  # "gloo:all_reduce", "nccl:all_gather", ...
    input_sizes: list[list[int]]
    input_dtypes: list[str]


class FlightRecorderDump(TypedDict):
    """torch's flight-recorder dump: its entries (the only part distlab reads)."""

    entries: list[FlightRecorderEntry]


def flight_recorder_dump() -> FlightRecorderDump | None:
    """torch's flight recorder (the latest collectives of this process, every group), or None.

    ``torch._C._distributed_c10d._dump_fr_trace_json(include_collectives=True, only_active=False)``:
    the public way, ``TORCH_FR_DUMP_TEMP_FILE``, writes a file only when a NCCL watchdog times out;
    distlab reads it on demand, on gloo too. None where this torch build has no recorder.
    """
    try:
        dump = json.loads(_c10d_privates._dump_fr_trace_json(True, False))
    except Exception:  # noqa: BLE001 - no recorder in this build, or one that cannot dump: nothing to say
        return None
    return FlightRecorderDump(entries=list(dump.get("entries") or [])) if isinstance(dump, dict) else None

"""The private torch APIs behind ``distlab.watch``'s view of a step's ops: dispatch modes, the ops'
schemas, collective ops and their ``Work``, and FSDP2's internals.

The rest of ``rank/torchcompat.py``'s rule holds here: each private API is called in this module
and nowhere else, with what it does and why no public API does it. Importing it imports
``torchcompat_release`` first, so the torch release is checked before any of these are touched.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TypeAlias, TypeVar

import torch
import torch.distributed as dist

# OpOverload: what a dispatch mode's ``__torch_dispatch__`` receives as ``func``; torch names it nowhere public.
from torch._ops import OpOverload

# TorchDispatchMode: the class ``__torch_dispatch__``'s documentation builds on, from a private module.
from torch.utils._python_dispatch import TorchDispatchMode

from . import torchcompat_release  # noqa: F401 - checks the torch release before anything here is used

__all__ = [
    "DispatchMode",
    "Op",
    "collective_group",
    "collective_group_size",
    "dispatch_mode",
    "future_of",
    "label_fsdp_collectives",
    "op_name",
    "op_returns_alias",
    "pop_dispatch_mode",
    "push_dispatch_mode",
    "remove_dispatch_mode",
    "resolve_process_group",
    "wait_functional",
    "wait_work",
    "watch_storage_resizes",
    "work_of",
    "wrapper_subclass_in",
]

#: The base class of a mode that sees every op of this thread (``__torch_dispatch__``).
DispatchMode = TorchDispatchMode

#: An op as ``__torch_dispatch__`` receives it (``torch._ops.OpOverload``), whatever it takes and returns.
Op: TypeAlias = "OpOverload[..., object]"

_Mode = TypeVar("_Mode", bound=TorchDispatchMode)


# ------------------------------------------------------------------------------------ ops


def wrapper_subclass_in(types: Sequence[type]) -> bool:
    """Whether ``types`` (what ``__torch_dispatch__`` receives) holds a tensor subclass that runs an op
    as ops of its own (DTensor: local ops and collectives; torchao's Float8TrainingTensor: fp8 casts
    and ``_scaled_mm``): a mode that counts ops returns NotImplemented to it, to see those ops instead.
    ``torch.utils._python_dispatch.is_traceable_wrapper_subclass_type`` (private module): no public API
    tells such a subclass apart from FakeTensor, which wraps nothing."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type

    return any(is_traceable_wrapper_subclass_type(t) for t in types)



def op_name(func: Op) -> str:
    """An op's name within its namespace ("_allgather_base_" for ``c10d::_allgather_base_``).

    ``OpOverload._schema.name``: the op's registered name; the public ``__name__`` adds the overload
    ("_allgather_base_.default"), which differs op by op.
    """
    return str(func._schema.name).split("::")[-1]


def op_returns_alias(func: Op) -> bool:
    """Whether an op's schema lets a result alias an input (a view, an in-place or ``out=`` op).

    ``OpOverload._schema.returns[i].alias_info``: the schema is the only place torch says so before
    the op runs, and reading the results' storages after would cost every op of a step.
    """
    return any(ret.alias_info is not None for ret in func._schema.returns)


def push_dispatch_mode(mode: TorchDispatchMode) -> None:
    """Put a ``TorchDispatchMode`` on this thread's mode stack until :func:`pop_dispatch_mode`.

    ``torch.utils._python_dispatch._push_mode``: a mode's ``with`` block cannot span the two hooks
    that open and close a training step (a forward pre-hook, an optimizer post-hook).
    """
    from torch.utils._python_dispatch import _push_mode

    _push_mode(mode)


def pop_dispatch_mode(mode: object) -> bool:
    """Take ``mode`` off this thread's mode stack if it is on top; False (and nothing popped) otherwise.

    ``_get_current_dispatch_mode`` / ``_pop_mode``: a mode entered after ours and still open is not
    ours to remove.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode

    if _get_current_dispatch_mode() is not mode:
        return False
    _pop_mode()
    return True


def remove_dispatch_mode(mode: object) -> bool:
    """Take ``mode`` off this thread's mode stack wherever it is; the modes above it stay, in order.
    False where it is not on the stack.

    ``_get_current_dispatch_mode_stack`` / ``_pop_mode`` / ``_push_mode``: a breakpoint's mode
    (``rank.pause``) ends with its cell, when a watch's mode pushed after it may still be open; that
    one's owner pops it later and finds it on top, as it left it.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    if not any(m is mode for m in _get_current_dispatch_mode_stack()):
        return False
    above = []
    while (top := _pop_mode()) is not mode:
        above.append(top)
    for m in reversed(above):
        _push_mode(m)
    return True


@contextlib.contextmanager
def dispatch_mode(mode: _Mode) -> Iterator[_Mode]:
    """``with mode:`` for a mode that may be pushed and popped by hand elsewhere."""
    push_dispatch_mode(mode)
    try:
        yield mode
    finally:
        pop_dispatch_mode(mode)


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The ``ProcessGroup`` registered under ``group_name``: what a functional collective (``_c10d_functional``
    ops, DTensor's and FSDP2's) receives in place of its group.

    ``torch._C._distributed_c10d._resolve_process_group`` (``distributed_c10d`` imports it from the
    C++ module): torch's own lookup for these ops, with no public equivalent. ``GroupName`` is a str
    at run time.
    """
    return torch._C._distributed_c10d._resolve_process_group(dist.distributed_c10d.GroupName(group_name))


def collective_group_size(func: Op, args: Sequence[object], kwargs: Mapping[str, object]) -> int:
    """How many ranks a collective op (seen by a dispatch mode) runs over.

    A ``c10d`` op receives its group as a TorchScript object, turned back into the
    ``ProcessGroup`` by ``ProcessGroup.unbox``; a functional collective names its group, resolved
    by :func:`resolve_process_group`. Neither has a public equivalent: the ops are the
    dispatcher's, not an API.
    """
    # An op whose arguments this torch lays out otherwise counts as the whole world.
    with contextlib.suppress(Exception):  # private op layouts: an unknown one means the world
        if func.namespace == "c10d":
            for arg in args:
                if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
                    return int(dist.ProcessGroup.unbox(arg).size())
        else:
            names = [a for a in list(args) + list(kwargs.values()) if isinstance(a, str) and a not in
                     ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")]
            if names:
                return int(resolve_process_group(names[-1]).size())
    return dist.get_world_size() if dist.is_initialized() else 1


def collective_group(func: Op, args: Sequence[object], kwargs: Mapping[str, object]) -> dist.ProcessGroup | None:
    """The ``ProcessGroup`` a collective op (seen by a dispatch mode) runs over, or None.

    As :func:`collective_group_size`: a ``c10d`` op's group is a TorchScript object (``ProcessGroup.unbox``),
    a functional collective's is a name (:func:`resolve_process_group`); neither is a public API.
    """
    with contextlib.suppress(Exception):  # private op layouts: an unknown one means None
        if func.namespace == "c10d":
            for arg in args:
                if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
                    return dist.ProcessGroup.unbox(arg)
        else:
            names = [a for a in list(args) + list(kwargs.values()) if isinstance(a, str) and a not in
                     ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")]
            if names:
                return resolve_process_group(names[-1])
    return None


def work_of(out: object) -> dist.Work | None:
    """The ``Work`` a ``c10d`` op returned (alone or last in a tuple), as the Python class, or None.

    ``Work.unbox`` turns the TorchScript object the dispatcher hands back into ``dist.Work``.
    """
    candidate = out[-1] if isinstance(out, tuple) and out else out
    if not isinstance(candidate, torch.ScriptObject):
        return None
    try:
        return dist.distributed_c10d.Work.unbox(candidate)
    except Exception:  # noqa: BLE001 - not a Work
        return None


def future_of(work: dist.Work) -> torch.futures.Future[object] | None:
    """``work.get_future()``, or None where the backend has none (gloo's reduce-scatter)."""
    try:
        return work.get_future()
    except RuntimeError:
        return None


def wait_work(work: dist.Work) -> None:
    work.wait()


def wait_functional(out: object) -> object:
    """Wait for a functional collective's result(s): ``_c10d_functional.wait_tensor``, as funcol does."""
    wait = torch.ops._c10d_functional.wait_tensor
    if isinstance(out, torch.Tensor):
        return wait(out)
    if isinstance(out, (list, tuple)):
        return type(out)(wait(t) if isinstance(t, torch.Tensor) else t for t in out)
    return out


def watch_storage_resizes(callback: Callable[[torch.UntypedStorage, int], None]) -> Callable[[], None]:
    """Call ``callback(storage, bytes_before)`` after FSDP2 resizes a storage; returns the undo.

    FSDP2 allocates the whole weights of a layer it gathers, and frees them, by resizing their
    storages in place (``alloc_storage`` / ``free_storage`` in
    ``torch.distributed.fsdp._fully_shard._fsdp_param``, also imported by name in
    ``_fsdp_param_group``). ``UntypedStorage.resize_`` is no dispatcher op, so nothing that watches
    ops sees it, and torch's CPU allocator keeps no statistics: these two functions are the only place
    the memory of gathered weights can be seen on a CPU. Replaced while a step is observed, put back
    by the undo. Without FSDP2 (or in a torch that moved them) nothing is replaced.
    """
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
    except ImportError:
        return lambda: None
    originals = {(mod, name): getattr(mod, name) for mod in (_fsdp_param, _fsdp_param_group)
                 for name in ("alloc_storage", "free_storage") if hasattr(mod, name)}

    def counted(original: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        @functools.wraps(original)
        def resize(tensor: torch.Tensor) -> None:
            storage = tensor.untyped_storage()
            before = storage.nbytes()
            original(tensor)
            if storage.nbytes() != before:
                callback(storage, before)
        return resize

    for (mod, name), original in originals.items():
        setattr(mod, name, counted(original))

    def undo() -> None:
        for (mod, name), original in originals.items():
            setattr(mod, name, original)

    return undo


def label_fsdp_collectives(set_label: Callable[[str | None], str | None]) -> Callable[[], None]:
    """While FSDP2 gathers or reduces a unit, ``set_label(unit's module name)``; returns the undo.

    FSDP2's ``FSDPParamGroup.unshard`` issues a unit's all-gather (also when it prefetches the next
    unit's) and ``post_backward`` its reduce-scatter; the group knows its module's name
    (``_module_fqn``, "" for the root). These private methods are the one place a collective can be
    tied to its layer: the ops themselves carry only tensors and a process group. Replaced on the
    class while a step is observed, put back by the undo. ``set_label`` returns the label before, so
    nested calls restore it.
    """
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        return lambda: None
    originals = {name: FSDPParamGroup.__dict__[name] for name in ("unshard", "post_backward")
                 if name in FSDPParamGroup.__dict__}

    def labelled(original: Callable[..., object]) -> Callable[..., object]:
        @functools.wraps(original)
        def method(self: FSDPParamGroup, *args: object, **kwargs: object) -> object:
            before = set_label(getattr(self, "_module_fqn", None) or "(root)")
            try:
                return original(self, *args, **kwargs)
            finally:
                set_label(before)
        return method

    for name, original in originals.items():
        setattr(FSDPParamGroup, name, labelled(original))

    def undo() -> None:
        for name, original in originals.items():
            setattr(FSDPParamGroup, name, original)

    return undo

"""The dispatcher's collective ops, as a dispatch mode sees them: which collective each is, which of
its arguments it sends, and which tensor classes run their own ops.

Shared by the telemetry's observer (``telemetry.ops``), the breakpoints on collectives
(``rank.pause``) and a grader that counts collectives. The names are the dispatcher's, not an API:
``tests/test_watch_sharded.py`` holds them to this torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import torchcompat_dispatch

__all__ = ["C10D_OPS", "FUNCTIONAL_OPS", "collective_name", "sent_tensors", "subclass_dispatches"]

# op name -> (the collective, how its size is read: which argument, and the theory's convention:
# all-reduce the tensor, reduce-scatter its full input, all-gather its full output).
C10D_OPS: dict[str, tuple[str, str]] = {
    "allreduce_": ("all_reduce", "arg0"),
    "allreduce_coalesced_": ("all_reduce", "arg0"),
    "_allgather_base_": ("all_gather", "arg0"),
    "allgather_": ("all_gather", "arg0"),
    "allgather_into_tensor_coalesced_": ("all_gather", "arg0"),
    "allgather_coalesced_": ("all_gather", "arg0"),
    "_reduce_scatter_base_": ("reduce_scatter", "arg1"),
    "reduce_scatter_": ("reduce_scatter", "arg1"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "arg1"),
    "alltoall_base_": ("all_to_all", "arg1"),
    "alltoall_": ("all_to_all", "arg1"),
    "broadcast_": ("broadcast", "arg0"),
    "reduce_": ("reduce", "arg0"),
    "gather_": ("gather", "arg1"),
    "scatter_": ("scatter", "arg0"),
    "send": ("send", "arg0"),
    "recv_": ("recv", "arg0"),
    "recv_any_source_": ("recv", "arg0"),
}
FUNCTIONAL_OPS: dict[str, tuple[str, str]] = {
    "all_reduce": ("all_reduce", "arg0"),
    "all_reduce_": ("all_reduce", "arg0"),
    "all_reduce_coalesced": ("all_reduce", "arg0"),
    "all_reduce_coalesced_": ("all_reduce", "arg0"),
    "all_gather_into_tensor": ("all_gather", "out"),
    "all_gather_into_tensor_out": ("all_gather", "out"),
    "all_gather_into_tensor_coalesced": ("all_gather", "out"),
    "reduce_scatter_tensor": ("reduce_scatter", "arg0"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "arg0"),
    "all_to_all_single": ("all_to_all", "arg0"),
    "broadcast": ("broadcast", "arg0"),
    "broadcast_": ("broadcast", "arg0"),
}
_NAMESPACES = {"c10d": C10D_OPS, "_c10d_functional": FUNCTIONAL_OPS, "_c10d_functional_autograd": FUNCTIONAL_OPS}


def collective_name(func: torchcompat_dispatch.Op) -> str | None:
    """The collective an op is ('all_gather', ...), or None for any other op."""
    table = _NAMESPACES.get(getattr(func, "namespace", ""))
    if table is None:
        return None
    entry = table.get(torchcompat_dispatch.op_name(func))
    return entry[0] if entry else None

# c10d ops whose first argument is where the result goes, and whose second is what the rank sends.
_SENDS_SECOND = frozenset({
    "_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_", "allgather_coalesced_",
    "_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_", "alltoall_base_",
    "alltoall_", "gather_", "scatter_",
})


def sent_tensors(func: torchcompat_dispatch.Op, args: Sequence[object]) -> list[torch.Tensor]:
    """The tensors a collective op is given to send (or, for a receive, to fill): its input, not
    the buffer its result goes to. A functional collective takes its input first."""
    if not args:
        return []
    sent = args[1] if func.namespace == "c10d" and torchcompat_dispatch.op_name(func) in _SENDS_SECOND else args[0]
    if func.namespace == "c10d" and torchcompat_dispatch.op_name(func) == "barrier":
        return []  # a barrier's tensor is its own placeholder
    return [t for t in _leaves(sent) if isinstance(t, torch.Tensor)]


def _leaves(value: object) -> list[object]:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def subclass_dispatches(cls: type) -> bool:
    """True for DTensor and funcol's async tensor (and their subclasses): they run ops of their own.

    Not every tensor subclass: a fake tensor (what FSDP2 and torch.compile trace with) refuses ops
    outside its own mode, and handing it the op would leave no one to run it.
    """
    answer = _DISPATCHING.get(cls)
    if answer is None:
        answer = _DISPATCHING[cls] = any(base.__name__ in ("DTensor", "AsyncCollectiveTensor")
                                         for base in cls.__mro__)
    return answer


_DISPATCHING: dict[type, bool] = {}

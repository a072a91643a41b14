"""Every op of a watched step, seen once: collectives timed, new tensors counted.

FSDP2 and tensor parallelism (DTensor) talk to their process groups from Python and from C++,
through torch's dispatcher: ``c10d`` ops (``_allgather_base_``, ``_reduce_scatter_base_``, the ops
``dist.all_reduce`` and friends call) and the functional collectives DTensor uses
(``_c10d_functional.all_reduce`` then ``wait_tensor``). A ``TorchDispatchMode`` sees each of them,
whoever called it, so one observer covers FSDP2, DTensor and collectives written by hand, with no
patch to any library. The same pass counts the storages each op makes (``storages.LiveTensors``), the
CPU's stand-in for the allocator statistics it lacks.

The observer is on while a model trains: the watch pushes it at the first step's forward and pops
it at the cell's end, so what comes after an update (averaging the models every H steps) is seen
too, and code outside training (between cells) runs at full speed.

A collective is stamped when it is launched and when it completes: by a callback on its future
where the backend gives one (gloo's all-reduce, all-gather, broadcast), else by waiting for it where
it was launched (gloo's reduce-scatter has no future; FSDP2 waits for it at once anyway), and the
functional collectives by waiting for their result, which the next op needs anyway. On a GPU the
stamps say when work was queued, so CUDA events time it instead. gloo's sends and receives are
listed untimed: they have no future, waiting where one is posted can block the receive posted after
it, and each can be waited for only once, by its caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from ..rank import torchcompat, torchcompat_dispatch
from ..rank.collective_ops import C10D_OPS, FUNCTIONAL_OPS, collective_name, subclass_dispatches
from .storages import makes_storage

if TYPE_CHECKING:
    from .storages import LiveTensors

__all__ = ["CollectiveTiming", "OpObserver", "Stamped", "collective_name"]

class Stamped:
    """What a timed collective has: ``launched`` and ``done`` (``perf_counter``), or CUDA ``events``.

    On a GPU the CPU clock says when work was queued, not run: CUDA events time it instead.
    """

    launched: float
    done: float | None
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None

    def seconds(self) -> float | None:
        if self.events is not None:
            start, end = self.events
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        return None if self.done is None else self.done - self.launched

    def start_events(self) -> None:
        """Time it on the GPU: record the start event now; the end is recorded on completion."""
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self.events = (start, torch.cuda.Event(enable_timing=True))


@dataclass
class CollectiveTiming(Stamped):
    """One collective of a step: what, how many bytes (the theory's convention), when, over how many ranks."""

    op: str
    bytes: int
    ranks: int
    launched: float
    done: float | None = None
    #: Stamped by waiting where it was launched (no future to call back): the caller was blocked.
    waited: bool = False
    #: Listed with its bytes, not timed (gloo's send and recv: see the module's docstring).
    untimed: bool = False
    #: The layer it gathers or reduces, where that is known (FSDP2's units).
    layer: str | None = None
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None


def _tensor_bytes(value: object) -> int:
    return sum(t.numel() * t.element_size() for t in torchcompat.tree_leaves(value) if isinstance(t, torch.Tensor))


# torch's TorchDispatchMode is untyped: defining a subclass calls its __init_subclass__.
class OpObserver(torchcompat_dispatch.DispatchMode):
    """A dispatch mode that times collectives into ``timings`` and counts new tensors into ``memory``.

    Either may be None (off). The watch swaps ``timings`` for each step's list.
    """

    def __init__(self, memory: LiveTensors | None = None, timings: list[CollectiveTiming] | None = None) -> None:
        cast("Callable[[], None]", super().__init__)()  # TorchDispatchMode's, unannotated in torch
        self.memory = memory
        self.timings = timings
        self._seen: dict[torchcompat_dispatch.Op, tuple[str | None, bool]] = {}
        #: The layer whose collectives run now (set around FSDP2's gathers and reductions).
        self.label: str | None = None

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Let torch.compile compile while this mode is on (measured: with any other mode on the stack it
        skips every frame, and a watched compiled model ran uncompiled). The mode is off while torch
        compiles and on while the compiled code runs: collectives outside the graphs are seen as ever,
        and so are the ops of a graph that runs them one by one (aot_eager); a kernel that inductor
        fused is one op the mode does not see (nor, on the CPU, the memory it allocates)."""
        return True

    def set_label(self, label: str | None) -> str | None:
        """Tag the collectives launched from now on with ``label``; returns the previous one."""
        before, self.label = self.label, label
        return before

    def __torch_dispatch__(
        self, func: torchcompat_dispatch.Op, types: tuple[type, ...], args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        if any(subclass_dispatches(t) for t in types):
            # A DTensor (or another tensor subclass) gets the op first: it runs its own ops on its
            # local tensors, and the collectives it needs (a redistribution inside the op, the
            # all-reduce of a Partial gradient in an optimizer's step) come back here one by one.
            # Handled here instead, they would run with this mode off, unseen.
            return NotImplemented
        kwargs = kwargs or {}
        seen = self._seen.get(func)
        if seen is None:  # once per op: every op of a step comes here, so nothing is worked out twice
            seen = self._seen[func] = (collective_name(func), makes_storage(func))
        name, fresh = seen
        if name is not None and self.timings is not None:
            return self._timed(name, func, args, kwargs)
        out = func(*args, **kwargs)
        if fresh and self.memory is not None:
            self.memory.add_outputs(out)
        return out

    def _timed(
        self, name: str, func: torchcompat_dispatch.Op, args: tuple[object, ...], kwargs: dict[str, object]
    ) -> object:
        functional = func.namespace != "c10d"
        ranks = torchcompat_dispatch.collective_group_size(func, args, kwargs)
        timing = CollectiveTiming(name, 0, ranks, time.perf_counter(), layer=self.label)
        cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in torchcompat.tree_leaves(args))
        if cuda:
            timing.start_events()
        out = func(*args, **kwargs)
        if self.memory is not None and makes_storage(func):
            self.memory.add_outputs(out)
        table = FUNCTIONAL_OPS if functional else C10D_OPS
        where = table[torchcompat_dispatch.op_name(func)][1]
        timing.bytes = _tensor_bytes(out if where == "out" else args[int(where[3:])])
        # A list: __torch_dispatch__ times a collective only while timings is one (None: off).
        cast("list[CollectiveTiming]", self.timings).append(timing)
        if functional:
            out = torchcompat_dispatch.wait_functional(out)
            self._stamp(timing)
        else:
            work = torchcompat_dispatch.work_of(out)
            future = torchcompat_dispatch.future_of(work) if work is not None else None
            if future is not None:
                future.then(lambda _done: self._stamp(timing))
            elif name in _POINT_TO_POINT:
                # Listed, not timed. Waited for here, a send would block before the receive posted
                # beside it (a ring's batch_isend_irecv hung on every rank); and gloo's send and recv
                # can be waited for once only (a thread waiting beside the caller left the caller
                # hanging in its own wait).
                timing.untimed = True
                timing.done = timing.launched
            else:
                if work is not None:
                    torchcompat_dispatch.wait_work(work)
                timing.waited = True
                self._stamp(timing)
        return out

    @staticmethod
    def _stamp(timing: CollectiveTiming) -> None:
        timing.done = time.perf_counter()
        if timing.events is not None:
            timing.events[1].record()


#: Point-to-point ops: gloo's give no future, and their caller decides when to wait.
_POINT_TO_POINT = frozenset({"send", "recv"})

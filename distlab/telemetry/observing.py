"""A watch's op observer (``ops.OpObserver``), on while a step runs (``telemetry/watch.py``).

It times the collectives that DDP's reducer does not (FSDP2's, tensor parallelism's, those called by
hand) and, on the CPU, counts the storages ops make (``storages.LiveTensors``: a step's peak memory).
Turned on at a step's beginning, with the patches of torch that feed it (storage resizes, FSDP2's
collective labels), and off at a cell's end or the watch's close.
"""

from __future__ import annotations

from collections.abc import Callable

from ..rank import torchcompat_dispatch
from .ops import OpObserver
from .steps import Step
from .storages import LiveTensors

__all__ = ["INSIDE_COMPILED", "ObservedOps"]

#: The watch's note when it begins inside a compiled call, which sets the observer aside.
INSIDE_COMPILED = (
    "this model runs inside a torch.compile'd module, so the watch began inside the compiled call, which set "
    "its op observer aside: the first step's record misses ops (FSDP2's collectives, the CPU's memory). "
    "Watch the compiled module (distlab.watch(compiled)) to see them all")


def _nothing() -> None:
    pass


class ObservedOps:
    """The observer of a watch's steps, if it needs one: ``time_ops``, ``count_storages`` (see the module)."""

    def __init__(self, time_ops: bool, count_storages: bool) -> None:
        self.live = LiveTensors() if count_storages else None
        self.observer = OpObserver(self.live, [] if time_ops else None) if (time_ops or self.live) else None
        self.on = False
        self._undo_patches: Callable[[], object] = _nothing

    @property
    def timed(self) -> bool:
        """True when it times collectives op by op."""
        return self.observer is not None and self.observer.timings is not None

    def begin(self, step: Step) -> None:
        """Observe ``step``'s ops from now: the collectives it times go to the step."""
        if self.observer is None:
            return
        if self.observer.timings is not None:
            self.observer.timings = step.collectives
        if not self.on:
            torchcompat_dispatch.push_dispatch_mode(self.observer)
            self.on = True
            undo = [torchcompat_dispatch.watch_storage_resizes(self.live.resized)] if self.live is not None else []
            if self.observer.timings is not None:
                undo.append(torchcompat_dispatch.label_fsdp_collectives(self.observer.set_label))
            self._undo_patches = lambda: [u() for u in undo]

    def stop(self, notes: list[str]) -> None:
        """Observe no more; if another dispatch mode is still open above it, it cannot: ``notes`` says so."""
        if not self.on:
            return
        if not torchcompat_dispatch.pop_dispatch_mode(self.observer):
            notes.append("ops stopped being observed late: another dispatch mode was entered after the step began "
                         "and is still open")
            return
        self.on = False
        self._undo_patches()
        self._undo_patches = _nothing

"""What the ``ddp-from-hooks`` grader sees of the learner's backward and ``finish()``, one step at a time.

Its own hook on every parameter, registered before the learner's (a parameter's hooks run in the
order they were registered), counts the gradients as they become ready and, before each one's hooks
run, how many gradient bytes the learner's hooks left unlaunched: DDP launches a bucket from the hook
that fills it, so those bytes never reach the cap between two gradients. ``dist.all_reduce`` is
wrapped to note each call (how many gradients were ready, how many elements, asynchronous or not),
and its work handle to note every wait on it before backward returned: ``work.wait()`` and
``synchronize()``, its future's ``wait()``, ``torch.futures.wait_all`` and ``dist.barrier()`` (gloo's
barrier waits for every collective before it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ...rank.exercise import backward

__all__ = ["Late", "Launch", "Watch"]


@dataclass(frozen=True)
class Launch:
    """One ``dist.all_reduce`` call: during backward or in finish(), after how many gradients were ready."""

    in_backward: bool
    ready: int
    numel: int
    is_async: bool


@dataclass(frozen=True)
class Late:
    """A full bucket left waiting: after gradient ``after`` (counted from 1), ``pending`` bytes unlaunched."""

    after: int
    pending: int


@dataclass
class _Step:
    in_backward: bool = False
    ready: int = 0
    ready_elements: int = 0
    launched_elements: int = 0
    launches: list[Launch] = field(default_factory=list)
    waits: list[str] = field(default_factory=list)  # what waited on an all-reduce before backward returned
    late: Late | None = None


class Watch:
    """Counts what one model's backward and the learner's all-reduces do; make it before the learner's hooks."""

    def __init__(self, model: nn.Module, cap_bytes: int) -> None:
        self.cap = cap_bytes
        self.element_size = next(model.parameters()).element_size()
        self.now = _Step()
        for p in model.parameters():
            if p.requires_grad:
                # torch leaves register_post_accumulate_grad_hook unannotated: typed here as documented.
                hook = p.register_post_accumulate_grad_hook
                register = cast("Callable[[Callable[[torch.Tensor], None]], object]", hook)
                register(self._ready)

    def _ready(self, p: torch.Tensor) -> None:
        now = self.now
        if not now.in_backward:
            return
        # Before this gradient's own hooks: what the learner's hooks left after the one before.
        pending = (now.ready_elements - now.launched_elements) * self.element_size
        if pending >= self.cap and now.late is None:
            now.late = Late(now.ready, pending)
        now.ready += 1
        now.ready_elements += p.numel()

    @contextmanager
    def step(self) -> Iterator[_Step]:
        """The learner's all-reduces and waits watched: what this step did, once it has run."""
        self.now = now = _Step()
        originals = (dist.all_reduce, dist.barrier, torch.futures.wait_all)

        def all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            is_async = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
            now.launches.append(Launch(now.in_backward, now.ready, tensor.numel(), is_async))
            if now.in_backward:
                now.launched_elements += tensor.numel()
            work = originals[0](tensor, *args, **kwargs)
            return _Watched(work, now) if work is not None else None

        def barrier(*args: Any, **kwargs: Any) -> Any:
            _waited(now, "dist.barrier()")
            return originals[1](*args, **kwargs)

        def wait_all(futures: list[Any]) -> list[Any]:
            _waited(now, "torch.futures.wait_all(...)")
            return originals[2](futures)

        dist.all_reduce, dist.barrier, torch.futures.wait_all = all_reduce, barrier, wait_all
        try:
            yield now
        finally:
            dist.all_reduce, dist.barrier, torch.futures.wait_all = originals

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, counted as the learner's backward."""
        self.now.in_backward = True
        try:
            backward(loss)
        finally:
            self.now.in_backward = False


def _waited(now: _Step, how: str) -> None:
    if now.in_backward:
        now.waits.append(how)


class _Watched:
    """An all-reduce's work handle, telling the grader when it is waited on."""

    def __init__(self, work: Any, now: _Step) -> None:
        self._work, self._now = work, now

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        _waited(self._now, "work.wait()")
        return self._work.wait(*args, **kwargs)

    def synchronize(self) -> Any:
        _waited(self._now, "work.synchronize()")
        return self._work.synchronize()

    def get_future(self) -> torch.futures.Future[Any]:
        # A future of torch's own type (torch.futures.wait_all takes no other), completed with the work's.
        watched = _WatchedFuture(self._now)
        self._work.get_future().add_done_callback(watched.complete)
        return watched

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class _WatchedFuture(torch.futures.Future[Any]):
    def __init__(self, now: _Step) -> None:
        super().__init__()
        self._now = now

    def complete(self, done: torch.futures.Future[Any]) -> None:
        try:
            self.set_result(done.value())
        except Exception as exc:  # noqa: BLE001 - the all-reduce's own error, handed on to whoever waits
            self.set_exception(exc)

    def wait(self) -> Any:
        _waited(self._now, "work.get_future().wait()")
        return super().wait()

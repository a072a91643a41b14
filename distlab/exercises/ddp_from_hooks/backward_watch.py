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
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from ...rank.exercise import backward

__all__ = ["Late", "Launch", "Watch"]

P = ParamSpec("P")
R = TypeVar("R")


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

        # In torch's place, returning a watched handle for its Work: a stand-in whose type torch cannot name.
        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            is_async = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
            now.launches.append(Launch(now.in_backward, now.ready, tensor.numel(), is_async))
            if now.in_backward:
                now.launched_elements += tensor.numel()
            work = originals[0](tensor, *args, **kwargs)
            return _Watched(work, now) if work is not None else None

        barrier = _noted(now, "dist.barrier()", originals[1])
        wait_all = _noted(now, "torch.futures.wait_all(...)", originals[2])
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


def _noted(now: _Step, how: str, real: Callable[P, R]) -> Callable[P, R]:
    """``real``, noting each call as a wait (``how``) first."""

    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        _waited(now, how)
        return real(*args, **kwargs)

    return call


class _Watched:
    """An all-reduce's work handle, telling the grader when it is waited on."""

    def __init__(self, work: dist.Work, now: _Step) -> None:
        self._work, self._now = work, now

    def wait(self, *args: timedelta, **kwargs: timedelta) -> bool:  # Work.wait(timeout)
        _waited(self._now, "work.wait()")
        return self._work.wait(*args, **kwargs)

    def synchronize(self) -> None:
        _waited(self._now, "work.synchronize()")
        return self._work.synchronize()

    def get_future(self) -> torch.futures.Future[object]:
        # A future of torch's own type (torch.futures.wait_all takes no other), completed with the work's.
        watched = _WatchedFuture(self._now)
        self._work.get_future().add_done_callback(watched.complete)
        return watched

    def __getattr__(self, name: str) -> object:
        return getattr(self._work, name)


# Of object: the all-reduce's result is handed on as it is, and torch types set_exception's argument as a result.
class _WatchedFuture(torch.futures.Future[object]):
    def __init__(self, now: _Step) -> None:
        super().__init__()
        self._now = now

    def complete(self, done: torch.futures.Future[object]) -> None:
        try:
            self.set_result(done.value())
        except Exception as exc:  # noqa: BLE001 - the all-reduce's own error, handed on to whoever waits
            self.set_exception(exc)

    def wait(self) -> object:
        _waited(self._now, "work.get_future().wait()")
        return super().wait()

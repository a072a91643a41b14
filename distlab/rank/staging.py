"""Sends and receives of CUDA tensors over gloo, through copies in host memory.

Ranks that share one GPU run gloo (NCCL refuses two ranks on one device), and gloo takes CUDA
tensors in its collectives but not in ``send`` and ``recv``: it hands the tensor's device pointer to
the socket, and the sender fails with ``writev ... Bad address`` (torch 2.11 on an H200, measured:
a pipeline's first send). Every send and receive passes through the process group's methods that
``torchcompat.observe_point_to_point`` wraps; there, a CUDA tensor on gloo travels as a copy:

- a send copies the tensor to host memory when it is posted (what a GPU send reads is the tensor
  as it is then) and sends the copy, which the returned work keeps alive;
- a receive lands in a host buffer and is copied into the CUDA tensor when its work is waited on,
  as NCCL's receive is only guaranteed complete after ``wait()``.

    work = staged(original_method, group, "recv", [cuda_tensor], peer, tag)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StagedReceive", "needs_staging", "staged"]


def needs_staging(group: Any, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are CUDA tensors that ``group`` (a gloo group) cannot send or receive as they are."""
    if not any(t.is_cuda for t in tensors):
        return False
    with contextlib.suppress(Exception):  # a group torch cannot name: leave it to torch
        return bool(dist.get_backend(group) == "gloo")
    return False


def staged(original: Callable[..., Any], group: Any, op: str, tensors: Sequence[torch.Tensor], *args: Any) -> Any:
    """``original(group, tensors, *args)`` with host copies standing in for ``tensors``."""
    if op == "send":
        return StagedSend(original(group, [t.detach().cpu() for t in tensors], *args))
    buffers = [torch.empty_like(t, device="cpu") for t in tensors]
    return StagedReceive(original(group, buffers, *args), list(tensors), buffers)


class StagedSend(dist.Work):
    """gloo's send work (which holds the host copy it sends), as torch's callers use it."""

    def __init__(self, work: Any) -> None:
        super().__init__()
        self._work = work

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return bool(self._work.wait(timeout))  # timedelta(0): the group's own timeout, as torch's

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def is_success(self) -> bool:
        return bool(self._work.is_success())

    def exception(self) -> Any:
        return self._work.exception()

    def abort(self) -> None:
        self._work.abort()


class StagedReceive(StagedSend):
    """A receive into host buffers whose ``wait`` copies them into the CUDA tensors asked for."""

    def __init__(self, work: Any, targets: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
        super().__init__(work)
        self._targets, self._buffers = targets, buffers

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        done = super().wait(timeout)
        if self._buffers:
            # Outside autograd: a pipeline stage receives into leaf tensors that require grad (its
            # inputs), which torch's own receive fills without autograd seeing it.
            with torch.no_grad():
                for target, buffer in zip(self._targets, self._buffers):
                    target.copy_(buffer)
            self._buffers = []
        return done

    def _source_rank(self) -> int:
        """The sender of a receive from any source (``dist.recv(src=None)`` reads it after ``wait``)."""
        return int(self._work._source_rank())

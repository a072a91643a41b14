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

gloo's all-gather has the same gap on one path: ``dist.all_gather_into_tensor`` takes CUDA tensors,
but torch's functional all-gather (``_c10d_functional.all_gather_into_tensor``, what DTensor's
``Shard -> Replicate``, ``full_tensor()`` and a compiled FSDP2 model call) goes to gloo's coalesced
all-gather, which reads the device pointers as host memory: both ranks die with SIGSEGV (torch 2.11
on an H200, measured; ``scripts/gpu-gloo-probe.py`` shows it without distlab). In a lab whose ranks
share a GPU over gloo, ``stage_functional_all_gathers`` puts a kernel of its own in front of those ops
for CUDA tensors: the all-gather through ``dist.all_gather_into_tensor`` on host copies, done when it
returns (``wait_tensor`` then finds no work and returns at once, as for a collective already waited on).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .torchcompat_c10d import ForwardingWork
from .torchcompat_dispatch import resolve_process_group

__all__ = ["StagedReceive", "needs_staging", "stage_functional_all_gathers", "staged"]


def needs_staging(group: dist.ProcessGroup | None, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are CUDA tensors that ``group`` (a gloo group) cannot send or receive as they are."""
    if not any(t.is_cuda for t in tensors):
        return False
    with contextlib.suppress(Exception):  # a group torch cannot name: leave it to torch
        return bool(dist.get_backend(group) == "gloo")
    return False


def staged(
    original: Callable[..., dist.Work], group: dist.ProcessGroup, op: str, tensors: Sequence[torch.Tensor],
    *args: object,
) -> StagedSend:
    """``original(group, tensors, *args)`` with host copies standing in for ``tensors``."""
    if op == "send":
        return StagedSend(original(group, [t.detach().cpu() for t in tensors], *args))
    buffers = [torch.empty_like(t, device="cpu") for t in tensors]
    return StagedReceive(original(group, buffers, *args), list(tensors), buffers)


class StagedSend(ForwardingWork):
    """gloo's send work (which holds the host copy it sends), as torch's callers use it."""


class StagedReceive(StagedSend):
    """A receive into host buffers whose ``wait`` copies them into the CUDA tensors asked for."""

    def __init__(self, work: dist.Work, targets: list[torch.Tensor], buffers: list[torch.Tensor]) -> None:
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


#: The torch.library registrations (kept: a Library's kernels go when it is collected), by dispatch key.
_functional_kernels: dict[str, torch.library.Library] = {}
#: torch's own, untyped: the kernel registry.
_Library: Any = torch.library.Library


def stage_functional_all_gathers(dispatch_key: str = "CUDA") -> None:
    """Run torch's functional all-gathers of ``dispatch_key`` tensors through host copies (module doc).
    Once per process and key. Only for a lab whose groups are gloo: the kernel it replaces is gone for
    the process, and a group of another backend gets the same staged all-gather (correct, not overlapped)."""
    if dispatch_key in _functional_kernels:
        return
    library = _Library("_c10d_functional", "IMPL")
    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        library.impl("all_gather_into_tensor", _all_gather, dispatch_key)
        library.impl("all_gather_into_tensor_out", _all_gather_out, dispatch_key)
        library.impl("all_gather_into_tensor_coalesced", _all_gather_coalesced, dispatch_key)
    _functional_kernels[dispatch_key] = library


def _group(group_name: str | dist.ProcessGroup) -> dist.ProcessGroup:
    # torch 2.11 passes the group's registered name; 2.13's schema takes the group itself as well.
    return group_name if isinstance(group_name, dist.ProcessGroup) else resolve_process_group(group_name)


def _all_gather(tensor: torch.Tensor, group_size: int, group_name: str | dist.ProcessGroup) -> torch.Tensor:
    out = torch.empty((tensor.shape[0] * group_size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    return _all_gather_out(tensor, group_size, group_name, out=out)


def _all_gather_out(
    tensor: torch.Tensor, group_size: int, group_name: str | dist.ProcessGroup, *, out: torch.Tensor
) -> torch.Tensor:
    gathered = torch.empty(out.shape, dtype=out.dtype, device="cpu")
    dist.all_gather_single(gathered, tensor.detach().to("cpu").contiguous(), group=_group(group_name))
    out.copy_(gathered)
    return out


def _all_gather_coalesced(
    tensors: list[torch.Tensor], group_size: int, group_name: str | dist.ProcessGroup
) -> list[torch.Tensor]:
    return [_all_gather(t, group_size, group_name) for t in tensors]

"""The private torch APIs of ``torch.distributed``'s internal module and of its ``Work``: point-to-point
functions replaced where torch itself looks them up (exercise graders and the 1F1B schedule's
recorder), and a ``Work`` that stands for another (``rank/staging.py``'s host copies).

``rank/torchcompat.py``'s rule holds here: each private API is used in this module and nowhere else,
with what it does and why no public API does it. Importing it imports ``torchcompat_release`` first, so the
torch release is checked before any of these are touched. Exercise graders run on the ranks and may
import only ``distlab/rank/`` modules: this one is theirs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import torchcompat_release  # noqa: F401 - checks the torch release before anything here is used

__all__ = ["ForwardingWork", "point_to_point_functions", "replaced_point_to_point"]


# ------------------------------------------------------------------ point-to-point functions


def point_to_point_functions(names: tuple[str, ...]) -> dict[str, Callable[..., dist.Work | int | None]]:
    """torch's functions ``names`` ("send", "isend", "recv", "irecv", "barrier", ...), as
    ``torch.distributed.distributed_c10d`` holds them now: what :func:`replaced_point_to_point` replaces.
    Each returns what its torch function does: a Work to wait on, a sender's rank (recv), or None."""
    return {name: getattr(c10d, name) for name in names}


@contextlib.contextmanager
def replaced_point_to_point(replacements: Mapping[str, Callable[..., object]]) -> Iterator[None]:
    """Within the block, each function of ``torch.distributed`` named in ``replacements`` is its
    replacement, for a user's call and for torch's own; restored after.

    ``torch.distributed.distributed_c10d`` (an internal module, re-exported by ``torch.distributed``)
    is where torch looks them up itself: ``dist.send`` calls its module's ``isend``, and
    ``batch_isend_irecv`` checks a ``P2POp``'s op against its module's ``isend`` and ``irecv`` by
    identity. Replacing the public name alone would miss those calls and refuse a ``P2POp`` made with
    the replacement; the same function goes in both modules.
    """
    saved = [(module, name, getattr(module, name)) for name in replacements for module in (dist, c10d)]
    try:
        for name, replacement in replacements.items():
            setattr(dist, name, replacement)
            setattr(c10d, name, replacement)
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


# ------------------------------------------------------------------------------------ Work


class ForwardingWork(dist.Work):
    """A ``Work`` that stands for another (``self.work``): its state, its wait and its sender are the other's.

    ``Work._source_rank``: what ``dist.recv(src=None)`` calls, after ``wait``, to return the sender of
    a receive from any source; it is part of no public API, and a ``Work`` that does not forward it
    makes such a receive fail.
    """

    def __init__(self, work: dist.Work) -> None:
        super().__init__()
        self.work = work

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        return bool(self.work.wait(timeout))  # timedelta(0): the group's own timeout, as torch's

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def is_success(self) -> bool:
        return bool(self.work.is_success())

    def exception(self) -> object:  # what the work's own says (torch's stub leaves it untyped)
        return self.work.exception()

    def abort(self) -> None:
        # torch 2.13's Work has no abort (nor its stub): forwarded where the work has one, else nothing to do.
        abort = getattr(self.work, "abort", None)
        if abort is not None:
            abort()

    def _source_rank(self) -> int:
        return int(self.work._source_rank())

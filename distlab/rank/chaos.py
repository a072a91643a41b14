"""Faults on a schedule, inside a cell: ``distlab.chaos(kill={1: 40}, slow={2: 0.2}, nan={3: 60})``.

Every rank calls it with the same schedule (a ``%%ddp`` cell does); each rank does what the schedule
says of it, counted in optimizer steps:

- ``kill={rank: step}``: the rank's process is SIGKILLed right after its ``step``-th step (a crash:
  no exception, no exit handlers);
- ``slow={rank: seconds}``: the rank sleeps that long before each of its steps (a straggler);
- ``nan={rank: step}``: the rank's gradients are NaN at its ``step``-th step, after they were averaged
  and before the update: its weights become NaN and the replicas differ; at the next step the NaN
  reaches its loss, and through the averaged gradients every rank's weights.

Steps are counted by hooks on every optimizer (torch's global step hooks), from the call on; in a
cell that heals (``distlab.heal``) they are the quorum's steps, so that a replacement, which heals
past the step its predecessor died at, is not killed again. The schedule lasts until the cell ends.
Each event says so on the rank's output first, so that the notebook shows what was done and when.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..errors import LabUsageError
from . import heal
from .hooks import at_cell_end

__all__ = ["chaos"]

_handles: list[Any] = []


def chaos(
    kill: Mapping[int, int] | None = None,
    slow: Mapping[int, float] | None = None,
    nan: Mapping[int, int] | None = None,
    cut: Mapping[int, int] | None = None,
) -> None:
    """Schedule faults for this cell: ``kill`` and ``nan`` map a rank to a step, ``slow`` to seconds."""
    if cut is not None:
        raise LabUsageError(
            "distlab.chaos(cut=...) (a node's link cut at a step) is not built yet: "
            "kill each of the node's ranks at that step instead, like kill={2: 40, 3: 40}"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    kill, nan = _steps("kill", kill, world), _steps("nan", nan, world)
    slow = _seconds(slow, world)
    _stop()
    state = {"count": 0}

    def this_step() -> int:
        """The step being taken (in a pre-hook) or just taken (in a post-hook)."""
        healing = heal.current()
        # torchft counts a step when its quorum agrees to commit it, before the optimizer steps.
        return healing.manager.current_step() if healing is not None else state["count"]

    def before(optimizer: Any, args: Any, kwargs: Any) -> None:
        step = this_step() if heal.current() is not None else state["count"] + 1
        if rank in slow:
            time.sleep(slow[rank])
        if nan.get(rank) == step:
            print(f"[chaos] rank {rank}: gradients set to NaN at step {step}", flush=True)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.fill_(math.nan)

    def after(optimizer: Any, args: Any, kwargs: Any) -> None:
        state["count"] += 1
        step = this_step()
        if kill.get(rank) == step:
            print(f"[chaos] rank {rank}: killed after step {step}", flush=True)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    _handles.append(register_optimizer_step_pre_hook(before))
    _handles.append(register_optimizer_step_post_hook(after))


def _steps(name: str, schedule: Mapping[int, int] | None, world: int) -> dict[int, int]:
    out: dict[int, int] = {}
    for rank, step in _items(name, schedule, world):
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise LabUsageError(
                f"distlab.chaos({name}=...): rank {rank}'s step must be a whole number from 1 (got {step!r})"
            )
        out[rank] = step
    return out


def _seconds(schedule: Mapping[int, float] | None, world: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for rank, seconds in _items("slow", schedule, world):
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf:
            raise LabUsageError(
                f"distlab.chaos(slow=...): rank {rank}'s delay must be seconds, 0 or more (got {seconds!r})"
            )
        out[rank] = float(seconds)
    return out


def _items(name: str, schedule: Mapping[int, Any] | None, world: int) -> list[tuple[int, Any]]:
    if schedule is None:
        return []
    if not isinstance(schedule, Mapping):
        raise LabUsageError(f"distlab.chaos({name}=...) takes a dict of rank to value, like {name}={{1: 40}}")
    for rank in schedule:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise LabUsageError(f"distlab.chaos({name}=...): {rank!r} is not a rank of this world (0 to {world - 1})")
    return list(schedule.items())


@at_cell_end
def _stop() -> None:
    """The schedule ends with its cell."""
    while _handles:
        _handles.pop().remove()

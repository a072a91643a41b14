"""Faults on a schedule, inside a cell: ``distlab.chaos(kill={1: 40}, slow={2: 0.2}, nan={3: 60})``.

Every rank calls it with the same schedule (a ``%%ddp`` cell does); each rank does what the schedule
says of it, counted in optimizer steps:

- ``kill={rank: step}``: the rank's process is SIGKILLed right after its ``step``-th step (a crash:
  no exception, no exit handlers);
- ``slow={rank: seconds}``: the rank sleeps that long before each of its steps (a straggler);
- ``stall={rank: (step, seconds)}``: the rank sleeps that long once, before its ``step``-th step (a
  long pause: a swap storm, a slow disk). In a cell that heals, a stall past the lighthouse's join
  timeout (10 s) drops the rank from the others' quorums; it rejoins at its next quorum and heals;
- ``nan={rank: step}``: the rank's gradients are NaN at its ``step``-th step, after they were averaged
  and before the update: its weights become NaN and the replicas differ; at the next step the NaN
  reaches its loss, and through the averaged gradients every rank's weights.
- ``cut={node: step}`` (a lab on emulated nodes): right after the ``step``-th step, the node's link
  goes down (its ranks bring their namespace's interface down: a network partition). Unlike a
  death, nothing tells the others: no connection is reset, their next collective with the node just
  waits, for the process group's timeout or the cell's deadline. In a lab that heals, the node's
  ranks are then fenced (SIGKILLed, as a cluster's health check ends a partitioned node's job): the
  others' quorum goes on without them after the lighthouse's heartbeat timeout, and their
  replacements, started on the node once the lab has brought its link back, heal from a live peer.
  Elsewhere the node's ranks go on, cut off, until their cell ends, which brings the link back up;
  the lab also brings every link up before it starts engines on the nodes (a restart).
- ``lighthouse=step`` (a lab that heals): right after the ``step``-th step, rank 0 SIGKILLs torchft's
  lighthouse, the process every quorum needs. The lab starts it again on the same address at once;
  the quorum each rank was waiting for died with it and fails at torchft's quorum timeout, so that
  step does not commit and the next forms on the new lighthouse (``notebook.healing``).

Steps are counted by hooks on every optimizer (torch's global step hooks), from the call on; in a
cell that heals (``distlab.heal``) they are the quorum's steps. A replacement rank, which runs the
cell from its top, keeps only ``slow``: the kills, cuts and NaNs were its predecessor's. The
schedule lasts until the cell ends.
Each event says so on the rank's output first, so that the notebook shows what was done and when.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..errors import LabUsageError
from . import heal
from .hooks import at_cell_end

if TYPE_CHECKING:
    import torch
    from torch.utils.hooks import RemovableHandle

__all__ = ["chaos"]

_handles: list[RemovableHandle] = []
_cut_here: list[int] = []  # the node whose link this rank cut in the running cell
#: A node's one interface (``cluster.nodes``).
_LINK = "eth0"
# How long a rank about to be killed gives its last line to reach the notebook.
_LAST_WORDS_S = 0.1


def chaos(
    kill: Mapping[int, int] | None = None,
    slow: Mapping[int, float] | None = None,
    nan: Mapping[int, int] | None = None,
    cut: Mapping[int, int] | None = None,
    lighthouse: int | None = None,
    stall: Mapping[int, tuple[int, float]] | None = None,
) -> None:
    """Schedule faults for this cell: ``kill``, ``nan`` map a rank to a step, ``slow`` to seconds,
    ``stall`` to a step and seconds, ``cut`` a node to a step, ``lighthouse`` is a step."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    kill, nan = _steps("kill", kill, world), _steps("nan", nan, world)
    slow = _seconds(slow, world)
    stalls = _stalls(stall, world)
    cuts = _cuts(cut)
    lighthouse_at = _lighthouse_step(lighthouse)
    node = int(os.environ.get("GROUP_RANK", "0"))
    if heal.is_replacement():
        # The kills, cuts and NaNs were its predecessor's, and done: replayed here (a replacement
        # that came after the others ended trains on alone, from step 1) they would fault it again.
        kill, nan, cuts, lighthouse_at, stalls = {}, {}, {}, None, {}
    _stop()
    state = {"count": 0}

    def this_step() -> int:
        """The step being taken (in a pre-hook) or just taken (in a post-hook)."""
        healing = heal.current()
        # torchft counts a step when its quorum agrees to commit it, before the optimizer steps.
        return healing.manager.current_step() if healing is not None else state["count"]

    def before(optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        step = this_step() if heal.current() is not None else state["count"] + 1
        if rank in slow:
            time.sleep(slow[rank])
        if rank in stalls and stalls[rank][0] == step and not state.get("stalled"):
            state["stalled"] = 1
            print(f"[chaos] rank {rank}: stalls {stalls[rank][1]:g} s before step {step}", flush=True)
            time.sleep(stalls[rank][1])
        if nan.get(rank) == step:
            print(f"[chaos] rank {rank}: gradients set to NaN at step {step}", flush=True)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.fill_(math.nan)

    def after(optimizer: torch.optim.Optimizer, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        state["count"] += 1
        step = this_step()
        if kill.get(rank) == step:
            _die(f"[chaos] rank {rank}: killed after step {step}")
        if cuts.get(node) == step:
            print(f"[chaos] rank {rank}: node {node}'s link cut after step {step}", flush=True)
            if heal.current() is not None:
                _die(f"[chaos] rank {rank}: fenced (killed), its node cut off", cut=True)
            _link("down")
            _cut_here.append(node)
        if rank == 0 and lighthouse_at == step and not state.get("lighthouse"):
            # Once: the step after it does not commit, and would count as this one again.
            state["lighthouse"] = 1
            _kill_lighthouse(step)

    _handles.append(register_optimizer_step_pre_hook(before))
    _handles.append(register_optimizer_step_post_hook(after))


def _die(last_words: str, cut: bool = False) -> None:
    """Say why, let the line leave (a flush hands it to the engine's IO thread, not yet to the
    notebook), cut the link if asked, and die as a crash does: SIGKILL, no exit handlers."""
    print(last_words, flush=True)
    sys.stderr.flush()
    time.sleep(_LAST_WORDS_S)
    if cut:
        _link("down")
    os.kill(os.getpid(), signal.SIGKILL)


def _lighthouse_step(step: int | None) -> int | None:
    if step is None:
        return None
    if not heal.lighthouse_pid():
        raise LabUsageError(
            "distlab.chaos(lighthouse=...) kills torchft's lighthouse, which only a lab that heals has: "
            "%dist start -n 4 --heal (distlab.start(ranks=4, heal=True))"
        )
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise LabUsageError(f"distlab.chaos(lighthouse=...) takes the step to kill it after, from 1 (got {step!r})")
    return step


def _kill_lighthouse(step: int) -> None:
    pid = heal.lighthouse_pid()
    print(f"[chaos] rank 0: torchft's lighthouse killed after step {step}", flush=True)
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _cuts(schedule: Mapping[int, int] | None) -> dict[int, int]:
    if schedule is None:
        return {}
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    if not _on_emulated_nodes() or nodes < 2:
        raise LabUsageError(
            "distlab.chaos(cut=...) cuts a node's link, which needs a lab on emulated nodes: "
            "%dist start -n 4 --nodes 2 (distlab.start(ranks=4, nodes=2)), or kill the node's ranks instead"
        )
    if not isinstance(schedule, Mapping):
        raise LabUsageError("distlab.chaos(cut=...) takes a dict of node to step, like cut={1: 40}")
    out: dict[int, int] = {}
    for node, step in schedule.items():
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < nodes:
            raise LabUsageError(f"distlab.chaos(cut=...): {node!r} is not a node of this lab (0 to {nodes - 1})")
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise LabUsageError(
                f"distlab.chaos(cut=...): node {node}'s step must be a whole number from 1 (got {step!r})"
            )
        out[node] = step
    return out


def _on_emulated_nodes() -> bool:
    """Whether this rank runs on a node distlab made: its host name is the node's, and its only
    interface but loopback is the node's link (``cluster.nodes``)."""
    node = os.environ.get("GROUP_RANK", "")
    # The namespace's own interfaces (netlink), not /sys: a node in a user namespace has the machine's /sys.
    return socket.gethostname() == f"node{node}" and any(name == _LINK for _, name in socket.if_nameindex())


def _link(state: str) -> None:
    """The node's link down or up, from inside its namespace (the rank's own)."""
    done = subprocess.run(["ip", "link", "set", "dev", _LINK, state], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        said = done.stderr.strip() or f"ip exited with {done.returncode}"
        raise RuntimeError(f"distlab.chaos could not bring the node's link ({_LINK}) {state}: {said}")


def _stalls(schedule: Mapping[int, tuple[int, float]] | None, world: int) -> dict[int, tuple[int, float]]:
    out: dict[int, tuple[int, float]] = {}
    for rank, value in _items("stall", schedule, world):
        step, seconds = value if isinstance(value, tuple) and len(value) == 2 else (None, None)
        if (isinstance(step, bool) or not isinstance(step, int) or step < 1 or isinstance(seconds, bool)
                or not isinstance(seconds, (int, float)) or not 0 <= seconds < math.inf):
            raise LabUsageError(
                f"distlab.chaos(stall=...): rank {rank}'s stall must be (step from 1, seconds), like "
                f"stall={{{rank}: (40, 15)}} (got {value!r})"
            )
        out[rank] = (step, float(seconds))
    return out


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


def _items(name: str, schedule: Mapping[int, object] | None, world: int) -> list[tuple[int, object]]:
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
    """The schedule ends with its cell, and a link this rank cut comes back up."""
    while _handles:
        _handles.pop().remove()
    if _cut_here:
        _cut_here.clear()
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            _link("up")

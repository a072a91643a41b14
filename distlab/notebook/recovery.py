"""After a failed cell: say what happened (who never reached a collective), then make the world usable.

    diagnose(outcome, ctx, selected)   # a note naming the ranks that never arrived, and where the others waited
    repair = decide(outcome, ctx)      # rebuild the group, or restart the world, or say how to: the lab does it

Diagnosis reads each live rank's flight recorder (``rank.flight``) and compares them
(``errors.diagnose_collectives``). Recovery rebuilds the process group in place when it was torn
down or no longer completes an all-reduce (ranks keep their namespaces); restarts the world if a
rank had to be killed; and only says how to restart when a rank died by itself (a lesson may want
to look at the survivors first).
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import ABSENT, FAILED, FINISHED, STUCK, diagnose_collectives, format_ranks
from . import rpc
from .cell_context import CellContext, CellOutcome

__all__ = ["Repair", "decide", "diagnose", "group_problem", "rebuild_failed"]

# How long a health check's tiny all-reduce may take, and how long ranks get to send their traces.
HEALTH_TIMEOUT_S = 2.0
TRACE_TIMEOUT_S = 2.0
# Flight-recorder entries per rank that the diagnosis compares.
TRACE_ENTRIES = 4


# How a backend says a collective outlived the group's timeout (gloo; NCCL's watchdog).
_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting \d+ms|Watchdog caught collective operation timeout")


def diagnose(outcome: CellOutcome, ctx: CellContext, selected: list[int]) -> None:
    """After a stopped cell: which ranks never reached a collective, and where the others waited."""
    failed = outcome.failures
    # A rank whose collective outlived the process group's own timeout waited as a stopped one did:
    # the diagnosis is the same whichever deadline, the cell's or the group's, fired first.
    timed_out = {r for r, f in failed.items() if _COLLECTIVE_TIMEOUT.search(f.evalue or "")}
    stuck = set(outcome.stopped) | {r for r, f in failed.items() if f.ename == "KeyboardInterrupt"} | timed_out
    if not stuck:
        return
    dead = set(outcome.killed) | {r for r, f in failed.items() if f.ename == "EngineError"}
    alive = set(ctx.client.ids)
    asks = {
        r.rank: rpc.collective_trace(ctx.client[r.engine_id], TRACE_ENTRIES)
        for r in ctx.table
        if r.rank not in dead and r.engine_id in alive
    }
    traces = {}
    deadline = time.monotonic() + TRACE_TIMEOUT_S
    for rank, ar in asks.items():
        with contextlib.suppress(Exception):  # a rank that cannot answer has no trace, not an error
            traces[rank] = ar.get(timeout=max(0.01, deadline - time.monotonic()))
    doing = {
        r: STUCK if r in stuck else FAILED if r in failed else FINISHED if r in selected else ABSENT
        for r in range(len(ctx.table))
    }
    note = diagnose_collectives(traces, doing)
    if note:
        outcome.notes.insert(0, note)


@dataclass(frozen=True)
class Repair:
    """What the lab should do after a failed cell, and the note that says it was done.

    ``action``: "none" (nothing, or only ``note`` to say), "rebuild" (the process group, in place:
    ranks keep their namespaces) or "restart" (the world, with new processes)."""

    action: Literal["none", "rebuild", "restart"] = "none"
    note: str = ""


def decide(outcome: CellOutcome, ctx: CellContext) -> Repair:
    """How to make the world usable again after a failed cell (the lab carries it out)."""
    if outcome.killed:
        return Repair("restart", "the world was restarted: rank namespaces are fresh")
    dead = [r for r, f in outcome.failures.items() if f.ename == "EngineError"]
    if dead and ctx.heals:
        return Repair("none", (
            f"rank {format_ranks(dead)} died; the others were not stopped: in a lab that heals their quorum goes on "
            "without it. %dist restart (lab.restart()) brings a full world back"
        ))
    if dead:
        return Repair("none", (
            f"rank {format_ranks(dead)} died; the others were stopped and keep their namespaces: "
            "%dist restart (lab.restart()) brings a full world back"
        ))
    reason = "its group was torn down to release stuck ranks" if outcome.group_aborted else group_problem(ctx)
    if not reason:
        return Repair()
    return Repair("rebuild", f"process group rebuilt ({reason}); objects built on the old group must be rebuilt too")


def rebuild_failed(exc: BaseException) -> str:
    """The note when a rebuild in place failed and the world was restarted instead."""
    first = str(exc).splitlines()[0]
    return f"the process group could not be rebuilt ({first}): the world was restarted; rank namespaces are fresh"


def group_problem(ctx: CellContext) -> str | None:
    """None if every rank's group completes a tiny all-reduce, else which ranks' does not, and why."""
    registered = set(ctx.client.ids)
    problems = {r.rank: "its engine is gone" for r in ctx.table if r.engine_id not in registered}
    checks: dict[int, Any] = {
        r.rank: rpc.check_group(ctx.client[r.engine_id], HEALTH_TIMEOUT_S) for r in ctx.table if r.rank not in problems
    }
    for rank, ar in checks.items():
        try:
            verdict = ar.get(timeout=HEALTH_TIMEOUT_S + 2)
        except Exception as exc:  # noqa: BLE001 - any failure to answer is a problem to report
            verdict = type(exc).__name__
        if verdict != "ok":
            problems[rank] = verdict
    if not problems:
        return None
    first = next(iter(problems.values()))
    return f"rank {format_ranks(problems)}: {first}"

"""Which ranks the scale dry run (``rank/dryrun.py``) runs, and each run in a process of its own.

- :func:`kinds`: one rank of each kind: every rank alike without pipeline parallelism, else one per
  run of neighbouring stages that hold the same layers' worth.
- :func:`forked`: a run in a child forked from the dry run's process, which has made no process group.
  Each run is a rank of the same world: a new process group and a mesh of the same layout. In one
  process the second run's DTensor ops reuse sharding decisions cached for the first mesh (torch
  keys them by the mesh's layout) and name its groups, gone with it; a fork starts each run from the
  same clean state, without a new interpreter's imports.
"""

from __future__ import annotations

import itertools
import multiprocessing
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict, TypeVar, final

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from ..scale.plan import PlanJSON

__all__ = ["forked", "kinds"]

T = TypeVar("T")


def kinds(plan: PlanJSON) -> list[tuple[str, int, int, int | None]]:
    """(name, ranks of this kind, the rank run, its stage) for each distinct kind of rank.

    Under pp, pipeline ranks next to each other that hold the same layers' worth (their stages'
    layer counts, the embedding, the head) are one kind, run as its first (which holds the most
    micro-batches in flight)."""
    world, pp = plan["gpus"], plan["pp"]
    if pp == 1:
        return [("every rank", world, 0, None)]
    per = world // pp  # pp is the outermost dimension: stage s is ranks s*per .. (s+1)*per - 1
    splits, stages = plan["stage_layers"], pp * plan["chunks"]
    kinds: list[tuple[str, int, int, int | None]] = []
    holds = [(tuple(splits[s] for s in range(d, stages, pp)), d == 0, d == pp - 1) for d in range(pp)]
    for _, run in itertools.groupby(range(pp), key=holds.__getitem__):
        group = list(run)
        a, b = group[0], group[-1]
        if a in (0, pp - 1):
            name = "first stage" if a == 0 else "last stage"
        elif (a, b) == (1, pp - 2):
            name = f"middle stages ({a}-{b})"
        else:
            name = f"stage {a}" if a == b else f"stages {a}-{b}"
        kinds.append((name, per * len(group), a * per, a))
    return kinds


def forked(run: Callable[..., T], *args: object, name: str) -> T:
    """``run(*args)`` in a forked child, its result sent back; its error raised here as one line
    that starts with ``name`` (the rank kind's)."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, run, args, name))
    child.start()
    send.close()
    try:
        outcome: tuple[T] | _Failed = receive.recv()
    except EOFError:
        outcome = {"error": f"the run of the {name} died (exit status {child.exitcode})"}
    child.join()
    if isinstance(outcome, dict):
        raise RuntimeError(outcome["error"])
    return outcome[0]


@final
class _Failed(TypedDict):
    error: str


def _child(send: Connection, run: Callable[..., object], args: tuple[object, ...], name: str) -> None:
    try:
        send.send((run(*args),))
    except Exception as exc:  # noqa: BLE001 - sent to the parent, which raises it as one line
        send.send({"error": f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})

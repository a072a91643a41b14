"""distlab: distributed deep-learning training in Jupyter, on real ranks, with nothing hidden.

    %load_ext distlab
    %dist start -n 2
    %%ddp
    print(rank, world_size)

or, without IPython::

    import distlab
    with distlab.start(ranks=2) as lab:
        lab.run("print(rank)")

``import distlab`` stays light: torch, ipyparallel and the magics load only when used.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .version import __version__

__all__ = [
    "CellTimeout",
    "DistlabError",
    "Lab",
    "LabUsageError",
    "RankError",
    "__version__",
    "attach",
    "auto",
    "chaos",
    "current_lab",
    "divergence",
    "heal",
    "lint",
    "load_ipython_extension",
    "log",
    "start",
    "unload_ipython_extension",
    "watch",
]

if TYPE_CHECKING:
    from .errors import CellTimeout, DistlabError, LabUsageError, RankError
    from .front.lab import Lab, attach, start
    from .front.lab import current as current_lab
    from .front.magics import auto
    from .notebook.cell_lint import lint
    from .rank.chaos import chaos
    from .rank.divergence import divergence
    from .rank.heal import heal
    from .telemetry.watch import log, watch  # the module: mypy takes telemetry.watch for the submodule

# name -> module that defines it; resolved on first use (PEP 562).
_LAZY = {
    "Lab": "front.lab",
    "attach": "front.lab",  # a lab kept past its kernel (start(keep=True)), taken back
    "current_lab": "front.lab",
    "start": "front.lab",
    "CellTimeout": "errors",
    "DistlabError": "errors",
    "LabUsageError": "errors",
    "RankError": "errors",
    "watch": "telemetry",
    "log": "telemetry",
    "heal": "rank.heal",  # on a rank, in a cell of a lab started with heal=True
    "chaos": "rank.chaos",  # on a rank, in a cell: faults on a schedule
    "divergence": "rank.divergence",  # on a rank, in a cell: the first op where replicas part
    "lint": "notebook.cell_lint",  # a cell's collectives that only some ranks reach, before it runs
    "auto": "front.magics",  # every plain cell of this notebook on the ranks: %dist auto on
}
_RENAMED = {"current_lab": "current"}  # public name -> its name in its module
_SUBMODULES = ("theory", "quiz", "exercises", "errors", "checkpoint", "checks", "notebook", "rank")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), _RENAMED.get(name, name))
    if name in _SUBMODULES:
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module 'distlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(_SUBMODULES))


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext distlab``: register %dist, %%ddp, %quiz and %exercise."""
    from .cluster import warm
    from .front.magics import register

    register(ipython)
    # The warm-rank template imports torch in the background while the user reads and types:
    # the first %dist start forks its ranks instead of starting them cold (cluster/warm.py).
    warm.prewarm()


def unload_ipython_extension(ipython: Any) -> None:
    from .front.magics import unregister

    unregister(ipython)

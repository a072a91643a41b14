"""What runs on a rank when a cell (or a script) ends, before its reply: a small registry.

A module with something to send before the reply (a watch's last steps, the last state of tqdm's
bars) registers a function when it is imported (``@at_cell_end``). A module never imported
registers nothing, so a rank that never watches or never draws a bar pays nothing, and the cell
runner need not know who they are (``rank/cell.py`` calls :func:`cell_ended`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

__all__ = ["at_cell_end", "cell_ended"]

Hook = Callable[[], None]

_hooks: list[Hook] = []


def at_cell_end(fn: Hook) -> Hook:
    """Call ``fn()`` when each cell ends on this rank, before its reply; returns ``fn`` (a decorator).

    Registering the same function again (a module reloaded) keeps one entry, in its first place.
    """
    key = _key(fn)
    for i, known in enumerate(_hooks):
        if _key(known) == key:
            _hooks[i] = fn
            return fn
    _hooks.append(fn)
    return fn


def cell_ended() -> None:
    """Call every registered hook, in the order they were registered.

    A hook's failure never turns the cell's result into an error, nor stops the hooks after it:
    telemetry and progress bars are views of the cell, not its outcome.
    """
    for fn in list(_hooks):
        with contextlib.suppress(Exception):  # a view's hook: never the cell's error, nor stops the rest
            fn()


def _key(fn: Hook) -> tuple[str, str]:
    return getattr(fn, "__module__", "") or "", getattr(fn, "__qualname__", repr(fn))

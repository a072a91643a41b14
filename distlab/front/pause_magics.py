"""``%dist break``, ``%dist step`` and ``%dist continue``: the lab's breakpoints on collectives
(``LabCore.pause``, ``step``, ``cont``) in a magic's words."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.display import display

from ..errors import LabUsageError

__all__ = ["break_magic", "show_pause", "show_values", "step_magic"]

_KEYS = {"at": int, "op": str, "group": str, "line": int, "timeout": float}
_USAGE = "%dist break 3 (the 3rd collective of the next cell), %dist break op=all_gather group=mesh_tp line=12, " \
         "%dist break off"


def break_magic(lab: Any, rest: list[str]) -> None:
    """``%dist break N [op=OP] [group=G] [line=L] [timeout=S]`` arms the next cell; ``off`` disarms it."""
    if rest == ["off"]:
        lab.unpause()
        print("no breakpoint: the next cell runs through")
        return
    given: dict[str, Any] = {}
    for word in rest:
        key, eq, value = word.partition("=")
        if not eq and key.isdigit() and "at" not in given:
            key, value = "at", key
        elif key not in _KEYS or not eq:
            raise UsageError(f"%dist break does not take {word!r}: {_USAGE}")
        try:
            given[key] = _KEYS[key](value)
        except ValueError:
            kind = {"int": "an int", "float": "a number", "str": "a name"}[_KEYS[key].__name__]
            raise UsageError(f"%dist break: {key}={value!r} is not {kind}: {_USAGE}") from None
    if not given:
        raise UsageError(f"%dist break needs a collective to stop at: {_USAGE}")
    try:
        lab.pause(**given)
    except LabUsageError as exc:
        raise UsageError(str(exc)) from None
    print("armed: the next cell stops every rank before that collective; %dist step and %dist continue go on")


def step_magic(lab: Any, word: str) -> None:
    """``%dist step`` (to the next collective) or ``%dist continue`` (to the cell's end)."""
    try:
        if word == "step":
            pause = lab.step()
            if pause is None:
                print("the cell ended")
            else:
                display(pause)
            return
        result = lab.cont()
    except LabUsageError as exc:
        raise UsageError(str(exc)) from None
    show_values(result)


def show_pause(result: Any) -> bool:
    """Show the Pause a %%ddp cell stopped at; whether it did."""
    if result.paused is None:
        return False
    display(result.paused)
    return True


def show_values(result: Any) -> None:
    for rank, shown in result.items():
        if shown is not None:
            print(f"Out[rank {rank}]: {shown}")

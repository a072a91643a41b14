"""Checks of a user's arguments, written once: each failure is one line naming the value and the fix.

Every public entry point (the Lab and its config, the magics, ``watch``, ``theory``, ``checkpoint``,
the quizzes) checks its arguments with these before it changes anything. They raise
:class:`~distlab.errors.LabUsageError` (a ``ValueError``) unless told to raise another type: a
``TypeError`` where the caller passed the wrong kind of object altogether.

    seconds = checks.positive("timeout", timeout, example="timeout=30")
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar, overload

from .errors import LabUsageError

__all__ = ["choice", "flag", "fraction", "instance", "non_negative", "number", "positive", "whole"]

_T = TypeVar("_T")


def _like(example: str | None) -> str:
    return f", like {example}" if example else ""


def _from_text(value: object, text: str | None) -> str:
    return f"; {text}" if text and isinstance(value, str) else ""


def number(
    name: str,
    value: object,
    *,
    example: str | None = None,
    kind: str = "a number",
    text: str | None = None,
    error: type[Exception] = LabUsageError,
) -> float:
    """A finite int or float (never a bool, never text). ``kind`` names it in messages ("a number of seconds");
    ``text`` says how to convert text given instead ("400 MB" to bytes)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"{name} must be {kind}{_like(example)} (got {value!r}){_from_text(value, text)}")
    if not math.isfinite(value):
        raise error(f"{name} must be finite (got {value!r})")
    return float(value)


def positive(
    name: str,
    value: object,
    *,
    example: str | None = None,
    kind: str = "a number",
    text: str | None = None,
    error: type[Exception] = LabUsageError,
) -> float:
    """A finite number > 0 (seconds, bytes, rates)."""
    got = number(name, value, example=example, kind=kind, text=text, error=error)
    if got <= 0:
        raise error(f"{name} must be {kind} > 0{_like(example)} (got {value!r})")
    return got


def non_negative(
    name: str,
    value: object,
    *,
    example: str | None = None,
    text: str | None = None,
    error: type[Exception] = LabUsageError,
) -> float:
    got = number(name, value, example=example, text=text, error=error)
    if got < 0:
        raise error(f"{name} must be >= 0{_like(example)} (got {value!r})")
    return got


def fraction(
    name: str, value: object, *, open_top: bool = False, text: str | None = None, error: type[Exception] = LabUsageError
) -> float:
    """A number from 0 to 1 (below 1 with ``open_top``)."""
    got = number(name, value, text=text, error=error)
    if got < 0 or got > 1 or (open_top and got == 1):
        top = "below 1" if open_top else "at most 1"
        raise error(f"{name} is a fraction: give a value from 0 {top} (e.g. 0.25 for 25%), got {value!r}")
    return got


def whole(
    name: str,
    value: object,
    *,
    minimum: int = 0,
    example: str | None = None,
    integral_floats: bool = False,
    error: type[Exception] = LabUsageError,
) -> int:
    """A whole number >= ``minimum``. ``integral_floats``: accept 4.0 as 4 (counts computed upstream)."""
    if integral_floats and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be a whole number{_like(example)} (got {value!r})")
    if value < minimum:
        raise error(f"{name} must be >= {minimum}{_like(example)} (got {value!r})")
    return value


def choice(name: str, value: object, allowed: Sequence[str], *, error: type[Exception] = LabUsageError) -> str:
    """One of ``allowed`` (exactly as written there)."""
    if not isinstance(value, str) or value not in allowed:
        raise error(f"unknown {name} {value!r}: choose one of {', '.join(allowed)}")
    return value


def flag(name: str, value: object, *, error: type[Exception] = LabUsageError) -> bool:
    """True or False, nothing that merely tests true."""
    if not isinstance(value, bool):
        raise error(f"{name} must be True or False (got {value!r})")
    return value


@overload
def instance(name: str, value: object, kind: type[_T], *, what: str, error: type[Exception] = ...) -> _T: ...
@overload
def instance(
    name: str, value: object, kind: tuple[type, ...], *, what: str, error: type[Exception] = ...
) -> object: ...
def instance(
    name: str, value: object, kind: type | tuple[type, ...], *, what: str, error: type[Exception] = LabUsageError
) -> object:
    """An object of ``kind`` (subclasses too); ``what`` names it for the user ("a torch.nn.Module")."""
    if not isinstance(value, kind):
        raise error(f"{name} must be {what} (got {type(value).__name__})")
    return value

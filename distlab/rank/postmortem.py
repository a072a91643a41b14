"""A rank's last failure, kept for a look inside: the failing frame and its callers, their locals summarised.

``rank/cell.py`` keeps the exception of a cell (or script, or graded case) that raised, with its
traceback, and drops it when the next one starts. :func:`describe` reads the traceback's frames
into plain data (dicts, lists, text and numbers: it travels by pickle to a notebook that never
imports torch), which ``notebook/postmortem.py`` formats. The frames are the rank's own objects,
so the locals are the values they held when the cell failed, not a copy made before.
"""

from __future__ import annotations

import ast
import linecache
import os
import sysconfig
import traceback
import types
from dataclasses import dataclass
from typing import TypedDict

from ..wire import LEARNER_FILE
from .namespace import LAB_NAMES
from .value_summary import EXACT_LIMIT, REPR_CHARS, SAMPLE, ValueSummary, safe_str, summarise, summarise_safely

__all__ = ["EXACT_LIMIT", "REPR_CHARS", "SAMPLE", "describe", "drop", "keep", "summarise"]

# Locals shown for a frame of library code (torch, the standard library, distlab): its own
# arguments matter, its bookkeeping does not.
LIBRARY_LOCALS = 6
EVALUE_CHARS = 2000

# The runner's own file: its SIGINT handler is where distlab's KeyboardInterrupt is raised, the
# last frame of the traceback, but the user's code was in the frame above it.
_RUNNER = os.path.join(os.path.dirname(__file__), "cell.py")
_DISTLAB = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where library code lives: the standard library, site-packages, distlab itself.
_LIBRARY_DIRS = tuple(
    sorted(
        {
            os.path.abspath(p) + os.sep
            for k in ("stdlib", "platstdlib", "purelib", "platlib")
            if (p := sysconfig.get_paths().get(k))
        }
        | {_DISTLAB + os.sep},
        key=len,
        reverse=True,
    )
)
# Names IPython puts in a shell's namespace (input and output history, its exits).
_IPYTHON_NAMES = frozenset(
    {"In", "Out", "exit", "quit", "get_ipython", "_", "__", "___", "_i", "_ii", "_iii", "_ih", "_oh", "_dh"}
)
# What a namespace holds that is code, not data: not shown.
_CODE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


@dataclass(frozen=True)
class _Kept:
    exc: BaseException
    #: The file name the failed code ran under (``<rank 1 cell>``, a script's path, a grader's).
    filename: str


_kept: _Kept | None = None


def keep(exc: BaseException, filename: str) -> None:
    """Keep a failed cell's exception, traceback and all, until :func:`drop` (the next cell's start)."""
    global _kept
    _kept = _Kept(exc, filename)


def drop() -> None:
    """Let the kept failure go, and with it the frames and every value they held."""
    global _kept
    if _kept is None:
        return
    exc, _kept = _kept.exc, None
    # A traceback's frames often sit in a reference cycle (a local holding the exception): clear
    # their locals now, so that what they held (activations on a GPU after an out-of-memory error)
    # is freed before the next cell's code runs, not at some later collection. A full collection
    # did this before: 0.13 s a rank on an idle machine, and past a 2 s cell deadline on a loaded
    # one (four ranks collecting on two cores); clearing the failure's own frames costs microseconds.
    _clear_frames(exc, set())


def _clear_frames(exc: BaseException | None, seen: set[int]) -> None:
    """Clear the locals of every frame in ``exc``'s traceback and in those of the exceptions it chains."""
    if exc is None or id(exc) in seen:
        return
    seen.add(id(exc))
    traceback.clear_frames(exc.__traceback__)  # a frame still running is left as it is
    _clear_frames(exc.__cause__, seen)
    _clear_frames(exc.__context__, seen)
    for inner in getattr(exc, "exceptions", ()):  # an ExceptionGroup's members
        if isinstance(inner, BaseException):
            _clear_frames(inner, seen)


class FrameDescription(TypedDict):
    """One frame of :func:`describe`'s failure."""

    filename: str
    where: str
    lineno: int
    function: str
    line: str
    library: bool
    locals: list[ValueSummary]
    more_locals: int
    skipped: int


class FailureDescription(TypedDict):
    """The kept failure as plain data (:func:`describe`)."""

    ename: str
    evalue: str
    filename: str
    context: str
    frames: list[FrameDescription]
    frames_total: int


def describe(max_frames: int = 12, max_locals: int = 30) -> FailureDescription | None:
    """The kept failure as plain data, or None when this rank keeps none.

    ``{"ename", "evalue", "filename", "context", "frames": [...], "frames_total"}`` (``context``:
    the exception this one interrupted or was raised from, in a line, or ""); frames run from the
    user's code (the cell) down to where it failed, the failing one last. Each is ``{"filename",
    "where" (a short name for library files), "lineno", "function", "line", "library", "locals",
    "more_locals", "skipped"}``: ``skipped`` counts frames left out just above it (at most
    ``max_frames`` are kept: the failing one, the cell, the user's own, then library frames
    nearest the user's call). Each local is :func:`summarise`'s dict with its ``name``; at most
    ``max_locals`` per frame of the user's code, ``LIBRARY_LOCALS`` per library frame.
    """
    if isinstance(max_frames, bool) or not isinstance(max_frames, int) or max_frames < 1:
        raise ValueError(f"max_frames must be a whole number >= 1 (got {max_frames!r})")
    if isinstance(max_locals, bool) or not isinstance(max_locals, int) or max_locals < 0:
        raise ValueError(f"max_locals must be a whole number >= 0 (got {max_locals!r})")
    kept = _kept
    if kept is None:
        return None
    entries = _user_entries(kept.exc.__traceback__, kept.filename)
    chosen = _choose([_is_library(frame.f_code.co_filename) for frame, _ in entries], max_frames)
    frames, previous = [], -1
    for index in chosen:
        frame, lineno = entries[index]
        described = _describe_frame(frame, lineno, max_locals)
        described["skipped"] = index - previous - 1
        frames.append(described)
        previous = index
    evalue = safe_str(kept.exc)
    return {
        "ename": type(kept.exc).__name__,
        "evalue": evalue if len(evalue) <= EVALUE_CHARS else evalue[: EVALUE_CHARS - 3] + "...",
        "filename": kept.filename,
        "context": _context(kept.exc),
        "frames": frames,
        "frames_total": len(entries),
    }


def _context(exc: BaseException) -> str:
    """'while handling RuntimeError: ...' (or 'caused by ...'): what the failure interrupted, in a line.

    distlab's KeyboardInterrupt often lands as a collective released under a stuck rank raises:
    the collective's own error is then this context.
    """
    if exc.__cause__ is not None:
        how, other = "caused by", exc.__cause__
    elif exc.__context__ is not None and not exc.__suppress_context__:
        how, other = "while handling", exc.__context__
    else:
        return ""
    message = safe_str(other).strip().splitlines()
    line = f"{how} {type(other).__name__}" + (f": {message[0]}" if message else "")
    return line if len(line) <= 2 * REPR_CHARS else line[: 2 * REPR_CHARS - 3] + "..."


def _user_entries(tb: types.TracebackType | None, filename: str) -> list[tuple[types.FrameType, int]]:
    """(frame, line) from the user's code down; distlab's frames above it dropped, as the cell's error does."""
    entries = []
    while tb is not None:
        entries.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    start = next(
        (i for i, (frame, _) in enumerate(entries) if frame.f_code.co_filename in (filename, LEARNER_FILE)),
        max(len(entries) - 1, 0),
    )
    entries = entries[start:]
    while len(entries) > 1 and entries[-1][0].f_code.co_filename == _RUNNER:
        entries.pop()  # the SIGINT handler that raised distlab's KeyboardInterrupt
    return entries


def _choose(library: list[bool], max_frames: int) -> list[int]:
    """Which frames to keep: the failing one and the cell's first, the user's own, then library ones from the top."""
    n = len(library)
    if n <= max_frames:
        return list(range(n))
    order = [n - 1, 0]
    order += [i for i in range(n - 1, 0, -1) if not library[i]]
    order += [i for i in range(1, n) if library[i]]
    keep: list[int] = []
    for i in order:
        if len(keep) == max_frames:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def _is_library(filename: str) -> bool:
    if filename.startswith("<"):
        return filename.startswith("<frozen")  # a cell, a script compiled from text, the learner's code: the user's
    return os.path.abspath(filename).startswith(_LIBRARY_DIRS)


def _where(filename: str) -> str:
    """A library file named from its package ('torch/distributed/distributed_c10d.py'); others as they are."""
    if filename.startswith("<"):
        return filename
    full = os.path.abspath(filename)
    for folder in _LIBRARY_DIRS:
        if full.startswith(folder):
            return "distlab/" + full[len(folder) :] if folder == _DISTLAB + os.sep else full[len(folder) :]
    return filename


def _describe_frame(frame: types.FrameType, lineno: int, max_locals: int) -> FrameDescription:
    code = frame.f_code
    library = _is_library(code.co_filename)
    limit = min(max_locals, LIBRARY_LOCALS) if library else max_locals
    names = _shown_names(frame, lineno)
    shown = []
    for name, value in names[:limit]:
        summary = summarise_safely(value)
        summary["name"] = name
        shown.append(summary)
    return {
        "filename": code.co_filename,
        "where": _where(code.co_filename),
        "lineno": lineno,
        "function": code.co_name,
        "line": linecache.getline(code.co_filename, lineno, frame.f_globals).strip(),
        "library": library,
        "locals": shown,
        "more_locals": max(0, len(names) - limit),
        "skipped": 0,  # set by describe
    }


def _shown_names(frame: types.FrameType, lineno: int) -> list[tuple[str, object]]:
    """The frame's local names worth showing, in order.

    At a module's top level (a cell, a script) the locals are the whole namespace: only the names
    its source mentions are shown (those on the failing line first), never distlab's own.
    """
    code = frame.f_code
    scope = frame.f_locals
    if code.co_name == "<module>":
        order = [n for n in _mentioned(frame, lineno) if n in scope and n not in LAB_NAMES]
        items = [(n, scope[n]) for n in order if n not in _IPYTHON_NAMES]
    else:
        items = list(scope.items())
    return [(n, v) for n, v in items if not (n.startswith("__") and n.endswith("__")) and not isinstance(v, _CODE)]


def _mentioned(frame: types.FrameType, lineno: int) -> list[str]:
    """Names the frame's whole source file mentions, those on ``lineno`` first, then in order.

    The source, not the code object: a cell's last expression runs as code of its own, which
    names only what that expression reads.
    """
    source = "".join(linecache.getlines(frame.f_code.co_filename, frame.f_globals))
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return list(frame.f_code.co_names)
    found = sorted(
        ((node.lineno != lineno, node.lineno, node.col_offset), node.id)
        for node in ast.walk(tree)
        if isinstance(node, ast.Name)
    )
    return list(dict.fromkeys([name for _, name in found] + list(frame.f_code.co_names)))

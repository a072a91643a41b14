"""Live stacks of a lab's ranks, read from outside their processes with py-spy (a binary from PyPI).

A rank that hangs cannot be asked where it is: its Python thread sits in a C++ collective and
answers nothing. py-spy reads a process's frames from outside (it pauses the process for a few
milliseconds and walks its interpreter's memory, with ptrace), so the stacks come even from a rank
that will never answer, and the rank is left as it was:

    stacks = take({0: pid0, 1: pid1}, sources={"<rank 0 cell>": lines, ...})   # -> Stacks
    print(stacks)        # ranks whose stacks are the same are shown once: "ranks 0,2"

Each stack is cut to the user's code: the frames of the engine that runs the cell (ipykernel,
ipyparallel, tornado, asyncio, distlab's cell runner) are left out, outermost first, up to the
first frame that is not theirs. A rank with nothing but those frames is idle. Frames of a cell
are named by its line, with the line's text when the cell's source is given.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypedDict

from ..errors import DistlabError, format_ranks
from ..wire import CELL_FILE

__all__ = ["Frame", "Stacks", "Thread", "executable", "fold", "take"]

#: A stack's frames that belong to the engine running the cell, not to the user's code (by file).
_MACHINERY = re.compile(
    r"/(ipykernel|ipyparallel|tornado|asyncio|zmq|traitlets|IPython)/"
    r"|distlab/rank/(cell|script|dispatch|engine_main|warm_template)\.py$"
    r"|(runpy|threading|selectors)\.py$|^<(frozen runpy|string)>$"
)
#: How a cell's frames are named on the ranks (``wire.CELL_FILE``): one name for every rank's.
_CELL = re.compile("^" + re.escape(CELL_FILE).replace(r"\{rank\}", r"\d+") + "$")
_PY_SPY_HINT = "pip install py-spy (it reads a rank's stacks from outside its process)"


class _PySpyFrame(TypedDict, total=False):
    """One frame of ``py-spy dump --json``, as read here."""

    name: str
    filename: str
    short_filename: str
    line: int


class _PySpyThread(TypedDict, total=False):
    """One thread of ``py-spy dump --json``, as read here (its frames innermost first)."""

    thread_name: str
    active: bool
    os_thread_id: int
    frames: list[_PySpyFrame]


class _PrettyPrinter(Protocol):
    """What ``_repr_pretty_`` uses of IPython's pretty printer."""

    def text(self, obj: str) -> None: ...


@dataclass(frozen=True)
class Frame:
    """One frame: the function, its file (the cell's frames: ``<cell>``) and line (0 for native code)."""

    name: str
    filename: str
    line: int
    text: str = ""  # the line's source, where it is known (a cell's)
    engine: bool = field(default=False, repr=False)  # the engine's own code, not the user's


    def __str__(self) -> str:
        where = f"{self.filename}:{self.line}" if self.line else self.filename
        return f"{self.name} ({where})" + (f"    {self.text}" if self.text else "")


@dataclass(frozen=True)
class Thread:
    """A thread's frames, outermost first (as a traceback reads), cut to the user's code."""

    name: str
    active: bool  # py-spy saw it running (on a CPU), not waiting
    frames: tuple[Frame, ...]

    @property
    def idle(self) -> bool:
        """Nothing but the engine's own frames: no cell running in this thread."""
        return not self.frames


@dataclass
class Stacks:
    """Each rank's threads (its main thread, the one that runs cells, first) and the ranks not read."""

    threads: dict[int, tuple[Thread, ...]] = field(default_factory=dict)
    #: rank -> why its stack was not read (a rank on another machine, a process gone, no permission).
    missing: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0

    def main(self, rank: int) -> Thread | None:
        """The thread that runs rank ``rank``'s cells (None where it was not read)."""
        threads = self.threads.get(rank)
        return threads[0] if threads else None

    def text(self, all_threads: bool = False) -> str:
        """The stacks as text, ranks with the same stack folded; ``all_threads``: every thread's."""
        return fold(self, all_threads)

    def __str__(self) -> str:
        return fold(self, all_threads=False)

    def _repr_pretty_(self, p: _PrettyPrinter, cycle: bool) -> None:
        p.text(str(self))


def fold(stacks: Stacks, all_threads: bool = False) -> str:
    """Ranks with the same stack shown once, ``ranks 0,2``; each stack outermost first."""
    groups: dict[tuple[tuple[str, tuple[Frame, ...]], ...], list[int]] = {}
    for rank, threads in sorted(stacks.threads.items()):
        shown = threads if all_threads else threads[:1]
        key = tuple((t.name, t.frames) for t in shown)
        groups.setdefault(key, []).append(rank)
    lines = []
    for key, ranks in groups.items():
        label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)}"
        for i, (name, frames) in enumerate(key):
            if not frames:  # the main thread runs cells; another idle thread waits for its own work
                lines.append(f"{label} ({name}): idle" + (", no cell running" if i == 0 else ""))
                continue
            lines.append(f"{label} ({name}), most recent call last:")
            lines.extend(f"    {frame}" for frame in frames)
    for rank, why in sorted(stacks.missing.items()):
        lines.append(f"rank {rank}: not read: {why}")
    return "\n".join(lines)


def executable() -> str:
    """py-spy's binary: beside this Python's (a virtual environment's bin), else on the PATH."""
    here = os.path.dirname(sys.executable)
    found = shutil.which("py-spy", path=os.pathsep.join([here, os.environ.get("PATH", "")]))
    if found is None:
        raise DistlabError(f"py-spy is not installed here: {_PY_SPY_HINT}")
    return found


def take(
    pids: Mapping[int, int],
    native: bool = False,
    timeout_s: float = 10.0,
    sources: Mapping[str, Sequence[str]] | None = None,
) -> Stacks:
    """The stacks of the processes ``pids`` (rank -> pid), read all at once; ``native`` adds the C
    and C++ frames (slower). ``sources``: a cell file's name -> its lines, to show the lines' text."""
    t0 = time.perf_counter()
    binary = executable()
    stacks = Stacks()
    running: dict[int, subprocess.Popen[str]] = {}
    for rank, pid in pids.items():
        cmd = [binary, "dump", "--pid", str(pid), "--json", *(["--native"] if native else [])]
        running[rank] = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "RUST_BACKTRACE": "0"},
        )
    deadline = time.monotonic() + timeout_s
    for rank, proc in running.items():
        try:
            out, err = proc.communicate(timeout=max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            stacks.missing[rank] = f"py-spy did not answer within {timeout_s:g} s"
            continue
        if proc.returncode != 0:
            said = [line for line in (err or out).splitlines() if line.startswith("Error:")]
            stacks.missing[rank] = f"py-spy: {said[0][6:].strip() if said else f'exit code {proc.returncode}'}"
            continue
        try:
            stacks.threads[rank] = _threads(json.loads(out), pids[rank], sources or {})
        except (ValueError, KeyError, TypeError) as exc:
            stacks.missing[rank] = f"py-spy's answer was not understood ({exc})"
    stacks.seconds = time.perf_counter() - t0
    return stacks


def _threads(dump: list[_PySpyThread], pid: int, sources: Mapping[str, Sequence[str]]) -> tuple[Thread, ...]:
    threads = []
    for entry in dump:
        frames = [_frame(f, sources) for f in reversed(entry["frames"])]
        # The engine's frames (and the interpreter's native ones around them), outermost first, up
        # to the user's code: a cell's first frame, else the first Python frame not the engine's.
        # A thread with only the engine's Python is idle; one with no Python at all (gloo's) keeps
        # its native frames.
        cell = [i for i, f in enumerate(frames) if f.filename == "<cell>"]
        user = cell or [i for i, f in enumerate(frames) if not f.engine and f.line]
        if user:
            frames = frames[user[0]:]
        elif any(f.engine for f in frames):
            frames = []
        main = entry.get("os_thread_id") == pid  # a process's main thread has its pid
        thread = Thread(str(entry.get("thread_name") or "?"), bool(entry.get("active")), tuple(frames))
        threads.append((not main, thread))
    return tuple(t for _, t in sorted(threads, key=lambda x: x[0]))


def _frame(raw: _PySpyFrame, sources: Mapping[str, Sequence[str]]) -> Frame:
    name, filename = str(raw.get("name")), str(raw.get("filename") or "?")
    line = int(raw.get("line") or 0)
    if _CELL.match(filename):
        lines = sources.get(filename, ())
        return Frame(name, "<cell>", line, lines[line - 1].strip() if 0 < line <= len(lines) else "")
    short = str(raw.get("short_filename") or filename)
    return Frame(name, short, line, engine=bool(_MACHINERY.search(filename)))

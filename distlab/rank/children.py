"""Child processes a cell starts on a rank: one that failed fails the cell.

A tutorial's launcher (``p = Process(target=run, args=(rank, size)); p.start(); ...; p.join()``)
pasted into a ``%%ddp`` cell starts children on every rank. When they all fail (a function defined
in a cell cannot be found by a spawned child; a fixed port is taken), ``join()`` returns as if all
went well: without this, the cell would report success and the children's errors would show only
on stderr, among the rest. While a cell runs (:func:`watching`), each ``multiprocessing`` process
started is noted with its target and where the cell started it; at the cell's end,
:func:`check` raises ``ChildProcessError`` naming each child that exited with a non-zero code
or was killed by a signal the cell did not send (``terminate()``, ``kill()``: a DataLoader ending
its workers). Children that succeeded, or still run, say nothing.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

__all__ = ["ChildProcessFailed", "check", "watching"]


@dataclass
class _Started:
    process: BaseProcess
    target: str
    stack: traceback.StackSummary
    stopped: bool = False  # the cell itself ended it (terminate, kill): its signal is no failure


@dataclass
class _Watch:
    started: list[_Started] = field(default_factory=list)


# The cell being watched (None between cells: processes started then are not the cell's).
_current: _Watch | None = None
_patched = False


class ChildProcessFailed(ChildProcessError):
    """Child processes a cell started failed; ``stack``: where the cell started the first of them."""

    def __init__(self, message: str, stack: traceback.StackSummary) -> None:
        super().__init__(message)
        self.stack = stack


@contextlib.contextmanager
def watching() -> Iterator[None]:
    """Note the processes started until the block ends (a cell's code)."""
    global _current
    _patch()
    previous, _current = _current, _Watch()
    try:
        yield
    finally:
        _current = previous


def check() -> None:
    """Raise ``ChildProcessFailed`` if a child started in the watched block failed (see the module's docstring)."""
    watch = _current
    if watch is None:
        return
    failed = []
    for child in watch.started:
        with contextlib.suppress(ValueError):  # closed by the cell (process.close()): it looked itself
            code = child.process.exitcode
            if code is None or code == 0 or (code < 0 and child.stopped):
                continue
            failed.append((child, code))
    if not failed:
        return
    parts = [f"pid {child.process.pid} (target {child.target}) {_how(code)}" for child, code in failed]
    noun = "a child process" if len(failed) == 1 else f"{len(failed)} child processes"
    raise ChildProcessFailed(
        f"{noun} this cell started failed: {'; '.join(parts)} "
        f"({'its own error is' if len(failed) == 1 else 'their own errors are'} on the rank's stderr). "
        "On a lab every rank is already one of the world's processes: call the target on each rank "
        "instead of starting processes, e.g. run(rank, world_size)",
        failed[0][0].stack,
    )


def _how(code: int) -> str:
    if code > 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name}"


def _target_name(process: BaseProcess) -> str:
    target = getattr(process, "_target", None)  # set by BaseProcess.__init__; start() deletes it
    if target is None:
        return f"{type(process).__name__}.run"
    return getattr(target, "__qualname__", None) or repr(target)


def _patch() -> None:
    """Wrap ``start``, ``terminate`` and ``kill`` of every multiprocessing process, once (torch's too)."""
    global _patched
    if _patched:
        return
    _patched = True
    start, terminate, kill = BaseProcess.start, BaseProcess.terminate, BaseProcess.kill

    @functools.wraps(start)
    def noting_start(self: BaseProcess) -> None:
        watch = _current
        if watch is not None:
            # Taken before start(), which forgets the target; the stack without this frame.
            stack = traceback.StackSummary.from_list(traceback.extract_stack()[:-1])
            watch.started.append(_Started(self, _target_name(self), stack))
        start(self)

    def stopping(original: Callable[[BaseProcess], None]) -> Callable[[BaseProcess], None]:
        @functools.wraps(original)
        def stop(self: BaseProcess) -> None:
            watch = _current
            for child in watch.started if watch is not None else ():
                if child.process is self:
                    child.stopped = True
            original(self)

        return stop

    # setattr by name: mypy refuses assigning to a method of a class (what this patch is for).
    patched = {"start": noting_start, "terminate": stopping(terminate), "kill": stopping(kill)}
    for name, method in patched.items():
        setattr(BaseProcess, name, method)

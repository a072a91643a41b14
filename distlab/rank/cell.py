"""Running a cell on a rank: the user's code in the rank's namespace, its failure described for the notebook."""

from __future__ import annotations

import ast
import contextlib
import linecache
import signal
import sys
import threading
import traceback
from typing import Any

from ..wire import CellError, CellReply
from .namespace import user_namespace

__all__ = ["run_cell"]

# Where the cell being handled is: "starting" until its code runs, "running" while it does, then
# "ending" (packing the reply). A SIGINT in "starting" is kept for the moment the code would start.
_cell_phase = "ending"
_interrupt_pending = False


def _interrupt_cell_code(signum: int, frame: Any) -> None:
    """SIGINT handler while a cell is being handled: interrupt the cell's code, never the reply.

    distlab stops a rank's cell with SIGINT, and a cell can end on its own just as the signal is
    sent (a collective released by the group's teardown returns at once). ipykernel's handler
    would then raise KeyboardInterrupt while the engine sends the reply, and ipykernel drops a
    reply so interrupted: the notebook would wait out its grace periods for an answer that never
    comes, and kill a rank that had finished (seen in about one run in five of a released DDP
    cell). A SIGINT that arrives after the code has finished has nothing left to stop; one that
    arrives before it starts stops it as it starts.
    """
    global _interrupt_pending
    if _cell_phase == "running":
        raise KeyboardInterrupt
    if _cell_phase == "starting":
        _interrupt_pending = True


def run_cell(code: str, rank: int, want: str) -> CellReply:
    """Run a cell's code in the rank's namespace, as a notebook would; return its last expression.

    ``want="repr"`` returns the repr instead (what a notebook shows as Out), so values that cannot
    travel back (a DDP model, an open file) still show. Failures come back as ``{"error": ...}``
    with the exception's name, message and a traceback trimmed to the user's code: the notebook
    groups them across ranks.
    """
    from IPython import get_ipython

    global _cell_phase, _interrupt_pending
    shell = get_ipython()
    filename = f"<rank {rank} cell>"
    _cell_phase, _interrupt_pending = "starting", False
    if getattr(shell, "kernel", None) is not None and threading.current_thread() is threading.main_thread():
        # Only inside the engine's request handler: ipykernel puts its own handler back after it.
        signal.signal(signal.SIGINT, _interrupt_cell_code)
    try:
        source = shell.transform_cell(code) if shell is not None else code
        # Register the source so tracebacks show the offending line, as in a notebook.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        tree = ast.parse(source, filename=filename)
        last: ast.Expression | None = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        namespace = user_namespace()
        try:
            _cell_phase = "running"
            if _interrupt_pending:
                raise KeyboardInterrupt
            exec(compile(tree, filename, "exec"), namespace)
            value = eval(compile(last, filename, "eval"), namespace) if last is not None else None
        finally:
            _cell_phase = "ending"
        if want == "repr":
            return {"repr": None if value is None else repr(value)}
        return {"value": value}
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt too: the notebook reports it
        return {"error": _describe_failure(exc, filename)}
    finally:
        _cell_phase = "ending"
        sys.stdout.flush()
        sys.stderr.flush()
        _flush_telemetry()


def _flush_telemetry() -> None:
    """Send what open watches recorded before the cell's reply, so the notebook has their last steps."""
    watch = sys.modules.get("distlab.telemetry.watch")  # never imported: nothing is watched
    if watch is not None:
        with contextlib.suppress(Exception):  # telemetry never turns a cell's result into an error
            watch.flush()


def _describe_failure(exc: BaseException, filename: str) -> CellError:
    frames = traceback.extract_tb(exc.__traceback__)
    # Drop distlab's own frames above the user's code; keep everything from the cell down.
    start = next((i for i, f in enumerate(frames) if f.filename == filename), len(frames))
    trimmed = frames[start:] if start < len(frames) else frames[-1:]
    lines = ["Traceback (most recent call last):\n"]
    lines += traceback.format_list(trimmed)
    lines += traceback.format_exception_only(type(exc), exc)
    return {"ename": type(exc).__name__, "evalue": str(exc), "traceback": "".join(lines)}

"""Running a cell (or a torchrun script) on a rank: the user's code, its failure described for the notebook."""

from __future__ import annotations

import ast
import linecache
import os
import signal
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from typing import TextIO

from ..wire import CELL_FILE, LEARNER_FILE, CellError, CellReply
from . import children, heal, hooks, pause, postmortem
from .namespace import LAB_NAMES, restore_lab_names, user_namespace
from .script import as_script

__all__ = ["run_cell", "run_prepared", "run_script"]

# distlab's stand-ins for torch's init_process_group and destroy_process_group (``rank.torchrun``),
# and the forwarding function torch's names now hold (``rank.torchcompat``).
_STAND_INS = tuple(os.path.join(os.path.dirname(__file__), name) for name in ("torchrun.py", "torchcompat.py"))

# Where the cell being handled is: "starting" until its code runs, "running" while it does, then
# "ending" (packing the reply). A SIGINT in "starting" is kept for the moment the code would start.
_cell_phase = "ending"
_interrupt_pending = False


def _interrupt_cell_code(signum: int, frame: types.FrameType | None) -> None:
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

    shell = get_ipython()
    filename = CELL_FILE.format(rank=rank)

    def prepare() -> Callable[[], object]:
        source = shell.transform_cell(code) if shell is not None else code
        # Register the source so tracebacks show the offending line, as in a notebook.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        tree = ast.parse(source, filename=filename)
        last: ast.Expression | None = None
        final = tree.body[-1] if tree.body else None
        if isinstance(final, ast.Expr):
            tree.body.pop()
            last = ast.Expression(final.value)
        namespace = user_namespace()

        def run() -> object:
            try:
                _run_statements(tree.body, filename, namespace)
                return eval(compile(last, filename, "eval"), namespace) if last is not None else None
            finally:
                said = restore_lab_names()  # a pasted launcher loop (for rank in range(size)) rebinds rank
                if said is not None:
                    print(said, flush=True)

        return run

    return run_prepared(filename, prepare, want)


def _run_statements(body: list[ast.stmt], filename: str, namespace: dict[str, object]) -> None:
    """Run a cell's top-level statements in ``namespace``.

    In a replacement (``rank.heal``) a loop ends where the others' did (``WorldFinished``): when the
    replacement stepped with them to that step, the statements after the one the loop is in run too,
    as they did on the others. Otherwise (it never caught up: it is given the others' state after
    the cell) they do not, and what they would have bound is said (``_lacking``).
    """
    while body:
        try:
            exec(compile(ast.Module(body=body, type_ignores=[]), filename, "exec"), namespace)  # noqa: S102 - the user's cell
            return
        except heal.WorldFinished as finished:
            line = _cell_line_of(finished.__traceback__, filename)
            at = next((i for i, stmt in enumerate(body) if stmt.lineno <= line <= (stmt.end_lineno or line)), None)
            if at is None:
                raise
            ran_on = heal.caught_up()
            # The loop it ended in ran its earlier steps here (what they bind, they bound): what the
            # statement binds outside its loops, and every later statement where those do not run.
            skipped = _bound_names(body[at], in_loops=False) + [
                name for stmt in ([] if ran_on else body[at + 1 :]) for name in _bound_names(stmt)
            ]
            _lacking.extend(skipped)  # those the namespace still lacks at the cell's end: run_prepared
            if not ran_on:
                raise
            body = body[at + 1 :]


_lacking: list[str] = []  # what the last cell's statements a replacement did not finish would have bound


def _cell_line_of(tb: types.TracebackType | None, filename: str) -> int:
    """The line of the cell's own top level (its module frame) that ``tb`` passed through; 0 if none."""
    line = 0
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename and tb.tb_frame.f_code.co_name == "<module>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _bound_names(stmt: ast.stmt, in_loops: bool = True) -> list[str]:
    """The names a top-level statement binds in the cell's namespace (not those inside a function,
    a class or a comprehension; nor in a loop, unless ``in_loops``), in order of appearance, each once."""
    names: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
            return
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return
        if not in_loops and isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.append(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.extend((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(stmt)
    return list(dict.fromkeys(names))


def run_script(text: str, path: str, argv: list[str], rank: int) -> CellReply:
    """Run a script written for torchrun on this rank as ``python path`` would run it, unchanged.

    So that code written for torchrun runs in the lab as it is (``%dist run``): it runs as
    ``__main__`` (``if __name__ == "__main__":`` holds, ``sys.modules["__main__"]`` is its module,
    so what it defines pickles), with ``sys.argv = argv``, ``__file__ = path`` and the script's
    folder first on ``sys.path``, its modules imported afresh (``rank/script.py``: as in the new
    process torchrun would start); ``sys.exit()`` or ``sys.exit(0)`` is a success. Its
    ``init_process_group`` joins the lab's group (``rank.torchrun``). The text comes from the
    notebook, so the ranks need not share its files; it is compiled under ``path`` so that
    tracebacks name the script and its lines. Afterwards the names the script defined are the
    rank's, for the next cells (as IPython's ``%run`` leaves them), but for distlab's own (``rank``,
    ``device``, ...: a script's global ``device`` need not be this rank's). Replies as
    :func:`run_cell`, with no value.
    """

    def prepare() -> Callable[[], object]:
        linecache.cache[path] = (len(text), None, text.splitlines(True), path)
        code = compile(text, path, "exec", dont_inherit=True)  # not distlab's __future__ imports
        module = types.ModuleType("__main__")
        module.__file__ = path

        def run() -> None:
            try:
                with as_script(module, path, argv):
                    exec(code, vars(module))  # noqa: S102 - running the user's script is the point
            except SystemExit as exc:
                if exc.code not in (None, 0):
                    raise
            finally:
                defined = vars(module).items()
                user_namespace().update((k, v) for k, v in defined if not k.startswith("__") and k not in LAB_NAMES)

        return run

    return run_prepared(path, prepare, "value")


def run_prepared(filename: str, prepare: Callable[[], Callable[[], object]], want: str) -> CellReply:
    """Run what ``prepare`` makes ready, stoppable by SIGINT, and pack its reply.

    ``prepare`` (reading, compiling) runs before the code starts; the function it returns is the
    user's code. A SIGINT that arrives while preparing stops the code as it starts. A failure is
    kept (``postmortem``: its traceback, for a look at its frames) until the next one starts here.
    """
    from IPython import get_ipython

    global _cell_phase, _interrupt_pending
    shell = get_ipython()
    _cell_phase, _interrupt_pending = "starting", False
    _lacking.clear()
    postmortem.drop()
    if getattr(shell, "kernel", None) is not None and threading.current_thread() is threading.main_thread():
        # Only inside the engine's request handler: ipykernel puts its own handler back after it.
        signal.signal(signal.SIGINT, _interrupt_cell_code)
    try:
        run = prepare()
        try:
            _cell_phase = "running"
            if _interrupt_pending:
                raise KeyboardInterrupt
            with children.watching(), pause.armed(filename):
                try:
                    value = run()
                except heal.WorldFinished:
                    value = None  # a replacement's cell ends where the others' did (rank/heal.py)
                children.check()  # a child process the cell started failed: so did the cell
        finally:
            _cell_phase = "ending"
        reply: CellReply = {"repr": None if value is None else repr(value)} if want == "repr" else {"value": value}
        step = heal.ended_step()
        if step is not None:
            reply["step"] = step  # before the cell's end hooks end the quorum
        namespace = user_namespace()
        lacks = [name for name in dict.fromkeys(_lacking) if name not in namespace]
        if lacks:
            reply["lacks"] = lacks
        return reply
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt too: the notebook reports it
        postmortem.keep(exc, filename)
        return {"error": _describe_failure(exc, filename)}
    finally:
        _cell_phase = "ending"
        _flush_written(sys.stdout)
        _flush_written(sys.stderr)
        hooks.cell_ended()  # open watches' last steps, tqdm bars' last state: sent before the reply


def _flush_written(stream: TextIO) -> None:
    """Flush a stream the cell wrote to, so that its text goes out before what the end hooks send.

    ipykernel's flush waits for its IO thread even with nothing to send (two thread switches, per
    stream); its ``_flush_pending`` says whether anything was written since the last flush. A
    stream without it (not ipykernel's) is flushed.
    """
    if getattr(stream, "_flush_pending", True):
        stream.flush()


def _describe_failure(exc: BaseException, filename: str) -> CellError:
    # A failed child is the cell's failure where the cell started it, not where distlab noticed it.
    frames = exc.stack if isinstance(exc, children.ChildProcessFailed) else traceback.extract_tb(exc.__traceback__)
    # Drop distlab's own frames above the user's code; keep everything from the cell down.
    start = next((i for i, f in enumerate(frames) if f.filename in (filename, LEARNER_FILE)), len(frames))
    trimmed = frames[start:] if start < len(frames) else frames[-1:]
    if len(trimmed) > 1 and trimmed[-1].filename == _STAND_INS[0]:
        # distlab's init_process_group refused the call: the error is about the user's line, shown last.
        while len(trimmed) > 1 and trimmed[-1].filename in _STAND_INS:
            trimmed.pop()
    lines = ["Traceback (most recent call last):\n"]
    lines += traceback.format_list(trimmed)
    lines += traceback.format_exception_only(type(exc), exc)
    return {"ename": type(exc).__name__, "evalue": str(exc), "traceback": "".join(lines), "at": time.time()}

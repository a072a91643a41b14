"""The saving process of ``atomic-checkpoint``'s kill cases, and the grader's end of the pipe to it.

The grading rank starts it (``Saver``: ``sys.executable``, its own session, dying with the rank);
it unpacks the learner's definitions, watches ``os.replace`` / ``os.rename`` / ``os.fsync``, and
answers one line per request on its stdout: ``probe`` (four watched saves), ``trial N`` (a forked
copy that saves until the grader SIGKILLs it), ``reap PID``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Protocol, TypedDict

import torch

from ...rank.exercise import Learner
from ...wire import LEARNER_FILE
from .states import Case, State, state

__all__ = ["Event", "Report", "Save", "Saver", "SaverDied", "grading_rank", "headline", "serve"]

# Saves the probe makes; from the second on, ``path`` already exists (the steady state).
_PROBE_SAVES = 4
# How long the saving process may take to answer one request (its start imports torch: seconds).
_ANSWER_S = 40.0


class Event(TypedDict, total=False):
    """A watched call: "replace" (``src``, ``dst``, and what ``src`` was) or "fsync" (what was synced)."""

    op: str  # "replace" or "fsync"
    seq: int  # its place among the calls
    src: str
    dst: str
    dev: int
    ino: int
    size: int  # -1: ``src`` could not be read


class Save(TypedDict):
    """One save of the probe: how long, the file it left at ``path``, the calls watched, the other files."""

    seconds: float
    ino: int
    size: int
    events: list[Event]
    others: list[str]


class Report(TypedDict, total=False):
    """What the probe found (its answer "P ..."): the saves and the folder, or the learner's ``error``."""

    error: str
    saves: list[Save]
    folder_dev: int
    folder_ino: int


#: A path as ``os.replace`` takes one.
_Path = str | bytes | os.PathLike[str] | os.PathLike[bytes]


class _HasFileno(Protocol):
    def fileno(self) -> int: ...


class Saver:
    """The process that saves: started here, asked over its stdin, answering one line at a time on its stdout."""

    def __init__(self, root: str, case: Case, learner: Learner, path: str) -> None:
        with open(os.path.join(root, "learner.blob"), "wb") as f:
            f.write(learner.blob)
        with open(os.path.join(root, "case.json"), "w") as f:
            json.dump({"case": case, "path": path, "rank": grading_rank(), "world_size": _world_size()}, f)
        package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
        env["TMPDIR"] = os.path.join(root, "elsewhere")  # tempfile's default folder: not the checkpoint's
        env["OMP_NUM_THREADS"] = "1"
        self.log = os.path.join(root, "saver.log")
        self._buffer = b""
        self.trial_pid: int | None = None  # a forked saver not yet reaped: killed in close()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", f"from {__name__} import serve; serve()", root, str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                cwd=root,
                env=env,
                start_new_session=True,  # a SIGINT that stops the rank's case goes to the rank, not here
            )

    def ask(self, request: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(request.encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise SaverDied(self._last_words()) from None

    def line(self, timeout_s: float = _ANSWER_S) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SaverDied(f"it did not answer in {timeout_s:g} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise SaverDied(self._last_words())
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _last_words(self) -> str:
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        with open(self.log, "rb") as f:
            lines = [x for x in f.read().decode(errors="replace").splitlines() if x.strip()]
        return f"it exited with status {self.proc.returncode}" + (f": {lines[-1].strip()}" if lines else "")

    def close(self) -> None:
        if self.trial_pid is not None:
            # Still the saver's unreaped child, so the pid cannot have been reused.
            try:
                os.kill(self.trial_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except BrokenPipeError:
                    pass


class SaverDied(Exception):
    """The saving process stopped answering."""

def grading_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1

def headline(exc: BaseException) -> str:
    line = _first_line(exc)
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= 80 else line[:77] + "..."


class _Watch:
    """Records os.replace / os.rename / os.fsync calls in this process: what, on which file, in which order."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.seq = 0

    def install(self) -> None:
        import posix

        real_replace, real_rename = os.replace, os.rename
        real_fsync = os.fsync
        has_fdatasync = hasattr(os, "fdatasync")  # not on macOS
        # Called only where os has it.
        real_fdatasync: Callable[[int | _HasFileno], None] = getattr(os, "fdatasync", real_fsync)
        watch = self

        # os.replace's and os.rename's own: the two paths, then keyword-only src_dir_fd and dst_dir_fd.
        def replace(src: _Path, dst: _Path, *args: int | None, **kwargs: int | None) -> None:
            watch.moved(src, dst)
            real_replace(src, dst, *args, **kwargs)

        def rename(src: _Path, dst: _Path, *args: int | None, **kwargs: int | None) -> None:
            watch.moved(src, dst)
            real_rename(src, dst, *args, **kwargs)

        def fsync(fd: int | _HasFileno) -> None:
            watch.synced(fd)
            real_fsync(fd)

        def fdatasync(fd: int | _HasFileno) -> None:
            watch.synced(fd)
            real_fdatasync(fd)

        # posix too: a function pickled as `posix.replace` (from `from os import replace`) unpickles as this one.
        for module in (os, posix):
            # setattr by name: posix's stub names neither replace nor rename, and mypy refuses replacing a function.
            patched = {"replace": replace, "rename": rename, "fsync": fsync}
            if has_fdatasync:
                patched["fdatasync"] = fdatasync
            for name, function in patched.items():
                setattr(module, name, function)

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def moved(self, src: _Path, dst: _Path) -> None:
        event: Event = {"op": "replace", "seq": self._next()}
        try:
            event["src"] = os.path.realpath(os.fsdecode(src))
            event["dst"] = os.path.realpath(os.fsdecode(dst))
            st = os.stat(src)
            event.update({"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size})
        except (OSError, TypeError):
            event.setdefault("src", repr(src))
            event.setdefault("dst", repr(dst))
            event.setdefault("size", -1)
        self.events.append(event)

    def synced(self, fd: int | _HasFileno) -> None:
        try:
            st = os.fstat(fd if isinstance(fd, int) else fd.fileno())
        except (OSError, AttributeError, ValueError):
            return
        self.events.append({"op": "fsync", "seq": self._next(), "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size})


def _die_with_parent(parent: int) -> None:
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def _learner_error(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == LEARNER_FILE]
    where = f" at line {frames[-1].lineno} of {frames[-1].name}" if frames else ""
    return f"{headline(exc)}{where}"


def serve() -> None:
    """The saving process: ``python -c ... ROOT PARENT_PID``; requests on stdin, answers on its stdout."""
    root, parent = sys.argv[1], int(sys.argv[2])
    _die_with_parent(parent)
    answers = os.dup(1)
    os.dup2(2, 1)  # the learner's prints go to the log, not into the answers

    def answer(text: str) -> None:
        os.write(answers, text.encode() + b"\n")  # one write: a line under PIPE_BUF is never torn

    torch.set_num_threads(1)
    with open(os.path.join(root, "case.json")) as f:
        job = json.load(f)
    case: Case = job["case"]
    path: str = job["path"]
    from ...rank.namespace import fill

    # Outside an engine the rank's names live in a plain dict: fill it, so that Learner rebinds the
    # learner's `rank`, `world_size`, `torch`, ... to this rank's (no process group: `dist` is uninitialised).
    fill(job["rank"], job["world_size"], job["rank"], torch.device("cpu"))
    with open(os.path.join(root, "learner.blob"), "rb") as packed:
        blob = packed.read()
    watch = _Watch()
    watch.install()  # before unpickling: a pickled `posix.replace` then resolves to the watched one
    save = Learner(blob)["save_checkpoint"]
    states = (state(case, 0), state(case, 1))
    folder = os.path.dirname(path)
    for request in sys.stdin:
        verb, *args = request.split()
        if verb == "probe":
            answer("P " + json.dumps(_probe(save, states, path, folder, watch)))
        elif verb == "trial":
            first = int(args[0])
            pid = os.fork()
            if pid == 0:
                _save_until_killed(save, states, path, first, watch, answer)
            answer(f"T {pid}")
        elif verb == "reap":
            _, status = os.waitpid(int(args[0]), 0)
            answer(f"R {status}")


#: The learner's ``save_checkpoint(state, path)``.
_SaveFunction = Callable[[State, str], object]


def _probe(save: _SaveFunction, states: tuple[State, State], path: str, folder: str, watch: _Watch) -> Report:
    folder_stat = os.stat(folder)
    saves: list[Save] = []
    report: Report = {"saves": saves, "folder_dev": folder_stat.st_dev, "folder_ino": folder_stat.st_ino}
    for i in range(_PROBE_SAVES):
        watch.events.clear()
        began = time.perf_counter()
        try:
            save(states[i % 2], path)
        except Exception as exc:  # noqa: BLE001 - told to the grader, which names it
            return {"error": _learner_error(exc)}
        seconds = time.perf_counter() - began
        st = os.stat(path)
        others = sorted(n for n in os.listdir(folder) if n != os.path.basename(path))
        saves.append(
            {"seconds": seconds, "ino": st.st_ino, "size": st.st_size, "events": list(watch.events), "others": others}
        )
    return report


def _save_until_killed(
    save: _SaveFunction,
    states: tuple[State, State],
    path: str,
    first: int,
    watch: _Watch,
    answer: Callable[[str], None],
) -> None:
    """The forked saver: save the two states in turn, from ``first``, until SIGKILL; never returns."""
    try:
        _die_with_parent(os.getppid())
        n = 0
        while True:
            watch.events.clear()
            save(states[(first + n) % 2], path)
            n += 1
            answer(f"S {n}")
    except BaseException as exc:  # noqa: BLE001 - told to the grader
        answer("E " + _learner_error(exc))
    finally:
        os._exit(1)

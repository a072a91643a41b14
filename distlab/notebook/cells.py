"""What a lab runs on its ranks: cells, scripts, distlab's own calls, pushes and pulls; what
ran (``history``, ``export``) and what a failed rank kept (``postmortem``).

A part of :class:`distlab.notebook.core.LabCore`, kept apart because it is the half of a lab that
a cell goes through: send (``cell.CellRun``), wait and stream, then carry out recovery's decision.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ..cluster.processes import pid_alive
from ..errors import CellTimeout, DistlabError, LabUsageError, RankError, RankFailure, parse_ranks
from . import recovery, rpc
from .cell import CellContext, CellRun, Listener, RunResult, Send
from .config import LabConfig
from .group import form_group, get
from .labs import LabObserver
from .postmortem import MAX_FRAMES, MAX_LOCALS, LastCell, Postmortem, first_failed, gone, nothing_kept
from .release import Releaser
from .script import CellRan, Event, Pushed, ScriptRan, build_script, export_path, read_script, script_args
from .streams import RankPrinter
from .world import RankInfo, RankTable, World

if TYPE_CHECKING:
    from .core import LabCore

__all__ = ["RunsCells", "exclusive"]

F = TypeVar("F", bound=Callable[..., Any])


def exclusive(method: F) -> F:
    """The lab's method, run holding the lab's lock (``LabCore._lock``): what another thread must not
    stop half way (``LabCore.stop_unless_busy``), and what must not start on a lab it is stopping."""

    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return cast("F", locked)


class RunsCells:
    """The cells half of a lab (mixed into ``LabCore``, which holds the state named here)."""

    config: LabConfig
    backend: str
    world_size: int
    _client: Any
    _world: World | None
    _history: list[Event]
    _last_cell: LastCell | None
    _observers: list[LabObserver]
    _releaser: Releaser
    _listeners: list[Listener]
    _pushed: dict[str, Any]
    _engines: dict[int, rpc.Engine]
    _cell_source: str
    _lock: threading.RLock
    last_cell_at: float | None

    if TYPE_CHECKING:  # what LabCore provides

        @property
        def timeout(self) -> float: ...
        @property
        def debug(self) -> bool: ...
        @property
        def table(self) -> RankTable: ...
        def _require_running(self) -> None: ...
        def ranks(self, spec: str | int | Iterable[int] | None = None) -> list[int]: ...
        def kill(self, rank: int) -> None: ...
        def restart(self, ranks: int | None = None) -> Any: ...
        @property
        def _healing(self) -> tuple[str, str]: ...
        def _replace_rank(self, rank: int) -> tuple[Any, RankInfo]: ...
        def _replace_before(self, gone: list[int]) -> None: ...
        def _on_this_machine(self, info: RankInfo) -> bool: ...
        def _whole_again(self, outcome: Any) -> None: ...
        def _stacks_of_stopped(self, ranks: list[int]) -> str: ...
        def _top_up_spares(self) -> None: ...
        @property
        def running(self) -> bool: ...
        def stop(self) -> None: ...

    def stop_unless_busy(self, still: Callable[[], bool]) -> bool:
        """From another thread: stop the lab unless it is starting, stopping or running a cell (its
        companions too), and only if ``still()`` holds once that is known; whether it stopped."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if not self.running or not still():
                return False
            self.stop()
            return True
        finally:
            self._lock.release()

    # ------------------------------------------------------------------------ cells

    @exclusive
    def call(
        self, send: Send, ranks: str | int | Iterable[int] | None = None, timeout: float | None = None
    ) -> RunResult:
        """distlab's own call on the given ranks (all by default), through a cell's path: the deadline,
        SIGINT, releasing stuck ranks, recovery; nothing streamed, nothing recorded for export.
        ``send(engine, rank)`` sends it to one rank (an ``rpc`` function); raises as :meth:`run` does."""
        self._require_running()
        return self._run_on(self.ranks(ranks), timeout, False, send)

    @exclusive
    def push(self, ranks: str | int | Iterable[int] | None = None, **names: Any) -> None:
        """Copy names into the namespace of the given ranks (all by default)."""
        self._require_running()
        if not names:
            raise LabUsageError("nothing to push: name the values, like lab.push(lr=0.1)")
        selected = self.ranks(ranks)
        targets = [self.table[r].engine_id for r in selected]
        get(self._client.direct_view(targets).push(names, block=False), self.timeout, "pushing to the ranks")
        self._history.append(Pushed(tuple(names), self._subset(selected)))
        if self.config.heal and self._subset(selected) is None:
            self._pushed.update(names)  # a replacement rank is given them too (``healing``)

    @exclusive
    def pull(self, name: str, ranks: str | int | Iterable[int] | None = None) -> dict[int, Any]:
        """{rank: value of ``name``} from the given ranks (all by default)."""
        import ipyparallel as ipp

        self._require_running()
        if not isinstance(name, str) or not name.isidentifier():
            raise LabUsageError(f"pull takes one variable name, like lab.pull('loss') (got {name!r})")
        pending = {r: self._client[self.table[r].engine_id].pull(name, block=False) for r in self.ranks(ranks)}
        values, failures = {}, {}
        for rank, ar in pending.items():
            try:
                values[rank] = ar.get(timeout=self.timeout)
            except ipp.error.RemoteError as exc:
                failures[rank] = RankFailure(rank, exc.ename, exc.evalue)
            except ipp.error.TimeoutError:
                failures[rank] = RankFailure(rank, "TimeoutError", f"no answer within {self.timeout:g} s")
        if failures:
            raise RankError(failures)
        return values

    @property
    def history(self) -> tuple[Event, ...]:
        """What ran, in order: cells that succeeded, pushes, scripts, restarts (``script.Event``)."""
        return tuple(self._history)

    @exclusive
    def run(
        self,
        code: str,
        ranks: str | int | Iterable[int] | None = None,
        timeout: float | None = None,
        stream: bool = True,
        want: str = "value",
        record: bool = True,
    ) -> RunResult:
        """Run ``code`` on the given ranks (all by default) and wait for it.

        Each rank's output is printed as it arrives, labelled by rank. Returns {rank: value of the
        last expression}. If any rank fails, raises RankError naming the ranks, with identical
        failures grouped; ranks still running are stopped, and a broken process group is rebuilt.
        ``timeout`` (seconds) bounds the whole cell; Ctrl-C / kernel interrupt stops it on every rank.
        A cell that succeeds is kept for :meth:`export`; ``record=False`` leaves it out (code run for
        distlab's own purposes, such as a quiz's check).
        """
        from .. import checks

        self._require_running()
        if not isinstance(code, str):
            raise LabUsageError(f"code must be a string of Python, got {type(code).__name__}")
        if timeout is not None:
            checks.positive("timeout", timeout, example="timeout=30")
        checks.choice("want", want, ("value", "repr"))
        checks.flag("record", record)
        selected = self.ranks(ranks)
        self._cell_source = code
        send: Send = lambda engine, rank: rpc.run_cell(engine, code, rank, want)  # noqa: E731
        result = self._profiled(selected, lambda: self._run_on(selected, timeout, stream, send))
        if record:
            self._history.append(CellRan(code, self._subset(selected)))
        return result

    @exclusive
    def run_script(
        self, path: str | os.PathLike[str], args: Iterable[str] = (), timeout: float | None = None, stream: bool = True
    ) -> RunResult:
        """Run a script written for torchrun on every rank, as ``__main__``, unchanged: ``%dist run``.

        So that code written for torchrun runs in the lab as it is: ``sys.argv`` is ``[path, *args]``,
        ``os.environ`` has torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...), the script's
        ``init_process_group`` joins the lab's group and its ``destroy_process_group()`` leaves it up.
        The file is read here and its text sent, so the ranks need not share this machine's files.
        Output streams labelled by rank; a failure raises RankError as a cell's does, its traceback
        naming the script's lines. Afterwards the names the script defined are the ranks' own.
        Returns {rank: None}, with each rank's output (``.stdout``, ``.stderr``).
        """
        from .. import checks

        self._require_running()
        if timeout is not None:
            checks.positive("timeout", timeout, example="timeout=30")
        name, text = read_script(path)
        argv = [name, *script_args(args)]
        full = os.path.abspath(name)  # the file's name on the ranks, in tracebacks and __file__
        self._cell_source = ""  # the script's frames name its file, which py-spy reads
        result = self._profiled(self.ranks(), lambda: self._run_on(
            self.ranks(), timeout, stream, lambda engine, rank: rpc.run_script(engine, text, full, argv, rank), full
        ))
        self._history.append(ScriptRan(tuple(argv)))
        return result

    def export(self, path: str | os.PathLike[str]) -> str:
        """Write the cells run so far on every rank as a script torchrun runs as it is; return its path.

        So that what was built in the lab leaves it as a torchrun script: ``torchrun --standalone
        --nproc_per_node=N path`` runs the cells that succeeded, in order, on ranks that start with
        what a lab's rank has. What the script cannot carry (names pushed with :meth:`push`, cells run
        on some ranks only, lines only IPython runs) is said in its comments and in a UserWarning.
        """
        self._require_running()
        name = export_path(path)
        on_gpus = self.backend != "nccl" and any(r.device.startswith("cuda") for r in self.table)
        script = build_script(self._history, self.world_size, self.backend, name, on_gpus)
        if script.cells == 0:
            raise LabUsageError("no cell has run on every rank yet: there is nothing to export")
        try:
            with open(name, "w", encoding="utf-8") as out:
                out.write(script.text)
        except OSError as exc:
            raise LabUsageError(f"cannot write {name}: {exc.strerror}") from None
        if script.notes:
            warnings.warn(f"{name}: " + "; ".join(script.notes), UserWarning, stacklevel=2)
        return name

    def postmortem(self, rank: int | None = None) -> Postmortem:
        """A failed rank's frames, the failing one last, each with its locals summarised: ``print(lab.postmortem())``.

        Read from the rank's own traceback, which it keeps from a failed cell until its next cell
        starts: tensors by shape, dtype, device and statistics (min, max, mean, norm, nan/inf),
        modules by class and parameter count, containers by type and length, the rest by a short
        repr. With no ``rank``, the first rank that failed in the lab's last cell (one that raised
        by itself before one distlab stopped). A rank that keeps nothing (its cell succeeded, its
        process died, the world was restarted) raises DistlabError saying which; ``%dist debug``.
        """
        from .. import checks

        self._require_running()
        if rank is None:
            rank = first_failed(self._last_cell)
        else:
            checks.whole("rank", rank, example="lab.postmortem(1)")
            (rank,) = parse_ranks(rank, self.world_size)
        why = gone(rank, self._last_cell)
        if why:
            raise DistlabError(why)
        info = self.table[rank]
        if info.engine_id not in set(self._client.ids):
            raise DistlabError(
                f"rank {rank} kept no failure: its process has died, and what it held went with it; "
                "%dist restart (lab.restart()) brings a full world back"
            )
        data = get(
            rpc.postmortem(self._client[info.engine_id], MAX_FRAMES, MAX_LOCALS), self.timeout,
            f"reading rank {rank}'s kept failure",
        )
        if data is None:
            raise DistlabError(nothing_kept(rank, self._last_cell))
        return Postmortem(rank, data)

    def _profiled(self, ranks: list[int], run: Callable[[], RunResult]) -> RunResult:
        """A user's cell on ``ranks``: ``run()``, which a view may wrap (``Lab``: ``lab.profile``)."""
        return run()

    def _subset(self, selected: list[int]) -> tuple[int, ...] | None:
        """None for every rank of the world, else the ranks."""
        return None if selected == list(range(self.world_size)) else tuple(selected)

    def _run_on(
        self, selected: list[int], timeout: float | None, stream: bool, send: Send, filename: str | None = None
    ) -> RunResult:
        """Send the work to the selected ranks, stream their output, and recover from a failure."""
        registered = set(self._client.ids)
        # A rank killed a moment ago is gone from this machine before the controller has heard.
        gone = [
            r for r in selected
            if self.table[r].engine_id not in registered
            or (self._on_this_machine(self.table[r]) and not pid_alive(self.table[r].pid))
        ]
        if gone and self.config.heal:
            self._replace_before(gone)
            gone = []
        if gone:
            # The others would only wait for them in the first collective: run the cell nowhere.
            raise RankError(
                {r: RankFailure(r, "EngineError", "the rank's process has died") for r in gone},
                notes=["the cell ran on no rank: %dist restart (lab.restart()) brings a full world back"],
            )
        self._top_up_spares()  # forked now, registered by the time a rank of this cell may die
        ctx = self._cell_context()
        cell = CellRun(ctx, selected, send, filename)
        printer = RankPrinter(label_width=len(str(self.world_size - 1)), ranks=selected) if stream else None
        with contextlib.ExitStack() as views:  # what observers show while a cell runs (progress bars)
            for observer in list(self._observers):
                views.enter_context(observer.cell(cast("LabCore", self), stream))
            views.callback(self._cell_ended)  # before the views' exits (last in, first out): they see its end
            outcome = cell.run(timeout, printer)
        if outcome.replaced:
            self._whole_again(outcome)
            if stream:
                for note in outcome.notes:
                    print(f"[distlab] {note}", flush=True)
        if outcome.failures:
            world = self._world
            recovery.diagnose(outcome, ctx, selected)
            self._repair(recovery.decide(outcome, ctx), outcome)
            self._last_cell = LastCell.of(selected, outcome, restarted=self._world is not world)
            raise (CellTimeout if outcome.timed_out else RankError)(outcome.failures, notes=outcome.notes)
        self._last_cell = LastCell.of(selected, outcome, restarted=False)
        return cell.result()

    def _cell_ended(self) -> None:
        self.last_cell_at = time.time()

    def _repair(self, repair: recovery.Repair, outcome: Any) -> None:
        """Carry out recovery's decision; what was done goes into the cell's notes."""
        if repair.action == "rebuild":
            try:
                assert self._world is not None
                form_group(self._client, self._world, self.timeout, self.debug, rebuild=True)
            except (RankError, DistlabError) as exc:
                # A group that cannot be rebuilt in place is rebuilt with the processes.
                self.restart()
                outcome.notes.append(recovery.rebuild_failed(exc))
                return
        elif repair.action == "restart":
            self.restart()
        if repair.note:
            outcome.notes.append(repair.note)

    def _cell_context(self) -> CellContext:
        if not self.config.heal:
            return CellContext(
                self._client, self.table, self._releaser, self.kill, self._on_poll, engines=self._engines,
                stacks=self._stacks_of_stopped,
            )
        return CellContext(
            self._client, self.table, self._releaser, self.kill, self._on_poll,
            heals=True, replace=self._replace_rank, heal_end=self._healing[1], engines=self._engines,
            stacks=self._stacks_of_stopped,
        )

    def _on_poll(self, pending: dict[int, Any], final: bool) -> None:
        for listener in list(self._listeners):
            listener(pending, final)


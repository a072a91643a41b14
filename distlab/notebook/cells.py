"""What a lab runs on its ranks: cells, scripts, distlab's own calls, pushes and pulls; what
ran (``history``, ``export``) and what a failed rank kept (``postmortem``).

:class:`CellRunner`, a lab's collaborator: the half of a lab that a cell goes through: send
(``cell.CellRun``), wait and stream, then carry out recovery's decision. The lab's public methods
(``core.LabCore.run`` and the others) check the lab runs, hold its lock, and hand each here.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import CellTimeout, DistlabError, LabUsageError, RankError, RankFailure
from ..wire import Breakpoint
from . import recovery, rpc
from .cell import CellRun
from .cell_context import CellContext, RunResult, Send
from .config import LabConfig
from .group import get
from .healing import Healer
from .lab_world import LabWorld
from .mismatch import mismatch_note
from .observers import ObserverBus
from .pause import Pause, PauseControl
from .postmortem import MAX_FRAMES, MAX_LOCALS, LastCell, Postmortem, first_failed, gone, nothing_kept
from .processes import LabProcesses
from .script import CellRan, Event, Pushed, ScriptRan, build_script, export_path, read_script, script_args
from .stacks import StacksReader
from .streams import HEALING_NOISE, RankPrinter

__all__ = ["AroundCell", "CellRunner"]


@dataclass
class _Running:
    """A cell sent and not yet over: what waiting for it again (after a pause) needs."""

    cell: CellRun
    selected: list[int]
    timeout: float | None
    stream: bool
    printer: RankPrinter | None

#: What may wrap a user's cell on its ranks (``front.profiling.Profiler.around``): ``(ranks, run) -> run()``.
AroundCell = Callable[[list[int], Callable[[], RunResult]], RunResult]


def _plain(ranks: list[int], run: Callable[[], RunResult]) -> RunResult:
    return run()


class CellRunner:
    """Runs what a lab's ranks are given, on ``processes``' engines as ``world`` numbers them; heals
    with ``healer``, reads stacks with ``stacks``, tells views through ``bus``. ``config()`` is the
    lab's configuration now; ``restart()`` and ``kill(rank)`` are the lab's own (recovery's repairs)."""

    def __init__(
        self, config: Callable[[], LabConfig], processes: LabProcesses, world: LabWorld, healer: Healer,
        stacks: StacksReader, bus: ObserverBus, restart: Callable[[], Any], kill: Callable[[int], None],
    ) -> None:
        self._config = config
        self._processes = processes
        self._world = world
        self._healer = healer
        self._stacks = stacks
        self._bus = bus
        self._restart = restart
        self._kill = kill
        self.around: AroundCell = _plain  # a view may wrap a user's cell (``Lab``: ``lab.profile``)
        # What ran, in order (cells that succeeded, pushes, scripts, restarts): what export writes.
        self._history: list[Event] = []
        # Which ranks the last cell ran on, failed on, killed (``postmortem``); None before the world's first.
        self._last_cell: LastCell | None = None
        #: When the last cell (or call on the ranks) ended: seconds since the epoch.
        self.last_cell_at: float | None = None
        self._armed: Breakpoint | None = None  # the breakpoint armed for the next cell (``pause``)
        self._held: _Running | None = None  # a cell held at a pause (``step``, ``cont``)

    @property
    def _timeout(self) -> float:
        return self._config().timeout

    @property
    def _world_size(self) -> int:
        return self._config().ranks

    def reset(self) -> None:
        """A new lab: nothing ran yet."""
        self._history, self._last_cell, self.last_cell_at = [], None, None

    def new_world(self, event: Event) -> None:
        """A new world (a restart): what failed in the old one is gone; ``event`` says so in the history."""
        self._last_cell = None
        self._history.append(event)

    def clear_history(self) -> None:
        """Forget what ran so far: an export writes only what runs from now on."""
        self._history = []

    # ------------------------------------------------------------------------ cells
    # Each is ``LabCore``'s method of the same name (its docstring says what it does), on ranks
    # already parsed (``selected``), with the lab running and its lock held.

    def call(self, send: Send, selected: list[int], timeout: float | None) -> RunResult:
        self.refuse_while_paused("run distlab's own call on the ranks")
        return self._run_on(selected, timeout, False, send)

    def push(self, selected: list[int], names: dict[str, Any]) -> None:
        self.refuse_while_paused("push")
        if not names:
            raise LabUsageError("nothing to push: name the values, like lab.push(lr=0.1)")
        table = self._world.table
        targets = [table[r].engine_id for r in selected]
        client = self._processes.client
        get(client.direct_view(targets).push(names, block=False), self._timeout, "pushing to the ranks")
        self._history.append(Pushed(tuple(names), self._subset(selected)))
        if self._config().heal and self._subset(selected) is None:
            self._healer.remember_push(names)  # a replacement rank is given them too

    def pull(self, name: str, selected: list[int]) -> dict[int, Any]:
        import ipyparallel as ipp

        if not isinstance(name, str) or not name.isidentifier():
            raise LabUsageError(f"pull takes one variable name, like lab.pull('loss') (got {name!r})")
        held = self._held.cell.ctx.pauses if self._held is not None and self.paused is not None else None
        if held is not None:  # the ranks' main threads wait at the pause: read its frames
            return held.read(name, selected)
        table, client, timeout = self._world.table, self._processes.client, self._timeout
        pending = {r: client[table[r].engine_id].pull(name, block=False) for r in selected}
        values, failures = {}, {}
        for rank, ar in pending.items():
            try:
                values[rank] = ar.get(timeout=timeout)
            except ipp.error.RemoteError as exc:
                failures[rank] = RankFailure(rank, exc.ename, exc.evalue)
            except ipp.error.TimeoutError:
                failures[rank] = RankFailure(rank, "TimeoutError", f"no answer within {timeout:g} s")
        if failures:
            raise RankError(failures)
        return values

    @property
    def history(self) -> tuple[Event, ...]:
        return tuple(self._history)

    def run(
        self, code: str, selected: list[int], timeout: float | None, stream: bool, want: str, record: bool
    ) -> RunResult:
        from .. import checks

        if not isinstance(code, str):
            raise LabUsageError(f"code must be a string of Python, got {type(code).__name__}")
        if timeout is not None:
            checks.positive("timeout", timeout, example="timeout=30")
        checks.choice("want", want, ("value", "repr"))
        checks.flag("record", record)
        self._stacks.remember_cell(code)
        send: Send = lambda engine, rank: rpc.run_cell(engine, code, rank, want)  # noqa: E731
        result = self.around(selected, lambda: self._run_on(
            selected, timeout, stream, send,
            # distlab's own code is never paused; a pause says the lines of the code as given, as the
            # lint does (the ranks number them after IPython drops the leading blank ones: ``rank.cell``)
            paused_lines_from=_leading_blank_lines(code) if record else None,
        ))
        if record and result.paused is None:
            self._history.append(CellRan(code, self._subset(selected)))
        return result

    def run_script(
        self, path: str | os.PathLike[str], args: Iterable[str], timeout: float | None, stream: bool
    ) -> RunResult:
        from .. import checks

        self.refuse_while_paused("run a script")
        if timeout is not None:
            checks.positive("timeout", timeout, example="timeout=30")
        name, text = read_script(path)
        argv = [name, *script_args(args)]
        full = os.path.abspath(name)  # the file's name on the ranks, in tracebacks and __file__
        self._stacks.remember_cell("")  # the script's frames name its file, which py-spy reads
        every = list(range(self._world_size))
        result = self.around(every, lambda: self._run_on(
            every, timeout, stream, lambda engine, rank: rpc.run_script(engine, text, full, argv, rank), full, 0
        ))
        self._history.append(ScriptRan(tuple(argv)))
        return result

    def export(self, path: str | os.PathLike[str], backend: str) -> str:
        name = export_path(path)
        on_gpus = backend != "nccl" and any(r.device.startswith("cuda") for r in self._world.table)
        script = build_script(self._history, self._world_size, backend, name, on_gpus)
        if script.cells == 0:
            raise LabUsageError("no cell has run on every rank yet: there is nothing to export")
        try:
            with open(name, "w", encoding="utf-8") as out:
                out.write(script.text)
        except OSError as exc:
            raise LabUsageError(f"cannot write {name}: {exc.strerror}") from None
        if script.notes:
            warnings.warn(f"{name}: " + "; ".join(script.notes), UserWarning, stacklevel=3)
        return name

    def postmortem(self, rank: int | None) -> Postmortem:
        from .. import checks

        if rank is None:
            rank = first_failed(self._last_cell)
        else:
            checks.whole("rank", rank, example="lab.postmortem(1)")
            (rank,) = self._world.ranks(rank, self._world_size)
        why = gone(rank, self._last_cell)
        if why:
            raise DistlabError(why)
        info = self._world.table[rank]
        client = self._processes.client
        if info.engine_id not in self._processes.registered():
            raise DistlabError(
                f"rank {rank} kept no failure: its process has died, and what it held went with it; "
                "%dist restart (lab.restart()) brings a full world back"
            )
        data = get(
            rpc.postmortem(client[info.engine_id], MAX_FRAMES, MAX_LOCALS), self._timeout,
            f"reading rank {rank}'s kept failure",
        )
        if data is None:
            raise DistlabError(nothing_kept(rank, self._last_cell))
        return Postmortem(rank, data)

    def _subset(self, selected: list[int]) -> tuple[int, ...] | None:
        """None for every rank of the world, else the ranks."""
        return None if selected == list(range(self._world_size)) else tuple(selected)

    def _run_on(
        self, selected: list[int], timeout: float | None, stream: bool, send: Send, filename: str | None = None,
        paused_lines_from: int | None = None,
    ) -> RunResult:
        """Send the work to the selected ranks, stream their output, and recover from a failure."""
        processes, config = self._processes, self._config()
        registered = processes.registered()
        table = self._world.table
        # A rank killed a moment ago is gone from this machine before the controller has heard.
        gone = [r for r in selected if not processes.alive(table[r], registered)]
        if gone and config.heal:
            self._healer.replace_before(gone, config)
            gone = []
        if gone:
            # The others would only wait for them in the first collective: run the cell nowhere.
            raise RankError(
                {r: RankFailure(r, "EngineError", "the rank's process has died") for r in gone},
                notes=["the cell ran on no rank: %dist restart (lab.restart()) brings a full world back"],
            )
        processes.top_up_spares(config)  # forked now, registered by the time a rank of this cell may die
        ctx = self._cell_context(config, selected, paused_lines_from)
        cell = CellRun(ctx, selected, send, filename)
        hidden = HEALING_NOISE if config.heal else ()
        printer = RankPrinter(len(str(self._world_size - 1)), selected, hidden) if stream else None
        return self._wait_for(_Running(cell, selected, timeout, stream, printer))

    def _wait_for(self, running: _Running) -> RunResult:
        """Wait for a cell sent (or stepped on from a pause): its result, or, where every rank still in
        it waits before a collective, its Pause (``paused``) with the cell held for ``step`` and ``cont``."""
        cell, selected, stream = running.cell, running.selected, running.stream
        with self._bus.cell_views(stream, self._cell_ended):  # what observers show while a cell runs
            outcome = cell.run(running.timeout, running.printer)
        if outcome.paused is not None:
            self._held = running
            return RunResult({}, {}, {}, notes=[outcome.paused.text().splitlines()[0]], paused=outcome.paused)
        ctx = cell.ctx
        # Said as the cell ends, where a rank was replaced or the lighthouse started again.
        said = 0 if outcome.replaced else len(outcome.notes)
        if outcome.replaced:
            self._healer.whole_again(outcome)
        outcome.notes.extend(self._healer.lighthouse_notes())
        if stream:
            for note in outcome.notes[said:]:
                print(f"[distlab] {note}", flush=True)
        if outcome.failures:
            world = self._world.current
            recovery.diagnose(outcome, ctx, selected)
            if (disagree := mismatch_note(outcome.failures)) is not None:
                outcome.notes.insert(0, disagree)
            self._repair(recovery.decide(outcome, ctx), outcome)
            self._last_cell = LastCell.of(selected, outcome, restarted=self._world.current is not world)
            raise (CellTimeout if outcome.timed_out else RankError)(outcome.failures, notes=outcome.notes)
        self._last_cell = LastCell.of(selected, outcome, restarted=False)
        return cell.result()

    def _cell_ended(self) -> None:
        self.last_cell_at = time.time()

    def _repair(self, repair: recovery.Repair, outcome: Any) -> None:
        """Carry out recovery's decision; what was done goes into the cell's notes."""
        if repair.action == "rebuild":
            try:
                self._world.rebuild_group()
            except (RankError, DistlabError) as exc:
                # A group that cannot be rebuilt in place is rebuilt with the processes.
                self._restart()
                outcome.notes.append(recovery.rebuild_failed(exc))
                return
        elif repair.action == "restart":
            self._restart()
        if repair.note:
            outcome.notes.append(repair.note)

    def _cell_context(self, config: LabConfig, selected: list[int], paused_lines_from: int | None) -> CellContext:
        processes, world = self._processes, self._world
        # A breakpoint arms the user's next cell (``pause``); distlab's own calls pass it by.
        pauses = self._arm(selected, paused_lines_from) if paused_lines_from is not None else None
        if not config.heal:
            return CellContext(processes.client, world.table, world.releaser, self._kill, self._bus.poll,
                               engines=processes.engines, stacks=self._stacks.of_stopped, pauses=pauses)
        return CellContext(
            processes.client, world.table, world.releaser, self._kill, self._bus.poll, heals=True,
            replace=lambda rank: self._healer.replace_rank(rank, self._config()), heal_end=self._healer.healing[1],
            engines=processes.engines, stacks=self._stacks.of_stopped, pauses=pauses,
        )

    # ------------------------------------------------------------------------ breakpoints

    def pause(self, spec: Breakpoint | None) -> None:
        """Arm the next cell with ``spec`` (``LabCore.pause``); None disarms it."""
        self._armed = spec

    def _arm(self, selected: list[int], line_offset: int) -> PauseControl | None:
        """Send the armed breakpoint to the ranks of the cell about to be sent, ahead of it (the two
        requests run in order on each rank): the cell's ranks are then asked whether they are paused."""
        spec, self._armed = self._armed, None
        if spec is None:
            return None
        table, client = self._world.table, self._processes.client
        pending = [rpc.arm_pause(client[table[r].engine_id], spec) for r in selected]
        for ar in pending:
            get(ar, self._timeout, "arming the breakpoint on the ranks")
        return PauseControl(client, table, line_offset)

    @property
    def paused(self) -> Pause | None:
        """The Pause the cell held now waits at, or None."""
        held = self._held
        return None if held is None or held.cell.ctx.pauses is None else held.cell.ctx.pauses.current

    def refuse_while_paused(self, doing: str) -> None:
        """One line, where a cell is held at a pause and ``doing`` would need the ranks' main threads."""
        pause = self.paused
        if pause is not None:
            raise LabUsageError(f"cannot {doing}: the world is paused before collective {pause.index} ({pause.op}) "
                                "of a cell; lab.step() or lab.cont() first (lab.stop() ends it)")

    def step(self) -> Pause | None:
        """Every paused rank launches its collective and stops before its next one: the new Pause, or
        None when the cell ended (its output shown, its failure raised as ``run``'s)."""
        running = self._take_held("step")
        assert running.cell.ctx.pauses is not None
        running.cell.ctx.pauses.tell("step")
        return self._wait_for(running).paused

    def cont(self) -> RunResult:
        """The held cell runs to its end, no longer paused: what ``run`` would have returned."""
        running = self._take_held("cont")
        pauses = running.cell.ctx.pauses
        assert pauses is not None
        pauses.tell("cont")
        running.cell.ctx.__dict__["pauses"] = None  # (frozen) no more pauses for this cell: ask no more
        return self._wait_for(running)

    def drop_held(self) -> None:
        """Nothing is paused any more: a held cell's ranks are stopped as at a deadline (SIGINT ends
        their wait at the pause), so that a stop or restart does not wait for ranks that never answer."""
        held, self._held = self._held, None
        if held is not None:
            held.cell.stop()

    def _take_held(self, word: str) -> _Running:
        held = self._held
        if held is None or self.paused is None:
            raise LabUsageError(f"nothing is paused, so there is nothing to {word}: lab.pause(at=3) arms the next "
                                "cell to stop before its third collective")
        self._held = None
        return held


def _leading_blank_lines(code: str) -> int:
    """How many lines IPython's transform drops from the top of ``code``: those with only whitespace."""
    count = 0
    for line in code.splitlines():
        if line.strip():
            break
        count += 1
    return count

"""LabCore: N torch.distributed ranks, each an ipyparallel engine, driven from the notebook.

The core of a lab, and nothing of its views: a short class that holds its collaborators as named
fields (``processes``, ``world``, ``cells``, ``healer``, ``network``, ``stacks_reader``, ``keeper``,
``bus``, ``lifecycle``, ``linter``, ``breakpoints``, ``companions``: ARCHITECTURE.md says what each
owns), each built here with what it needs, and hands each job to the one that owns it. Views attach
from outside, through its observer bus; ``front.lab.Lab`` is the core with them attached. ``config``
is the checked configuration (``config.LabConfig``, the one place its fields are written).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

from .. import checks
from ..errors import LabUsageError
from .breakpoints import Breakpoints
from .cell_context import RunResult, Send
from .cell_lint import CellLinter, Finding
from .cells import CellRunner
from .companions import Companions
from .config import LabConfig, lab_config
from .healing import Healer
from .keeper import Keeper
from .lab_world import LabWorld
from .lifecycle import Lifecycle
from .nodes import NetworkControls
from .observers import LabObserver, Listener, ObserverBus
from .pause import Pause
from .postmortem import Postmortem
from .processes import LabProcesses
from .script import Event
from .stacks import StacksReader
from .world import RankInfo, RankTable, World

__all__ = ["LabCore", "RankInfo", "RankTable", "RunResult", "exclusive"]

F = TypeVar("F", bound=Callable[..., Any])
#: A lab, as its own type: ``start()`` of a ``Lab`` gives the ``Lab``.
_L = TypeVar("_L", bound="LabCore")
Ranks = str | int | Iterable[int] | None


def exclusive(method: F) -> F:
    """The lab's method, run holding the lab's lock (``LabCore.lock``): what another thread must not
    stop half way (``LabCore.stop_unless_busy``), and what must not start on a lab it is stopping."""

    @functools.wraps(method)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return cast("F", locked)


class LabCore:
    """N ranks of torch.distributed, each an ipyparallel engine, ready to run cells; no views.

    ``LabCore(ranks=2, backend="gloo", ...)`` takes :class:`~distlab.notebook.config.LabConfig`'s
    keywords (or ``config=``, a checked one, which keywords given too override). ``distlab.start``
    gives a :class:`distlab.front.lab.Lab`, this core with its views attached. A lab is also a
    context manager that stops everything it started on exit.
    """

    def __init__(self, *args: Any, config: LabConfig | None = None, **overrides: Any) -> None:
        self.config = lab_config(config, *args, **overrides)
        #: Backend in use once started (``auto`` resolved), else the one asked for.
        self.backend = self.config.backend
        #: What the choice of backend and devices needs said (ranks sharing a GPU over gloo), or "".
        self.note = ""
        #: How long each phase of the last start (``ready_s``) or restart (``restart_s``) took, in seconds.
        self.timings: dict[str, float] = {}
        self.started_at: float | None = None  #: when the lab started: seconds since the epoch
        # Held while the lab starts, restarts, stops or gives its ranks work (``exclusive``), and by another
        # thread that stops it (``stop_unless_busy``). Reentrant; a companion shares its lab's.
        self.lock = threading.RLock()
        timeout, debug = self.config.timeout, self.config.debug
        self.bus = ObserverBus(self)
        self.processes = LabProcesses(timeout)
        self.world = LabWorld(self.processes, timeout, debug)
        self.healer = Healer(self.processes, self.world, timeout, debug)
        self.stacks_reader = StacksReader(self.world)
        self.network = NetworkControls(self.processes)
        self.keeper = Keeper(self.processes, self.world, timeout)
        self.cells = CellRunner(
            lambda: self.config, self.processes, self.world, self.healer, self.stacks_reader, self.bus,
            restart=self.restart, kill=self.kill,
        )
        self.lifecycle = Lifecycle(
            self, self.processes, self.world, self.healer, self.keeper, self.cells, self.bus, on_failure=self.stop
        )
        self.breakpoints = Breakpoints(self.cells, self.bus)
        self.bus.observe(self.healer.records)  # each healing cell's record: ``heals()``
        # What earlier cells left on the ranks that makes a call a collective (a sharded model, a
        # function that all-reduces), for the lint of the cells after them; a new world forgets it.
        self.linter = CellLinter()
        self.every_cell = False  # the notebook runs its plain cells here (%dist auto on): the panel says so
        self.companions: Companions[LabCore] = Companions(
            lambda ranks, backend: LabCore(ranks=ranks, backend=backend, timeout=self.config.timeout), self.lock
        )

    @classmethod
    def from_config(cls: type[_L], config: LabConfig) -> _L:
        """A lab of an already checked configuration (what ``%dist start`` builds)."""
        return cls(config=config)

    # The configuration, as attributes (the magics and tests read them).
    timeout = property(lambda self: self.config.timeout)
    launcher = property(lambda self: self.config.launcher)
    debug = property(lambda self: self.config.debug)
    requested_backend = property(lambda self: self.config.backend)

    @property
    def world_size(self) -> int:
        return self.config.ranks

    @property
    def last_cell_at(self) -> float | None:
        """When the lab's last cell (or call on its ranks) ended: seconds since the epoch."""
        return self.cells.last_cell_at

    # ----------------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        return self.processes.running

    @exclusive
    def start(self: _L) -> _L:
        """Start the controller and engines, build the rank table, initialise the process group."""
        if self.running:
            raise LabUsageError("this lab is already running: stop it first, or use restart()")
        self.started_at = time.time()
        self.lifecycle.start(self.config, self.timings, self._adopt)
        return self

    @exclusive
    def restart(self: _L, ranks: int | None = None) -> _L:
        """A fresh world: new engine processes, ranks numbered the same way.

        ``ranks`` changes the world size (elastic training: resume from a checkpoint on more or
        fewer ranks); by default it stays the same.
        """
        self._require_running()
        if ranks is not None:
            self.config = self.lifecycle.check_restart(self.config, ranks, self.backend)
        self.cells.drop_held()  # a paused cell's ranks are stopped before their world goes
        self.lifecycle.restart(self.config, self.timings, self._adopt)
        return self

    def _adopt(self, world: World) -> None:
        """The new world's backend (``auto`` resolved) and note, before the observers hear of it."""
        self.backend, self.note = world.backend, world.note
        if self.config.debug:
            from .mismatch import checked_start_note, installed_version

            said = checked_start_note(world.backend, installed_version("torch"))
            self.note = "; ".join(n for n in (self.note, said) if n)
        self.linter.forget()  # new namespaces: no earlier cell's model or function is on the ranks

    @exclusive
    def stop(self) -> None:
        """Stop engines and controller and make sure their processes are gone.

        Companions stop first; one that fails to stop does not keep this lab running: its error
        is raised once this lab is stopped."""
        errors = self.companions.stop_all()
        self.cells.drop_held()  # a paused cell ends with its ranks
        try:
            self.lifecycle.stop(self.config)
        finally:
            if errors:
                raise errors[0]

    def stop_unless_busy(self, still: Callable[[], bool]) -> bool:
        """From another thread: stop the lab unless it is starting, stopping or running a cell (its
        companions too), and only if ``still()`` holds once that is known; whether it stopped."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if not self.running or not still():
                return False
            self.stop()
            return True
        finally:
            self.lock.release()

    def detach(self) -> None:
        """Let go of a kept lab: its ranks go on, for ``distlab.attach()`` in another kernel (this one
        no longer drives them). A kept lab is let go of so when its kernel ends."""
        if not self.config.keep:
            raise LabUsageError("only a kept lab can be let go of: start it with keep=True (%dist start --keep)")
        if self.running:
            self.lifecycle.detach(self.config)

    def take_back(self, record: dict[str, Any]) -> None:
        """Reconnect to a kept lab's controller and ranks (``kept.attach``), and hold it from this process."""
        started = record.get("started") or time.time()

        def adopt(world: World) -> None:
            self.backend, self.started_at = world.backend, started

        self.lifecycle.take_back(record, self.config, adopt)

    def __enter__(self: _L) -> _L:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<Lab {state}: {self.world_size} ranks, backend={self.backend}, launcher={self.launcher}>"

    # ------------------------------------------------------------------ ranks

    def _require_running(self) -> None:
        if not self.running:
            raise LabUsageError("no lab is running: start one with %dist start -n 2 (or distlab.start(2))")

    def ranks(self, spec: Ranks = None) -> list[int]:
        """Parse a rank selection ('0,2-3', 1, [0, 1], None for all) against this world."""
        return self.world.ranks(spec, self.world_size)

    @property
    def table(self) -> RankTable:
        return self.world.table

    @exclusive
    def status(self) -> RankTable:
        """The rank table, each rank's health checked now: ok, busy or dead."""
        self._require_running()
        return self.lifecycle.status(self.network.caption())

    def kill(self, rank: int) -> None:
        """Fault injection: hard-kill one rank's engine process (SIGKILL), as a crash would."""
        self._require_running()
        (rank,) = self.ranks(rank)
        self.processes.kill(self.table[rank])

    @property
    def whole(self) -> bool:
        """Whether every rank is alive: registered with the controller and, on this machine, its process
        there (a killed rank is gone at once; the controller notices at its next missed heartbeats)."""
        return self.running and self.processes.whole(self.table)

    @property
    def spares(self) -> int:
        """How many spare engines the lab holds now (forked; registered or about to be)."""
        return len(self.processes.spares)

    def companion(self, name: str, ranks: int, backend: str = "gloo") -> LabCore:
        """A lab of ``ranks`` ranks this one keeps for its own purposes (an exercise's grader): started
        on first use, restarted at another size or when one of its ranks died, stopped with this lab.
        A plain core: no panel entry, no dashboard, no progress bars."""
        self._require_running()
        return self.companions.get(name, ranks, backend)

    # ------------------------------------------------------------------ cells

    @exclusive
    def run(
        self, code: str, ranks: Ranks = None, timeout: float | None = None, stream: bool = True,
        want: str = "value", record: bool = True, strict: bool = False,
    ) -> RunResult:
        """Run ``code`` on the given ranks (all by default), its output streamed labelled by rank:
        {rank: value of the last expression}. A failure raises RankError naming the ranks (identical
        failures grouped); ranks still running are stopped and a broken group rebuilt. ``timeout``
        (seconds) bounds the cell; a kernel interrupt stops it on every rank. ``record=False`` leaves
        it out of :meth:`export` (distlab's own code); ``strict`` refuses a cell the lint faults."""
        self._require_running()
        self.cells.refuse_while_paused("run a cell")
        selected = self.ranks(ranks)
        if isinstance(code, str):  # anything else: the runner says what is wrong
            self.linter.admit(code, strict)
        return self.breakpoints.ran(self.cells.run(code, selected, timeout, stream, want, record))

    # ------------------------------------------------------------------ breakpoints

    @exclusive
    def pause(
        self, at: int | None = None, op: str | None = None, group: str | None = None, line: int | None = None,
        timeout: float = 600.0,
    ) -> None:
        """Arm the next cell to stop every rank just before a collective: the ``at``-th of the cell
        (from 1) among those of ``op`` (``"all_gather"``), on ``group`` (torch's name: ``"mesh_tp"``),
        from the cell's ``line`` (None: any). Its ``run`` returns once every rank still in it waits
        there, :attr:`paused` saying where; ``pull`` reads the paused frames. With no word for
        ``timeout`` seconds the cell goes on; a breakpoint never reached is said in its output."""
        self._require_running()
        self.breakpoints.arm(at, op, group, line, timeout)

    def unpause(self) -> None:
        """Disarm the breakpoint ``pause`` armed, before its cell runs."""
        self.breakpoints.disarm()

    @property
    def paused(self) -> Pause | None:
        """None, or the :class:`~distlab.notebook.pause.Pause` the cell held now waits at: each rank's
        collective, group, line, and the shapes, dtypes, norms and hashes of what it would send."""
        return self.breakpoints.paused

    @exclusive
    def step(self) -> Pause | None:
        """Every paused rank launches its collective and stops before its next one: the new Pause, or
        None once the cell has ended (its output shown; a failure raised as ``run`` raises it)."""
        self._require_running()
        return self.breakpoints.step()

    @exclusive
    def cont(self) -> RunResult:
        """Let the paused cell run to its end: returns what ``run`` would have returned."""
        self._require_running()
        return self.breakpoints.cont()

    def set_every_cell(self, on: bool) -> None:
        """Tell the side panel (through the observers) whether the notebook's plain cells run here."""
        self.every_cell = on
        self.bus.tell("changed")

    def lint(self, code: str) -> list[Finding]:
        """:func:`distlab.lint` of ``code``, knowing what earlier cells left on the ranks; runs nothing."""
        checks.instance("code", code, str, what="a string of Python")
        return self.linter.check(code, remember=False)

    @exclusive
    def call(self, send: Send, ranks: Ranks = None, timeout: float | None = None) -> RunResult:
        """distlab's own call on the given ranks (all by default), through a cell's path: the deadline,
        SIGINT, releasing stuck ranks, recovery; nothing streamed, nothing recorded for export.
        ``send(engine, rank)`` sends it to one rank (an ``rpc`` function); raises as :meth:`run` does."""
        self._require_running()
        return self.cells.call(send, self.ranks(ranks), timeout)

    @exclusive
    def push(self, ranks: Ranks = None, **names: Any) -> None:
        """Copy names into the namespace of the given ranks (all by default)."""
        self._require_running()
        self.cells.push(self.ranks(ranks), names)

    @exclusive
    def pull(self, name: str, ranks: Ranks = None) -> dict[int, Any]:
        """{rank: value of ``name``} from the given ranks (all by default)."""
        self._require_running()
        return self.cells.pull(name, self.ranks(ranks))

    @exclusive
    def run_script(
        self, path: str | Any, args: Iterable[str] = (), timeout: float | None = None, stream: bool = True
    ) -> RunResult:
        """Run a torchrun script on every rank as ``__main__``, unchanged (``%dist run``): ``sys.argv``
        is ``[path, *args]``, the environment has torchrun's variables, its ``init_process_group``
        joins the lab's group and ``destroy_process_group()`` leaves it up. The text is sent from here
        (the ranks need not share this machine's files); a failure raises as a cell's does, naming the
        script's lines; its names stay on the ranks. {rank: None}, with ``.stdout`` and ``.stderr``."""
        self._require_running()
        return self.cells.run_script(path, args, timeout, stream)

    @property
    def history(self) -> tuple[Event, ...]:
        """What ran, in order: cells that succeeded, pushes, scripts, restarts (``script.Event``)."""
        return self.cells.history

    def export(self, path: str | Any) -> str:
        """Write the cells that succeeded, in order, as a script ``torchrun --standalone
        --nproc_per_node=N path`` runs as it is; its path. What it cannot carry (pushed names, cells
        on some ranks only, IPython-only lines) is said in its comments and in a UserWarning."""
        self._require_running()
        return self.cells.export(path, self.backend)

    def postmortem(self, rank: int | None = None) -> Postmortem:
        """A failed rank's frames, the failing one last, its locals summarised (tensors by shape, dtype,
        device and statistics; modules by class and size; the rest briefly), read from the traceback
        the rank keeps until its next cell (``%dist debug``). No ``rank``: the first that failed in
        the last cell by itself. A rank that keeps none raises DistlabError saying why."""
        self._require_running()
        return self.cells.postmortem(rank)

    # -------------------------------------------------------------- views, from outside

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(pending, final)`` on every poll of a running cell, in the caller's thread, in
        the order added: ``pending`` maps rank -> AsyncResult (``ar.data``: what it last published);
        ``final`` is True once, at the cell's end. A listener must be quick and must not raise."""
        self.bus.add_listener(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling a listener :meth:`add_listener` added (one not there is ignored)."""
        self.bus.remove_listener(listener)

    def observe(self, observer: LabObserver) -> None:
        """Tell ``observer`` when this lab starts, restarts, changes and stops, and wrap each cell
        in its ``cell`` context (``observers.LabObserver``): how views attach to a lab."""
        self.bus.observe(observer)


"""LabCore: N torch.distributed ranks, each an ipyparallel engine, driven from the notebook.

The core of a lab, and nothing of its views: a short class that holds its collaborators as named
fields, each built here with what it needs, and hands each job to the one that owns it. Views attach
from outside, through its observer bus (``observers``); ``front.lab.Lab`` (a package above
the views, which import this one) is the core with them attached.

- ``processes``: the cluster, client, network, folder, spares and guard (``processes.LabProcesses``);
- ``world``: the rank table and process group, formed and rebuilt (``lab_world.LabWorld``);
- ``cells``: what runs on the ranks, what ran, and recovery after a failed cell (``cells.CellRunner``);
- ``healer``: torchft's lighthouse, replacement ranks, one group again (``healing.Healer``);
- ``network``: the links between emulated nodes (``nodes.NetworkControls``);
- ``stacks``: where each rank is, read from outside (``stacks.StacksReader``);
- ``keeper``: a kept lab's record, letting go and taking back (``keeper.Keeper``);
- ``bus``: the observers and poll listeners views attach as (``observers.ObserverBus``);
- ``lifecycle``: the order in which they are asked at a start, restart and stop (``lifecycle.Lifecycle``);
- ``linter``: what earlier cells left on the ranks, for the lint of the next (``cell_lint.CellLinter``).

``config`` is the checked configuration (``config.LabConfig``, the one place its fields are written).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

from .. import checks
from ..errors import LabUsageError
from .cell_context import RunResult, Send
from .cell_lint import CellLinter, Finding
from .cells import CellRunner
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
        #: When the lab started: seconds since the epoch.
        self.started_at: float | None = None
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
        self.bus.observe(self.healer.records)  # each healing cell's record: ``heals()``
        # What earlier cells left on the ranks that makes a call a collective (a sharded model, a
        # function that all-reduces), for the lint of the cells after them; a new world forgets it.
        self.linter = CellLinter()
        self.every_cell = False  # the notebook runs its plain cells here (%dist auto on): the panel says so
        # Labs this one keeps for its own purposes (an exercise's grader): they stop with it.
        self.companions: dict[str, LabCore] = {}

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
            from .mismatch import checked_start_note

            said = checked_start_note(world.backend, _installed("torch"))
            self.note = "; ".join(n for n in (self.note, said) if n)
        self.linter.forget()  # new namespaces: no earlier cell's model or function is on the ranks

    @exclusive
    def stop(self) -> None:
        """Stop engines and controller and make sure their processes are gone.

        Companions stop first; one that fails to stop does not keep this lab running: its error
        is raised once this lab is stopped."""
        companions, self.companions = list(self.companions.values()), {}
        errors: list[BaseException] = []
        for companion in companions:
            try:
                companion.stop()
            except Exception as exc:  # noqa: BLE001 - raised below, after this lab has stopped
                errors.append(exc)
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
        if not self.running:
            return False
        registered = self.processes.registered()
        return all(self.processes.alive(info, registered) for info in self.table)

    @property
    def spares(self) -> int:
        """How many spare engines the lab holds now (forked; registered or about to be)."""
        return len(self.processes.spares)

    def companion(self, name: str, ranks: int, backend: str = "gloo") -> LabCore:
        """A lab of ``ranks`` ranks this one keeps for its own purposes (an exercise's grader): started
        on first use, restarted at another size or when one of its ranks died, stopped with this lab.
        A plain core: no panel entry, no dashboard, no progress bars."""
        self._require_running()
        lab = self.companions.get(name)
        if lab is None or not lab.running:
            lab = LabCore(ranks=ranks, backend=backend, timeout=self.config.timeout)
            lab.lock = self.lock
            self.companions[name] = lab.start()
        elif lab.world_size != ranks or not lab.whole:
            lab.restart(ranks=ranks)
        return lab

    # ------------------------------------------------------------------ cells

    @exclusive
    def run(
        self, code: str, ranks: Ranks = None, timeout: float | None = None, stream: bool = True,
        want: str = "value", record: bool = True, strict: bool = False,
    ) -> RunResult:
        """Run ``code`` on the given ranks (all by default) and wait for it.

        Each rank's output is printed as it arrives, labelled by rank. Returns {rank: value of the
        last expression}. If any rank fails, raises RankError naming the ranks, with identical
        failures grouped; ranks still running are stopped, and a broken process group is rebuilt.
        ``timeout`` (seconds) bounds the whole cell; Ctrl-C / kernel interrupt stops it on every rank.
        A cell that succeeds is kept for :meth:`export`; ``record=False`` leaves it out (code run for
        distlab's own purposes, such as a quiz's check). ``strict``: a cell the lint finds fault with
        (:meth:`lint`) is refused, and nothing runs.
        """
        self._require_running()
        self.cells.refuse_while_paused("run a cell")
        selected = self.ranks(ranks)
        if isinstance(code, str):  # anything else: the runner says what is wrong
            self.linter.admit(code, strict)
        result = self.cells.run(code, selected, timeout, stream, want, record)
        if result.paused is not None:
            self.bus.tell("changed")  # the side panel shows the pause
        return result

    # ------------------------------------------------------------------ breakpoints

    @exclusive
    def pause(
        self, at: int | None = None, op: str | None = None, group: str | None = None, line: int | None = None,
        timeout: float = 600.0,
    ) -> None:
        """Arm the next cell (``run``, ``%%ddp``) to stop every rank just before a collective: the
        ``at``-th of the cell (from 1) among those that are ``op`` (``"all_gather"``, ...), run on
        ``group`` (as torch describes it: ``"default_pg"``, ``"mesh_tp"``) and launched from the cell's
        ``line``; each left None matches any. That cell's ``run`` returns once every rank still in it
        waits there, with :attr:`paused` the :class:`~distlab.notebook.pause.Pause`; meanwhile
        ``pull`` reads the paused cell's names. A pause that hears nothing for ``timeout`` seconds
        lets the cell go on. A breakpoint the cell never reaches is said in its output."""
        from .pause import breakpoint_of

        self._require_running()
        self.cells.refuse_while_paused("arm another breakpoint")
        checks.positive("timeout", timeout, example="timeout=600")
        self.cells.pause(breakpoint_of(at, op, group, line, timeout))

    def unpause(self) -> None:
        """Disarm the breakpoint ``pause`` armed, before its cell runs."""
        self.cells.pause(None)

    @property
    def paused(self) -> Pause | None:
        """None, or the :class:`~distlab.notebook.pause.Pause` the cell held now waits at: each rank's
        collective, group, line, and the shapes, dtypes, norms and hashes of what it would send."""
        return self.cells.paused

    @exclusive
    def step(self) -> Pause | None:
        """Every paused rank launches its collective and stops before its next one: the new Pause, or
        None once the cell has ended (its output shown; a failure raised as ``run`` raises it)."""
        self._require_running()
        try:
            return self.cells.step()
        finally:
            self.bus.tell("changed")

    @exclusive
    def cont(self) -> RunResult:
        """Let the paused cell run to its end: returns what ``run`` would have returned."""
        self._require_running()
        try:
            return self.cells.cont()
        finally:
            self.bus.tell("changed")

    def set_every_cell(self, on: bool) -> None:
        """Say (to the side panel, through the observers) whether the notebook's plain cells run here."""
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
        self.cells.refuse_while_paused("run distlab's own call on the ranks")
        return self.cells.call(send, self.ranks(ranks), timeout)

    @exclusive
    def push(self, ranks: Ranks = None, **names: Any) -> None:
        """Copy names into the namespace of the given ranks (all by default)."""
        self._require_running()
        self.cells.refuse_while_paused("push")
        self.cells.push(self.ranks(ranks), names)

    @exclusive
    def pull(self, name: str, ranks: Ranks = None) -> dict[int, Any]:
        """{rank: value of ``name``} from the given ranks (all by default)."""
        self._require_running()
        if self.cells.paused is not None:  # the ranks' main threads wait at the pause: read its frames
            return self.cells.read_paused(name, self.ranks(ranks))
        return self.cells.pull(name, self.ranks(ranks))

    @exclusive
    def run_script(
        self, path: str | Any, args: Iterable[str] = (), timeout: float | None = None, stream: bool = True
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
        self._require_running()
        self.cells.refuse_while_paused("run a script")
        return self.cells.run_script(path, args, timeout, stream)

    @property
    def history(self) -> tuple[Event, ...]:
        """What ran, in order: cells that succeeded, pushes, scripts, restarts (``script.Event``)."""
        return self.cells.history

    def export(self, path: str | Any) -> str:
        """Write the cells run so far on every rank as a script torchrun runs as it is; return its path.

        So that what was built in the lab leaves it as a torchrun script: ``torchrun --standalone
        --nproc_per_node=N path`` runs the cells that succeeded, in order, on ranks that start with
        what a lab's rank has. What the script cannot carry (names pushed with :meth:`push`, cells run
        on some ranks only, lines only IPython runs) is said in its comments and in a UserWarning.
        """
        self._require_running()
        return self.cells.export(path, self.backend)

    def postmortem(self, rank: int | None = None) -> Postmortem:
        """A failed rank's frames, the failing one last, each with its locals summarised: ``print(lab.postmortem())``.

        Read from the rank's own traceback, which it keeps from a failed cell until its next cell
        starts: tensors by shape, dtype, device and statistics (min, max, mean, norm, nan/inf),
        modules by class and parameter count, containers by type and length, the rest by a short
        repr. With no ``rank``, the first rank that failed in the lab's last cell (one that raised
        by itself before one distlab stopped). A rank that keeps nothing (its cell succeeded, its
        process died, the world was restarted) raises DistlabError saying which; ``%dist debug``.
        """
        self._require_running()
        return self.cells.postmortem(rank)

    # -------------------------------------------------------------- views, from outside

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(pending, final)`` on every poll of a running cell, in the caller's thread.

        ``pending`` maps rank -> ipyparallel AsyncResult (``ar.data`` holds what the rank last
        published with ``publish_data``); ``final`` is True once, when the cell has ended. Listeners
        run in the order they were added, all after the lab's telemetry store has read the poll.
        A listener must be quick and must not raise.
        """
        self.bus.add_listener(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling a listener :meth:`add_listener` added (one not there is ignored)."""
        self.bus.remove_listener(listener)

    def observe(self, observer: LabObserver) -> None:
        """Tell ``observer`` when this lab starts, restarts, changes and stops, and wrap each cell
        in its ``cell`` context (``observers.LabObserver``): how views attach to a lab."""
        self.bus.observe(observer)


def _installed(package: str) -> str | None:
    """The installed version of ``package`` (the ranks' own, where they share the notebook's
    environment), read from its metadata: the notebook never imports torch."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None

"""LabCore: N torch.distributed ranks, each an ipyparallel engine, driven from the notebook.

The core of a lab, and nothing of its views: it holds the cluster and the world, and hands each job
to the module that owns it. Views (the panel's state file, the dashboard, progress bars) attach
from outside, as observers (``labs.LabObserver``) and poll listeners; ``lab.Lab`` is the core with
them attached. What the lab does after a failed cell is ``recovery``'s decision, carried out here.

- ``config``: the checked configuration;  ``cluster.launch``: the ipyparallel cluster;
- ``world``: the rank table and backend (pure);  ``group``: forming the process group;
- ``cell``: a cell's run;  ``recovery``: diagnosis and repair after a failed cell;
- ``script``: what the lab ran, and the torchrun script made of it (``export``);
- ``cluster.processes``: which processes are ours, and ending them;  ``release``: freeing stuck ranks;
- ``cluster.nodes``: emulated nodes (network namespaces) and the links between them;
- ``postmortem``: a failed rank's frames and their locals, as it kept them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from ..cluster.gpus import local_gpus
from ..cluster.launch import (
    controller_address,
    controller_start_args,
    guard_iopub,
    link_client_sockets,
    make_cluster,
)
from ..cluster.lighthouse import Lighthouse
from ..cluster.nodes import Network
from ..cluster.processes import ProcessGuard, machine_id, pid_alive, signal_all, terminate, wait_for
from ..errors import LabUsageError, parse_ranks
from . import kept, labs, rpc
from .cell import Listener, RunResult
from .cells import RunsCells, exclusive
from .config import LabConfig
from .group import form_group, get
from .healing import HealsRanks
from .labs import LabObserver
from .nodes import HasNodes
from .postmortem import LastCell
from .release import Releaser
from .script import Event, Restarted
from .spares import KeepsSpares
from .stacks import ReadsStacks
from .world import RankInfo, RankTable, World, check_gpus, plan_world

__all__ = ["LabCore", "RankInfo", "RankTable", "RunResult"]


class LabCore(RunsCells, HealsRanks, HasNodes, KeepsSpares, ReadsStacks, kept.KeepsItself):
    """N ranks of torch.distributed, each an ipyparallel engine, ready to run cells; no views.

    ``distlab.start`` gives a :class:`distlab.notebook.lab.Lab`, this core with its views attached.
    A lab is also a context manager that stops everything it started on exit.
    """

    def __init__(
        self, ranks: int = 2, backend: str = "auto", timeout: float = 30.0, launcher: str = "local",
        debug: bool = False, nodes: int | None = None, link: str | None = None,
        latency: str | float | None = None, subnet: str | None = None, heal: bool = False,
        spares: int | None = None, racks: int | None = None, uplink: str | None = None, keep: bool | float = False,
    ) -> None:
        self._configure(LabConfig(
            ranks=ranks, backend=backend, timeout=timeout, launcher=launcher, debug=debug,
            nodes=nodes, link=link, latency=latency, subnet=subnet, heal=heal, spares=spares,
            racks=racks, uplink=uplink, keep=keep,
        ))

    @classmethod
    def from_config(cls, config: LabConfig) -> Any:
        """A lab of an already checked configuration (what ``%dist start`` builds)."""
        lab = cls.__new__(cls)
        lab._configure(config)
        return lab

    def _configure(self, config: LabConfig) -> None:
        self.config = config
        #: Backend in use once started (``auto`` resolved), else the one asked for.
        self.backend = self.config.backend
        self.world_size = self.config.ranks
        self._cluster: Any = None  # ipyparallel.Cluster
        self._client: Any = None  # ipyparallel.Client
        self._engines: dict[int, rpc.Engine] = {}  # engine id -> what cells send to it (``cell.CellContext.engine``)
        self._world: World | None = None
        self._guard = ProcessGuard()
        self._network: Network | None = None  # the emulated nodes, when config.nodes is set
        self._folder: str | None = None  # the lab's own files (the controller's sockets on nodes, logs)
        self._lighthouse: Lighthouse | None = None  # torchft's, in a lab that heals
        self._releaser = Releaser()
        self._listeners: list[Listener] = []
        self._observers: list[LabObserver] = []
        self.timings: dict[str, float] = {}
        self.note = ""
        self._phase_start = 0.0
        # What ran, in order (cells that succeeded, pushes, scripts, restarts): what export writes.
        self._history: list[Event] = []
        # Which ranks the last cell ran on, failed on, killed (``postmortem``); None before the world's first.
        self._last_cell: LastCell | None = None
        self._cell_source = ""  # the running (or last) cell's code: its lines in live stacks
        # Labs this one keeps for its own purposes (an exercise's grader): they stop with it.
        self._companions: dict[str, LabCore] = {}
        # In a lab that heals, what lab.push gave every rank: a replacement is given it too.
        self._pushed: dict[str, Any] = {}
        self._spares: dict[int, str] = {}  # pid -> engine set: engines ready to become ranks (``spares``)
        self._retired: set[int] = set()  # engine ids of ranks that are gone
        # Held while the lab starts, restarts, stops or gives its ranks work (``cells.exclusive``), and by another
        # thread that stops it (``stop_unless_busy``). Reentrant; a companion shares its lab's.
        self._lock = threading.RLock()
        #: When the lab started, and when its last cell (or call on its ranks) ended: seconds since the epoch.
        self.started_at: float | None = None
        self.last_cell_at: float | None = None

    # The configuration, as attributes (the magics and tests read them).
    timeout = property(lambda self: self.config.timeout)
    launcher = property(lambda self: self.config.launcher)
    debug = property(lambda self: self.config.debug)
    requested_backend = property(lambda self: self.config.backend)

    # ----------------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        return self._cluster is not None

    @exclusive
    def start(self) -> Any:
        """Start the controller and engines, build the rank table, initialise the process group."""
        if self.running:
            raise LabUsageError("this lab is already running: stop it first, or use restart()")
        if self.config.launcher == "local":
            check_gpus(self.world_size, self.config.backend, _local_gpus(self.config.backend))
        t0 = self._phase_start = time.perf_counter()
        self.started_at, self.last_cell_at = time.time(), None
        labs.add(self)  # stopped at the interpreter's exit, if still running
        self._history, self._pushed = [], {}
        self._spares, self._retired = {}, set()
        self._last_cell = None
        try:
            if self.config.nodes or self.config.heal:
                self._folder = tempfile.mkdtemp(prefix=f"distlab-lab-{os.getpid()}-")
            if self.config.nodes:
                self._network = Network.create(
                    self.config.nodes, self.config.node_link(), self.config.subnet,
                    racks=self.config.racks, uplink=self.config.rack_uplink(),
                )
                self._phase("network_s")
            self._cluster = make_cluster(
                self.world_size, self.config.launcher, self.config.local, self.timeout, self._network, self._folder,
                warm_ok=not self.config.keep,
            )
            self._cluster.start_controller_sync(**controller_start_args(self._network))
            self._guard.watch(
                self._cluster, folders=[self._folder] if self._folder else [],
                namespaces=self._network.namespaces() if self._network else [], keep=self._keep_watch(),
            )
            self._phase("controller_s")
            if self.config.heal:
                self._start_lighthouse()
            ids = self._gather_engines(self.world_size)
            self._phase("engines_s")
            self._build_world(ids)
            if self.config.keep:
                kept.write(self)
        except BaseException:
            self.stop()
            raise
        self.timings["ready_s"] = time.perf_counter() - t0
        self._top_up_spares()
        self._tell("started")
        return self

    def _connect_client(self) -> None:
        """The notebook's ipyparallel client of the lab's controller (once its engines are starting)."""
        if self._folder is not None:
            link_client_sockets(self._cluster, self._folder, self.timeout)
        self._client = self._cluster.connect_client_sync()
        self._engines = {}
        guard_iopub(self._client)

    def _build_world(self, ids: list[int]) -> None:
        """Rank table (of engines ``ids``), device checks, rendezvous, process group, and the ranks' namespace."""
        client = self._client
        network = self._network
        identities = get(rpc.describe(client.direct_view(ids), self._controller_ip()), self.timeout,
                         "describing the engines")
        self._phase("describe_s")  # includes engines finishing their import of torch
        nodes = [network.hostname(i) for i in range(network.nodes)] if network else []
        self._world = plan_world(dict(zip(ids, identities)), self.world_size, self.config.backend, host_order=nodes)
        self.backend = self._world.backend
        self._claim_spares(r.pid for r in self._world.table)
        #: What the choice of backend and devices needs said (ranks sharing a GPU over gloo), or "".
        self.note = self._world.note
        form_group(client, self._world, self.timeout, self.debug, rebuild=False, healing=self._healing)
        self._phase("process_group_s")  # rendezvous, init_process_group, first all-reduce
        self._releaser.listen(client, self._world.table, self.timeout)
        self._guard.adopt_engine_helpers(self._local_pids())
        # Let names defined in the notebook (functions, classes) travel to the ranks by value.
        client.direct_view(ids).use_cloudpickle().get(timeout=self.timeout)
        self._phase("namespace_s")

    def _controller_ip(self) -> str:
        """The address ranks reach the controller (and the lab's lighthouse) at: the switch's on emulated
        nodes. Each engine's own address is the one its traffic there leaves from: how the others reach it."""
        return self._network.switch_addr if self._network else controller_address(self._cluster)

    def _phase(self, name: str) -> None:
        """Record how long the phase that just ended took (start-up is measured phase by phase)."""
        now = time.perf_counter()
        self.timings[name] = now - self._phase_start
        self._phase_start = now

    @exclusive
    def restart(self, ranks: int | None = None) -> Any:
        """A fresh world: new engine processes, ranks numbered the same way.

        ``ranks`` changes the world size (elastic training: resume from a checkpoint on more or
        fewer ranks); by default it stays the same.
        """
        self._require_running()
        if ranks is not None:
            new = replace(self.config, ranks=ranks)  # checked as the lab's own config is
            if new.launcher == "local":
                check_gpus(ranks, self.backend, _local_gpus(self.backend))
            self.config, self.world_size = new, ranks
        t0 = self._phase_start = time.perf_counter()
        old_ids = frozenset(r.engine_id for r in self.table)
        old_pids = self._local_pids()
        # Ranks on other machines are ended by their launcher: their engine sets are stopped.
        elsewhere = len(old_pids) < len(self.table)
        old_sets = [name for name in self._cluster.engines if name not in self._spares.values()] if elsewhere else []
        # The old world exits (each rank as it would on its own: buffers flushed, exit handlers run)
        # while the new one forms, on spares where the lab keeps them (else on engines started now);
        # the restart returns once the new world works, and the old one's end is seen to in the
        # background (its engine sets are ipyparallel's until the lab stops).
        signal_all(old_pids, signal.SIGTERM)
        self._guard.end_engines_soon(old_pids)
        self._retired |= old_ids
        self._world, self._last_cell, self._pushed = None, None, {}
        try:
            self._build_world(self._gather_engines(self.world_size))
            for engine_set in old_sets:
                self._cluster.stop_engines_sync(engine_set)
            if self.config.keep:
                kept.write(self)
        except BaseException:
            self.stop()
            raise
        self.timings["restart_s"] = time.perf_counter() - t0
        self._top_up_spares()
        self._history.append(Restarted(self.world_size))
        self._tell("restarted")
        return self

    @exclusive
    def stop(self) -> None:
        """Stop engines and controller and make sure their processes are gone.

        Companions stop first; one that fails to stop does not keep this lab running: its error
        is raised once this lab is stopped."""
        companions, self._companions = list(self._companions.values()), {}
        errors: list[BaseException] = []
        for companion in companions:
            try:
                companion.stop()
            except Exception as exc:  # noqa: BLE001 - raised below, after this lab has stopped
                errors.append(exc)
        try:
            self._stop_own()
        finally:
            if errors:
                raise errors[0]

    def _stop_own(self) -> None:
        if self.config.keep:
            kept.remove(self)
        cluster, self._cluster = self._cluster, None
        if cluster is None:
            self._remove_network()  # a start that failed before its cluster existed
            labs.remove(self)
            return
        self._adopt_spare_helpers()
        spares, self._spares = list(self._spares), {}
        signal_all(spares, signal.SIGKILL)  # idle engines: nothing of theirs to flush or wait for
        pids = self._local_pids() + spares
        pgids = self._guard.pgids()
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
            self._engines = {}
        terminate(pids)  # all at once: ipyparallel's stop goes one engine at a time
        with contextlib.suppress(Exception):
            cluster.stop_cluster_sync()
        self._guard.end_all(pgids, pids)  # trust the processes, not the call
        self._stop_lighthouse()
        self._world = None
        self._remove_network()
        self._guard.close()  # last: the watchdog covers everything above if the notebook dies mid-stop
        labs.remove(self)
        self._tell("stopped")

    def _remove_network(self) -> None:
        """The nodes, switch and links go (after the processes in them), and the lab's folder."""
        network, self._network = self._network, None
        if network is not None:
            network.destroy()
        folder, self._folder = self._folder, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> Any:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<Lab {state}: {self.world_size} ranks, backend={self.backend}, launcher={self.launcher}>"

    # ------------------------------------------------------------------ ranks and data

    def _require_running(self) -> None:
        if not self.running:
            raise LabUsageError("no lab is running: start one with %dist start -n 2 (or distlab.start(2))")

    def _on_this_machine(self, info: RankInfo) -> bool:
        """Whether the rank's process runs on this machine (in any namespace): then it is signalled directly."""
        return info.machine == machine_id()

    def _local_pids(self) -> list[int]:
        return [r.pid for r in self.table if self._on_this_machine(r)]

    def ranks(self, spec: str | int | Iterable[int] | None = None) -> list[int]:
        """Parse a rank selection ('0,2-3', 1, [0, 1], None for all) against this world."""
        if spec is None:
            return list(range(self.world_size))
        return parse_ranks(spec, self.world_size)

    @property
    def table(self) -> RankTable:
        return RankTable(self._world.table if self._world is not None else ())

    @exclusive
    def status(self) -> RankTable:
        """The rank table, each rank's health checked now: ok, busy or dead."""
        self._require_running()
        registered = set(self._client.ids)
        alive = [r.engine_id for r in self.table if r.engine_id in registered]
        queue = self._client.queue_status(targets=alive) if alive else {}
        rows = RankTable(caption=self._network_caption())
        for r in self.table:
            if r.engine_id not in registered or (self._on_this_machine(r) and not pid_alive(r.pid)):
                health = "dead"
            elif isinstance(queue.get(r.engine_id), dict) and queue[r.engine_id].get("tasks"):
                health = "busy"
            else:
                health = "ok"
            rows.append(replace(r, health=health))
        return rows

    def kill(self, rank: int) -> None:
        """Fault injection: hard-kill one rank's engine process (SIGKILL), as a crash would."""
        self._require_running()
        (rank,) = parse_ranks(rank, self.world_size)
        info = self.table[rank]
        if self._on_this_machine(info):
            with contextlib.suppress(ProcessLookupError):
                os.kill(info.pid, signal.SIGKILL)
            wait_for(lambda: not pid_alive(info.pid), 5.0)
        else:
            self._client.send_signal(signal.SIGKILL, targets=[info.engine_id], block=True)

    # -------------------------------------------------------------- views, from outside

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(pending, final)`` on every poll of a running cell, in the caller's thread.

        ``pending`` maps rank -> ipyparallel AsyncResult (``ar.data`` holds what the rank last
        published with ``publish_data``); ``final`` is True once, when the cell has ended. Listeners
        run in the order they were added, all after the lab's telemetry store has read the poll.
        A listener must be quick and must not raise.
        """
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling a listener :meth:`add_listener` added (one not there is ignored)."""
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def observe(self, observer: LabObserver) -> None:
        """Tell ``observer`` when this lab starts, restarts, changes and stops, and wrap each cell
        in its ``cell`` context (``labs.LabObserver``): how views attach to a lab."""
        self._observers.append(observer)

    def _tell(self, event: str) -> None:
        for observer in list(self._observers):
            getattr(observer, event)(self)

    # ---------------------------------------------------- for distlab's own code (graders)

    @property
    def whole(self) -> bool:
        """Whether every rank is alive: registered with the controller and, on this machine, its process
        there (a killed rank is gone at once; the controller notices at its next missed heartbeats)."""
        if not self.running:
            return False
        registered = set(self._client.ids)
        return all(
            info.engine_id in registered and (not self._on_this_machine(info) or pid_alive(info.pid))
            for info in self.table
        )

    def companion(self, name: str, ranks: int, backend: str = "gloo") -> LabCore:
        """A lab of ``ranks`` ranks this one keeps for its own purposes (an exercise's grader): started
        on first use, restarted at another size or when one of its ranks died, stopped with this lab.
        A plain core: no panel entry, no dashboard, no progress bars."""
        self._require_running()
        lab = self._companions.get(name)
        if lab is None or not lab.running:
            lab = LabCore(ranks=ranks, backend=backend, timeout=self.config.timeout)
            lab._lock = self._lock
            self._companions[name] = lab.start()
        elif lab.world_size != ranks or not lab.whole:
            lab.restart(ranks=ranks)
        return lab


def _local_gpus(backend: str) -> int | None:
    # Only NCCL needs them; counted from the driver, never by torch (cluster/gpus.py says why).
    return local_gpus() if backend == "nccl" else 0

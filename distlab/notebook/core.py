"""Lab: N torch.distributed ranks, each an ipyparallel engine, driven from the notebook.

The Lab is the product's surface (``distlab.start``, ``%dist``, the side panel all act through it)
and a thin one: it holds the cluster and the world, and hands each job to the module that owns it:

- ``config``: the checked configuration;  ``cluster.launch``: the ipyparallel cluster;
- ``world``: the rank table and backend (pure);  ``group``: forming the process group;
- ``cell``: a cell's run;  ``recovery``: diagnosis and repair after a failed cell;
- ``script``: what the lab ran, and the torchrun script made of it (``export``);
- ``cluster.processes``: which processes are ours, and ending them;  ``release``: freeing stuck ranks;
- ``cluster.nodes``: emulated nodes (network namespaces) and the links between them;
- ``postmortem``: a failed rank's frames and their locals, as it kept them.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import tempfile
import time
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from ..cluster.gpus import local_gpus
from ..cluster.launch import (
    controller_address,
    controller_start_args,
    engine_start_args,
    guard_iopub,
    link_client_sockets,
    make_cluster,
)
from ..cluster.nodes import Link, Network
from ..cluster.processes import ProcessGuard, machine_id, pid_alive, terminate, wait_for
from ..dashboard.autoshow import prewarm as prewarm_dashboard
from ..errors import CellTimeout, DistlabError, LabUsageError, RankError, RankFailure, parse_ranks
from ..server import registry
from . import recovery, rpc
from .cell import CellContext, CellRun, Listener, RunResult, Send
from .config import LabConfig
from .group import form_group, get
from .postmortem import MAX_FRAMES, MAX_LOCALS, LastCell, Postmortem, first_failed, gone, nothing_kept
from .release import Releaser
from .script import CellRan, Event, Pushed, Restarted, ScriptRan, build_script, export_path, read_script, script_args
from .streams import RankPrinter
from .world import RankInfo, RankTable, World, check_gpus, plan_world

__all__ = ["Lab", "RankInfo", "RankTable", "RunResult", "start"]

_live: weakref.WeakSet[Lab] = weakref.WeakSet()  # stopped at interpreter exit, if still running


class Lab:
    """N ranks of torch.distributed, each an ipyparallel engine, ready to run cells.

    Use :func:`distlab.start` (or ``Lab(...).start()``); a Lab is also a context manager that
    stops everything it started on exit.
    """

    def __init__(
        self, ranks: int = 2, backend: str = "auto", timeout: float = 30.0, launcher: str = "local",
        debug: bool = False, nodes: int | None = None, link: str | None = None,
        latency: str | float | None = None, subnet: str | None = None,
    ) -> None:
        self._configure(LabConfig(
            ranks=ranks, backend=backend, timeout=timeout, launcher=launcher, debug=debug,
            nodes=nodes, link=link, latency=latency, subnet=subnet,
        ))

    @classmethod
    def from_config(cls, config: LabConfig) -> Lab:
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
        self._world: World | None = None
        self._guard = ProcessGuard()
        self._network: Network | None = None  # the emulated nodes, when config.nodes is set
        self._folder: str | None = None  # the lab's own files (the controller's sockets on nodes)
        self._releaser = Releaser()
        self._listeners: list[Listener] = []
        self._telemetry: Any = None  # distlab.dashboard.TelemetryStore, made on first use
        self.timings: dict[str, float] = {}
        self.note = ""
        self._phase_start = 0.0
        # What ran, in order (cells that succeeded, pushes, scripts, restarts): what export writes.
        self._history: list[Event] = []
        # Which ranks the last cell ran on, failed on, killed (``postmortem``); None before the world's first.
        self._last_cell: LastCell | None = None
        # Labs this one started for its own purposes (an exercise's grader): they stop with it.
        self._companions: dict[str, Lab] = {}

    # The configuration, as attributes (the magics and tests read them).
    timeout = property(lambda self: self.config.timeout)
    launcher = property(lambda self: self.config.launcher)
    debug = property(lambda self: self.config.debug)
    requested_backend = property(lambda self: self.config.backend)

    # ----------------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        return self._cluster is not None

    def start(self) -> Lab:
        """Start the controller and engines, build the rank table, initialise the process group."""
        if self.running:
            raise LabUsageError("this lab is already running: stop it first, or use restart()")
        if self.config.launcher == "local":
            check_gpus(self.world_size, self.config.backend, _local_gpus(self.config.backend))
        t0 = self._phase_start = time.perf_counter()
        _stop_at_exit(self)
        self._history = []
        self._last_cell = None
        try:
            if self.config.nodes:
                self._folder = tempfile.mkdtemp(prefix=f"distlab-lab-{os.getpid()}-")
                self._network = Network.create(self.config.nodes, self.config.node_link(), self.config.subnet)
                self._phase("network_s")
            self._cluster = make_cluster(
                self.world_size, self.config.launcher, self.config.local, self.timeout, self._network, self._folder
            )
            self._cluster.start_controller_sync(**controller_start_args(self._network))
            self._guard.watch(
                self._cluster, folders=[self._folder] if self._folder else [],
                namespaces=self._network.namespaces() if self._network else [],
            )
            self._phase("controller_s")
            self._launch_engines()
            self._phase("engines_s")
            self._build_world()
        except BaseException:
            self.stop()
            raise
        self.timings["ready_s"] = time.perf_counter() - t0
        registry.track(self)  # the side panel's view of this lab
        prewarm_dashboard()  # after the ranks are up: the import would compete with their start for the cores
        return self

    def _launch_engines(self) -> None:
        network = self._network
        if network is None:
            self._cluster.start_engines_sync(self.world_size, **engine_start_args(self.config.local))
        else:
            for node, count in enumerate(self.config.ranks_per_node()):
                self._cluster.start_engines_sync(count, **engine_start_args(True, network.exec_prefix(node)))
        self._guard.update()
        if self._client is None:
            if self._folder is not None:
                link_client_sockets(self._cluster, self._folder, self.timeout)
            self._client = self._cluster.connect_client_sync()
            guard_iopub(self._client)
        try:
            self._client.wait_for_engines(self.world_size, timeout=self.timeout, block=True, interactive=False)
        except TimeoutError:
            raise DistlabError(
                f"only {len(self._client.ids)} of {self.world_size} engines registered within {self.timeout:g} s: "
                "check the launcher's logs, or raise --timeout"
            ) from None

    def _build_world(self) -> None:
        """Rank table, device checks, rendezvous, process group, and the ranks' namespace."""
        client = self._client
        ids = sorted(client.ids)[-self.world_size :]
        network = self._network
        # Each engine's address is the one its traffic to the controller leaves from: how the others reach it.
        controller_ip = network.switch_addr if network else controller_address(self._cluster)
        identities = get(rpc.describe(client.direct_view(ids), controller_ip), self.timeout, "describing the engines")
        self._phase("describe_s")  # includes engines finishing their import of torch
        nodes = [network.hostname(i) for i in range(network.nodes)] if network else []
        self._world = plan_world(dict(zip(ids, identities)), self.world_size, self.config.backend, host_order=nodes)
        self.backend = self._world.backend
        #: What the choice of backend and devices needs said (ranks sharing a GPU over gloo), or "".
        self.note = self._world.note
        form_group(client, self._world, self.timeout, self.debug, rebuild=False)
        self._phase("process_group_s")  # rendezvous, init_process_group, first all-reduce
        self._releaser.listen(client, self._world.table, self.timeout)
        self._guard.adopt_engine_helpers(self._local_pids())
        # Let names defined in the notebook (functions, classes) travel to the ranks by value.
        client.direct_view(ids).use_cloudpickle().get(timeout=self.timeout)
        self._phase("namespace_s")

    def _phase(self, name: str) -> None:
        """Record how long the phase that just ended took (start-up is measured phase by phase)."""
        now = time.perf_counter()
        self.timings[name] = now - self._phase_start
        self._phase_start = now

    def restart(self, ranks: int | None = None) -> Lab:
        """A fresh world: new engine processes, ranks numbered the same way.

        ``ranks`` changes the world size (elastic training: resume from a checkpoint on more or
        fewer ranks); by default it stays the same.
        """
        self._require_running()
        if ranks is not None:
            new = replace(self.config, ranks=ranks)  # checked as the lab's own config is
            if new.launcher == "local":
                check_gpus(ranks, self.backend, _local_gpus(self.backend))
            if ranks != self.world_size:
                # Telemetry is per world: the next use makes a store (and dashboard) of the new size.
                self.config, self.world_size, self._telemetry = new, ranks, None
        t0 = self._phase_start = time.perf_counter()
        old_ids = {r.engine_id for r in self.table}
        terminate(self._local_pids())  # all at once: ipyparallel's stop goes one engine at a time
        self._cluster.stop_engines_sync()
        wait_for(lambda: not old_ids & set(self._client.ids), 10.0)
        self._guard.end_engines(self._local_pids())
        self._world, self._last_cell = None, None
        try:
            self._launch_engines()
            self._build_world()
        except BaseException:
            self.stop()
            raise
        self.timings["restart_s"] = time.perf_counter() - t0
        self._history.append(Restarted(self.world_size))
        registry.publish(self)
        return self

    def stop(self) -> None:
        """Stop engines and controller and make sure their processes are gone."""
        for companion in self._companions.values():
            companion.stop()
        self._companions.clear()
        cluster, self._cluster = self._cluster, None
        if cluster is None:
            self._remove_network()  # a start that failed before its cluster existed
            return
        pids = self._local_pids()
        pgids = self._guard.pgids()
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        terminate(pids)  # all at once: ipyparallel's stop goes one engine at a time
        with contextlib.suppress(Exception):
            cluster.stop_cluster_sync()
        self._guard.end_all(pgids, pids)  # trust the processes, not the call
        self._world = None
        self._remove_network()
        _live.discard(self)
        registry.forget(self)

    def _remove_network(self) -> None:
        """The nodes, switch and links go (after the processes in them), and the lab's folder."""
        network, self._network = self._network, None
        if network is not None:
            network.destroy()
        folder, self._folder = self._folder, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> Lab:
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

    def _network_caption(self) -> str:
        network = self._network
        if network is None:
            return ""
        return (
            f"{network.nodes} nodes on {network.subnet}, each linked to a switch at {network.switch_addr}; "
            f"link {network.link or 'not shaped'} (each way, every node's link)"
        )

    # ---------------------------------------------------------------------- the network

    @property
    def link(self) -> Link | None:
        """The link between nodes now (``.rate_bps``, ``.latency_s``; prints as "1gbit"); None where
        nothing is shaped (no nodes, or nodes with an unshaped link)."""
        return self._network.link if self._network is not None else None

    def set_link(self, rate: str | None, latency: str | float | None = None) -> Link | None:
        """Reshape every node's link, both ways, between cells: ``lab.set_link("100mbit")``.

        ``latency`` adds a one-way delay between nodes where the kernel has netem. ``None`` as the
        rate takes the shaping off. Returns the new link.
        """
        self._require_nodes("set_link")
        assert self._network is not None
        config = replace(self.config, link=rate, latency=latency)  # checked as the lab's own config is
        link = config.node_link()
        self._network.set_link(link)
        self.config = config
        registry.publish(self)
        return link

    def link_bytes(self) -> dict[int, int]:
        """{node: bytes it has sent onto its link so far}, as the kernel's queue counted them (frames,
        headers included). Take it before and after a cell to see what crossed the links."""
        self._require_nodes("link_bytes")
        assert self._network is not None
        return self._network.sent_bytes()

    def _require_nodes(self, what: str) -> None:
        self._require_running()
        if self._network is None:
            raise LabUsageError(
                f"{what} needs a lab on emulated nodes: start one like distlab.start(ranks=4, nodes=2, link=\"1gbit\") "
                "(%dist start -n 4 --nodes 2 --link 1gbit)"
            )

    def push(self, ranks: str | int | Iterable[int] | None = None, **names: Any) -> None:
        """Copy names into the namespace of the given ranks (all by default)."""
        self._require_running()
        if not names:
            raise LabUsageError("nothing to push: name the values, like lab.push(lr=0.1)")
        selected = self.ranks(ranks)
        targets = [self.table[r].engine_id for r in selected]
        get(self._client.direct_view(targets).push(names, block=False), self.timeout, "pushing to the ranks")
        self._history.append(Pushed(tuple(names), self._subset(selected)))

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

    # ------------------------------------------------------------------------ cells

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
        result = self._run_on(selected, timeout, stream, lambda engine, rank: rpc.run_cell(engine, code, rank, want))
        if record:
            self._history.append(CellRan(code, self._subset(selected)))
        return result

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
        result = self._run_on(
            self.ranks(), timeout, stream, lambda engine, rank: rpc.run_script(engine, text, full, argv, rank), full
        )
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

    def _subset(self, selected: list[int]) -> tuple[int, ...] | None:
        """None for every rank of the world, else the ranks."""
        return None if selected == list(range(self.world_size)) else tuple(selected)

    def _run_on(
        self, selected: list[int], timeout: float | None, stream: bool, send: Send, filename: str | None = None
    ) -> RunResult:
        """Send the work to the selected ranks, stream their output, and recover from a failure."""
        registered = set(self._client.ids)
        gone = [r for r in selected if self.table[r].engine_id not in registered]
        if gone:
            # The others would only wait for them in the first collective: run the cell nowhere.
            raise RankError(
                {r: RankFailure(r, "EngineError", "the rank's process has died") for r in gone},
                notes=["the cell ran on no rank: %dist restart (lab.restart()) brings a full world back"],
            )
        ctx = self._cell_context()
        cell = CellRun(ctx, selected, send, filename)
        printer = RankPrinter(label_width=len(str(self.world_size - 1))) if stream else None
        from ..dashboard.progress import CellProgress

        progress = CellProgress() if stream else None  # the ranks' tqdm bars: one widget in the output
        if progress is not None:
            self._listeners.append(progress.on_poll)
        try:
            outcome = cell.run(timeout, printer)
        finally:
            if progress is not None:
                self._listeners.remove(progress.on_poll)
                progress.finish()  # the bars' last state, as text
        if outcome.failures:
            world = self._world
            recovery.diagnose(outcome, ctx, selected)
            recovery.recover(outcome, ctx, rebuild_group=self._rebuild_group, restart=self.restart)
            self._last_cell = LastCell.of(selected, outcome, restarted=self._world is not world)
            raise (CellTimeout if outcome.timed_out else RankError)(outcome.failures, notes=outcome.notes)
        self._last_cell = LastCell.of(selected, outcome, restarted=False)
        return cell.result()

    def _cell_context(self) -> CellContext:
        return CellContext(self._client, self.table, self._releaser, self.kill, self._on_poll)

    def _on_poll(self, pending: dict[int, Any], final: bool) -> None:
        # The telemetry store reads what the ranks published before any listener looks at it, even
        # a store made during this cell (by a listener, or anew after a restart at another size).
        if self._telemetry is not None:
            self._telemetry.on_poll(pending, final)
        for listener in self._listeners:
            listener(pending, final)

    def _rebuild_group(self) -> None:
        assert self._world is not None
        form_group(self._client, self._world, self.timeout, self.debug, rebuild=True)

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

    @property
    def telemetry(self) -> Any:
        """What ``distlab.watch(model)`` publishes on the ranks: ``lab.telemetry.records()``.

        A ``distlab.dashboard.TelemetryStore``, made and fed from the first use on; it also picks up
        what earlier cells of this lab published.
        """
        if self._telemetry is None:
            from ..dashboard.store import TelemetryStore

            store = TelemetryStore(self.world_size)
            if self._client is not None:
                store.backfill(list(self._client.metadata.values()))
            self._telemetry = store
        return self._telemetry

    def dashboard(self) -> Any:
        """The live dashboard of this lab's telemetry (ipywidgets + plotly); one per lab."""
        from ..dashboard.view import dashboard_for

        return dashboard_for(self.telemetry)


def start(
    ranks: int = 2, backend: str = "auto", timeout: float = 30.0, launcher: str = "local", debug: bool = False,
    nodes: int | None = None, link: str | None = None, latency: str | float | None = None, subnet: str | None = None,
) -> Lab:
    """Start a lab of ``ranks`` torch.distributed ranks and return it, ready to run cells.

    ``debug=True`` turns on torch's collective checking on every rank (TORCH_DISTRIBUTED_DEBUG=DETAIL):
    mismatched collectives fail at once, named; everything runs slower.

    ``nodes=2, link="1gbit"`` spreads the ranks over emulated nodes: network namespaces on this
    machine, each with its own address, joined to a switch by links shaped to ``link`` both ways
    (``latency="200us"`` adds delay where the kernel has netem). Ranks on one node talk over its
    loopback, ranks on different nodes over the links. Needs root (CAP_NET_ADMIN).
    """
    return Lab(
        ranks=ranks, backend=backend, timeout=timeout, launcher=launcher, debug=debug,
        nodes=nodes, link=link, latency=latency, subnet=subnet,
    ).start()


def _local_gpus(backend: str) -> int | None:
    # Only NCCL needs them; counted from the driver, never by torch (cluster/gpus.py says why).
    return local_gpus() if backend == "nccl" else 0


def _stop_at_exit(lab: Lab) -> None:
    atexit.unregister(_stop_all)  # registered once, however many labs start
    atexit.register(_stop_all)
    _live.add(lab)


def _stop_all() -> None:
    for lab in list(_live):
        with contextlib.suppress(Exception):
            lab.stop()

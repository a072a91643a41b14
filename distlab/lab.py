"""Lab: one ipyparallel cluster whose engines are torch.distributed ranks.

The Lab owns the cluster (controller + engines), the rank table (rank -> engine id, host, pid,
device) and the process group's lifecycle. Magics and the side panel are thin shells over it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from importlib.metadata import entry_points
from typing import Any

import ipyparallel as ipp

from . import _registry
from ._allocator import engine_environment
from ._calls import on_rank
from ._procs import pid_alive as _pid_alive
from ._streams import RankPrinter
from .errors import (
    ABSENT,
    FAILED,
    FINISHED,
    STUCK,
    CellTimeout,
    DistlabError,
    LabUsageError,
    RankError,
    RankFailure,
    diagnose_collectives,
    format_ranks,
    parse_ranks,
)

__all__ = ["BACKENDS", "Lab", "RankInfo", "RankTable", "RunResult", "start"]

BACKENDS = ("auto", "gloo", "nccl")

# ipyparallel's hub finishes an engine's registration only when it has seen its heartbeat; at the
# default 3 s period that is most of a cluster's start-up time (measured: 6.6 s -> 2.2 s for 2
# engines at 500 ms). At 250 ms, 20 misses still give a busy machine 5 s before an engine is
# declared dead (the engine answers pings from a C thread, without the GIL).
HEARTBEAT_MS = 250
HEARTBEAT_MISSES = 20

# After SIGINT, how long ranks get to leave their cell before distlab aborts the process group
# under them, and then how long before it kills them. Together they stay under 2 s.
_INTERRUPT_GRACE_S = 0.8
_ABORT_GRACE_S = 0.8
# When one rank fails while others still run, how long the others get to finish on their own.
_FAILURE_GRACE_S = 0.3
_POLL_S = 0.02
_HEALTH_TIMEOUT_S = 2.0
# How gloo and NCCL word a collective failing because a peer process went away.
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|remote process exited", re.I)

_live_labs: weakref.WeakSet[Lab] = weakref.WeakSet()


@dataclass(frozen=True)
class RankInfo:
    """One row of the rank table."""

    rank: int
    engine_id: int
    host: str
    pid: int
    local_rank: int
    device: str
    backend: str
    addr: str
    health: str = "ok"


class RankTable(list[RankInfo]):
    """The rank table, printed as a table."""

    _COLUMNS = ("rank", "engine_id", "host", "pid", "device", "backend", "health")

    def __str__(self) -> str:
        rows = [self._COLUMNS] + [tuple(str(getattr(r, c)) for c in self._COLUMNS) for r in self]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self._COLUMNS))]
        return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


class RunResult(dict[int, Any]):
    """{rank: value of the cell's last expression (None for a statement)}, plus each rank's output."""

    def __init__(self, values: dict[int, Any], stdout: dict[int, str], stderr: dict[int, str]):
        super().__init__(sorted(values.items()))
        self.stdout = stdout
        self.stderr = stderr


def _launcher_names() -> list[str]:
    return sorted({ep.name for ep in entry_points(group="ipyparallel.engine_launchers")})


def _check_ranks(ranks: Any) -> None:
    if isinstance(ranks, bool) or not isinstance(ranks, int):
        raise LabUsageError(f"ranks must be a whole number >= 1, like ranks=2 (got {ranks!r})")
    if ranks < 1:
        raise LabUsageError(f"ranks must be >= 1 (got {ranks}): start at least one rank, like ranks=2")


def _check_args(ranks: Any, backend: Any, timeout: Any, launcher: Any) -> None:
    """Refuse bad arguments before anything starts; each message names the problem and the fix."""
    _check_ranks(ranks)
    if backend not in BACKENDS:
        raise LabUsageError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    _check_timeout(timeout, "timeout")
    names = _launcher_names()
    if not isinstance(launcher, str) or launcher.lower() not in names:
        raise LabUsageError(f"unknown launcher {launcher!r}: choose one of {', '.join(names)}")


def _check_timeout(timeout: Any, what: str) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise LabUsageError(f"{what} must be a number of seconds > 0, like {what}=30 (got {timeout!r})")


def _check_local_gpus(ranks: int, backend: str) -> None:
    """For engines on this host, catch impossible GPU requests before starting anything."""
    if backend != "nccl":
        return
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        raise LabUsageError("backend nccl needs GPUs and this machine has none: use --backend gloo (or auto)")
    if ranks > gpus:
        raise LabUsageError(
            f"{ranks} GPU ranks but this machine has {gpus} GPUs: start at most -n {gpus}, "
            "or use --backend gloo for CPU ranks"
        )


class Lab:
    """N ranks of torch.distributed, each an ipyparallel engine, ready to run cells.

    Use :func:`distlab.start` (or ``Lab(...).start()``); a Lab is also a context manager that
    stops everything it started on exit.
    """

    def __init__(
        self,
        ranks: int = 2,
        backend: str = "auto",
        timeout: float = 30.0,
        launcher: str = "local",
        debug: bool = False,
    ) -> None:
        _check_args(ranks, backend, timeout, launcher)
        if not isinstance(debug, bool):
            raise LabUsageError(f"debug must be True or False (got {debug!r})")
        self.world_size = ranks
        self.requested_backend = backend
        self.backend = backend
        self.timeout = float(timeout)
        self.launcher = launcher.lower()
        #: torch's collective checking (TORCH_DISTRIBUTED_DEBUG=DETAIL) on every rank.
        self.debug = debug
        self._cluster: ipp.Cluster | None = None
        self._client: ipp.Client | None = None
        self._table: list[RankInfo] = []
        self._master_addr = "127.0.0.1"
        self._reaper: subprocess.Popen[bytes] | None = None
        self._pgid_file: str | None = None
        self._release_dir: str | None = None  # the ranks' release sockets (bootstrap.listen_for_release)
        self._helper_pgids: set[int] = set()  # processes the engines started in sessions of their own
        self.timings: dict[str, float] = {}
        self._phase_start = 0.0
        self._listeners: list[Callable[[dict[int, Any], bool], None]] = []
        self._telemetry: Any = None  # distlab.dashboard.TelemetryStore, made on first use

    # ----------------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        return self._cluster is not None

    def start(self) -> Lab:
        """Start the controller and engines, build the rank table, initialise the process group."""
        if self.running:
            raise LabUsageError("this lab is already running: stop it first, or use restart()")
        if self.launcher == "local":
            _check_local_gpus(self.world_size, self.backend)
        t0 = time.perf_counter()
        # Listen on loopback unless engines may come from other hosts.
        controller_ip = "127.0.0.1" if self.launcher in ("local", "mpi") else ""
        self._cluster = ipp.Cluster(
            n=self.world_size,
            engine_launcher_class=self.launcher,
            controller_ip=controller_ip,
            controller_args=[
                f"--HeartMonitor.period={HEARTBEAT_MS}",
                f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}",
            ],
            delay=0,
            # Engines start at once and wait for the controller's connection file, instead of
            # starting only once the controller is up: their Python start-up overlaps its own.
            send_engines_connection_env=False,
            engine_timeout=max(1, int(self.timeout)),
            # distlab reports dead ranks itself; ipyparallel's warnings would dump engine logs into
            # the notebook. Its default logger in a kernel is the kernel app's, so pass our own.
            log=_ipp_log(),
        )
        _register_atexit()
        _live_labs.add(self)
        try:
            self._phase_start = t0
            self._cluster.start_controller_sync()
            self._start_reaper()
            self._phase("controller_s")
            self._launch_engines()
            self._phase("engines_s")
            self._build_world()
        except BaseException:
            self.stop()
            raise
        self.timings["ready_s"] = time.perf_counter() - t0
        _registry.track(self)  # the side panel's view of this lab
        return self

    def _launch_engines(self) -> None:
        assert self._cluster is not None
        if self.launcher in ("local", "mpi"):
            # Engines on this machine run our entry point, which imports torch while they register.
            # Their malloc keeps freed tensor memory instead of faulting it back in every step.
            extra: dict[str, Any] = {
                "engine_cmd": [sys.executable, "-m", "distlab._engine"],
                "environment": engine_environment(os.environ),
            }
        else:
            # Elsewhere the remote command stays the launcher's own; torch loads after registration.
            extra = {"engine_args": ["--IPEngine.startup_command=import distlab.bootstrap"]}
        self._cluster.start_engines_sync(self.world_size, **extra)
        self._write_pgids()
        if self._client is None:
            self._client = self._cluster.connect_client_sync()
        try:
            self._client.wait_for_engines(self.world_size, timeout=self.timeout, block=True, interactive=False)
        except TimeoutError:
            got = len(self._client.ids)
            raise DistlabError(
                f"only {got} of {self.world_size} engines registered within {self.timeout:g} s: "
                "check the launcher's logs, or raise --timeout"
            ) from None

    def _build_world(self) -> None:
        """Rank table, device checks, rendezvous, process group, and the ranks' namespace."""
        client = self._client
        assert client is not None and self._cluster is not None
        ids = sorted(client.ids)[-self.world_size :]
        controller_ip = self._cluster.controller_ip or "127.0.0.1"
        described = client.direct_view(ids).apply_async(on_rank, "bootstrap", "describe", controller_ip)
        infos = dict(zip(ids, self._get(described, "describing the engines")))
        self._phase("describe_s")  # includes engines finishing their import of torch
        self._table = self._assign_ranks(infos)
        self._master_addr = (
            "127.0.0.1" if len({r.host for r in self._table}) == 1 else self._table[0].addr
        )
        self._init_group("init_rank", first=True)
        self._phase("process_group_s")  # rendezvous, init_process_group, first all-reduce
        self._listen_for_release()
        self._adopt_engine_helpers()
        # Let names defined in the notebook (functions, classes) travel to the ranks by value.
        client.direct_view(ids).use_cloudpickle().get(timeout=self.timeout)
        self._phase("namespace_s")

    def _adopt_engine_helpers(self) -> None:
        """Each engine starts a nanny (it reports the engine's death at once) in a session of its own;
        it would outlive a stop by seconds. Its group joins those that stop() and the reaper kill."""
        import psutil

        here = socket.gethostname()
        for r in self._table:
            if r.host != here:
                continue
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(r.pid).children():
                    if os.getpgid(child.pid) == child.pid:
                        self._helper_pgids.add(child.pid)
        self._write_pgids()

    def _listen_for_release(self) -> None:
        """Give each rank on this host a socket through which a stuck collective can be released."""
        here = socket.gethostname()
        local = [r for r in self._table if r.host == here]
        if not local or not hasattr(socket, "AF_UNIX"):
            return
        if self._release_dir is None:
            self._release_dir = tempfile.mkdtemp(prefix="distlab-release-")  # mode 0700
        pids = [r.pid for r in local]
        asks = [self._on(r.engine_id, "listen_for_release", self._release_path(r), pids) for r in local]
        for ar in asks:
            with contextlib.suppress(Exception):  # without it, stuck ranks are killed instead
                ar.get(timeout=self.timeout)

    def _release_path(self, info: RankInfo) -> str:
        assert self._release_dir is not None
        return os.path.join(self._release_dir, f"{info.pid}.sock")

    def _release(self, ranks: list[int]) -> None:
        """Ask stuck ranks on this host to drop their connections to their peers (their collectives fail)."""
        if self._release_dir is None:
            return
        here = socket.gethostname()
        connections = []
        for r in ranks:
            if self._table[r].host != here:
                continue
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(1.0)
            try:
                sock.connect(self._release_path(self._table[r]))
                sock.sendall(b"release")
                connections.append(sock)
            except OSError:
                sock.close()
        deadline = time.monotonic() + 1.0
        for sock in connections:  # every rank works on its release at once; wait for their answers
            with sock, contextlib.suppress(OSError):
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                sock.recv(16)

    def _phase(self, name: str) -> None:
        """Record how long the phase that just ended took (start-up is measured phase by phase)."""
        now = time.perf_counter()
        self.timings[name] = now - self._phase_start
        self._phase_start = now

    def _assign_ranks(self, infos: dict[int, dict[str, Any]]) -> list[RankInfo]:
        launcher_ranks = [info["launcher_rank"] for info in infos.values()]
        if sorted(r for r in launcher_ranks if r is not None) == list(range(self.world_size)):
            # MPI / Slurm said who is who: keep their numbering.
            order = sorted(infos, key=lambda eid: infos[eid]["launcher_rank"])
        else:
            # Group ranks by host (in order of each host's first engine), then by engine id.
            host_order: dict[str, int] = {}
            for eid in sorted(infos):
                host_order.setdefault(infos[eid]["host"], len(host_order))
            order = sorted(infos, key=lambda eid: (host_order[infos[eid]["host"]], eid))
        per_host: dict[str, int] = {}
        backend = self._resolve_backend(infos)
        table = []
        for rank, eid in enumerate(order):
            info = infos[eid]
            local_rank = per_host.get(info["host"], 0)
            per_host[info["host"]] = local_rank + 1
            device = f"cuda:{local_rank}" if backend == "nccl" else "cpu"
            table.append(
                RankInfo(rank, eid, info["host"], info["pid"], local_rank, device, backend, info["addr"])
            )
        for host, count in per_host.items():
            gpus = next(i["cuda_devices"] for i in infos.values() if i["host"] == host)
            if backend == "nccl" and count > gpus:
                raise LabUsageError(
                    f"host {host} has {gpus} GPUs but {count} ranks: start at most {gpus} ranks per host, "
                    "or use --backend gloo"
                )
        self.backend = backend
        return table

    def _resolve_backend(self, infos: dict[int, dict[str, Any]]) -> str:
        every_rank_has_gpu = all(info["cuda_devices"] > 0 for info in infos.values())
        if self.requested_backend == "auto":
            return "nccl" if every_rank_has_gpu else "gloo"
        if self.requested_backend == "nccl" and not every_rank_has_gpu:
            hosts = sorted({i["host"] for i in infos.values() if i["cuda_devices"] == 0})
            raise LabUsageError(
                f"backend nccl needs a GPU on every rank; {', '.join(hosts)} has none: use --backend gloo"
            )
        return self.requested_backend

    def _init_group(self, func: str, first: bool) -> None:
        """Rank 0 opens a rendezvous store on a port the OS picks; every rank then joins."""
        client = self._client
        assert client is not None
        rank0 = self._table[0]
        port = self._get(
            self._on(rank0.engine_id, "open_store", self._master_addr, self.timeout),
            "opening the rendezvous store on rank 0",
        )
        local_world = {r.host: 0 for r in self._table}
        for r in self._table:
            local_world[r.host] += 1
        pending = {}
        for r in self._table:
            if first:
                args: tuple[Any, ...] = (
                    r.rank, self.world_size, r.local_rank, self._master_addr, port, self.backend,
                    self.timeout, local_world[r.host], self.debug,
                )
            else:
                args = (port,)
            pending[r.rank] = self._on(r.engine_id, func, *args)
        failures = {}
        deadline = time.monotonic() + self.timeout + 5
        for rank, ar in pending.items():
            try:
                ar.get(timeout=max(0.1, deadline - time.monotonic()))
            except ipp.error.TimeoutError:
                failures[rank] = RankFailure(rank, "TimeoutError", "did not join the process group in time")
            except ipp.error.RemoteError as exc:
                failures[rank] = RankFailure(rank, exc.ename, exc.evalue, exc.traceback or "")
        if failures:
            raise RankError(failures, notes=["the process group could not be initialised"])

    def _on(self, engine_id: int, name: str, *args: Any) -> Any:
        """Call ``bootstrap.<name>(*args)`` on one engine; returns its AsyncResult."""
        assert self._client is not None
        return self._client[engine_id].apply_async(on_rank, "bootstrap", name, *args)

    def _get(self, ar: Any, doing: str) -> Any:
        try:
            return ar.get(timeout=self.timeout)
        except ipp.error.TimeoutError:
            raise DistlabError(f"timed out after {self.timeout:g} s {doing}: raise --timeout") from None
        except ipp.error.CompositeError as exc:
            raise DistlabError(f"failed {doing}: {exc.elist[0][0]}: {exc.elist[0][1]}") from None
        except ipp.error.RemoteError as exc:
            raise DistlabError(f"failed {doing}: {exc.ename}: {exc.evalue}") from None

    def restart(self, ranks: int | None = None) -> Lab:
        """A fresh world: new engine processes, ranks numbered the same way.

        ``ranks`` changes the world size (elastic training: resume from a checkpoint on more or
        fewer ranks); by default it stays the same.
        """
        self._require_running()
        assert self._cluster is not None and self._client is not None
        if ranks is not None:
            _check_ranks(ranks)
            if self.launcher == "local":
                _check_local_gpus(ranks, self.backend)
            if ranks != self.world_size:
                self._resize(ranks)
        t0 = self._phase_start = time.perf_counter()
        old_ids = {r.engine_id for r in self._table}
        self._cluster.stop_engines_sync()
        _wait_for(lambda: not old_ids & set(self._client.ids), 10.0)  # type: ignore[union-attr]
        self._reap_pids([r.pid for r in self._table if r.host == socket.gethostname()])
        for pgid in self._helper_pgids:
            _kill_group(pgid)
        self._helper_pgids = set()
        self._table = []
        try:
            self._launch_engines()
            self._build_world()
        except BaseException:
            self.stop()
            raise
        self.timings["restart_s"] = time.perf_counter() - t0
        _registry.publish(self)
        return self

    def _resize(self, ranks: int) -> None:
        self.world_size = ranks
        if self._telemetry is not None:
            # Telemetry is per world: the next use makes a store (and dashboard) of the new size.
            with contextlib.suppress(ValueError):
                self._listeners.remove(self._telemetry.on_poll)
            self._telemetry = None

    def stop(self) -> None:
        """Stop engines and controller and make sure their processes are gone."""
        cluster, self._cluster = self._cluster, None
        if cluster is None:
            return
        pids = [r.pid for r in self._table if r.host == socket.gethostname()]
        pgids = self._known_pgids(cluster)
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
        with contextlib.suppress(Exception):
            cluster.stop_cluster_sync()
        # Trust the processes, not the call: kill any group still standing.
        for pgid in pgids:
            _kill_group(pgid)
        self._reap_pids(pids)
        self._table = []
        self._helper_pgids = set()
        self._stop_reaper()
        if self._release_dir is not None:
            shutil.rmtree(self._release_dir, ignore_errors=True)
            self._release_dir = None
        _live_labs.discard(self)
        _registry.forget(self)

    def _reap_pids(self, pids: Iterable[int]) -> None:
        for pid in pids:
            if not _wait_for(lambda pid=pid: not _pid_alive(pid), 5.0):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def __enter__(self) -> Lab:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<Lab {state}: {self.world_size} ranks, backend={self.backend}, launcher={self.launcher}>"

    # ------------------------------------------------------------- reaper (orphan guard)

    def _known_pgids(self, cluster: ipp.Cluster | None = None) -> list[int]:
        cluster = cluster or self._cluster
        pids: list[int] = []
        if cluster is None:
            return pids
        launchers: list[Any] = [cluster.controller] if cluster.controller is not None else []
        for engine_set in cluster.engines.values():
            launchers.append(engine_set)
            launchers.extend(getattr(engine_set, "launchers", {}).values())
        for launcher in launchers:
            pid = getattr(launcher, "pid", None) or getattr(getattr(launcher, "process", None), "pid", None)
            if isinstance(pid, int) and pid > 0:
                pids.append(pid)
        # ipyparallel starts each local process in a session of its own: its pid is its group id.
        return sorted(set(pids) | self._helper_pgids)

    def _start_reaper(self) -> None:
        fd, self._pgid_file = tempfile.mkstemp(prefix="distlab-", suffix=".pgids")
        os.close(fd)
        self._write_pgids()
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "distlab._reaper", str(os.getpid()), self._pgid_file],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )

    def _write_pgids(self) -> None:
        if self._pgid_file is None:
            return
        tmp = self._pgid_file + ".tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(str(p) for p in self._known_pgids()))
        os.replace(tmp, self._pgid_file)

    def _stop_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.terminate()
            try:
                self._reaper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
                self._reaper.wait(timeout=5)
            self._reaper = None
        if self._pgid_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._pgid_file)
            self._pgid_file = None

    # ------------------------------------------------------------------ ranks and data

    def _require_running(self) -> None:
        if not self.running:
            raise LabUsageError("no lab is running: start one with %dist start -n 2 (or distlab.start(2))")

    def ranks(self, spec: str | int | Iterable[int] | None = None) -> list[int]:
        """Parse a rank selection ('0,2-3', 1, [0, 1], None for all) against this world."""
        if spec is None:
            return list(range(self.world_size))
        return parse_ranks(spec, self.world_size)

    @property
    def table(self) -> RankTable:
        return RankTable(self._table)

    def status(self) -> RankTable:
        """The rank table, each rank's health checked now: ok, busy or dead."""
        self._require_running()
        assert self._client is not None
        registered = set(self._client.ids)
        alive = [r.engine_id for r in self._table if r.engine_id in registered]
        queue = self._client.queue_status(targets=alive) if alive else {}
        here = socket.gethostname()
        rows = RankTable()
        for r in self._table:
            if r.engine_id not in registered or (r.host == here and not _pid_alive(r.pid)):
                health = "dead"
            elif isinstance(queue.get(r.engine_id), dict) and queue[r.engine_id].get("tasks"):
                health = "busy"
            else:
                health = "ok"
            rows.append(replace(r, health=health))
        return rows

    def push(self, ranks: str | int | Iterable[int] | None = None, **names: Any) -> None:
        """Copy names into the namespace of the given ranks (all by default)."""
        self._require_running()
        assert self._client is not None
        if not names:
            raise LabUsageError("nothing to push: name the values, like lab.push(lr=0.1)")
        targets = [self._table[r].engine_id for r in self.ranks(ranks)]
        self._get(self._client.direct_view(targets).push(names, block=False), "pushing to the ranks")

    def pull(self, name: str, ranks: str | int | Iterable[int] | None = None) -> dict[int, Any]:
        """{rank: value of ``name``} from the given ranks (all by default)."""
        self._require_running()
        assert self._client is not None
        if not isinstance(name, str) or not name.isidentifier():
            raise LabUsageError(f"pull takes one variable name, like lab.pull('loss') (got {name!r})")
        selected = self.ranks(ranks)
        pending = {r: self._client[self._table[r].engine_id].pull(name, block=False) for r in selected}
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
        assert self._client is not None
        (rank,) = parse_ranks(rank, self.world_size)
        info = self._table[rank]
        if info.host == socket.gethostname():
            with contextlib.suppress(ProcessLookupError):
                os.kill(info.pid, signal.SIGKILL)
            _wait_for(lambda: not _pid_alive(info.pid), 5.0)
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
    ) -> RunResult:
        """Run ``code`` on the given ranks (all by default) and wait for it.

        Each rank's output is printed as it arrives, labelled by rank. Returns {rank: value of the
        last expression}. If any rank fails, raises RankError naming the ranks, with identical
        failures grouped; ranks still running are stopped, and a broken process group is rebuilt.
        ``timeout`` (seconds) bounds the whole cell; Ctrl-C / kernel interrupt stops it on every rank.
        """
        self._require_running()
        if not isinstance(code, str):
            raise LabUsageError(f"code must be a string of Python, got {type(code).__name__}")
        if timeout is not None:
            _check_timeout(timeout, "timeout")
        if want not in ("value", "repr"):
            raise LabUsageError("want must be 'value' or 'repr'")
        selected = self.ranks(ranks)
        assert self._client is not None
        printer = RankPrinter(label_width=len(str(self.world_size - 1))) if stream else None
        pending = {
            r: self._on(self._table[r].engine_id, "run_cell", code, r, want)
            for r in selected
        }
        outcome = _CellOutcome()
        try:
            self._wait_cell(pending, outcome, printer, timeout)
        except KeyboardInterrupt:
            outcome.interrupted = True
            self._stop_cell(pending, outcome, printer)
        self._collect(pending, outcome, printer)
        if outcome.failures:
            self._diagnose(outcome, selected)
            self._recover(outcome)
            cls = CellTimeout if outcome.timed_out else RankError
            raise cls(outcome.failures, notes=outcome.notes)
        return RunResult(outcome.values, _texts(pending, "stdout"), _texts(pending, "stderr"))

    def _wait_cell(
        self, pending: dict[int, Any], outcome: _CellOutcome, printer: RankPrinter | None, timeout: float | None
    ) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        first_failure_at: float | None = None
        while True:
            self._emit(pending, printer)
            running = [r for r, ar in pending.items() if not ar.ready()]
            if not running:
                return
            now = time.monotonic()
            if first_failure_at is None and any(_failed(ar) for ar in pending.values() if ar.ready()):
                first_failure_at = now
            if first_failure_at is not None and now - first_failure_at > _FAILURE_GRACE_S:
                # One rank failed: the others cannot finish an SPMD program without it. Stop them now
                # rather than let them wait out the collective timeout.
                failed = [r for r, ar in pending.items() if ar.ready() and _failed(ar)]
                dead = [r for r in failed if _died(pending[r])]
                # A death is the cause; failures beside it are mostly its neighbours' broken collectives.
                what = f"rank {format_ranks(dead)} died" if dead else f"rank {format_ranks(failed)} failed"
                outcome.stopped, outcome.stopped_because = running, what
                self._stop_cell(pending, outcome, printer, abort_first=True)
                return
            if deadline is not None and now > deadline:
                outcome.timed_out = True
                outcome.stopped = running
                outcome.stopped_because = f"the cell ran past its {timeout:g} s deadline"
                self._stop_cell(pending, outcome, printer)
                return
            pending[running[0]].wait(_POLL_S)

    def _stop_cell(
        self,
        pending: dict[int, Any],
        outcome: _CellOutcome,
        printer: RankPrinter | None,
        abort_first: bool = False,
    ) -> None:
        """Interrupt ranks still in the cell; free any stuck in a collective; kill what will not stop.

        ``abort_first``: another rank has failed, so the ones still running are (or soon will be)
        waiting for it in a collective; tear the group down at once rather than after SIGINT.
        """
        assert self._client is not None
        running = [r for r, ar in pending.items() if not ar.ready()]
        if not running:
            return
        if abort_first:
            self._abort_group_on_free_ranks(running, outcome)
        with contextlib.suppress(Exception):
            self._client.send_signal(
                signal.SIGINT, targets=[self._table[r].engine_id for r in running], block=True
            )
        running = self._wait_ranks(pending, running, _INTERRUPT_GRACE_S, printer)
        if running:
            # SIGINT cannot reach a rank blocked inside a C++ collective. Tearing down the group on
            # the ranks that are free, and having the stuck ones drop their peer connections from a
            # side thread, makes the stuck collectives fail.
            if not abort_first:
                self._abort_group_on_free_ranks(running, outcome)
            self._release(running)
            outcome.group_aborted = True
            running = self._wait_ranks(pending, running, _ABORT_GRACE_S, printer)
        if running:
            outcome.killed = running
            for r in running:
                self.kill(r)
            outcome.notes.append(f"rank {format_ranks(running)} did not stop and was killed")

    def _abort_group_on_free_ranks(self, running: list[int], outcome: _CellOutcome) -> None:
        assert self._client is not None
        alive = set(self._client.ids)
        free = [r for r in range(self.world_size) if r not in running and self._table[r].engine_id in alive]
        here = self._table[free[0]].host if free else ""
        # Connections to stuck ranks on the same host are shut down too (see bootstrap.abort_group).
        stuck_pids = [self._table[r].pid for r in running if self._table[r].host == here]
        aborts = [self._on(self._table[r].engine_id, "abort_group", stuck_pids) for r in free]
        for ar in aborts:
            with contextlib.suppress(Exception):
                ar.get(timeout=0.5)
        outcome.group_aborted = outcome.group_aborted or bool(free)

    def _wait_ranks(
        self, pending: dict[int, Any], ranks: list[int], seconds: float, printer: RankPrinter | None
    ) -> list[int]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._emit(pending, printer)
            ranks = [r for r in ranks if not pending[r].ready()]
            if not ranks:
                break
            pending[ranks[0]].wait(_POLL_S)
        return [r for r in ranks if not pending[r].ready()]

    def add_listener(self, listener: Callable[[dict[int, Any], bool], None]) -> None:
        """Call ``listener(pending, final)`` on every poll of a running cell, in the caller's thread.

        ``pending`` maps rank -> ipyparallel AsyncResult (``ar.data`` holds what the rank last
        published with ``publish_data``); ``final`` is True once, when the cell has ended.
        Telemetry and the dashboard feed on this; a listener must be quick and must not raise.
        """
        self._listeners.append(listener)

    @property
    def telemetry(self) -> Any:
        """What ``distlab.watch(model)`` publishes on the ranks: ``lab.telemetry.records()``.

        A ``distlab.dashboard.TelemetryStore``, made and fed from the first use on; it also picks up
        what earlier cells of this lab published.
        """
        if self._telemetry is None:
            from .dashboard.store import TelemetryStore

            store = TelemetryStore(self.world_size)
            if self._client is not None:
                store.backfill(list(self._client.metadata.values()))
            self.add_listener(store.on_poll)
            self._telemetry = store
        return self._telemetry

    def dashboard(self) -> Any:
        """The live dashboard of this lab's telemetry (ipywidgets + plotly); one per lab."""
        from .dashboard.view import dashboard_for

        return dashboard_for(self.telemetry)

    def _emit(self, pending: dict[int, Any], printer: RankPrinter | None, final: bool = False) -> None:
        for listener in self._listeners:
            listener(pending, final)
        if printer is None:
            return
        for rank, ar in pending.items():
            printer.feed(rank, "stdout", ar.stdout or "", final)
            printer.feed(rank, "stderr", ar.stderr or "", final)

    def _collect(self, pending: dict[int, Any], outcome: _CellOutcome, printer: RankPrinter | None) -> None:
        for rank, ar in pending.items():
            if not ar.ready():
                if rank in outcome.killed:
                    ar.wait(2.0)  # ipyparallel reports the dead engine promptly
                if not ar.ready():
                    outcome.failures[rank] = RankFailure(rank, "KeyboardInterrupt", "still running when stopped")
                    continue
            try:
                result = ar.get(timeout=0)
            except ipp.error.EngineError:
                outcome.failures[rank] = RankFailure(rank, "EngineError", "the rank's process died")
                continue
            except ipp.error.RemoteError as exc:
                outcome.failures[rank] = RankFailure(rank, exc.ename, exc.evalue, exc.traceback or "")
                continue
            if "error" in result:
                err = result["error"]
                outcome.failures[rank] = RankFailure(rank, err["ename"], err["evalue"], err["traceback"])
            else:
                outcome.values[rank] = result.get("value", result.get("repr"))
        # A rank's reply can overtake its last output (they travel on different channels).
        output_deadline = time.monotonic() + 1.0
        for ar in pending.values():
            if ar.ready():
                with contextlib.suppress(Exception):
                    ar.wait_for_output(timeout=max(0.0, output_deadline - time.monotonic()))
        dead = [r for r, f in outcome.failures.items() if f.ename == "EngineError"]
        for rank, failure in list(outcome.failures.items()):
            if dead and rank not in dead and _PEER_GONE.search(failure.evalue):
                # gloo noticed the dead peer before distlab did: say so in the same words.
                outcome.failures[rank] = RankFailure(
                    rank, "Stopped", f"rank {format_ranks(dead)} died while this rank was in a collective with it"
                    f"{_cell_line(failure.traceback)}", failure.traceback,
                )
        for rank in outcome.stopped:
            # Say why distlab stopped the rank; what it was doing stays in the message.
            was = outcome.failures.get(rank)
            doing = _cell_line(was.traceback) if was is not None else ""
            outcome.failures[rank] = RankFailure(
                rank, "Stopped", f"stopped by distlab: {outcome.stopped_because}{doing}", was.traceback if was else ""
            )
        self._emit(pending, printer, final=True)

    def _diagnose(self, outcome: _CellOutcome, selected: list[int]) -> None:
        """After a stopped cell: which ranks never reached a collective, and where the others waited."""
        failed = outcome.failures
        stuck = set(outcome.stopped) | {r for r, f in failed.items() if f.ename == "KeyboardInterrupt"}
        if not stuck:
            return
        dead = set(outcome.killed) | {r for r, f in failed.items() if f.ename == "EngineError"}
        assert self._client is not None
        alive = set(self._client.ids)
        asks = {
            r.rank: self._on(r.engine_id, "collective_trace")
            for r in self._table
            if r.rank not in dead and r.engine_id in alive
        }
        traces = {}
        deadline = time.monotonic() + 2.0
        for rank, ar in asks.items():
            with contextlib.suppress(Exception):
                traces[rank] = ar.get(timeout=max(0.01, deadline - time.monotonic()))
        doing = {
            r: STUCK if r in stuck else FAILED if r in failed else FINISHED if r in selected else ABSENT
            for r in range(self.world_size)
        }
        note = diagnose_collectives(traces, doing)
        if note:
            outcome.notes.insert(0, note)

    def _recover(self, outcome: _CellOutcome) -> None:
        """After a failed cell: make the world usable again, and say what was done."""
        if outcome.killed:
            self.restart()
            outcome.notes.append("the world was restarted: rank namespaces are fresh")
            return
        dead = [r for r, f in outcome.failures.items() if f.ename == "EngineError"]
        if dead:
            # A world with a dead rank cannot form a group; restarting is the user's call (a lesson
            # may want to look at the survivors first), so say how.
            outcome.notes.append(
                f"rank {format_ranks(dead)} died; the others were stopped and keep their namespaces: "
                "%dist restart (lab.restart()) brings a full world back"
            )
            return
        reason = "its group was torn down to release stuck ranks" if outcome.group_aborted else self._group_problem()
        if reason:
            try:
                self._init_group("rebuild_group", first=False)
            except (RankError, DistlabError) as exc:
                # A group that cannot be rebuilt in place is rebuilt with the processes.
                self.restart()
                first = str(exc).splitlines()[0]
                outcome.notes.append(f"the process group could not be rebuilt ({first}): the world was restarted; "
                                     "rank namespaces are fresh")
                return
            outcome.notes.append(
                f"process group rebuilt ({reason}); objects built on the old group must be rebuilt too"
            )

    def _group_problem(self) -> str | None:
        assert self._client is not None
        checks = {
            r.rank: self._on(r.engine_id, "check_group", _HEALTH_TIMEOUT_S)
            for r in self._table
        }
        problems = {}
        for rank, ar in checks.items():
            try:
                verdict = ar.get(timeout=_HEALTH_TIMEOUT_S + 2)
            except Exception as exc:  # noqa: BLE001 - any failure to answer is a problem to report
                verdict = type(exc).__name__
            if verdict != "ok":
                problems[rank] = verdict
        if not problems:
            return None
        first = next(iter(problems.values()))
        return f"rank {format_ranks(problems)}: {first}"


@dataclass
class _CellOutcome:
    """What became of one cell on each rank, and what distlab did about it."""

    values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, RankFailure] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)  # ranks distlab stopped, and why
    stopped_because: str = ""
    interrupted: bool = False
    timed_out: bool = False
    group_aborted: bool = False


def _cell_line(traceback_text: str) -> str:
    """'; it was at line 4: dist.all_reduce(t)', from the deepest frame of the user's cell."""
    lines = traceback_text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        match = re.search(r'File "<rank \d+ cell>", line (\d+)', lines[i])
        if match:
            source = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"; it was at line {match.group(1)}: {source}"
    return ""


def _failed(ar: Any) -> bool:
    try:
        result = ar.get(timeout=0)
    except Exception:  # noqa: BLE001 - a remote or engine error is a failure
        return True
    return isinstance(result, dict) and "error" in result


def _died(ar: Any) -> bool:
    try:
        ar.get(timeout=0)
    except ipp.error.EngineError:
        return True
    except Exception as exc:  # noqa: BLE001 - the hub's report of a death arrives as a RemoteError
        return getattr(exc, "ename", "") == "EngineError"
    return False


def _texts(pending: dict[int, Any], name: str) -> dict[int, str]:
    return {rank: getattr(ar, name) or "" for rank, ar in pending.items()}




def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _wait_for(condition: Any, seconds: float, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + seconds
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


def _ipp_log() -> logging.Logger:
    """ipyparallel's logger for distlab's clusters: errors only, to stderr."""
    log = logging.getLogger("distlab.ipyparallel")
    if not log.handlers:
        log.addHandler(logging.StreamHandler(sys.stderr))
        log.propagate = False
    log.setLevel(logging.ERROR)
    return log


def start(
    ranks: int = 2, backend: str = "auto", timeout: float = 30.0, launcher: str = "local", debug: bool = False
) -> Lab:
    """Start a lab of ``ranks`` torch.distributed ranks and return it, ready to run cells.

    ``debug=True`` turns on torch's collective checking on every rank (TORCH_DISTRIBUTED_DEBUG=DETAIL):
    mismatched collectives fail at once, named; everything runs slower.
    """
    return Lab(ranks=ranks, backend=backend, timeout=timeout, launcher=launcher, debug=debug).start()


def _stop_all() -> None:
    for lab in list(_live_labs):
        with contextlib.suppress(Exception):
            lab.stop()


_atexit_registered = False


def _register_atexit() -> None:
    global _atexit_registered
    if not _atexit_registered:
        atexit.register(_stop_all)
        _atexit_registered = True


def live_labs() -> Iterator[Lab]:
    """The labs this process has started and not stopped."""
    return iter(list(_live_labs))

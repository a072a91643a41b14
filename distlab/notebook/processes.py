"""A lab's processes and what starts them: the ipyparallel cluster and the notebook's client of it,
the emulated network its ranks may run in, the lab's folder, its spare engines, and the guard that
makes sure all of it ends (``cluster.processes.ProcessGuard``, and its watchdog).

:class:`LabProcesses` knows processes, not ranks: which engine is which rank is ``lab_world``'s;
the processes of a world are given to it (``stop``'s ``rank_pids``) when they are to end.

- ``cluster.launch``: the cluster, the controller's and engines' arguments, waiting for engines;
- ``cluster.nodes``: emulated nodes (network namespaces) and the links between them;
- ``spares``: engines started before anyone asks for them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ..cluster.launch import (
    controller_address,
    controller_start_args,
    engine_start_args,
    guard_iopub,
    link_client_sockets,
    make_cluster,
    node_engine_start_args,
    wait_for_engines,
)
from ..cluster.nodes import Network
from ..cluster.processes import ProcessGuard, machine_id, pid_alive, terminate, wait_for
from ..errors import DistlabError, LabUsageError
from . import kept, rpc
from .config import LabConfig
from .spares import SparePool
from .world import RankInfo

if TYPE_CHECKING:
    from ..ipycompat import IppClient, IppCluster

__all__ = ["LabProcesses", "on_this_machine"]


def on_this_machine(info: RankInfo) -> bool:
    """Whether the rank's process runs on this machine (in any namespace): then it is signalled directly."""
    return info.machine == machine_id()


class LabProcesses:
    """The cluster, client, network, folder, spares and guard of one lab; ``timeout`` bounds each wait."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.cluster: IppCluster = None
        self.client: IppClient = None
        #: engine id -> what cells send to it (``cell.CellContext.engine``), made once per client.
        self.engines: dict[int, rpc.Engine] = {}
        self.guard = ProcessGuard()
        self.network: Network | None = None  # the emulated nodes, when the lab has them
        self.folder: str | None = None  # the lab's own files (the controller's sockets on nodes, logs)
        self.spares = SparePool(self.guard)
        #: Engine ids of ranks that are gone (an old world's, a replaced rank's): a world never counts them.
        self.retired: set[int] = set()

    @property
    def running(self) -> bool:
        return self.cluster is not None

    # ------------------------------------------------------------------ starting

    def start(self, config: LabConfig, phase: Callable[[str], None]) -> None:
        """The folder, network, controller and watchdog of a lab of ``config`` (no engines yet)."""
        self.spares.clear()
        self.retired = set()
        if config.nodes or config.heal:
            self.folder = tempfile.mkdtemp(prefix=f"distlab-lab-{os.getpid()}-")
        if config.nodes:
            self.network = Network.create(
                config.nodes, config.node_link(), config.subnet, racks=config.racks, uplink=config.rack_uplink(),
            )
            phase("network_s")
        self.cluster = make_cluster(
            config.ranks, config.launcher, config.local, self.timeout, self.network, self.folder,
            warm_ok=not config.keep,
        )
        self.cluster.start_controller_sync(**controller_start_args(self.network))
        self.guard.watch(
            self.cluster, folders=[self.folder] if self.folder else [],
            namespaces=self.network.namespaces() if self.network else [], keep=self._keep_watch(config.keep),
        )
        phase("controller_s")

    def _keep_watch(self, keep: bool | float) -> tuple[float, str] | None:
        """What the watchdog needs to spare a kept lab when its kernel ends: (idle seconds, record)."""
        if not keep:
            return None
        self.cluster.shutdown_atexit = False  # ipyparallel's own exit handler would stop it
        return float(keep), str(kept.record_path(self.cluster.cluster_id))

    def connect_client(self) -> None:
        """The notebook's ipyparallel client of the lab's controller (once its engines are starting)."""
        if self.folder is not None:
            link_client_sockets(self.cluster, self.folder, self.timeout)
        try:
            self.client = self.cluster.connect_client_sync()
        except RuntimeError as error:  # ipyparallel's "Controller stopped with ... while waiting for ...": why
            raise DistlabError(f"{error}{_last_lines(self.cluster.controller)}") from error
        self.engines = {}
        guard_iopub(self.client)

    def controller_ip(self) -> str:
        """The address ranks reach the controller (and the lab's lighthouse) at: the switch's on emulated
        nodes. Each engine's own address is the one its traffic there leaves from: how the others reach it."""
        return self.network.switch_addr if self.network else controller_address(self.cluster)

    def exec_prefix(self) -> tuple[str, ...]:
        """What runs a process beside the controller: in the switch's namespace on emulated nodes."""
        return tuple(self.network.exec_prefix(None)) if self.network is not None else ()

    def start_engines(self, count: int, config: LabConfig, node: int | None = None) -> None:
        """Start ``count`` engines: on emulated node ``node``, or (None) spread over the nodes as
        ``config`` says; on this machine's loopback where the lab has no nodes."""
        network = self.network
        if network is None:
            self.cluster.start_engines_sync(count, **engine_start_args(config.local))
        else:
            network.reconnect()  # a node whose link a cell cut is reachable again for its new engines
            if node is not None:
                self.cluster.start_engines_sync(count, **node_engine_start_args(self.cluster, network, node))
            else:
                for each, per_node in enumerate(config.ranks_per_node()):
                    self.cluster.start_engines_sync(per_node, **node_engine_start_args(self.cluster, network, each))
        self.guard.update()

    def gather_engines(
        self, count: int, config: LabConfig, in_use: frozenset[int], node: int | None = None
    ) -> list[int]:
        """The engine ids of ``count`` ranks of a new world (or a replacement, on ``node``): spares
        first, the rest started now; returns once every one has registered. ``in_use``: the engine
        ids of the world's ranks now, which are not taken."""
        spare_sets = self.spares.engine_sets() if node is None else set()
        spare_count = len(self.spares) if node is None else 0
        before = set(self.cluster.engines)
        if count > spare_count:
            self.start_engines(count - spare_count, config, node)
        if self.client is None:
            self.connect_client()
        client = self.client
        taken = frozenset(self.retired | in_use)
        started = [name for name in self.cluster.engines if name not in before]
        wait_for_engines(client, count, self.timeout, taken, self.cluster, started + sorted(spare_sets))
        return sorted(set(client.ids) - taken)[:count]

    def top_up_spares(self, config: LabConfig) -> None:
        self.spares.top_up(self.cluster, config.spare_count)

    # ------------------------------------------------------------------ ranks' processes

    def registered(self) -> set[int]:
        """The engine ids the controller knows now."""
        return set(self.client.ids)

    def alive(self, info: RankInfo, registered: set[int]) -> bool:
        """Whether a rank's engine is registered and, on this machine, its process still there (a killed
        rank is gone at once; the controller notices at its next missed heartbeats)."""
        return info.engine_id in registered and (not on_this_machine(info) or pid_alive(info.pid))

    def whole(self, table: Iterable[RankInfo]) -> bool:
        """Whether every rank of ``table`` is alive (``alive``)."""
        registered = self.registered()
        return all(self.alive(info, registered) for info in table)

    def kill(self, info: RankInfo) -> None:
        """Hard-kill one rank's engine process (SIGKILL), as a crash would."""
        if on_this_machine(info):
            with contextlib.suppress(ProcessLookupError):
                os.kill(info.pid, signal.SIGKILL)
            wait_for(lambda: not pid_alive(info.pid), 5.0)
        else:
            self.client.send_signal(signal.SIGKILL, targets=[info.engine_id], block=True)

    def rank_engine_sets(self) -> list[str]:
        """The engine sets of this cluster but the spares': what a restart stops of ranks on other
        machines, whom their launcher ends."""
        spares = self.spares.engine_sets()
        return [name for name in self.cluster.engines if name not in spares]

    # ------------------------------------------------------------------ stopping

    def stop(self, rank_pids: list[int]) -> None:
        """End every process of the lab: spares, the ranks on this machine (``rank_pids``), the
        controller; then the network and the folder. Trusts the processes, not the calls."""
        cluster, self.cluster = self.cluster, None
        if cluster is None:
            self.remove_network()  # a start that failed before its cluster existed
            return
        spares = self.spares.kill_all()
        pids = rank_pids + spares
        pgids = self.guard.pgids()
        self.close_client()
        terminate(pids)  # all at once: ipyparallel's stop goes one engine at a time
        with contextlib.suppress(Exception):  # engines already killed above: the stop is tidying only
            cluster.stop_cluster_sync()
        self.guard.end_all(pgids, pids)

    def finish_stop(self) -> None:
        """After the lab's other processes (its lighthouse) have gone: the network, the folder, and
        last the guard (the watchdog covers everything before it if the notebook dies mid-stop)."""
        self.remove_network()
        self.guard.close()

    def close_client(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):  # a client whose sockets died with the cluster: dropped
                self.client.close()
        self.client = None
        self.engines = {}

    def remove_network(self) -> None:
        """The nodes, switch and links go (after the processes in them), and the lab's folder."""
        network, self.network = self.network, None
        if network is not None:
            network.destroy()
        folder, self.folder = self.folder, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    # ------------------------------------------------------------------ kept labs

    def forget(self) -> None:
        """Drop the client and cluster of a lab that could not be taken back (its processes are not ours)."""
        self.close_client()
        self.cluster = None

    def let_go(self) -> None:
        """Let go of a kept lab's processes: they go on; the watchdog stays, and ends them if nobody
        attaches the lab within its time."""
        self.forget()
        self.guard.release()

    def take_back(self, cluster_file: str, lab_id: str, keep: bool | float) -> None:
        """Reconnect to a kept lab's controller (``ipyparallel.Cluster.from_file``) and its engines."""
        import ipyparallel as ipp

        from ..cluster.launch import ipp_log

        try:
            self.cluster = ipp.Cluster.from_file(cluster_file, log=ipp_log())
        except (OSError, ValueError, KeyError) as exc:
            raise LabUsageError(f"kept lab {lab_id} cannot be reached ({exc}): it has ended") from None
        self.connect_client()

    def watch_taken_back(self, keep: bool | float) -> None:
        self.guard.watch(self.cluster, keep=self._keep_watch(keep))


def _last_lines(launcher: object, count: int = 6) -> str:
    """The last lines a launcher's process wrote (``get_output``, ipyparallel's), for an error's text:
    its log's messages and an exception's last line, not a traceback's frames (indented)."""
    get_output = getattr(launcher, "get_output", None)
    if get_output is None:
        return ""
    lines = [line for line in str(get_output()).splitlines() if line.strip() and not line[0].isspace()][-count:]
    return "; it wrote last:\n" + "\n".join(lines) if lines else "; it wrote nothing"

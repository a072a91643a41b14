"""How a lab's ipyparallel cluster is made and its engines started, on loopback or on emulated nodes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypedDict

import ipyparallel as ipp

from .. import ipycompat
from ..errors import DistlabError
from . import warm
from .allocator import engine_environment
from .forked import ForkedControllerLauncher, ForkedEngineSetLauncher
from .namespaces import RUN_NETNS
from .nodes import Network
from .ports import controller_ports
from .processes import pid_alive, wait_for
from .slurm import SlurmEngineSetLauncher

if TYPE_CHECKING:
    import zmq

__all__ = [
    "HEARTBEAT_MISSES",
    "HEARTBEAT_MS",
    "NODE_HEARTBEAT_MISSES",
    "NODE_HEARTBEAT_MS",
    "controller_address",
    "controller_start_args",
    "engine_report",
    "engine_start_args",
    "link_client_sockets",
    "make_cluster",
    "node_engine_start_args",
    "wait_for_engines",
]

# ipyparallel's hub finishes an engine's registration only when it has seen its heartbeat; at the
# default 3 s that was most of a cluster's start-up time (measured: 6.6 s -> 2.2 s for 2 engines at
# 500 ms). Local labs beat every 100 ms: with warm ranks a start and a restart take ~0.2 s less than
# at 250 ms (benchmarks/RESULTS.md); 50 misses still give a busy machine 5 s before an engine is
# declared dead (the engine answers pings from a C thread, without the GIL, and a dead rank is named
# by its nanny at once anyway). Labs on emulated nodes beat every 250 ms: the pings cross a node's
# link, and at 100 ms they added to the bytes notebook 14 counts there.
HEARTBEAT_MS = 100
HEARTBEAT_MISSES = 50
NODE_HEARTBEAT_MS = 250
NODE_HEARTBEAT_MISSES = 20

# How often a start that is still waiting for engines asks the hub which ones registered.
_RECOUNT_S = 0.5

# The notebook reaches a controller on emulated nodes through UNIX sockets in the lab's folder.
_CLIENT_SOCKET = "client"


def make_cluster(
    engines: int, launcher: str, local: bool, timeout_s: float,
    network: Network | None = None, folder: str | None = None, warm_ok: bool = True,
) -> ipp.Cluster:
    """A cluster of ``engines`` engines, not started. ``local``: every engine runs on this machine.

    On emulated nodes (``network``) the controller runs in the switch namespace, as a head node
    would: engines reach it over their node's link at the switch's address; the notebook, which
    is on no node, reaches it through UNIX sockets in ``folder``.
    """
    period, misses = (HEARTBEAT_MS, HEARTBEAT_MISSES) if network is None else (NODE_HEARTBEAT_MS, NODE_HEARTBEAT_MISSES)
    args = [f"--HeartMonitor.period={period}", f"--HeartMonitor.max_heartmonitor_misses={misses}"]
    if network is not None:
        args += [
            f"--IPController.engine_ip={network.switch_addr}",
            "--IPController.client_transport=ipc",
            f"--IPController.client_ip={os.path.join(str(folder), _CLIENT_SOCKET)}",
        ]
    # warm_ok False: a lab that outlives its kernel (``notebook.kept``) cannot hang on its warm template.
    # Engines on nodes join their node's namespace once forked, which takes root's named namespaces.
    forked = (
        launcher == "local" and warm.enabled() and warm_ok and (network is None or not network.host.rootless)
    )
    # ipyparallel's Slurm launcher, with what a lab needs of it (cluster.slurm).
    engines_class = ForkedEngineSetLauncher if forked else SlurmEngineSetLauncher if launcher == "slurm" else launcher
    cluster = ipp.Cluster(
        n=engines,
        # Local engines and their controller are forked from the warm-rank template (cluster.warm);
        # on nodes the engines only: the controller in the switch's namespace starts as before.
        engine_launcher_class=engines_class,
        controller_launcher_class=ForkedControllerLauncher if forked and network is None else "local",
        controller_args=args,
        delay=0,
        # Engines start at once and wait for the controller's connection file, instead of
        # starting only once the controller is up: their Python start-up overlaps its own.
        send_engines_connection_env=False,
        engine_timeout=max(1, int(timeout_s)),
        # distlab reports dead ranks itself; ipyparallel's warnings would dump engine logs into
        # the notebook. Its default logger in a kernel is the kernel app's, so pass our own.
        log=ipp_log(),
    )
    if network is not None:
        cluster.controller_ip = ""  # the addresses are the ones given above
    elif not cluster.controller_ip:
        # Where the user's ipyparallel profile says (c.Cluster.controller_ip = "*" for MPI ranks on
        # other hosts); else loopback, unless engines may come from other hosts: those need every
        # interface, which ipyparallel spells "*" ("" would leave the controller's default, loopback).
        cluster.controller_ip = "127.0.0.1" if local else "*"
    if network is None and local:
        # Ports the kernel does not hand out by itself, so none is taken between ipyparallel's choice
        # and its bind (cluster.ports); engines elsewhere keep the ports the user's profile opens.
        block = controller_ports(cluster.controller_ip)
        if block is not None:
            cluster.controller_args = [*cluster.controller_args, f"--IPController.ports={block.start}-{block.stop - 1}"]
    return cluster


def controller_address(cluster: ipp.Cluster) -> str:
    """The address engines reach the controller at, worked out as they do it themselves.

    Its listening IP; where that is every interface ("*"), its location from the engines' connection
    file (``Cluster.controller_location``, by default this machine's host name).
    """
    ip = cluster.controller_ip or "127.0.0.1"
    if ip not in ("*", "0.0.0.0"):
        return ip
    location = None
    path = ipycompat.controller_connection_file(cluster, "engine")
    # Not written yet, half written, or not a dict: the other sources below say where.
    with contextlib.suppress(OSError, ValueError, AttributeError), open(path) as f:
        location = json.load(f).get("location")
    return location or cluster.controller_location or socket.gethostname()


class ControllerStartArgs(TypedDict, total=False):
    """Keyword arguments for ipyparallel's ``Cluster.start_controller_sync``."""

    controller_cmd: list[str]


class EngineStartArgs(TypedDict, total=False):
    """Keyword arguments for ipyparallel's ``Cluster.start_engines_sync``."""

    engine_cmd: list[str]
    environment: dict[str, str]
    engine_args: list[str]
    node_netns: str  # engines forked on an emulated node (ForkedEngineSetLauncher)
    node_hostname: str


def controller_start_args(network: Network | None) -> ControllerStartArgs:
    """Keyword arguments for ``Cluster.start_controller_sync``: on emulated nodes, run it on the switch."""
    if network is None:
        return {}
    return {"controller_cmd": [*network.exec_prefix(None), sys.executable, "-m", "ipyparallel.controller"]}


def engine_start_args(local: bool, prefix: list[str] | None = None) -> EngineStartArgs:
    """Keyword arguments for ``Cluster.start_engines_sync``; ``prefix`` runs them on an emulated node."""
    if local:
        # Engines on this machine run our entry point, which imports torch while they register.
        # Their malloc keeps freed tensor memory instead of faulting it back in every step.
        return {
            "engine_cmd": [*(prefix or []), sys.executable, "-m", "distlab.rank.engine_main"],
            "environment": engine_environment(os.environ),
        }
    # Elsewhere the remote command stays the launcher's own; torch loads after registration.
    return {"engine_args": ["--IPEngine.startup_command=import distlab.rank.group"]}


def node_engine_start_args(cluster: ipp.Cluster, network: Network, node: int) -> EngineStartArgs:
    """``engine_start_args`` for engines on emulated node ``node``: forked from the warm template
    into the node's namespace where the cluster forks its engines, else started there cold."""
    if cluster.engine_launcher_class is ForkedEngineSetLauncher:
        return {**engine_start_args(True), "node_netns": os.path.join(RUN_NETNS, network.node_ns(node)),
                "node_hostname": network.hostname(node)}
    return engine_start_args(True, network.exec_prefix(node))


def wait_for_engines(
    client: ipp.Client, count: int, timeout_s: float, leaving: frozenset[int] = frozenset(),
    cluster: ipp.Cluster | None = None, sets: Iterable[str] | None = None,
) -> None:
    """Wait until ``count`` engines registered; ``leaving``: ids of an old world's engines, still
    exiting, which do not count. When they do not come, the error says what became of the
    processes ``cluster`` started (of its engine sets ``sets``)."""
    deadline = time.monotonic() + timeout_s
    while not wait_for(lambda: len(set(client.ids) - leaving) >= count, _RECOUNT_S, poll_s=0.01):
        for job in _slurm_jobs(cluster, sets):
            job.check()  # raises for a job Slurm will never start as asked, or one that ended: no use waiting
        if time.monotonic() > deadline:
            report = engine_report(cluster, sets or list(cluster.engines)) if cluster is not None else ""
            raise DistlabError(
                f"only {len(set(client.ids) - leaving)} of {count} engines registered within {timeout_s:g} s "
                f"(raise --timeout on a busy machine){report}"
            )
        # A client that has just connected can miss an engine that registered meanwhile (ipycompat
        # says how): the hub is asked again, rather than the start waiting out its timeout.
        ipycompat.count_missed_engines(client, _RECOUNT_S, leaving)


def engine_report(cluster: ipp.Cluster, sets: Iterable[str]) -> str:
    """A line per engine process of ``sets`` started on this machine: running or how it ended, and
    the last line it wrote (why an engine that never registered did not); a line per Slurm job of
    ``sets``: its state, and what it waits for."""
    lines = [job.report() for job in _slurm_jobs(cluster, sets)]
    try:
        states = ipycompat.engine_states(cluster, sets)
    except DistlabError:
        return "".join(lines)
    for pid, code, output in states:
        said = [line.strip() for line in output.splitlines() if line.strip()]
        if code is not None:
            state = f"exited with {code}"
        else:  # ipyparallel notices an exit on its own schedule
            state = "running" if pid_alive(pid) else "exited"
        lines.append(f"\n  engine pid {pid}: {state}; its last line: {said[-1][:200] if said else '(none)'}")
    return "".join(lines)


def _slurm_jobs(cluster: ipp.Cluster | None, sets: Iterable[str] | None) -> list[SlurmEngineSetLauncher]:
    """The engine sets (of ``sets``; all by default) that are Slurm jobs."""
    if cluster is None:
        return []
    found = [cluster.engines.get(name) for name in (sets if sets is not None else list(cluster.engines))]
    return [job for job in found if isinstance(job, SlurmEngineSetLauncher)]


def guard_iopub(client: ipp.Client, timeout_s: float = 5.0) -> None:
    """Keep the client's IOPub stream delivering when a rank makes a widget outside a kernel.

    ipyparallel 9 relays an engine's widget (comm) messages to the notebook's front end, testing
    ``get_ipython().kernel`` as it does; a terminal IPython's shell has no such attribute, the
    dispatch raises, and the stream stops: every later output and telemetry of the lab is lost
    (seen: one ``display(IntSlider())`` on a rank, under ``%%ddp`` in IPython). Outside a kernel
    there is no front end to relay to, so such a message is dropped instead. Everything else, and
    any error inside a kernel, goes through as before.
    """
    from IPython import get_ipython

    def guarded(dispatch: ipycompat.IopubHandler) -> ipycompat.IopubHandler:
        def on_recv(parts: list[zmq.Frame]) -> None:
            try:
                dispatch(parts)
            except AttributeError:
                shell = get_ipython()
                if shell is None or hasattr(shell, "kernel"):
                    raise

        return on_recv

    ipycompat.wrap_iopub_dispatch(client, guarded, timeout_s)


def link_client_sockets(cluster: ipp.Cluster, folder: str, timeout_s: float) -> None:
    """Make the controller's UNIX sockets reachable under the names ipyparallel's client uses.

    ipyparallel 9's controller binds ``ipc://PATH-PORT`` and its client connects to
    ``ipc://PATH:PORT``; a link under the client's name joins the two.
    """
    path = ipycompat.controller_connection_file(cluster, "client")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as f:
                info = json.load(f)
            break
        except (OSError, ValueError):  # not there yet, or half written
            if time.monotonic() > deadline:
                raise DistlabError(
                    f"the controller wrote no connection file within {timeout_s:g} s: raise --timeout"
                ) from None
            time.sleep(0.02)
    base = os.path.join(folder, _CLIENT_SOCKET)
    for key in ("registration", "control", "mux", "task", "iopub", "notification", "broadcast"):
        link = f"{base}:{info[key]}"
        if not os.path.lexists(link):
            os.symlink(f"{base}-{info[key]}", link)


def ipp_log() -> logging.Logger:
    """ipyparallel's logger for distlab's clusters: errors only, to stderr."""
    log = logging.getLogger("distlab.ipyparallel")
    if not log.handlers:
        log.addHandler(logging.StreamHandler(sys.stderr))
        log.propagate = False
    log.setLevel(logging.ERROR)
    return log

"""Every private or undocumented ipyparallel, ipykernel and ipywidgets API distlab uses, in one place.

distlab reaches into these packages where they offer no public way to do what it needs: send a
control message of its own to an engine (releasing a stuck rank), answer it on the engine, keep the
client's IOPub stream alive, find the processes a cluster started, count a widget's messages.
Private APIs change between releases without notice, so each is used here and nowhere else, with a
comment saying what it does and why no public API does it: a new release is checked against this
one file, and its siblings named for what they wrap: ``ipycompat_launchers.py`` (ipyparallel's
launchers, subclassed by ``cluster/``), ``ipycompat_engine.py`` (an engine's and its kernel's, on
the ranks) and ``ipycompat_widgets.py`` (ipywidgets). The model is
``rank/torchcompat.py``.

Each function checks the version of the package it reaches into, on its first use: outside the
versions really run (``KNOWN_GOOD``, which ``pyproject.toml``'s bounds match) it raises a
:class:`~distlab.errors.DistlabError` with one line naming the package, its version and what to
install. Within them, a missing attribute raises the same way. Never a silent no-op: a rename
upstream would otherwise make, say, releasing stuck ranks quietly do nothing.

Imported on both sides (the notebook and the ranks), so it imports neither torch nor either side,
and the packages themselves only when a function needs them.
"""

from __future__ import annotations

import concurrent.futures
import glob
import importlib
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeAlias

from .errors import DistlabError

if TYPE_CHECKING:
    import zmq

__all__ = [
    "KNOWN_GOOD",
    "IopubHandler",
    "IppAsyncResult",
    "IppClient",
    "IppCluster",
    "check_version",
    "checked_package",
    "cluster_files",
    "control_request",
    "controller_connection_file",
    "count_missed_engines",
    "engine_send_target",
    "engine_states",
    "launcher_pids",
    "required_attribute",
    "version_problem",
    "wrap_iopub_dispatch",
]

#: {package: ((major, minor) of the first release run, (major, minor) one past the last)}: the
#: releases distlab is run with (CI and the GPU machines). pyproject.toml's bounds say the same.
KNOWN_GOOD: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "ipyparallel": ((9, 2), (9, 3)),
    "ipykernel": ((7, 4), (7, 5)),
    "ipywidgets": ((8, 1), (8, 2)),
}

_checked: set[str] = set()

# ipyparallel ships no type hints: its objects stay Any, named here for what they are.
#: An ``ipyparallel.Client``.
IppClient: TypeAlias = Any
#: An ``ipyparallel.Cluster``.
IppCluster: TypeAlias = Any
#: An ipyparallel ``AsyncResult``: one call sent to an engine, that the notebook waits on.
IppAsyncResult: TypeAlias = Any

#: A handler of the client's IOPub stream: a message's frames (``ZMQStream.on_recv(..., copy=False)``).
IopubHandler: TypeAlias = "Callable[[list[zmq.Frame]], None]"


# --------------------------------------------------------------------------------------- versions


def version_problem(package: str, version: str) -> str | None:
    """None for a ``package`` version in ``KNOWN_GOOD``, else the one line that says what to do."""
    low, high = KNOWN_GOOD[package]
    found = re.match(r"(\d+)\.(\d+)", version)
    if found and low <= (int(found.group(1)), int(found.group(2))) < high:
        return None
    spec = f"{package}>={low[0]}.{low[1]},<{high[0]}.{high[1]}"
    return (
        f"distlab is known to work with {package} {low[0]}.{low[1]} to {high[0]}.{high[1] - 1}, "
        f"and this is {package} {version}: install one of those (pip install '{spec}'); "
        f"a newer release must first be checked against distlab/ipycompat.py"
    )


def check_version(package: str, version: str) -> None:
    """Refuse (:class:`DistlabError`, one line) a ``package`` version outside ``KNOWN_GOOD``."""
    problem = version_problem(package, version)
    if problem is not None:
        raise DistlabError(problem)


def checked_package(name: str) -> ModuleType:
    """The imported package ``name``, its version checked (once per process). For the compatibility
    modules alone (this one and its ``ipycompat_*`` siblings)."""
    module = importlib.import_module(name)
    if name not in _checked:
        check_version(name, str(getattr(module, "__version__", "unknown")))
        _checked.add(name)
    return module


def required_attribute(obj: object, name: str, package: str, what: str) -> Any:
    """``obj.name``, or one line saying that this release of ``package`` lacks what distlab needs
    (``what``: "to ..." what distlab does with it). For the compatibility modules alone."""
    try:
        return getattr(obj, name)
    except AttributeError:
        version = getattr(sys.modules.get(package), "__version__", "unknown")
        owner = obj.__name__ if isinstance(obj, type) else type(obj).__name__
        raise DistlabError(
            f"{package} {version} has no {owner}.{name}, which distlab uses to {what}: "
            f"install {package} {'.'.join(map(str, KNOWN_GOOD[package][0]))}.x "
            f"or report it (see distlab/ipycompat.py)"
        ) from None


# ---------------------------------------------------------------------------- ipyparallel client


def control_request(client: IppClient, targets: list[int], msg_type: str, content: dict[str, object],
                    timeout_s: float) -> list[dict[str, Any]] | None:
    """Send ``msg_type`` on the control channel of the engines ``targets``; their replies, or None
    when not all came within ``timeout_s`` or a target is no longer registered.

    ``Client._send_control_request``: how ipyparallel sends its own control requests
    (``signal_request``, ``clear_request``, ``abort_request``); it has no public call for a message
    type of one's own, and the control channel is the one an engine serves while its main thread is
    stuck in C++.
    """
    ipp = checked_package("ipyparallel")
    send = required_attribute(client, "_send_control_request", "ipyparallel", "send a control request to an engine")
    try:
        replies = send(targets=targets, msg_type=msg_type, content=content, block=False)
        return list(replies.result(timeout=timeout_s))
    except concurrent.futures.TimeoutError:
        return None  # a rank that does not answer in time is killed by the caller
    except (KeyError, IndexError, ipp.error.NoEnginesRegistered):
        return None  # an engine unregistered since the caller listed the live ones


def count_missed_engines(client: IppClient, timeout_s: float, leaving: Iterable[int] = ()) -> int:
    """Add to ``client.ids`` the engines the hub has registered that the client never heard of
    (``leaving``: engines on their way out, never added back); how many were added (0 also when
    the hub did not answer within ``timeout_s``).

    A client learns of engines twice: the hub's answer to its connection request lists those
    registered then, and a notification (a PUB socket) announces each one after. ipyparallel 9's
    ``Client._connect`` subscribes to the notifications only *after* that answer came, so an
    engine that registers in between is in neither, and ``client.ids`` never counts it (seen with
    engines forked warm: one of three counted, the others registered but waited on for 30 s).
    The same request asked again (``connection_request`` on ``Client._query_stream``) lists them;
    ``Client._update_engines`` adds them, on the client's IO thread as a notification would.
    """
    send = required_attribute(client, "_send", "ipyparallel", "ask the hub which engines registered")
    stream = required_attribute(client, "_query_stream", "ipyparallel", "ask the hub which engines registered")
    try:
        reply = send(stream, "connection_request").result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        return 0
    on_hub = {int(k): str(v) for k, v in reply["content"].get("engines", {}).items()}
    known = set(client.ids) | set(leaving)
    missed = {eid: uuid for eid, uuid in on_hub.items() if eid not in known}
    if not missed:
        return 0
    update = required_attribute(client, "_update_engines", "ipyparallel", "count engines the client missed")
    done = threading.Event()

    def add() -> None:
        try:
            update(missed)
        finally:
            done.set()

    required_attribute(client, "_io_loop", "ipyparallel", "count engines the client missed").add_callback(add)
    done.wait(timeout_s)
    return len(missed)


def engine_send_target(client: IppClient, engine_id: int) -> tuple[Any, bytes, list[int]]:
    """``(socket, identity, targets)``: what a DirectView on ``engine_id`` passes to the client's
    documented ``Client.send_apply_request(socket, f, args, kwargs, ident=identity)``, and the target
    list its ``AsyncResult`` is made with.

    ``Client._build_targets`` (the engine's ZMQ identity) and ``DirectView._socket`` (the stream the
    view sends on): ipyparallel has no public way to send to one engine without the view's
    bookkeeping per call, which cost a ``%%ddp`` cell milliseconds (``notebook/rpc.py`` ``Engine``).
    """
    checked_package("ipyparallel")
    what = "send a call to one engine"
    (identity,), targets = required_attribute(client, "_build_targets", "ipyparallel", what)(engine_id)
    socket = required_attribute(client[engine_id], "_socket", "ipyparallel", what)
    return socket, identity, list(targets)


def wrap_iopub_dispatch(client: IppClient, wrap: Callable[[IopubHandler], IopubHandler],
                        timeout_s: float) -> None:
    """Make the client's IOPub stream call ``wrap(ipyparallel's own handler)`` for each message.

    ``Client._dispatch_iopub`` (the handler), ``_iopub_stream`` (its ZMQStream) and ``_io_loop``
    (the client's IO thread, which owns the stream): ipyparallel offers no hook on the messages its
    client receives, and an exception in its handler stops the stream for good.
    """
    checked_package("ipyparallel")
    what = "guard the client's IOPub stream"
    dispatch = required_attribute(client, "_dispatch_iopub", "ipyparallel", what)
    stream = required_attribute(client, "_iopub_stream", "ipyparallel", what)
    loop = required_attribute(client, "_io_loop", "ipyparallel", what)
    handler = wrap(dispatch)
    swapped = threading.Event()

    def swap() -> None:  # on the client's IO thread, which owns the stream
        stream.on_recv(handler, copy=False)
        swapped.set()

    loop.add_callback(swap)
    if not swapped.wait(timeout_s):
        raise DistlabError(f"the ipyparallel client's IO thread did not answer within {timeout_s:g} s")


# --------------------------------------------------------------------------- ipyparallel cluster


def controller_connection_file(cluster: IppCluster, kind: str) -> str:
    """The path of the controller's ``kind`` ("client" or "engine") connection file.

    ``ControllerLauncher.connection_files``: undocumented; where the controller writes the
    addresses engines and clients connect to (distlab reads the engines' location and links the
    client's UNIX sockets from it).
    """
    checked_package("ipyparallel")
    controller = required_attribute(cluster, "controller", "ipyparallel", "find the controller's connection files")
    files = required_attribute(controller, "connection_files", "ipyparallel", "find the controller's connection files")
    return str(files[kind])


def _local_launchers(cluster: IppCluster) -> list[Any]:
    """The cluster's launchers that started a process on this machine: controller, then engines.

    ``LocalEngineSetLauncher.launchers`` (one launcher per engine): ipyparallel keeps its processes
    there and says nothing public about them. An unexpected layout raises rather than returning
    nothing, which would leave a lab's processes running after it stopped.
    """
    checked_package("ipyparallel")
    from ipyparallel.cluster import launcher as launchers

    local, engine_set = launchers.LocalProcessLauncher, launchers.LocalEngineSetLauncher
    found: list[Any] = [cluster.controller] if cluster.controller is not None else []
    for each in cluster.engines.values():
        found.append(each)
        if isinstance(each, engine_set):
            found.extend(required_attribute(each, "launchers", "ipyparallel", "find the engines' processes").values())
    return [launcher for launcher in found if isinstance(launcher, local)]


def cluster_files(cluster: IppCluster) -> list[str]:
    """Glob patterns of the files ipyparallel writes for a cluster on this machine: its cluster file
    and the controller's connection files (in the profile's ``security``), its processes' logs and
    the hub's engine-state file ``engines<cluster_id>.json`` (in its ``log``), which a stop leaves."""
    cluster_id = str(required_attribute(cluster, "cluster_id", "ipyparallel", "find the files a cluster writes"))
    profile = str(required_attribute(cluster, "profile_dir", "ipyparallel", "find the files a cluster writes"))
    if not cluster_id:
        return []
    return [os.path.join(profile, folder, f"*{glob.escape(cluster_id)}*") for folder in ("log", "security")]


def launcher_pids(cluster: IppCluster) -> list[int]:
    """The pids of every process the cluster's launchers started on this machine (each leads a group).

    ``LocalProcessLauncher.pid``; launchers that start nothing here (a batch system's) have none.
    """
    pids = []
    for launcher in _local_launchers(cluster):
        pid = required_attribute(launcher, "pid", "ipyparallel", "find the processes a cluster started")
        if isinstance(pid, int) and pid > 0:
            pids.append(pid)
    return pids


def engine_states(cluster: IppCluster, sets: Iterable[str]) -> list[tuple[int, int | None, str]]:
    """``(pid, exit code or None while it runs, output so far)`` of each engine of the cluster's
    engine sets ``sets`` that was started on this machine.

    A running engine's ``LocalProcessLauncher.output_file`` is read; an ended one's launcher left its
    set's ``launchers``, and the set keeps its output in ``outputs`` and its exit in
    ``stop_data["engines"]`` (ipyparallel 9's ``LocalEngineSetLauncher``).
    """
    from ipyparallel.cluster import launcher as launchers

    found: list[tuple[int, int | None, str]] = []
    for name in sets:
        engine_set = cluster.engines.get(name)
        if not isinstance(engine_set, launchers.LocalEngineSetLauncher):
            continue
        running = required_attribute(engine_set, "launchers", "ipyparallel", "find the engines' processes")
        for launcher in list(running.values()):
            path = str(required_attribute(launcher, "output_file", "ipyparallel", "find an engine's output"))
            try:
                with open(path, errors="replace") as f:
                    output = f.read()
            except OSError:
                output = ""
            found.append((int(launcher.pid or 0), None, output))
        outputs = required_attribute(engine_set, "outputs", "ipyparallel", "find an ended engine's output")
        stopped = required_attribute(engine_set, "stop_data", "ipyparallel", "find how an engine ended")
        ended = stopped.get("engines", {})
        for identifier, data in list(ended.items()):
            found.append((int(data.get("pid") or 0), data.get("exit_code"), str(outputs.get(identifier, ""))))
    return found

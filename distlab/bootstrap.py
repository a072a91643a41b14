"""What runs on each engine: identity, device binding, the process group, and the cell runner.

This module is imported by every engine at start-up (the engine's startup command), so torch is
already loaded by the time the client asks for anything. It never imports the client side
(``lab``, ``magics``, ``dashboard``): the two talk only through ipyparallel.
"""

from __future__ import annotations

import ast
import contextlib
import json
import linecache
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "abort_group",
    "check_group",
    "collective_trace",
    "describe",
    "init_rank",
    "listen_for_release",
    "open_store",
    "rebuild_group",
    "run_cell",
]

# Environment variables through which launchers tell a process its rank; the first one set wins.
_LAUNCHER_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")

# The rendezvous store. Rank 0 holds the server; the others hold clients. Kept here so the
# process group can be rebuilt on a fresh store without the client round-tripping objects.
_store: dist.TCPStore | None = None
_config: dict[str, Any] = {}

# torch's flight recorder keeps each group's latest collectives (op, shapes, sequence number) on
# every rank; after a hang, comparing them across ranks says who never arrived and where the others
# wait. It is sized when a process group is made, so the variable is set before that.
_FLIGHT_RECORDER_ENTRIES = "256"


def describe(controller_ip: str) -> dict[str, Any]:
    """This engine's identity, used by the client to build the rank table."""
    launcher_rank = next((int(os.environ[v]) for v in _LAUNCHER_RANK_VARS if v in os.environ), None)
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "addr": _address_toward(controller_ip),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "launcher_rank": launcher_rank,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }


def _address_toward(peer_ip: str) -> str:
    """The local address this host uses to reach ``peer_ip``: how other hosts on that network reach us.

    A UDP connect sends nothing; it only asks the kernel which interface routes to the peer.
    """
    if not peer_ip or peer_ip in ("*", "0.0.0.0"):
        peer_ip = "8.8.8.8"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer_ip, 9))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def open_store(host: str, timeout_s: float) -> int:
    """On rank 0: start the rendezvous server on a free port the OS picks; return the port.

    Port 0 makes the OS choose, so two labs never collide and no port is ever hard-coded.
    """
    global _store
    _store = None  # drop the previous server (on rebuild) before binding a new one
    try:
        # TCPStore alone listens on every interface; bound here, it listens only where the other
        # ranks reach rank 0 (loopback when they all run on this machine).
        listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError:
        listener = None
    _store = dist.TCPStore(
        host,
        listener.getsockname()[1] if listener else 0,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        # The store takes the descriptor over (and closes it when it goes): detach it from the socket
        # object, or closing that object later would close whatever reuses the number.
        **({"master_listen_fd": listener.detach()} if listener else {}),
    )
    return int(_store.port)


def init_rank(
    rank: int,
    world_size: int,
    local_rank: int,
    master_addr: str,
    master_port: int,
    backend: str,
    timeout_s: float,
    local_world_size: int = 1,
    debug: bool = False,
) -> dict[str, Any]:
    """Bind the device, join the process group, prove it with one all-reduce, fill the namespace.

    ``debug`` turns on torch's collective checking (TORCH_DISTRIBUTED_DEBUG=DETAIL): every collective
    is first compared across ranks, so an op or shape mismatch fails at once, named, on every rank.
    """
    global _store
    device = _bind_device(backend, local_rank)
    if device.type == "cpu":
        # N ranks sharing a host's cores each default to all of them and thrash; split them
        # (torchrun does the same by setting OMP_NUM_THREADS=1).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
    )
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", _FLIGHT_RECORDER_ENTRIES)
    if debug:
        # torch reads the level when it is imported (it already is): set it, then make it re-read.
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()
    if rank != 0:
        _store = dist.TCPStore(
            master_addr, master_port, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
    if dist.is_initialized():
        _destroy_group()
    # Every rank must name the new group alike; a failed earlier attempt may have left the counter up.
    with contextlib.suppress(Exception):
        dist.distributed_c10d._world.group_count = 0
    t0 = time.perf_counter()
    dist.init_process_group(
        backend,
        store=_store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != world_size:
        raise RuntimeError(f"first all-reduce gave {probe.item()}, expected {world_size}")
    _config.update(
        rank=rank, world_size=world_size, local_rank=local_rank, backend=backend,
        timeout_s=timeout_s, master_addr=master_addr, device=device,
        local_world_size=local_world_size, debug=debug,
    )
    _fill_namespace()
    return {"device": str(device), "init_s": time.perf_counter() - t0}


def _bind_device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise RuntimeError(
                f"local rank {local_rank} has no GPU: this host has {count}; start fewer ranks per host"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _fill_namespace() -> None:
    import distlab

    names = {
        "rank": _config["rank"],
        "world_size": _config["world_size"],
        "local_rank": _config["local_rank"],
        "device": _config["device"],
        "torch": torch,
        "dist": dist,
        "distlab": distlab,
    }
    _user_namespace().update(names)


def _user_namespace() -> dict[str, Any]:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:  # not inside an engine: keep a namespace of our own (unit tests)
        return _fallback_namespace
    return shell.user_ns  # type: ignore[no-any-return]


_fallback_namespace: dict[str, Any] = {}

# Where the cell being handled is: "starting" until its code runs, "running" while it does, then
# "ending" (packing the reply). A SIGINT in "starting" is kept for the moment the code would start.
_cell_phase = "ending"
_interrupt_pending = False


def _interrupt_cell_code(signum: int, frame: Any) -> None:
    """SIGINT handler while a cell is being handled: interrupt the cell's code, never the reply.

    distlab stops a rank's cell with SIGINT, and a cell can end on its own just as the signal is
    sent (a collective released by the group's teardown returns at once). ipykernel's handler
    would then raise KeyboardInterrupt while the engine sends the reply, and ipykernel drops a
    reply so interrupted: the notebook would wait out its grace periods for an answer that never
    comes, and kill a rank that had finished (seen in about one run in five of a released DDP
    cell). A SIGINT that arrives after the code has finished has nothing left to stop; one that
    arrives before it starts stops it as it starts.
    """
    global _interrupt_pending
    if _cell_phase == "running":
        raise KeyboardInterrupt
    if _cell_phase == "starting":
        _interrupt_pending = True


def run_cell(code: str, rank: int, want: str = "value") -> Any:
    """Run a cell's code in the rank's namespace, as a notebook would; return its last expression.

    ``want="repr"`` returns the repr instead (what a notebook shows as Out), so values that cannot
    travel back (a DDP model, an open file) still show. Failures come back as a dict with the
    exception's name, message and a traceback trimmed to the user's code: the client groups them.
    """
    from IPython import get_ipython

    global _cell_phase, _interrupt_pending
    shell = get_ipython()
    filename = f"<rank {rank} cell>"
    _cell_phase, _interrupt_pending = "starting", False
    if getattr(shell, "kernel", None) is not None and threading.current_thread() is threading.main_thread():
        # Only inside the engine's request handler: ipykernel puts its own handler back after it.
        signal.signal(signal.SIGINT, _interrupt_cell_code)
    try:
        source = shell.transform_cell(code) if shell is not None else code
        # Register the source so tracebacks show the offending line, as in a notebook.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        tree = ast.parse(source, filename=filename)
        last: ast.Expression | None = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        namespace = _user_namespace()
        try:
            _cell_phase = "running"
            if _interrupt_pending:
                raise KeyboardInterrupt
            exec(compile(tree, filename, "exec"), namespace)
            value = eval(compile(last, filename, "eval"), namespace) if last is not None else None
        finally:
            _cell_phase = "ending"
        if want == "repr":
            return {"repr": None if value is None else repr(value)}
        return {"value": value}
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt too: the client reports it
        return {"error": _describe_failure(exc, filename)}
    finally:
        _cell_phase = "ending"
        sys.stdout.flush()
        sys.stderr.flush()
        _flush_telemetry()


def _flush_telemetry() -> None:
    """Send what open watches recorded before the cell's reply, so the notebook has their last steps."""
    watch = sys.modules.get("distlab.telemetry.watch")  # never imported: nothing is watched
    if watch is not None:
        with contextlib.suppress(Exception):  # telemetry never turns a cell's result into an error
            watch.flush()


def _describe_failure(exc: BaseException, filename: str) -> dict[str, str]:
    frames = traceback.extract_tb(exc.__traceback__)
    # Drop distlab's own frames above the user's code; keep everything from the cell down.
    start = next((i for i, f in enumerate(frames) if f.filename == filename), len(frames))
    trimmed = frames[start:] if start < len(frames) else frames[-1:]
    lines = ["Traceback (most recent call last):\n"]
    lines += traceback.format_list(trimmed)
    lines += traceback.format_exception_only(type(exc), exc)
    return {
        "ename": type(exc).__name__,
        "evalue": str(exc),
        "traceback": "".join(lines),
    }


def check_group(timeout_s: float) -> str:
    """'ok' if a tiny all-reduce completes on the current group within timeout_s, else why not."""
    if not dist.is_initialized():
        return "no process group"
    try:
        probe = torch.ones(1, device=_config.get("device", torch.device("cpu")))
        work = dist.all_reduce(probe, async_op=True)
        if not work.wait(timedelta(seconds=timeout_s)):
            return "all-reduce did not complete"
        if int(probe.item()) != dist.get_world_size():
            return f"all-reduce gave {probe.item()}"
        return "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means the group is unusable
        return f"{type(exc).__name__}: {exc}".splitlines()[0]


def abort_group(peer_pids: list[int] | tuple[int, ...] = ()) -> bool:
    """Tear down this rank's process group and its connections to the ranks in ``peer_pids``.

    Peers blocked in a collective with this rank then fail at once instead of waiting out the
    timeout, which is how a stuck cell is released. ``destroy_process_group`` alone is not
    enough: a DDP model keeps the group, and its sockets, alive (measured: the peer waited the
    full timeout, and gloo's ``abort()``/``shutdown()`` did not help either). So the connections
    to the peer processes on this host are shut down at the socket level, as if this rank had
    died, while this process and its namespace live on.
    """
    was_up = dist.is_initialized()
    if was_up:
        _destroy_group()
    _shutdown_connections_to(set(peer_pids))
    return was_up


def _destroy_group() -> None:
    """``destroy_process_group``, finished by hand if shutting a broken backend down raised.

    torch resets its group counter only at the end of a clean destroy; a rank whose destroy failed
    half-way would name its next group differently from the others, and the rebuild would wait
    for keys that never come (measured: every rebuild after a released barrier timed out).
    """
    try:
        dist.destroy_process_group()
        return
    except Exception:  # noqa: BLE001 - a broken group may fail to shut down: forget it anyway
        pass
    c10d = dist.distributed_c10d
    with contextlib.suppress(Exception):
        c10d._update_default_pg(None)
    world = c10d._world
    for table in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
                  "pg_coalesce_state"):
        with contextlib.suppress(Exception):
            getattr(world, table).clear()
    with contextlib.suppress(Exception):
        c10d._unregister_all_process_groups()
    with contextlib.suppress(Exception):
        world.group_count = 0


def _shutdown_connections_to(peer_pids: set[int]) -> int:
    if not peer_pids:
        return 0
    import psutil

    me = os.getpid()
    connections = psutil.net_connections(kind="tcp")
    owner = {(c.laddr.ip, c.laddr.port): c.pid for c in connections if c.pid and c.laddr}
    closed = 0
    for c in connections:
        if c.pid != me or c.status != psutil.CONN_ESTABLISHED or not c.raddr or c.fd < 0:
            continue
        if owner.get((c.raddr.ip, c.raddr.port)) in peer_pids:
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(c.fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)  # shutdown acts on the socket, not just this fd
                closed += 1
    return closed


def listen_for_release(path: str, peer_pids: list[int]) -> bool:
    """Serve release requests on a private UNIX socket, from a side thread.

    A rank stuck in a collective cannot be interrupted (SIGINT waits for the C++ call to return),
    and when every rank is stuck there is no free one to tear the group down from outside. This
    thread can still run (collectives release the GIL while they wait): on b"release" it shuts down
    this rank's connections to its peers on this host, the stuck collective fails, and the cell
    returns with its namespace intact.
    """
    peers = {int(p) for p in peer_pids} - {os.getpid()}
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)  # in a directory only this user can enter (the client made it 0700)
    server.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                with contextlib.suppress(OSError):
                    if conn.recv(16) == b"release":
                        closed = 0
                        with contextlib.suppress(Exception):
                            closed = _shutdown_connections_to(peers)
                        # Answer when done: the client rebuilds the group only after this, so a
                        # late release can never cut the new group's connections.
                        conn.sendall(str(closed).encode())

    threading.Thread(target=serve, name="distlab-release", daemon=True).start()
    return True


def rebuild_group(master_port: int) -> dict[str, Any]:
    """Join a fresh process group of the same world on a new rendezvous port."""
    abort_group()
    return init_rank(
        _config["rank"], _config["world_size"], _config["local_rank"], _config["master_addr"],
        master_port, _config["backend"], _config["timeout_s"], _config["local_world_size"], _config["debug"],
    )


def collective_trace(last: int = 4) -> list[dict[str, Any]]:
    """This rank's latest collectives on the default process group, oldest first (flight recorder).

    Each is {seq, op, shapes, dtypes, p2p}: ``seq`` counts the group's collectives (or, for send
    and recv, its point-to-point operations) from 1. Still readable after the group is torn down.
    """
    try:
        dump = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False))
    except Exception:  # noqa: BLE001 - no recorder in this torch build: nothing to say
        return []
    entries = [e for e in dump.get("entries") or () if (e.get("process_group") or ["", ""])[1] == "default_pg"]
    if not entries:
        return []
    # A rebuilt group is a new one with the same name: keep the newest group's entries only.
    newest = max(e.get("pg_id", 0) for e in entries)
    entries = [e for e in entries if e.get("pg_id", 0) == newest]
    return [
        {
            "seq": e["p2p_seq_id"] if e.get("is_p2p") else e["collective_seq_id"],
            "op": str(e.get("profiling_name", "?")).split(":", 1)[-1],
            "shapes": e.get("input_sizes") or [],
            "dtypes": e.get("input_dtypes") or [],
            "p2p": bool(e.get("is_p2p")),
        }
        for e in entries[-last:]
    ]

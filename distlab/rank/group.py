"""The rank's process group: the rendezvous store, joining, checking, tearing down and rebuilding.

Imported by every local engine as it starts (``distlab.rank.engine_main``), so torch is loaded by
the time the notebook asks for anything.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

# torch.distributed.nn.functional's collectives take ``group=group.WORLD`` as their default, which
# Python reads once, when the module is imported: imported after a group exists (a cell importing
# torch.distributed.optim, FSDP or pipelining imports it), they would keep that group after the lab
# rebuilt the world in place and fail with "not initialized in the world group map". Imported here,
# before any group (every engine imports this module first; 3 ms), the default is None: the default
# group of the moment they are called.
import torch.distributed.nn.functional

from ..wire import GroupSpec, RankJoined
from . import flight, heal, namespace, progress, staging, torchcompat, torchrun
from .identity import interface_of
from .release import shutdown_peer_connections

__all__ = ["abort_group", "check_group", "init_rank", "join_as_replacement", "open_store", "rebuild_group"]

# The rendezvous store. Rank 0 holds the server; the others hold clients. Kept here so the
# process group can be rebuilt on a fresh store without the notebook round-tripping objects.
_store: dist.TCPStore | None = None
# How this rank last joined (a rebuild joins the same way on a new port).
_spec: GroupSpec | None = None
_device = torch.device("cpu")

# torch's flight recorder keeps each group's latest collectives (op, shapes, sequence number) on
# every rank; after a hang, comparing them across ranks says who never arrived and where the others
# wait (``rank.flight``). It is sized when a process group is made, so the variable is set before.
_FLIGHT_RECORDER_ENTRIES = "256"


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
    port = listener.getsockname()[1] if listener else 0
    # The store takes the descriptor over (and closes it when it goes): detach it from the socket
    # object, or closing that object later would close whatever reuses the number. Until the store
    # exists the descriptor is ours: a store that fails to start must not leak it.
    fd = listener.detach() if listener else None
    try:
        _store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
            master_listen_fd=fd,
        )
    except BaseException:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
        raise
    return int(_store.port)


def init_rank(spec: GroupSpec) -> RankJoined:
    """Bind the device, join the process group, prove it with one all-reduce, fill the namespace.

    The rank also gets torchrun's variables, and ``init_process_group`` joins this group from now
    on (``rank.torchrun``), so code written for torchrun runs in a cell as it is.

    ``spec.debug`` turns on torch's collective checking (TORCH_DISTRIBUTED_DEBUG=DETAIL): every
    collective is first compared across ranks, so an op or shape mismatch fails at once, named.
    """
    global _store, _spec, _device
    device = _prepare(spec)
    if spec.debug:
        # torch reads the level when it is imported (it already is): set it, then make it re-read.
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()
    if spec.rank != 0:
        _store = dist.TCPStore(
            spec.master_addr, spec.master_port, is_master=False, timeout=timedelta(seconds=spec.timeout_s)
        )
    if dist.is_initialized():
        _destroy_group()
    # Every rank must name the new group alike; a failed earlier attempt may have left the counter up.
    with contextlib.suppress(Exception):  # a half-destroyed group's counter: reset best effort
        torchcompat.reset_group_count()
    t0 = time.perf_counter()
    with torchrun.lab_owned():  # torch's own init_process_group, not the one cells call (which joins)
        dist.init_process_group(
            spec.backend,
            store=_store,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.timeout_s),
            # NCCL's communicator is made at once on its bound GPU. gloo gains nothing from a bound
            # device, and on torch 2.11 new_group and DeviceMesh then split gloo's group, which it
            # cannot (no perform_nocolor_split; its options cannot be copied): measured on an H200.
            device_id=device if device.type == "cuda" and spec.backend == "nccl" else None,
        )
    probe = torch.ones(1, device=device)
    dist.all_reduce(probe)
    if int(probe.item()) != spec.world_size:
        raise RuntimeError(f"first all-reduce gave {probe.item()}, expected {spec.world_size}")
    _spec, _device = spec, device
    flight.record_point_to_point()  # sends and receives of this group on, for a hang's diagnosis
    torchrun.follow(spec)  # from now on a cell's init_process_group joins this group
    namespace.fill(spec.rank, spec.world_size, spec.local_rank, device)
    progress.install(spec.rank)  # tqdm's bars are drawn in the notebook, not on the rank
    return {"device": str(device), "init_s": time.perf_counter() - t0}


def _prepare(spec: GroupSpec) -> torch.device:
    """What a rank is given before any group: its device, threads, torchrun's variables, the lab's lighthouse."""
    device = _bind_device(spec.backend, spec.local_rank, spec.device)
    if device.type == "cuda" and spec.backend == "gloo":
        staging.stage_functional_all_gathers()  # DTensor's all-gathers of CUDA tensors: rank/staging.py
    if device.type == "cpu":
        # N ranks sharing a host's cores each default to all of them and thrash; split them
        # (torchrun does the same by setting OMP_NUM_THREADS=1).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.local_world_size))
    torchrun.set_environment(spec)  # RANK, WORLD_SIZE, MASTER_ADDR, ... as torchrun gives them
    heal.set_lighthouse(spec.lighthouse, spec.heal_end)
    heal.became_replacement(False)  # a whole group's rank from here (join_as_replacement says otherwise)
    _choose_gloo_interface(spec.master_addr)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", _FLIGHT_RECORDER_ENTRIES)
    return device


def join_as_replacement(spec: GroupSpec) -> RankJoined:
    """Take the place of a rank that died while a healing cell runs: everything ``init_rank`` gives
    but the process group, which the others' is not open to. The cell's quorum (``rank.heal``)
    is how this rank trains with them; the lab forms a whole group again once the cell has ended."""
    global _spec, _device
    t0 = time.perf_counter()
    device = _prepare(spec)
    heal.became_replacement()
    _spec, _device = spec, device
    namespace.fill(spec.rank, spec.world_size, spec.local_rank, device)
    progress.install(spec.rank)
    return {"device": str(device), "init_s": time.perf_counter() - t0}


def _choose_gloo_interface(master_addr: str) -> None:
    """Have gloo listen on the interface that reaches rank 0, unless the user chose one.

    Left alone, gloo listens on the address its host name resolves to; on a host whose name
    resolves to nothing, or to loopback (nodes in network namespaces, many clusters), peers on other
    hosts could not reach it. Ranks on one host still talk over loopback: an address of one's own
    is routed through ``lo``.
    """
    if "GLOO_SOCKET_IFNAME" in os.environ or ipaddress.ip_address(master_addr).is_loopback:
        return
    name = interface_of(master_addr)
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def _bind_device(backend: str, local_rank: int, device: str = "") -> torch.device:
    """The rank's device, made current: the one the world planned, else NCCL's ``cuda:<local_rank>``."""
    wanted = torch.device(device) if device else torch.device("cuda", local_rank) if backend == "nccl" else None
    if wanted is None or wanted.type != "cuda":
        return torch.device("cpu")
    index = wanted.index if wanted.index is not None else local_rank
    count = torch.cuda.device_count()
    if index >= count:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU {index}: this host has {count}; start fewer ranks per host"
        )
    torch.cuda.set_device(index)  # ranks sharing one GPU over gloo all make it current
    return torch.device("cuda", index)


def rebuild_group(master_port: int) -> RankJoined:
    """Join a fresh process group of the same world on a new rendezvous port."""
    if _spec is None:
        raise RuntimeError("this rank never joined a process group: there is nothing to rebuild")
    # Only the old group goes (init_rank destroys it): cutting connections here would cut rank 0's
    # connections to the new store, opened just before.
    return init_rank(replace(_spec, master_port=master_port))


def check_group(timeout_s: float) -> str:
    """'ok' if a tiny all-reduce completes on the current group within timeout_s, else why not."""
    if not dist.is_initialized():
        return "no process group"
    try:
        probe = torch.ones(1, device=_device)
        work = dist.all_reduce(probe, async_op=True)
        if not work.wait(timedelta(seconds=timeout_s)):
            return "all-reduce did not complete"
        if int(probe.item()) != dist.get_world_size():
            return f"all-reduce gave {probe.item()}"
        return "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means the group is unusable
        return f"{type(exc).__name__}: {exc}".splitlines()[0]


def abort_group() -> bool:
    """Tear down this rank's process group and its connections to its peers, on any host.

    Peers blocked in a collective with this rank then fail at once instead of waiting out the
    timeout, which is how a stuck cell is released. ``destroy_process_group`` alone is not
    enough: a DDP model keeps the group, and its sockets, alive (measured: the peer waited the
    full timeout, and gloo's ``abort()``/``shutdown()`` did not help either). So the connections
    to the peers are shut down at the socket level (``rank.release``), as if this rank had died,
    while this process and its namespace live on.
    """
    was_up = dist.is_initialized()
    if was_up:
        _destroy_group()
    shutdown_peer_connections()
    return was_up


def _destroy_group() -> None:
    """``destroy_process_group``, finished by hand if shutting a broken backend down raised.

    torch resets its group counter only at the end of a clean destroy; a rank whose destroy failed
    half-way would name its next group differently from the others, and the rebuild would wait
    for keys that never come (measured: every rebuild after a released barrier timed out).
    """
    try:
        with torchrun.lab_owned():  # really destroyed (a cell's destroy_process_group() leaves it up)
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a broken group may fail to shut down: forget it anyway
        torchcompat.forget_process_groups()

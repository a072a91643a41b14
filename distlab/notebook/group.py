"""Forming the world's process group from the notebook: rank 0 opens the store, every rank joins."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import ipyparallel as ipp

from ..errors import DistlabError, RankError, RankFailure
from ..wire import GroupSpec
from . import rpc
from .world import RankInfo, World

if TYPE_CHECKING:
    from ..ipycompat import IppAsyncResult, IppClient

__all__ = ["form_group", "get", "group_spec"]


def get(ar: IppAsyncResult, timeout_s: float, doing: str) -> Any:
    """``ar.get`` with a deadline; a failure becomes one DistlabError line saying what was being done."""
    try:
        return ar.get(timeout=timeout_s)
    except ipp.error.TimeoutError:
        raise DistlabError(f"timed out after {timeout_s:g} s {doing}: raise --timeout") from None
    except ipp.error.CompositeError as exc:
        raise DistlabError(f"failed {doing}: {exc.elist[0][0]}: {exc.elist[0][1]}") from None
    except ipp.error.RemoteError as exc:
        raise DistlabError(f"failed {doing}: {exc.ename}: {exc.evalue}") from None


def group_spec(
    world: World, r: RankInfo, port: int, timeout_s: float, debug: bool, healing: tuple[str, str] = ("", "")
) -> GroupSpec:
    """What rank ``r`` is told to join the world's group with (``healing``: the lab's lighthouse and
    its file for a healing cell's end, where it heals)."""
    hosts = world.hosts()
    return GroupSpec(
        rank=r.rank, world_size=len(world.table), local_rank=r.local_rank,
        local_world_size=world.sharing_cores(r), master_addr=world.master_addr,
        master_port=port, backend=world.backend, timeout_s=timeout_s, debug=debug,
        node=hosts.index(r.host), nodes=len(hosts), ranks_on_node=world.local_world_size(r.host),
        device=r.device, lighthouse=healing[0], heal_end=healing[1],
    )


def form_group(
    client: IppClient, world: World, timeout_s: float, debug: bool, rebuild: bool, healing: tuple[str, str] = ("", "")
) -> None:
    """Rank 0 opens a rendezvous store on a port the OS picks; every rank then joins the group.

    ``rebuild``: the ranks joined before and join again the same way, on the new port.
    ``healing``: a healing lab's torchft lighthouse and end file (``rank.heal``). Raises
    RankError naming the ranks that failed or did not join within the timeout, or whose engine is
    gone (it died, or its node was cut off, and the controller let it go).
    """
    registered = set(client.ids)
    gone = {r.rank: RankFailure(r.rank, "EngineError", "its engine is gone") for r in world.table
            if r.engine_id not in registered}
    if gone:
        raise RankError(gone, notes=["the process group could not be initialised"])
    rank0 = world.table[0]
    port = get(
        rpc.open_store(client[rank0.engine_id], world.master_addr, timeout_s), timeout_s,
        "opening the rendezvous store on rank 0",
    )
    pending = {}
    for r in world.table:
        target = client[r.engine_id]
        if rebuild:
            pending[r.rank] = rpc.rebuild_group(target, port)
        else:
            pending[r.rank] = rpc.init_rank(target, group_spec(world, r, port, timeout_s, debug, healing))
    failures = {}
    deadline = time.monotonic() + timeout_s + 5
    for rank, ar in pending.items():
        try:
            ar.get(timeout=max(0.1, deadline - time.monotonic()))
        except ipp.error.TimeoutError:
            failures[rank] = RankFailure(rank, "TimeoutError", "did not join the process group in time")
        except ipp.error.RemoteError as exc:
            failures[rank] = RankFailure(rank, exc.ename, exc.evalue, exc.traceback or "")
    if failures:
        raise RankError(failures, notes=["the process group could not be initialised"])

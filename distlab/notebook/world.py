"""The rank table and the backend, decided from what the engines say of themselves: pure functions.

    world = plan_world(identities, world_size=4, requested_backend="auto")
    world.table[0].engine_id, world.backend, world.master_addr

Nothing here talks to a process, so every rule (who is rank 0, ranks grouped by host, local ranks,
which backend, which address the others reach rank 0 at) is tested without a cluster.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import LabUsageError
from ..wire import EngineIdentity

__all__ = ["RankInfo", "RankTable", "World", "check_gpus", "plan_world", "resolve_backend"]


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
    #: The machine's boot id (``rank.identity.machine_id``): equal for every rank on one machine.
    machine: str = ""


class RankTable(list[RankInfo]):
    """The rank table, printed as a table; ``caption`` (the link between nodes, say) goes under it."""

    _COLUMNS = ("rank", "engine_id", "host", "addr", "pid", "device", "backend", "health")

    def __init__(self, rows: Iterable[RankInfo] = (), caption: str = "") -> None:
        super().__init__(rows)
        self.caption = caption

    def __str__(self) -> str:
        rows = [self._COLUMNS] + [tuple(str(getattr(r, c)) for c in self._COLUMNS) for r in self]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self._COLUMNS))]
        text = "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)
        return f"{text}\n{self.caption}" if self.caption else text

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


@dataclass(frozen=True)
class World:
    """Who is which rank, on which backend, and where rank 0's rendezvous is."""

    table: tuple[RankInfo, ...]
    backend: str
    master_addr: str
    #: What start should say in one line about the choice of backend and devices ("" if nothing).
    note: str = ""

    def local_world_size(self, host: str) -> int:
        return sum(1 for r in self.table if r.host == host)

    def hosts(self) -> list[str]:
        """The world's hosts, in the order of their first rank (a host's index is torchrun's GROUP_RANK)."""
        return list(dict.fromkeys(r.host for r in self.table))

    def sharing_cores(self, info: RankInfo) -> int:
        """How many ranks share ``info``'s machine's cores: emulated nodes of one machine share
        them all, so they count together (by machine id), not per node."""
        if not info.machine:
            return self.local_world_size(info.host)
        return sum(1 for r in self.table if r.machine == info.machine)


def plan_world(
    identities: Mapping[int, EngineIdentity], world_size: int, requested_backend: str,
    host_order: Sequence[str] = (),
) -> World:
    """The world from ``{engine_id: identity}``.

    Ranks follow the launcher's numbering when it gave one to every engine (MPI, Slurm); otherwise
    they are grouped by host, then ordered by engine id. Hosts come in ``host_order`` (the lab's
    own nodes: node0 first), then the others in order of their first engine.
    ``local_rank`` counts within a host; NCCL ranks get ``cuda:<local_rank>``. With ``auto`` on a
    host that has GPUs but fewer than its ranks, the ranks run gloo and take its GPUs in turn
    (``cuda:<local_rank % gpus>``: CUDA tensors over gloo), as a laptop or Colab with one GPU needs.
    """
    numbered = {eid: i["launcher_rank"] for eid, i in identities.items() if i["launcher_rank"] is not None}
    if sorted(numbered.values()) == list(range(world_size)):
        order = sorted(numbered, key=numbered.__getitem__)
    else:
        position = {host: i for i, host in enumerate(host_order)}
        for eid in sorted(identities):
            position.setdefault(identities[eid]["host"], len(position))
        order = sorted(identities, key=lambda eid: (position[identities[eid]["host"]], eid))
    # GPUs belong to a machine, and emulated nodes (hosts) share one machine's GPUs: count them,
    # and the ranks that take them, per machine (its boot id; the host where none was given).
    machine = {eid: _machine(info) for eid, info in identities.items()}
    gpus_of = {machine[eid]: info["cuda_devices"] for eid, info in identities.items()}
    ranks_of: dict[str, int] = {}
    hosts_of: dict[str, list[str]] = {}
    for eid, info in identities.items():
        ranks_of[machine[eid]] = ranks_of.get(machine[eid], 0) + 1
        if info["host"] not in hosts_of.setdefault(machine[eid], []):
            hosts_of[machine[eid]].append(info["host"])
    names = {m: "+".join(hosts) for m, hosts in hosts_of.items()}  # what messages call a machine
    backend = resolve_backend(identities, requested_backend, ranks_of)
    shared = requested_backend == "auto" and backend == "gloo" and any(gpus_of.values())
    per_host: dict[str, int] = {}
    per_machine: dict[str, int] = {}
    table = []
    for rank, eid in enumerate(order):
        info = identities[eid]
        local_rank = per_host.get(info["host"], 0)
        per_host[info["host"]] = local_rank + 1
        index = per_machine.get(machine[eid], 0)  # = local_rank, unless nodes share the machine
        per_machine[machine[eid]] = index + 1
        gpus = gpus_of[machine[eid]]
        if backend == "nccl":
            device = f"cuda:{index}"
        elif shared and gpus:
            device = f"cuda:{index % gpus}"
        else:
            device = "cpu"
        table.append(RankInfo(
            rank, eid, info["host"], info["pid"], local_rank, device, backend, info["addr"],
            machine=info.get("machine", ""),
        ))
    if backend == "nccl":
        for where, count in per_machine.items():
            gpus = gpus_of[where]
            if count > gpus:
                raise LabUsageError(
                    f"host {names[where]} has {gpus} GPUs but {count} ranks: start at most {gpus} ranks per host, "
                    "or use --backend gloo"
                )
    # One host: everyone reaches rank 0 on loopback. Several: at rank 0's address toward the controller.
    master_addr = "127.0.0.1" if len(per_host) == 1 else table[0].addr
    note = (
        _sharing_note({names[m]: g for m, g in gpus_of.items()}, {names[m]: r for m, r in ranks_of.items()})
        if shared else ""
    )
    return World(tuple(table), backend, master_addr, note)


def _sharing_note(gpus_of: Mapping[str, int], ranks_of: Mapping[str, int]) -> str:
    bare = [host for host, gpus in gpus_of.items() if gpus == 0]
    if bare:
        return (
            f"{', '.join(bare)} {'has' if len(bare) == 1 else 'have'} no GPU: the ranks run gloo, on the GPUs of "
            "the hosts that have them and on the CPU elsewhere (NCCL needs a GPU per rank)"
        )
    host = next(host for host, ranks in ranks_of.items() if gpus_of[host] < ranks)
    gpus, ranks = gpus_of[host], ranks_of[host]
    where = f"{host} has" if len(ranks_of) > 1 else "this machine has"
    # torch's backend table: gloo takes CUDA tensors in every collective but send and recv, which
    # the ranks stage through host memory (rank/staging.py).
    return (
        f"{where} {gpus} GPU{'s' if gpus != 1 else ''} for {ranks} ranks: they run gloo and take the "
        f"GPU{'s' if gpus != 1 else ''} in turn (NCCL needs a GPU per rank); start at most {gpus} "
        f"rank{'s' if gpus != 1 else ''} per host for NCCL. Sends and receives of CUDA tensors go "
        "through host memory (gloo cannot take them there)"
    )


def _machine(info: EngineIdentity) -> str:
    """The machine whose GPUs an engine sees: its boot id, else (none given) its host."""
    return info.get("machine") or info["host"]


def resolve_backend(
    identities: Mapping[int, EngineIdentity], requested: str, ranks_of: Mapping[str, int] | None = None
) -> str:
    """``auto`` is NCCL when every rank has a GPU of its own, else gloo; ``nccl`` needs a GPU on every rank.

    ``ranks_of``: ranks per machine (``_machine``; by default, one per engine described).
    """
    if ranks_of is None:
        ranks_of = {}
        for info in identities.values():
            ranks_of[_machine(info)] = ranks_of.get(_machine(info), 0) + 1
    every_rank_has_gpu = all(i["cuda_devices"] > 0 for i in identities.values())
    if requested == "auto":
        own = all(i["cuda_devices"] >= ranks_of.get(_machine(i), 1) for i in identities.values())
        return "nccl" if every_rank_has_gpu and own else "gloo"
    if requested == "nccl" and not every_rank_has_gpu:
        hosts = sorted({i["host"] for i in identities.values() if i["cuda_devices"] == 0})
        raise LabUsageError(f"backend nccl needs a GPU on every rank; {', '.join(hosts)} has none: use --backend gloo")
    return requested


def check_gpus(ranks: int, backend: str, gpus: int | None) -> None:
    """Before starting engines on this host (which has ``gpus`` GPUs): refuse impossible GPU requests.

    ``gpus`` None: not known before the ranks start (they check, ``plan_world``)."""
    if backend != "nccl" or gpus is None:
        return
    if gpus == 0:
        raise LabUsageError("backend nccl needs GPUs and this machine has none: use --backend gloo (or auto)")
    if ranks > gpus:
        raise LabUsageError(
            f"{ranks} GPU ranks but this machine has {gpus} GPUs: start at most -n {gpus}, "
            "or use --backend gloo for CPU ranks"
        )

"""This rank's latest collectives, from torch's flight recorder, for diagnosing a hang.

``errors.diagnose_collectives`` compares these across ranks: who never arrived, where the others
waited, or which ranks disagree on a collective's op or shapes.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..wire import CollectiveEntry, PointToPointEntry
from . import torchcompat

__all__ = ["collective_trace", "record_point_to_point"]

# What this rank posted, point to point, since its group was made: per (group, op, peer) the count
# and the latest one's description, and its works until they complete. torch's own recorder has
# none of it on gloo (torchcompat.observe_point_to_point says why).
_lock = threading.Lock()  # the observer runs on any thread that sends (a pipeline's too)
_latest: dict[tuple[str, str, int], PointToPointEntry] = {}
_pending: dict[tuple[str, str, int], collections.deque[dist.Work]] = {}  # works not yet completed, oldest first
# Each group's name, description and members' global ranks (by group rank), read once: a send
# is on a pipeline's hot path.
_groups: dict[int, tuple[str, str, list[int]]] = {}


def record_point_to_point() -> None:
    """Record every send and receive this rank posts from now on, forgetting those of an earlier
    group (called each time the rank joins one; the hook is installed once)."""
    with _lock:
        _latest.clear()
        _pending.clear()
        _groups.clear()
    torchcompat.observe_point_to_point(_posted)


def _group(group: dist.ProcessGroup) -> tuple[str, str, list[int]]:
    known = _groups.get(id(group))
    if known is None or known[0] != str(group.group_name):  # new, or a new group where a gone one was
        members = [dist.get_global_rank(group, i) for i in range(group.size())]
        known = _groups[id(group)] = (str(group.group_name), str(group.group_desc), members)
    return known


def _posted(
    group: dist.ProcessGroup, op: str, group_peer: int | None, tensors: Sequence[torch.Tensor], work: dist.Work | None
) -> None:
    with _lock:
        name, desc, members = _group(group)
        # A receive from any source has no peer: -1 stands for "any".
        peer = members[group_peer] if group_peer is not None else -1
        key = (name, op, peer)
        latest = _latest.get(key)
        _latest[key] = {
            "seq": latest["seq"] + 1 if latest else 1,
            "op": op,
            "shapes": [list(t.shape) for t in tensors],
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "p2p": True,
            "group": name,
            "desc": desc,
            "members": members,
            "peer": peer,
        }
        # A work is kept only until it completes (it holds its tensors): the completed ones at the
        # front go at each post. None (an op of a NCCL batch, whose batch holds the work) is done.
        works = _pending.setdefault(key, collections.deque())
        while works and _completed(works[0]):
            works.popleft()
        if work is not None:
            works.append(work)


def _point_to_point() -> list[CollectiveEntry]:
    """The latest send and receive per group and peer, each saying whether one is still pending."""
    with _lock:
        entries: list[CollectiveEntry] = []
        for key, entry in _latest.items():
            works = _pending[key] = collections.deque(w for w in _pending.get(key, ()) if not _completed(w))
            entry["pending"] = bool(works)
            entries.append(entry)
        return entries


def _completed(work: dist.Work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a work of a torn-down group: it will never complete
        return True


def collective_trace(last: int) -> list[CollectiveEntry]:
    """This rank's latest ``last`` collectives of each process group it belongs to, oldest first
    within a group: the default group and every sub-group (a device mesh's dimensions, a pipeline's
    pairs), so that a hang in any of them is diagnosed.

    Each is {seq, op, shapes, dtypes, p2p, group, desc, members}: ``seq`` counts the group's
    collectives from 1. Sends and receives come first, from distlab's own record: the latest per
    group, op and peer, ``seq`` counting them, with ``peer`` and ``pending`` (``wire.PointToPointEntry``).
    Still readable after the group is torn down.
    """
    trace = _point_to_point()  # every rank's sends and receives, which gloo's recorder lacks
    dump = torchcompat.flight_recorder_dump()
    if not dump:
        return trace  # no recorder in this torch build: nothing more to say
    members = torchcompat.group_members()
    by_group: dict[str, list[torchcompat.FlightRecorderEntry]] = {}
    for e in dump.get("entries") or ():
        by_group.setdefault(str((e.get("process_group") or [""])[0]), []).append(e)
    for name, entries in by_group.items():
        # A rebuilt group is a new one with the same name: keep the newest group's entries only.
        newest = max(e.get("pg_id", 0) for e in entries)
        entries = [e for e in entries if e.get("pg_id", 0) == newest]
        desc = str((entries[-1].get("process_group") or ["", ""])[1])
        # Point-to-point entries (NCCL records them) are left to distlab's own record.
        for e in [e for e in entries if not e.get("is_p2p")][-last:]:
            trace.append({
                "seq": e["collective_seq_id"],
                "op": str(e.get("profiling_name", "?")).split(":", 1)[-1],
                "shapes": e.get("input_sizes") or [],
                "dtypes": e.get("input_dtypes") or [],
                "p2p": False,
                "group": name,
                "desc": desc,
                "members": members.get(name, []),
            })
    return trace

"""This rank's latest collectives, from torch's flight recorder, for diagnosing a hang.

``errors.diagnose_collectives`` compares these across ranks: who never arrived, where the others
waited, or which ranks disagree on a collective's op or shapes.
"""

from __future__ import annotations

from typing import Any

from ..wire import CollectiveEntry
from . import torchcompat

__all__ = ["collective_trace"]


def collective_trace(last: int) -> list[CollectiveEntry]:
    """This rank's latest ``last`` collectives of each process group it belongs to, oldest first
    within a group: the default group and every sub-group (a device mesh's dimensions, a pipeline's
    pairs), so that a hang in any of them is diagnosed.

    Each is {seq, op, shapes, dtypes, p2p, group, desc, members}: ``seq`` counts the group's
    collectives (or, for send and recv, its point-to-point operations) from 1. Still readable after
    the group is torn down.
    """
    dump = torchcompat.flight_recorder_dump()
    if not dump:
        return []  # no recorder in this torch build: nothing to say
    members = torchcompat.group_members()
    by_group: dict[str, list[dict[str, Any]]] = {}
    for e in dump.get("entries") or ():
        by_group.setdefault(str((e.get("process_group") or [""])[0]), []).append(e)
    trace: list[CollectiveEntry] = []
    for name, entries in by_group.items():
        # A rebuilt group is a new one with the same name: keep the newest group's entries only.
        newest = max(e.get("pg_id", 0) for e in entries)
        entries = [e for e in entries if e.get("pg_id", 0) == newest]
        desc = str((entries[-1].get("process_group") or ["", ""])[1])
        for e in entries[-last:]:
            trace.append({
                "seq": e["p2p_seq_id"] if e.get("is_p2p") else e["collective_seq_id"],
                "op": str(e.get("profiling_name", "?")).split(":", 1)[-1],
                "shapes": e.get("input_sizes") or [],
                "dtypes": e.get("input_dtypes") or [],
                "p2p": bool(e.get("is_p2p")),
                "group": name,
                "desc": desc,
                "members": members.get(name, []),
            })
    return trace

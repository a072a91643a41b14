"""This rank's latest collectives, from torch's flight recorder, for diagnosing a hang.

``errors.diagnose_collectives`` compares these across ranks: who never arrived, where the others
waited, or which ranks disagree on a collective's op or shapes.
"""

from __future__ import annotations

from ..wire import CollectiveEntry
from . import torchcompat

__all__ = ["collective_trace"]


def collective_trace(last: int) -> list[CollectiveEntry]:
    """This rank's latest ``last`` collectives on the default process group, oldest first.

    Each is {seq, op, shapes, dtypes, p2p}: ``seq`` counts the group's collectives (or, for send
    and recv, its point-to-point operations) from 1. Still readable after the group is torn down.
    """
    dump = torchcompat.flight_recorder_dump()
    if not dump:
        return []  # no recorder in this torch build: nothing to say
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

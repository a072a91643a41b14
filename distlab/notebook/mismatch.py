"""torch's check of each collective across ranks, when it fails: one line per rank, with its line.

Under ``debug=True`` (``%dist start --debug``: TORCH_DISTRIBUTED_DEBUG=DETAIL) torch wraps every
process group so that, before a collective runs, the ranks compare its fingerprint (sequence number,
op, the tensors' shapes, dtypes and devices); when they differ each rank raises "Detected mismatch
between collectives on ranks" at once instead of waiting in the collective. Its message is one long
line of C++ structs per rank; this turns the ranks' failures into the line a person needs: which
collective, what each rank was about to do and at which line of its cell, and what differs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import RankFailure, format_ranks

__all__ = ["Fingerprint", "checked_start_note", "installed_version", "mismatch_note"]

_MISMATCH = "Detected mismatch between collectives on ranks"
# "Rank 1 is running collective: CollectiveFingerPrint(SequenceNumber=1, OpType=ALLREDUCE, TensorShape=[2],
#  TensorDtypes=Float, TensorDeviceTypes=...": the first is the failing rank's own. A collective with no
#  tensor (a barrier) prints "SequenceNumber=1OpType=BARRIER)", with no comma.
_OWN = re.compile(
    r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+),? ?OpType=(\w+)"
    r"(?:, TensorShape=\[([^\]]*)\])?(?:, TensorDtypes=(\w+))?"
)
# torch's names in the fingerprint (c10d's OpType, ScalarType) -> the names a cell calls them by.
_OPS = {"ALLREDUCE": "all_reduce", "ALLGATHER": "all_gather", "_ALLGATHER_BASE": "all_gather_into_tensor",
        "REDUCE_SCATTER": "reduce_scatter", "_REDUCE_SCATTER_BASE": "reduce_scatter_tensor", "BROADCAST": "broadcast",
        "BARRIER": "barrier", "ALLTOALL": "all_to_all", "ALLTOALL_BASE": "all_to_all_single", "GATHER": "gather",
        "SCATTER": "scatter", "REDUCE": "reduce", "ALLREDUCE_COALESCED": "all_reduce_coalesced"}
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Int": "int32",
           "Long": "int64", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}
# torch releases whose CPU build kills a rank that builds DDP under the check: SIGSEGV in DDP's
# construction (``Logger.set_construction_data_and_log``, on the check's wrapped gloo group), also under
# plain torchrun with TORCH_DISTRIBUTED_DEBUG=DETAIL (benchmarks/RESULTS.md, the check at the call).
_DDP_CRASHES_UNDER_CHECK = ("2.13.",)


def checked_start_note(backend: str, torch_version: str | None) -> str:
    """What a lab started with the check (``debug=True``) should say first, or "": on gloo, a torch
    whose CPU build crashes a rank building DDP under it. ``torch_version``: the installed torch's."""
    if backend != "gloo" or torch_version is None or not torch_version.startswith(_DDP_CRASHES_UNDER_CHECK):
        return ""
    return (f"with the collective check on gloo, torch {torch_version} crashes a rank that builds a DDP model "
            "(a segfault in DDP's construction, under plain torchrun too); FSDP2, tensor parallelism and "
            "collectives by hand are checked; for DDP, %dist stop and start without --debug")



def installed_version(package: str) -> str | None:
    """The installed version of ``package`` (the ranks' own, where they share the notebook's
    environment), read from its metadata: the notebook never imports torch."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None

# A frame of the cell's own code in a rank's traceback, and the source line under it.
_CELL_FRAME = re.compile(r'File "<rank \d+ cell>", line (\d+), in [^\n]*\n\s*([^\n]*)')


@dataclass(frozen=True)
class Fingerprint:
    """What one rank was about to run: the group's collective number, op, shape, dtype; and where."""

    seq: int
    op: str
    shape: str | None
    dtype: str
    line: int | None
    code: str

    def describe(self) -> str:
        shape = f"[{self.shape}]" if self.shape is not None else ""
        where = f" at line {self.line} ({self.code})" if self.line is not None else ""
        op, dtype = _OPS.get(self.op, self.op.lower()), _DTYPES.get(self.dtype, self.dtype.lower())
        if not dtype and not shape:  # a barrier: torch prints no tensor for it
            return f"{op}{where}"
        return f"{op} of {dtype}{shape}{where}"


def mismatch_note(failures: Mapping[int, RankFailure]) -> str | None:
    """The one line for a collective torch's check found the ranks disagree on, or None."""
    prints = {rank: p for rank, f in failures.items() if (p := fingerprint(f)) is not None}
    if not prints:
        return None
    differ = [what for what, key in (("op", "op"), ("collective number", "seq"), ("shape", "shape"),
                                     ("dtype", "dtype")) if len({getattr(p, key) for p in prints.values()}) > 1]
    by_call: dict[str, list[int]] = {}
    for rank, p in sorted(prints.items()):
        by_call.setdefault(p.describe(), []).append(rank)
    calls = "; ".join(f"rank {format_ranks(ranks)}: {call}" for call, ranks in by_call.items())
    seq = min(p.seq for p in prints.values()) + 1  # torch counts a group's collectives from 0
    if "op" in differ:  # two different collectives: their tensors differ as a consequence
        differ = ["op"]
    what = " and ".join(differ) if differ else "fingerprint"
    return (f"collective #{seq} of its group: the ranks disagree on its {what}, caught before it ran (torch's "
            f"check, debug=True): {calls}")


def fingerprint(failure: RankFailure) -> Fingerprint | None:
    """What ``failure``'s rank was about to run, if torch's check stopped it; else None."""
    if _MISMATCH not in (failure.evalue or ""):
        return None
    own = _OWN.search(failure.evalue)
    if own is None:
        return None
    frames = list(_CELL_FRAME.finditer(failure.traceback))  # the last is where the cell called torch
    line, code = (int(frames[-1].group(1)), frames[-1].group(2).strip()) if frames else (None, "")
    return Fingerprint(int(own.group(2)), own.group(3), own.group(4), own.group(5) or "", line, code)

"""Each rank's memory at its latest recorded step, beside what the theory predicts for the layout its
watch read (``theory.sharded_memory``). Pure functions of ``TelemetryStore.records()`` and ``meta()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .. import theory
from ..records import Layout, StepRecord
from .replica_divergence import Meta

__all__ = ["RankMemory", "memory_by_rank", "memory_message"]


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory at its latest recorded step, next to the theory's prediction (None: no model)."""

    rank: int
    step: int
    parameters_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    peak_bytes: int
    theory: theory.ShardedMemory | None

    @property
    def resident_bytes(self) -> int:
        return self.parameters_bytes + self.gradients_bytes + self.optimizer_bytes

    @property
    def error(self) -> float | None:
        """(measured - theory) / theory of the resident model state."""
        if self.theory is None or not self.theory.total_bytes:
            return None
        return (self.resident_bytes - self.theory.total_bytes) / self.theory.total_bytes


def memory_by_rank(records: Sequence[StepRecord], meta: Meta) -> list[RankMemory]:
    """Each rank's latest memory record with ``theory.sharded_memory`` for the layout its watch read."""
    latest: dict[int, StepRecord] = {}
    for rec in records:
        if rec.get("memory") and (rec["rank"] not in latest or rec["step"] >= latest[rec["rank"]]["step"]):
            latest[rec["rank"]] = rec
    out = []
    for rank in sorted(latest):
        rec = latest[rank]
        mem = rec["memory"]
        assert mem is not None
        layout = _layout(meta, rank)
        predicted = theory.sharded_memory(**layout) if layout else None
        out.append(RankMemory(rank, rec["step"], mem["parameters_bytes"], mem["gradients_bytes"],
                              mem["optimizer_bytes"], mem["peak_bytes"], predicted))
    return out


def _layout(meta: Meta, rank: int) -> Layout | None:
    """The model configuration ``rank``'s watch read (None before its first update)."""
    mine = meta.get(rank)
    return mine.get("layout") if mine else None


def memory_message(rows: Sequence[RankMemory], meta: Meta) -> str:
    if not rows:
        return "memory: not recorded"
    peak = max(rows, key=lambda r: r.peak_bytes)
    text = (f"memory: model state {rows[0].resident_bytes / 1e6:.2f} MB on rank {rows[0].rank}, "
            f"peak {peak.peak_bytes / 1e6:.2f} MB (rank {peak.rank})")
    layout = _layout(meta, rows[0].rank)
    if rows[0].theory is not None and layout:
        error = rows[0].error
        text += (f"; theory ({layout['strategy']}, data x tensor parallel {layout['data_parallel']} x "
                 f"{layout['tensor_parallel']}, {layout['optimizer']}) {rows[0].theory.total_bytes / 1e6:.2f} MB"
                 + (f" ({error:+.1%})" if error is not None else ""))
    return text

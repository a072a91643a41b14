"""Whether a run's replicas still hold the same weights, from the records' exact checksums: which
ranks and layers differ, since which step, how far apart (their weights' norms), and the likely
cause. A pure function of ``TelemetryStore.records()`` and ``meta()`` (``analysis.divergence``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..records import LayerValues, StepRecord, WatchMeta

__all__ = ["Divergence", "Meta", "divergence", "total_norm"]

#: Each rank's watch's description, by rank (``TelemetryStore.meta()``).
Meta = Mapping[int, WatchMeta]


@dataclass(frozen=True)
class Divergence:
    """Whether the replicas' weights still agree, and if not where, since when and why."""

    diverged: bool
    message: str
    checked_steps: int = 0
    first_step: int | None = None
    ranks: list[int] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    cause: str | None = None
    started_apart: bool = False
    #: Steps whose checksums differ across ranks.
    mismatch_steps: list[int] = field(default_factory=list)
    #: {rank: [(step, |W_rank| / |W_ref| - 1)]} at sampled steps: how far apart, not just whether.
    spread: dict[int, list[tuple[int, float]]] = field(default_factory=dict)


_CAUSE_START = (
    "the replicas started from different weights: seed every rank the same (torch.manual_seed) "
    "or broadcast rank {ref}'s weights (DDP does this when it wraps the model)"
)
_CAUSE_NO_AVERAGE = (
    "the replicas started equal and drifted apart: gradients are not averaged across ranks; wrap the "
    "model in DDP, or all-reduce the gradients and divide by world_size before the update"
)
_CAUSE_DDP = (
    "DDP keeps replicas equal, so something changed weights outside it: an update on some ranks only, "
    "or parameters edited by hand"
)


def divergence(records: Sequence[StepRecord], meta: Meta) -> Divergence:
    """Compare the ranks' exact checksums; name the ranks, the layers, the first step and the cause."""
    ranks = sorted({rec["rank"] for rec in records} | set(meta))
    if len(ranks) < 2:
        return Divergence(False, "one rank: nothing to compare")
    ref = ranks[0]
    ref_meta = meta.get(ref)
    if ref_meta and ref_meta.get("replicated") is False:
        return Divergence(False, "each rank's weights are its own (replicated=False): no replicas to compare")
    if ref_meta and ref_meta.get("layers") and set(ref_meta.get("sharded_layers") or ()) >= set(ref_meta["layers"]):
        return Divergence(False, "weights sharded across ranks (FSDP2, tensor parallel): no replicas to compare")
    by_step: dict[int, dict[int, StepRecord]] = defaultdict(dict)
    for rec in records:
        by_step[rec["step"]][rec["rank"]] = rec

    start_layers: set[str] = set()
    start_ranks: set[int] = set()
    ref_start = ref_meta.get("initial_checksums") if ref_meta else None
    for r in ranks[1:]:
        their_meta = meta.get(r)
        theirs = their_meta.get("initial_checksums") if their_meta else None
        if ref_start and theirs:
            differing = {name for name in ref_start if theirs.get(name) != ref_start[name]}
            if differing:
                start_layers |= differing
                start_ranks.add(r)

    checked, mismatches = 0, []
    bad_ranks: set[int] = set(start_ranks)
    bad_layers: set[str] = set(start_layers)
    for step in sorted(by_step):
        recs = by_step[step]
        if ref not in recs or recs[ref].get("checksum") is None:
            continue
        others = [r for r in ranks[1:] if r in recs and recs[r].get("checksum") is not None]
        if not others:
            continue
        checked += 1
        ref_layers = recs[ref].get("layer_checksums") or {}
        step_bad = False
        for r in others:
            if recs[r]["checksum"] != recs[ref]["checksum"]:
                step_bad = True
                bad_ranks.add(r)
                theirs = recs[r].get("layer_checksums") or {}
                bad_layers |= {name for name in ref_layers if theirs.get(name) != ref_layers[name]}
        if step_bad:
            mismatches.append(step)

    spread = _weight_spread(by_step, ranks)
    layer_order = list(_layers(meta, ref) or sorted(bad_layers))
    layers = [name for name in layer_order if name in bad_layers]
    if not mismatches and not start_ranks:
        if checked == 0:
            return Divergence(False, "replicas: no checksums compared yet", spread=spread)
        return Divergence(
            False, f"replicas agree: checksums equal on all {len(ranks)} ranks at {checked} steps",
            checked_steps=checked, spread=spread,
        )
    if start_ranks:
        cause, first = _CAUSE_START.format(ref=ref), (mismatches[0] if mismatches else None)
    elif not all(m and m.get("ddp") for m in map(meta.get, ranks)):
        cause, first = _CAUSE_NO_AVERAGE, mismatches[0]
    else:
        cause, first = _CAUSE_DDP, mismatches[0]
    when = "from the start" if start_ranks else f"since step {first}"
    total = len(_layers(meta, ref) or layers)
    message = (
        f"replicas diverge: rank {_ranks_text(sorted(bad_ranks))} differ{'s' if len(bad_ranks) == 1 else ''} "
        f"from rank {ref} in {len(layers)} of {total} layers ({', '.join(layers[:6])}"
        f"{', ...' if len(layers) > 6 else ''}) {when}: {cause}"
    )
    return Divergence(
        True, message, checked_steps=checked, first_step=first, ranks=sorted(bad_ranks), layers=layers,
        cause=cause, started_apart=bool(start_ranks), mismatch_steps=mismatches, spread=spread,
    )


def _layers(meta: Meta, rank: int) -> list[str]:
    """The layers ``rank``'s watch named ([] before its first publish)."""
    mine = meta.get(rank)
    return (mine.get("layers") if mine else None) or []


def _weight_spread(by_step: dict[int, dict[int, StepRecord]], ranks: list[int]) -> dict[int, list[tuple[int, float]]]:
    ref = ranks[0]
    spread: dict[int, list[tuple[int, float]]] = {r: [] for r in ranks}
    for step in sorted(by_step):
        recs = by_step[step]
        base = total_norm(_weight_norms(recs.get(ref)))
        if not base:
            continue
        for r in ranks:
            norm = total_norm(_weight_norms(recs.get(r)))
            if norm is not None:
                spread[r].append((step, norm / base - 1.0))
    return spread


def _weight_norms(rec: StepRecord | None) -> LayerValues | None:
    return rec.get("weight_norm") if rec else None


def total_norm(norms: LayerValues | None) -> float | None:
    """The 2-norm of the whole model from its layers' norms (None when there are none)."""
    return math.sqrt(sum(v * v for v in norms.values())) if norms else None


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)

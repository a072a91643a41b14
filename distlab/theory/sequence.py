"""Splitting the tokens: context parallelism (a sequence over ranks, ring attention) and expert
parallelism (tokens sent to the rank of their expert).

Ring attention (Liu et al. 2023) gives each rank a part of the sequence: it keeps its queries, and
the keys and values travel around the ring, one rank's part per step. With a causal mask, a query
attends only to keys at or before it, so a rank holding the sequence's end has the most work.
Splitting the sequence into 2N chunks and giving rank r chunks r and 2N-1-r (one from each end,
"zigzag") evens it out. Counted here in query-key pairs computed, a key chunk entirely in a query
chunk's future skipped, and a chunk on the diagonal computed whole (then masked), as a blockwise
kernel does.

Expert parallelism (Lepikhin et al. 2020, GShard; Fedus et al. 2021, Switch) gives each expert a
capacity: ``capacity_factor * tokens / experts`` slots per batch; tokens routed to a full expert are
dropped (passed on unchanged by the residual connection).
"""

from __future__ import annotations

import math

from .. import checks
from ._checks import checked_count, checked_positive

__all__ = ["causal_load_imbalance", "expert_capacity", "ring_attention_pairs"]

LAYOUTS = ("contiguous", "zigzag")


def _chunks(sequence_length: int, ranks: int, layout: str) -> list[list[int]]:
    """Each rank's chunks, as chunk indices of equal size."""
    checks.choice("layout", layout, LAYOUTS, error=ValueError)
    parts = ranks if layout == "contiguous" else 2 * ranks
    if sequence_length % parts:
        raise ValueError(f"sequence_length {sequence_length} must split into {parts} equal chunks for {layout}")
    if layout == "contiguous":
        return [[r] for r in range(ranks)]
    return [[r, 2 * ranks - 1 - r] for r in range(ranks)]


def ring_attention_pairs(sequence_length: int, ranks: int, layout: str = "contiguous") -> list[int]:
    """Query-key pairs each rank computes in causal ring attention (its list, rank by rank).

    ``layout``: ``"contiguous"`` (rank r holds the r-th of N chunks) or ``"zigzag"`` (the r-th and the
    (2N-1-r)-th of 2N). A query chunk skips every key chunk after it and computes the others whole,
    its own (the diagonal) included: ``contiguous`` gives rank r ``(r + 1) (L/N)^2``; ``zigzag`` gives
    every rank ``(2N + 1) (L/2N)^2``.
    """
    length, n = checked_count("sequence_length", sequence_length), checked_count("ranks", ranks)
    chunks = _chunks(length, n, layout)
    size = length // sum(len(c) for c in chunks)
    return [sum(c + 1 for c in mine) * size * size for mine in chunks]


def causal_load_imbalance(ranks: int, layout: str = "contiguous") -> float:
    """The busiest rank's work over the mean, in causal ring attention: ``2N/(N+1)`` for contiguous
    chunks (towards 2 as N grows), exactly 1 for zigzag."""
    n = checked_count("ranks", ranks)
    pairs = ring_attention_pairs(2 * n, n, layout)
    return max(pairs) / (sum(pairs) / n)


def expert_capacity(tokens: int, experts: int, capacity_factor: float = 1.0) -> int:
    """Slots each expert has for a batch of ``tokens``: ``floor(capacity_factor * tokens / experts)``
    (the Switch Transformer's definition, Fedus et al. 2021, section 2.2). At a factor of 1 a
    perfectly even router fills every slot; any imbalance drops tokens."""
    t, e = checked_count("tokens", tokens), checked_count("experts", experts)
    return math.floor(checked_positive("capacity_factor", capacity_factor) * t / e)

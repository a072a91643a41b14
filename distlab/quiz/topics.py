"""The 15 topics of the curriculum, in teaching order, and how a learner may name one."""

from __future__ import annotations

import difflib

__all__ = ["DIFFICULTIES", "TOPICS", "resolve_difficulty", "resolve_topic"]

#: slug -> title, in teaching order (notebooks/README.md maps each topic to its notebooks). The slug names
#: the bank file and prefixes question ids.
TOPICS: dict[str, str] = {
    "why-distribute": "Why distribute",
    "training-round": "The training round, step by step",
    "data-parallelism": "Data parallelism",
    "sync-async": "Synchronous vs asynchronous; parameter server vs all-reduce",
    "model-parallelism": "Model parallelism",
    "communication-cost": "Communication cost",
    "batch-and-lr": "Global batch and learning rate",
    "memory-sharding": "Memory and sharding",
    "mixed-precision": "Mixed precision and accumulation",
    "torch-distributed-api": "The torch.distributed API",
    "data-loading": "Data loading",
    "metrics-logging": "Metrics and logging",
    "pitfalls": "Pitfalls and debugging",
    "fault-tolerance": "Fault tolerance",
    "scaling": "Scaling analysis",
}

DIFFICULTIES: tuple[str, ...] = ("easy", "medium", "hard")


def resolve_topic(topic: object) -> str:
    """The slug of ``topic``, given as a slug (any case) or as its number in the curriculum (1-15)."""
    text = str(topic).strip().lower() if isinstance(topic, (str, int)) and not isinstance(topic, bool) else ""
    if text in TOPICS:
        return text
    if text.isdigit() and 1 <= int(text) <= len(TOPICS):
        return list(TOPICS)[int(text) - 1]
    close = difflib.get_close_matches(text, TOPICS, n=1)
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"unknown topic {topic!r}{guess}; choose one of: {', '.join(TOPICS)} (or its number, 1-{len(TOPICS)})"
    )


def resolve_difficulty(difficulty: object) -> str | None:
    """``difficulty`` checked: None (any) or one of easy, medium, hard (any case)."""
    if difficulty is None:
        return None
    text = difficulty.strip().lower() if isinstance(difficulty, str) else ""
    if text not in DIFFICULTIES:
        raise ValueError(f"unknown difficulty {difficulty!r}; use easy, medium or hard (or leave it out for all)")
    return text

"""How much a watch measures and how often it publishes: one dataclass, checked once."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

__all__ = ["WatchConfig", "make_config"]


@dataclass(frozen=True)
class WatchConfig:
    """Sampling and rate limits of ``distlab.watch``.

    Every step gets its clock, loss and timed all-reduce buckets. What reads the whole model is
    sampled: per-layer statistics (snapshot, difference, four norms: ~6 ms at 4M parameters on one
    CPU core) and replica checksums (one pass, ~0.4 ms) every 50 steps, the interval PyTorch
    Lightning logs at by default. Each rank publishes once a second: every publish costs CPU on the
    rank, the controller and the notebook, which on a small machine share the ranks' cores.
    benchmarks/RESULTS.md has what these defaults cost (2-3% of the step throughput at 4M and 12M
    parameters on 2 shared cores; about 1 point of it is the notebook's store and redraws, which
    share the ranks' cores there) and what faster settings cost;
    pass ``stats_every=1`` to see every step's norms.
    """

    #: Per-layer gradient norm, weight norm and update-to-weight ratio every this many steps (0: never).
    stats_every: int = 50
    #: Replica checksum (exact, per layer) every this many steps (0: never).
    checksum_every: int = 50
    #: Time every all-reduce bucket of a DDP model (see ``telemetry.comm``).
    time_allreduce: bool = True
    #: At most one publish per this many seconds per rank (ipyparallel ``publish_data``); the
    #: notebook's dashboard redraws as they arrive.
    publish_interval_s: float = 1.0
    #: Steps kept on the rank (the final publish sends them all).
    buffer_steps: int = 512
    #: Steps sent in one live publish at most (older ones stay on the rank).
    window_steps: int = 128
    #: Publish at all (off: records stay on the rank, read them with ``Watch.records()``).
    publish: bool = True


def make_config(config: WatchConfig | None, overrides: dict[str, Any]) -> WatchConfig:
    """``config`` with ``overrides`` applied, every value checked; errors name the field and the fix."""
    base = config if config is not None else WatchConfig()
    if not isinstance(base, WatchConfig):
        raise TypeError(f"config must be a distlab.telemetry.WatchConfig, got {type(base).__name__}")
    known = {f.name: f for f in fields(WatchConfig)}
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise TypeError(f"watch() got unknown option(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    values = {name: getattr(base, name) for name in known}
    values.update(overrides)
    for name in ("stats_every", "checksum_every"):
        _whole(name, values[name], minimum=0)
    for name in ("buffer_steps", "window_steps"):
        _whole(name, values[name], minimum=1)
    interval = values["publish_interval_s"]
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
        raise ValueError(f"publish_interval_s must be a number of seconds > 0, like 1.0 (got {interval!r})")
    for name in ("time_allreduce", "publish"):
        if not isinstance(values[name], bool):
            raise ValueError(f"{name} must be True or False (got {values[name]!r})")
    return WatchConfig(**values)


def _whole(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, like {name}=10 (got {value!r})")

"""How much a watch measures and how often it publishes: one dataclass, checked once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from .. import checks

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
    #: Time every collective: a DDP model's all-reduce buckets (see ``telemetry.comm``), and the
    #: collectives of any other model op by op (FSDP2, tensor parallelism, by hand; ``telemetry.ops``).
    time_allreduce: bool = True
    #: Record each step's memory: model state and the step's peak (``telemetry.memory``).
    track_memory: bool = True
    #: At most one publish per this many seconds per rank (ipyparallel ``publish_data``); the
    #: notebook's dashboard redraws as they arrive.
    publish_interval_s: float = 1.0
    #: Steps kept on the rank (the final publish sends them all).
    buffer_steps: int = 512
    #: Steps sent in one live publish at most (older ones stay on the rank).
    window_steps: int = 128
    #: Publish at all (off: records stay on the rank, read them with ``Watch.records()``).
    publish: bool = True
    #: The ranks' weights are replicas of one model (data parallel, sharded or not). False where each
    #: rank's weights are its own (an expert of expert parallelism, a pipeline stage trained by
    #: hand): the dashboard then compares no replicas and applies no memory model.
    replicated: bool = True


def make_config(config: WatchConfig | None, overrides: Mapping[str, object]) -> WatchConfig:
    """``config`` with ``overrides`` applied, every value checked; errors name the field and the fix."""
    base = config if config is not None else WatchConfig()
    checks.instance("config", base, WatchConfig, what="a distlab.telemetry.WatchConfig", error=TypeError)
    known = {f.name: f for f in fields(WatchConfig)}
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise TypeError(f"watch() got unknown option(s) {', '.join(unknown)}: choose from {', '.join(known)}")
    values = {name: getattr(base, name) for name in known}
    values.update(overrides)
    for name, minimum in (("stats_every", 0), ("checksum_every", 0), ("buffer_steps", 1), ("window_steps", 1)):
        checks.whole(name, values[name], minimum=minimum, example=f"{name}=10")
    checks.positive(
        "publish_interval_s", values["publish_interval_s"], kind="a number of seconds", example="publish_interval_s=1.0"
    )
    for name in ("time_allreduce", "track_memory", "publish", "replicated"):
        checks.flag(name, values[name])
    return WatchConfig(**values)

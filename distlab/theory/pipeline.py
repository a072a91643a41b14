"""Pipeline parallelism: the bubble of the GPipe, 1F1B and interleaved 1F1B schedules, how many
micro-batches' activations a stage holds at once, the time of a step, and the order in which
``torch.distributed.pipelining`` runs each stage's forwards and backwards (with a timeline to draw).

p stages, m micro-batches, v chunks (model pieces) per device for the interleaved schedule. Sources:
Huang et al. 2019 (GPipe); Narayanan et al. 2019, "PipeDream" (1F1B), in its flushed, synchronous
form (PipeDream-Flush, Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training");
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (interleaved 1F1B).
"""

from __future__ import annotations

from .. import checks
from ._checks import checked_count, checked_non_negative

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def _shape(stages: int, micro_batches: int, schedule: str, chunks: int) -> tuple[int, int, int]:
    p, m = checked_count("stages", stages), checked_count("micro_batches", micro_batches)
    checks.choice("schedule", schedule, SCHEDULES)
    v = checked_count("chunks", chunks)
    if v != 1 and schedule != "interleaved":
        raise ValueError(f"chunks={chunks!r} applies to schedule='interleaved' only: leave chunks=1 for {schedule}")
    return p, m, v


def _timed_shape(stages: int, micro_batches: int, schedule: str, chunks: int) -> tuple[int, int, int]:
    p, m, v = _shape(stages, micro_batches, schedule, chunks)
    if schedule == "interleaved" and m < p:
        # With fewer micro-batches than stages a device waits between its chunks' rounds: the paper's
        # bubble no longer holds (Megatron-LM refuses such m; torch runs it, pipeline_timeline shows it).
        raise ValueError(
            f"the interleaved bubble holds for micro_batches >= stages ({p}), got {m}: use more micro-batches, "
            "or pipeline_timeline to see the schedule"
        )
    return p, m, v


def bubble_fraction(stages: int, micro_batches: int, schedule: str = "gpipe", chunks: int = 1) -> float:
    """Share of a step's time the stages sit idle: ``(p-1) / (m+p-1)`` for GPipe and 1F1B (1F1B saves
    memory, not time); ``(p-1) / (v*m + p-1)`` interleaved, whose bubble is v times shorter (m >= p)."""
    p, m, v = _timed_shape(stages, micro_batches, schedule, chunks)
    return (p - 1) / (v * m + p - 1)


def bubble_ratio(stages: int, micro_batches: int, schedule: str = "gpipe", chunks: int = 1) -> float:
    """Bubble time over ideal (busy) time: ``(p-1) / m``, and ``(p-1) / (v*m)`` interleaved (m >= p)."""
    p, m, v = _timed_shape(stages, micro_batches, schedule, chunks)
    return (p - 1) / (v * m)


def _micro_batches_per_round(stages: int, micro_batches: int) -> int:
    # torch's ScheduleInterleaved1F1B runs m // max(1, m // p) micro-batches per round (p when p divides m).
    return micro_batches // max(1, micro_batches // stages)


def _interleaved_warmup(stage: int, stages: int, micro_batches: int, chunks: int) -> int:
    # torch's _get_warmup_ops (Megatron's count when p divides m): forwards before the first backward.
    warmup = (chunks - 1) * _micro_batches_per_round(stages, micro_batches) + 2 * (stages - 1 - stage)
    return min(warmup, micro_batches * chunks)


def in_flight_micro_batches(
    stage: int, stages: int, micro_batches: int, schedule: str = "1f1b", chunks: int = 1
) -> float:
    """The most micro-batches whose activations stage ``stage`` (0 is the first) holds at once.

    * ``"gpipe"``: all m, every forward runs before the first backward;
    * ``"1f1b"``: ``min(m, p - stage)``, the forwards torch's ``Schedule1F1B`` runs before its first
      backward (the first stage p, the last 1);
    * ``"interleaved"``: the device holds (micro-batch, chunk) pairs, each 1/v of its layers'
      activations; this returns their number divided by v, in micro-batches' worth of the device's
      activations. The pairs: torch's warm-up ``(v-1) * r + 2 * (p-1-stage)`` (r micro-batches per
      round, p when p divides m) plus the forward that comes before the first steady backward, at most
      ``v * m``. More than 1F1B's: the price of the shorter bubble.
    """
    p, m, v = _shape(stages, micro_batches, schedule, chunks)
    s = checked_count("stage", stage, minimum=0)
    if s >= p:
        raise ValueError(f"stage must be below stages ({p}), got {stage!r}")
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, p - s)
    pairs = min(_interleaved_warmup(s, p, m, v) + 1, m * v)
    return pairs / v


def pipeline_step_time_s(
    stages: int, micro_batches: int, forward_s: float, backward_s: float, schedule: str = "1f1b", chunks: int = 1
) -> float:
    """Time of one step of uniform stages, communication free: ``(m + p - 1) * (f + b)`` for GPipe and
    1F1B, ``(m + (p-1)/v) * (f + b)`` interleaved, where f and b are one stage's forward and backward
    of one micro-batch (each chunk takes 1/v of them; interleaved needs m >= p)."""
    p, m, v = _timed_shape(stages, micro_batches, schedule, chunks)
    per_micro_batch = checked_non_negative("forward_s", forward_s) + checked_non_negative("backward_s", backward_s)
    return (m + (p - 1) / v) * per_micro_batch


# --------------------------------------------------------------------------------------------------
# The order torch runs, and its timeline
# --------------------------------------------------------------------------------------------------


def _single_stage_order(stage: int, p: int, m: int, schedule: str) -> list[str]:
    if schedule == "gpipe":  # ScheduleGPipe: every forward, then every backward, both in order.
        return [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
    # Schedule1F1B: min(m, p - stage) forwards, then a backward and a forward in turn, then the backwards left.
    warmup = min(m, p - stage)
    order = [f"F{i}" for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < m:
        order.append(f"B{backward}")
        backward += 1
        if forward < m:
            order.append(f"F{forward}")
            forward += 1
    return order


def _interleaved_order(rank: int, p: int, m: int, v: int) -> list[str]:
    # ScheduleInterleaved1F1B._calculate_single_rank_operations and _get_1f1b_rank_ops, without the idle
    # slots: warm-up forwards, then a forward and a backward in turn, then the backwards left.
    per_round = _micro_batches_per_round(p, m)
    warmup = _interleaved_warmup(rank, p, m, v)
    total = m * v
    next_forward: dict[int, int] = {}
    next_backward: dict[int, int] = {}

    def forward(step: int) -> str:
        stage = ((step // per_round) % v) * p + rank
        index = next_forward.get(stage, 0)
        next_forward[stage] = index + 1
        return f"{stage}F{index}"

    def backward(step: int) -> str:
        stage = (v - 1 - ((step - warmup) // per_round) % v) * p + rank
        index = next_backward.get(stage, 0)
        next_backward[stage] = index + 1
        return f"{stage}B{index}"

    order = [forward(step) for step in range(warmup)]
    for step in range(warmup, total):
        order += [forward(step), backward(step)]
    order += [backward(step) for step in range(total, total + warmup)]
    return order


def pipeline_schedule(stages: int, micro_batches: int, schedule: str = "1f1b", chunks: int = 1) -> list[list[str]]:
    """Each stage's actions in the order ``torch.distributed.pipelining`` runs them (one list per stage).

    ``"gpipe"`` (``ScheduleGPipe``) and ``"1f1b"`` (``Schedule1F1B``, which needs m >= p): ``"F3"`` is the
    forward of micro-batch 3, ``"B3"`` its backward. ``"interleaved"`` (``ScheduleInterleaved1F1B``,
    v = ``chunks`` stages per device; list i is device i, which holds stages i, i+p, ...): actions are
    named as torch prints them, stage then kind then micro-batch, ``"4F0"``.
    """
    p, m, v = _shape(stages, micro_batches, schedule, chunks)
    if schedule == "1f1b" and m < p:
        raise ValueError(f"torch's Schedule1F1B needs micro_batches >= stages ({p}), got {m}: use more micro-batches")
    if schedule == "interleaved":
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(
                f"torch's ScheduleInterleaved1F1B needs micro_batches to be a multiple of its {rounds} rounds "
                f"(max(1, m // stages)), got {m}: use a multiple of stages"
            )
        return [_interleaved_order(rank, p, m, v) for rank in range(p)]
    return [_single_stage_order(stage, p, m, schedule) for stage in range(p)]


def _parse(action: str, device: int, p: int, interleaved: bool) -> tuple[str, int, int]:
    # -> (kind, micro-batch, global stage)
    if interleaved:
        kind = "F" if "F" in action else "B"
        stage, index = action.split(kind)
        return kind, int(index), int(stage)
    return action[0], int(action[1:]), device


def pipeline_timeline(
    stages: int, micro_batches: int, forward_s: float, backward_s: float, schedule: str = "1f1b", chunks: int = 1
) -> list[list[tuple[str, float, float]]]:
    """When each action of :func:`pipeline_schedule` runs, per stage: ``(action, start_s, end_s)``.

    Each stage runs its actions in torch's order, each as soon as the stage is free and its input is
    there: a forward needs the previous stage's forward of that micro-batch, a backward the next stage's
    backward (the last stage's, its own forward). Stages are uniform (``forward_s`` and ``backward_s`` per
    micro-batch, 1/v of them per chunk interleaved) and sends take no time. The last end is
    :func:`pipeline_step_time_s`; the gaps are the bubble.
    """
    p, m, v = _shape(stages, micro_batches, schedule, chunks)
    forward = checked_non_negative("forward_s", forward_s) / v
    backward = checked_non_negative("backward_s", backward_s) / v
    orders = pipeline_schedule(p, m, schedule, v)
    interleaved = schedule == "interleaved"
    last_stage = p * v - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, global stage) -> end
    timeline: list[list[tuple[str, float, float]]] = [[] for _ in range(p)]
    position, free = [0] * p, [0.0] * p
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for device in range(p):
            # Run this device's next actions while their inputs are ready.
            while position[device] < len(orders[device]):
                action = orders[device][position[device]]
                kind, index, stage = _parse(action, device, p, interleaved)
                if kind == "F":
                    needed = ("F", index, stage - 1) if stage > 0 else None
                else:
                    needed = ("B", index, stage + 1) if stage < last_stage else ("F", index, stage)
                if needed is not None and needed not in done:
                    break
                start = max(free[device], done[needed] if needed else 0.0)
                end = start + (forward if kind == "F" else backward)
                done[(kind, index, stage)] = free[device] = end
                timeline[device].append((action, start, end))
                position[device] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for torch's orders; guards the loop
            raise RuntimeError(f"the {schedule} order deadlocks for {p} stages and {m} micro-batches")
    return timeline

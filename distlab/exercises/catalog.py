"""The exercises, in the order the course meets them."""

from __future__ import annotations

from importlib import import_module

from .model import Exercise

__all__ = ["EXERCISES", "get", "names"]

_MODULES = (
    "average_gradients",
    "distributed_sampler",
    "ring_allreduce",
    "parameter_server",
    "ddp_from_hooks",
    "zero_1",
    "tensor_parallel_mlp",
    "pipeline_1f1b",
    "atomic_checkpoint",
)


def _load() -> dict[str, Exercise]:
    exercises = (import_module(f".tasks.{module}", __package__).EXERCISE for module in _MODULES)
    return {exercise.name: exercise for exercise in exercises}


#: name -> Exercise, in course order.
EXERCISES: dict[str, Exercise] = _load()


def names() -> list[str]:
    return list(EXERCISES)


def get(name: str) -> Exercise:
    """The exercise called ``name``; a ValueError listing the names if there is none."""
    if isinstance(name, str) and name in EXERCISES:
        return EXERCISES[name]
    if isinstance(name, str) and name.replace("_", "-") in EXERCISES:
        return EXERCISES[name.replace("_", "-")]
    raise ValueError(f"there is no exercise {name!r}; the exercises are: {', '.join(EXERCISES)}")

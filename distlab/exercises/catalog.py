"""The exercises, found as the folders of this package that hold a ``task.py``, in the order the course meets them."""

from __future__ import annotations

from importlib import import_module, resources

from .model import Exercise

__all__ = ["EXERCISES", "get", "names"]

# The course's order is not the lessons' (ddp-from-hooks is met after parameter-server, and
# atomic-checkpoint last): it is said here. A folder not named here still counts, after these.
_COURSE = (
    "average_gradients",
    "distributed_sampler",
    "ring_allreduce",
    "parameter_server",
    "ddp_from_hooks",
    "zero_1",
    "tensor_parallel_mlp",
    "pipeline_1f1b",
    "diverged_replicas",
    "clip_sharded_gradients",
    "expert_dispatch",
    "diloco_outer_step",
    "ddp_comm_hook",
    "fsdp_shard_sizes",
    "atomic_checkpoint",
)


def _folders() -> list[str]:
    """The exercise folders of this package, in course order."""
    found = [entry.name for entry in resources.files(__package__).iterdir() if entry.joinpath("task.py").is_file()]
    return sorted(found, key=lambda module: (_COURSE.index(module) if module in _COURSE else len(_COURSE), module))


def _load() -> dict[str, Exercise]:
    exercises: dict[str, Exercise] = {}
    for module in _folders():
        exercise = import_module(f".{module}.task", __package__).EXERCISE
        if exercise.module != module:
            # The rank imports the grader by the exercise's name: a folder named otherwise is never found.
            raise ImportError(f"exercise {exercise.name!r} lives in {module}/: rename the folder {exercise.module}/")
        exercises[exercise.name] = exercise
    return exercises


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

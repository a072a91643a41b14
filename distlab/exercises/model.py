"""What an exercise is: the task a learner reads, the code they start from, hints, and how it is graded."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

__all__ = ["Exercise"]


@dataclass(frozen=True)
class Exercise:
    """One coding exercise, the folder ``distlab/exercises/<module>/``; graded on ranks by its ``grader.py``.

    ``defines`` are the names the learner's ``%%ddp`` cells define and the grader calls;
    ``world_sizes`` the worlds it is graded in (the grader starts its own ranks: the learner's lab
    and what it holds are left alone); ``case_timeout_s`` bounds each case, so a solution that
    deadlocks is stopped and named.
    """

    name: str
    title: str
    lesson: str  # the notebook where the topic is taught, e.g. "03-ring-allreduce.ipynb"
    task: str  # Markdown
    starter: str  # a %%ddp cell
    hints: tuple[str, ...]
    defines: tuple[str, ...]
    world_sizes: tuple[int, ...] = (2,)
    case_timeout_s: float = 30.0

    @property
    def module(self) -> str:
        """The name of the exercise's folder (its package: ``task``, ``solution.py``, ``grader``)."""
        return self.name.replace("-", "_")

    def solution(self) -> str:
        """The reference solution, as the text of a ``%%ddp`` cell (kept out of the learner's view)."""
        return resources.files(f"distlab.exercises.{self.module}").joinpath("solution.py").read_text("utf-8")

"""The learner's magics: %quiz (practice questions) and %exercise (coding exercises graded on the
live ranks). They use the lab %dist started, which ``magics.register`` gives them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .. import checks
from ..notebook.dist_args import checked

__all__ = ["LearningMagics"]


@magics_class
class LearningMagics(Magics):
    """%quiz and %exercise; ``lab()`` is the session's lab (None before %dist start)."""

    def __init__(self, shell: Any, lab: Callable[[], Any]) -> None:
        super().__init__(shell)
        self._lab = lab

    @property
    def lab(self) -> Any:
        lab = self._lab()
        return lab if lab is not None and lab.running else None

    def _running_lab(self) -> Any:
        if self.lab is None:
            raise UsageError("no lab is running: start one with %dist start -n 2")
        return self.lab

    # ------------------------------------------------------------------------ %quiz

    @magic_arguments()
    @argument("topic", nargs="?", default=None, help="a topic, e.g. communication-cost")
    @argument("-n", type=checked(lambda v: checks.whole("-n", v, minimum=1, example="-n 3")), default=None,
              help="number of questions")
    @argument("--difficulty", default=None, help="easy, medium or hard")
    @argument("--seed", type=int, default=None, help="the same questions and numbers each time")
    @line_magic
    def quiz(self, line: str) -> Any:
        """Practice questions on a topic, graded in Python: %quiz communication-cost -n 3"""
        args = parse_argstring(self.quiz, line)
        from .. import quiz

        lab = self.lab
        try:
            if args.topic is None:
                from ..exercises.catalog import EXERCISES

                return quiz.summary([(e.name, e.title) for e in EXERCISES.values()])
            return quiz.show(args.topic, n=args.n, difficulty=args.difficulty, lab=lab, seed=args.seed)
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    # ------------------------------------------------------------------------ %exercise

    @magic_arguments()
    @argument("words", nargs="*", help="NAME, check NAME or hint NAME; nothing for the list")
    @argument("--seed", type=checked(lambda v: checks.whole("--seed", v, minimum=0, example="--seed 1")),
              default=None, help="the same cases as a result that gave this seed")
    @line_magic
    def exercise(self, line: str) -> Any:
        """Coding exercises graded on the live ranks: %exercise, %exercise NAME, %exercise check NAME"""
        args = parse_argstring(self.exercise, line)
        from .. import exercises

        words = list(args.words)
        try:
            if not words:
                return exercises.overview()
            if words[0] in ("check", "hint") and len(words) == 2:
                if words[0] == "hint":
                    print(exercises.hint(words[1]))
                    return None
                return exercises.check(words[1], self._running_lab(), seed=args.seed)
            if len(words) == 1 and words[0] not in ("check", "hint"):
                view = exercises.show(words[0])
                # The starter becomes the next cell where the front end takes it (JupyterLab does);
                # the task shows it too, for front ends that do not.
                if self.shell is not None:
                    self.shell.set_next_input(view.exercise.starter, replace=False)
                return view
        except ValueError as exc:  # LabUsageError too: one line, nothing changed
            raise UsageError(str(exc)) from None
        raise UsageError(
            f"%exercise takes NAME, check NAME or hint NAME (got {line.strip()!r}); %exercise alone lists them"
        )

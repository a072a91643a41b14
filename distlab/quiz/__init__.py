"""Practice quizzes on the 15 topics of the curriculum, graded in Python::

    q = bank().get("batch-and-lr/global-batch")
    attempt = q.draw(seed=1)          # numbers drawn for this attempt
    print(attempt.prompt)
    attempt.check("256")              # -> CheckResult(correct=..., feedback=...)
    attempt.answer()                  # computed by distlab.theory, never stored

``show(topic)`` (what ``%quiz TOPIC`` calls) gives the widget; ``summary()`` the mastery per topic.
Live questions are graded on a running lab: ``q.draw(lab=lab)``. ``predict(...)`` asks for a guess
before a measurement, graded by theory, and shows it beside the measurement (``p.reveal(x)``).
"""

from .loader import Bank, BankError, bank, load_bank, schema
from .model import Attempt, CheckResult, Option, Question
from .predict import Comparison, Prediction, predict
from .progress import Summary, TopicMastery, progress_path
from .session import choose_questions, show, summary
from .topics import DIFFICULTIES, TOPICS

__all__ = [
    "DIFFICULTIES",
    "TOPICS",
    "Attempt",
    "Bank",
    "BankError",
    "CheckResult",
    "Comparison",
    "Option",
    "Prediction",
    "Question",
    "Summary",
    "TopicMastery",
    "bank",
    "choose_questions",
    "load_bank",
    "predict",
    "progress_path",
    "schema",
    "show",
    "summary",
]

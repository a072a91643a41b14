"""The learner's progress file: what each quiz question and coding exercise got last time, in the
Jupyter data directory. The quiz records answers in it and the exercises' checks their results; the
quiz's summary (``distlab.quiz.summary()``) reads both.

The file is small JSON, rewritten whole on every answer: read, update, write to a temporary file in the
same folder, fsync, ``os.replace``. A crash or a second kernel never leaves half a file behind; two
kernels answering at the same moment may lose one answer, never the file.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from jupyter_core.paths import jupyter_data_dir

__all__ = ["ENV_VAR", "ExerciseRecord", "ProgressFile", "QuestionRecord", "progress_path"]

#: Set to a file, or to a folder that holds ``quiz-progress.json``, to keep progress elsewhere (tests do).
ENV_VAR = "DISTLAB_QUIZ_PROGRESS"
_FILE_NAME = "quiz-progress.json"
_VERSION = 1


def progress_path() -> Path:
    """Where progress is kept: ``$DISTLAB_QUIZ_PROGRESS``, else ``<jupyter data dir>/distlab/quiz-progress.json``."""
    override = os.environ.get(ENV_VAR)
    if override:
        path = Path(override).expanduser()
        return path / _FILE_NAME if path.is_dir() else path
    return Path(jupyter_data_dir()) / "distlab" / _FILE_NAME


@dataclass
class QuestionRecord:
    """A learner's history with one question."""

    attempts: int = 0
    right: int = 0
    last_right: bool = False
    last_seen: float = 0.0  # Unix time


@dataclass
class ExerciseRecord:
    """A learner's history with one coding exercise."""

    checks: int = 0
    passed: bool = False  # ever
    last_passed: bool = False
    last_seen: float = 0.0  # Unix time


class ProgressFile:
    """The progress file, read when made; each record re-reads it first so other kernels' answers stay."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or progress_path()
        self.records, self.exercises = _read(self.path)

    def record(self, question_id: str, correct: bool) -> QuestionRecord:
        """Count one answer to ``question_id`` and save at once."""
        self.records, self.exercises = _read(self.path)
        entry = self.records.setdefault(question_id, QuestionRecord())
        entry.attempts += 1
        entry.right += int(correct)
        entry.last_right = correct
        entry.last_seen = time.time()
        self._save()
        return entry

    def record_exercise(self, name: str, passed: bool) -> ExerciseRecord:
        """Count one check of exercise ``name`` and save at once."""
        self.records, self.exercises = _read(self.path)
        entry = self.exercises.setdefault(name, ExerciseRecord())
        entry.checks += 1
        entry.passed = entry.passed or passed
        entry.last_passed = passed
        entry.last_seen = time.time()
        self._save()
        return entry

    def _save(self) -> None:
        _write_atomically(
            self.path,
            {
                "version": _VERSION,
                "questions": {k: asdict(v) for k, v in self.records.items()},
                "exercises": {k: asdict(v) for k, v in self.exercises.items()},
            },
        )

    def mastered(self, question_id: str) -> bool:
        """A question is mastered when its last answer was right."""
        entry = self.records.get(question_id)
        return bool(entry and entry.last_right)


def _read(path: Path) -> tuple[dict[str, QuestionRecord], dict[str, ExerciseRecord]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}, {}
    except OSError as error:
        # A quiz is still worth taking when its progress cannot be kept; saving will say so too.
        warnings.warn(
            f"cannot read quiz progress from {path} ({error}); set {ENV_VAR} to a writable file", stacklevel=3
        )
        return {}, {}
    try:
        data = json.loads(text)
        questions = {str(k): QuestionRecord(**v) for k, v in data["questions"].items()}
        # Files written before exercises were kept have no "exercises".
        exercises = {str(k): ExerciseRecord(**v) for k, v in data.get("exercises", {}).items()}
        return questions, exercises
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        # Keep the unreadable file for a person to look at, and start afresh rather than block the quiz.
        kept = path.with_name(f"{path.name}.unreadable-{int(time.time())}")
        os.replace(path, kept)
        warnings.warn(
            f"quiz progress in {path} was unreadable ({error}); moved to {kept}, starting afresh", stacklevel=3
        )
        return {}, {}


def _write_atomically(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump(data, file, indent=1, sort_keys=True)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise

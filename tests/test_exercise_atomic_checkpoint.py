"""atomic-checkpoint: the reference survives the kills and leaves nothing behind; the mistakes learners
make, each named (graded by test_exercises_graded.py)."""

from __future__ import annotations

import glob
import os
import tempfile

import psutil
from _exercises import Harness
from conftest import ours

from distlab.exercises.results import ExerciseResult

harness = Harness("atomic-checkpoint")


def _savers() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or ()
        # (ours: another test run's savers, an xdist worker beside this one, are not this test's)
        if any("distlab.exercises.atomic_checkpoint.saver import serve" in part for part in cmdline) and ours(proc):
            found.append(proc)
    return found


def leftovers() -> list[object]:
    """The saving processes and the cases' folders: they end with their case, whatever the code did."""
    return [*_savers(), *glob.glob(os.path.join(tempfile.gettempdir(), "distlab-atomic-checkpoint-*"))]


def reference_measures(result: ExerciseResult) -> None:
    kills = [case for case in result.cases if "killed" in case.name]
    assert len(kills) == 2
    for case in kills:
        assert case.measured["kills"] == 5
        assert 0 <= case.measured["stray_files"] <= 5  # at most one temporary file per kill
        assert case.measured["checkpoint_bytes"] > 2**20
        assert "the folder was fsync'ed" in case.message


WRITES_IN_PLACE = """
def save_checkpoint(state, path):
    torch.save(state, path)

def load_checkpoint(path):
    return torch.load(path)
"""

TEMPORARY_FILE_IN_TMP = """
import os, tempfile

def save_checkpoint(state, path):
    fd, temp = tempfile.mkstemp(suffix=".pt")
    with os.fdopen(fd, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)

def load_checkpoint(path):
    return torch.load(path)
"""

RENAMED_BEFORE_CLOSE = """
import os, pickle

def save_checkpoint(state, path):
    with open(path + ".tmp", "wb") as f:
        pickle.dump(state, f)
        os.replace(path + ".tmp", path)

def load_checkpoint(path):
    with open(path, "rb") as f:
        return pickle.load(f)
"""

NO_FSYNC = """
import os

def save_checkpoint(state, path):
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
    os.replace(path + ".tmp", path)

def load_checkpoint(path):
    return torch.load(path)
"""

LOAD_SWALLOWS_ERRORS = (
    harness.solution.split("def load_checkpoint")[0]
    + """
def load_checkpoint(path):
    try:
        return torch.load(path)
    except Exception:
        return {}
"""
)


MISTAKES = {
    "writes-in-place": (WRITES_IN_PLACE, "write to a temporary file and os.replace it"),
    "temporary-file-in-tmp": (TEMPORARY_FILE_IN_TMP, "the temporary file is in another folder"),
    "renamed-before-close": (RENAMED_BEFORE_CLOSE, "renamed onto `path` before it was complete"),
    "no-fsync": (NO_FSYNC, "not fsync'ed before os.replace"),
    "load-swallows-errors": (LOAD_SWALLOWS_ERRORS, "instead of raising"),
}

"""atomic-checkpoint: the reference survives the kills; the mistakes learners make fail, each named."""

from __future__ import annotations

import glob
import os
import tempfile

import psutil
import pytest
from _exercises import Harness, learners_lab
from conftest import ours

pytestmark = pytest.mark.cluster

NAME = "atomic-checkpoint"
harness = Harness(NAME)
lab = learners_lab()


def _savers() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or ()
        # (ours: another test run's savers, an xdist worker beside this one, are not this test's)
        if any("distlab.exercises.atomic_checkpoint.saver import serve" in part for part in cmdline) and ours(proc):
            found.append(proc)
    return found


def test_the_reference_solution_survives_every_kill_and_leaves_nothing_behind(lab):
    result = harness.check(lab, harness.solution)
    assert result.passed, result.feedback
    kills = [case for case in result.cases if "killed" in case.name]
    assert len(kills) == 2
    for case in kills:
        assert case.measured["kills"] == 5
        assert 0 <= case.measured["stray_files"] <= 5  # at most one temporary file per kill
        assert case.measured["checkpoint_bytes"] > 2**20
        assert "the folder was fsync'ed" in case.message
    assert _savers() == []  # the saving processes died with their cases
    assert glob.glob(os.path.join(tempfile.gettempdir(), "distlab-atomic-checkpoint-*")) == []


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


@pytest.mark.parametrize(
    ("code", "named"),
    [
        (WRITES_IN_PLACE, "write to a temporary file and os.replace it"),
        (TEMPORARY_FILE_IN_TMP, "the temporary file is in another folder"),
        (RENAMED_BEFORE_CLOSE, "renamed onto `path` before it was complete"),
        (NO_FSYNC, "not fsync'ed before os.replace"),
        (LOAD_SWALLOWS_ERRORS, "instead of raising"),
    ],
    ids=["writes-in-place", "temporary-file-in-tmp", "renamed-before-close", "no-fsync", "load-swallows-errors"],
)
def test_each_mistake_fails_with_feedback_that_names_it(lab, code, named):
    result = harness.check(lab, code)
    assert not result.passed
    assert named in str(result), result  # the feedback or a case's row: what the learner sees
    assert result.failures[0].rank is not None
    assert _savers() == []

"""nbgrader's assignment flow on a class's hub, across real users: the instructor and two learners.

The instructor's side (root here, as the course's grader is on a class's own server) writes the
assignment, releases it, collects, autogrades on live ranks, and releases the feedback. Each learner
is a system user of their own, in their own network namespace (their server started once by the hub),
and runs nbgrader's commands as a terminal of their server would (``_hub.as_learner``): fetch the
assignment into their home, fill it in, submit it through the class's exchange, fetch their feedback.
One learner submits the reference, the other an average that only sums and wrong answers to a numeric
question and to a live one (graded on the ranks of the submission's kernel).

nbgrader's exchange keeps learners apart by the folders' modes and by names no one can guess, not by
the submissions' own modes (a submission's folder is 0777, its files 0644, so that the instructor can
remove them): no learner may list the inbound or the feedback folder, a submission's name ends in a
random string, and a feedback page's name is a hash of a secret kept in the submitter's home (0700).
What is tried here is each of those, as the other learner, beside the owner's own attempt.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import nbformat
import psutil
import pytest
from _hub import Hub, as_learner, namespaces_of
from _jupyter import wait_for
from conftest import spawned_since
from test_classroom_nbgrader import EXERCISE, QUESTIONS, SUMS_ONLY, _solutions, _text, config_text, nbgrader

from distlab.classroom.assignment import write_assignment

pytestmark = pytest.mark.e2e

LEARNERS = ["dlg-ann", "dlg-bob"]  # names of this test's own: the hub's other tests make dl-ann and dl-bob
COURSE_ID = "dist101"
NAME = "ps1"

# Run as a learner: each attempt and what it got ("ok", or the error's name), from a JSON list on stdin.
PROBE = r"""
import json, os, sys
said = {}
for verb, path in json.loads(sys.stdin.read()):
    try:
        os.listdir(path) if verb == "list" else open(path, "rb").read(1)
        said[f"{verb} {path}"] = "ok"
    except Exception as exc:
        said[f"{verb} {path}"] = type(exc).__name__
print(json.dumps(said))
"""

# Run as a learner: their answers typed into the fetched notebook, as they would in JupyterLab.
FILL = r"""
import json, sys
import nbformat
task = json.loads(sys.stdin.read())
nb = nbformat.read(task["path"], as_version=4)
for cell in nb.cells:
    grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
    if grade_id in task["answers"]:
        cell.source = task["answers"][grade_id]
nbformat.write(nb, task["path"])
"""


def _netns_of(hub: Hub, name: str) -> str:
    pid = hub.request("GET", f"/hub/api/users/{name}")[1]["servers"][""]["state"]["pid"]
    inode = os.stat(f"/proc/{pid}/ns/net").st_ino
    return next(n for n in namespaces_of(hub.process.pid) if os.stat(f"/run/netns/{n}").st_ino == inode)


def _pids_of(uid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-u", str(uid)], capture_output=True, text=True, check=False).stdout
    return {int(p) for p in out.split()}


def test_learners_fetch_submit_and_read_their_own_feedback_graded_on_live_ranks_and_nothing_of_each_other(
    tmp_path: Path,
) -> None:
    # The exchange every learner writes to: outside the suite's folder, which is root's alone.
    exchange = Path(tempfile.mkdtemp(prefix="distlab-exchange-", dir="/tmp"))
    try:
        exchange.chmod(0o1777)
        (tmp_path / "hub").mkdir()
        with Hub(tmp_path / "hub", LEARNERS, []) as hub:
            _grade(hub, tmp_path, exchange)
    finally:
        shutil.rmtree(exchange, ignore_errors=True)


def _grade(hub: Hub, tmp_path: Path, exchange: Path) -> None:
    ann_user, bob_user = (hub.users[n] for n in LEARNERS)
    course, instructor = tmp_path / "course", tmp_path / "instructor-home"
    course.mkdir()
    instructor.mkdir()
    (course / "nbgrader_config.py").write_text(config_text(exchange))
    reference = _solutions(write_assignment(course, NAME, [EXERCISE], list(QUESTIONS)))
    for step in ("generate_assignment", "release_assignment"):
        nbgrader(course, instructor, step, NAME)

    # The learners' venv's bin first, as in a terminal of their server; it holds no `alembic`, and
    # fetch, submit and fetch_feedback never open the gradebook, which is the instructor's alone.
    learner_path = f"{os.path.dirname(hub.python)}:/usr/bin:/bin"
    assert not Path(os.path.dirname(hub.python), "alembic").exists()
    netns: dict[str, str] = {}

    def learner(name: str, *argv: str, stdin: str | None = None) -> str:
        user = hub.users[name]
        done = as_learner(user, netns[name], [hub.python, *argv], stdin=stdin, cwd=user.pw_dir, path=learner_path,
                          timeout=300)
        assert done.returncode == 0, f"{name}: {' '.join(argv)} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout + done.stderr

    def probe(name: str, attempts: list[tuple[str, str]]) -> dict[str, str]:
        said: dict[str, str] = json.loads(learner(name, "-c", PROBE, stdin=json.dumps(attempts)).splitlines()[-1])
        return said

    answers = {"dlg-ann": reference, "dlg-bob": {"average-gradients-code": SUMS_ONLY, "q1-answer": "answer_1 = 3",
                                           "q2-answer": "answer_2 = -1.0"}}
    submitted: dict[str, str] = {}
    for name in LEARNERS:
        hub.start_server(name)  # their namespace, and their home made theirs alone (0700)
        netns[name] = _netns_of(hub, name)
        user = hub.users[name]
        config = Path(user.pw_dir, "nbgrader_config.py")
        config.write_text(config_text(exchange))
        os.chown(config, user.pw_uid, user.pw_gid)
        learner(name, "-m", "nbgrader", "fetch_assignment", NAME)
        fetched = Path(user.pw_dir, COURSE_ID, NAME, f"{NAME}.ipynb")
        assert fetched.stat().st_uid == user.pw_uid  # in their home, theirs
        # What the learner got: the %%ddp cell is nbgrader's stub, and the reference is nowhere in it.
        released = {c.metadata.nbgrader["grade_id"]: c.source for c in nbformat.read(fetched, as_version=4).cells}
        assert released["average-gradients-code"] == "%%ddp\n# YOUR CODE HERE\nraise NotImplementedError()"
        assert released["q1-answer"] == "# YOUR CODE HERE\nraise NotImplementedError()"
        written = [text for key, text in released.items() if not key.endswith(("-task", "-prompt", "-intro"))]
        assert not any("all_reduce" in text or "SOLUTION" in text for text in written)
        learner(name, "-c", FILL, stdin=json.dumps({"path": str(fetched), "answers": answers[name]}))
        said = learner(name, "-m", "nbgrader", "submit", NAME)
        found = re.search(r"Destination: (\S+)", said)
        assert found, said
        submitted[name] = found.group(1)
        # No name was given: nbgrader named the submission after the system user who made it.
        assert Path(submitted[name]).name.startswith(f"{name}+{NAME}+"), submitted[name]

    # The exchange, as each learner: ann's submission, her cache (its secret names her feedback).
    inbound, outbound = exchange / COURSE_ID / "inbound", exchange / COURSE_ID / "outbound" / NAME
    ann_cache = Path(ann_user.pw_dir, ".local/share/jupyter/nbgrader_cache", COURSE_ID)
    ann_copy = next(ann_cache.glob(f"dlg-ann+{NAME}+*"))
    attempts = [("list", str(inbound)), ("list", str(outbound)), ("list", str(ann_cache)),
                ("read", str(ann_copy / "submission_secret.txt")), ("read", str(ann_copy / f"{NAME}.ipynb"))]
    ann, bob = probe("dlg-ann", attempts), probe("dlg-bob", attempts)
    # The inbound is write-only for every learner, its owner too: no one learns another's submission's name.
    assert ann[f"list {inbound}"] == bob[f"list {inbound}"] == "PermissionError"
    # The controls: both read the released assignment, and ann her own copy and its secret.
    assert ann[f"list {outbound}"] == bob[f"list {outbound}"] == "ok"
    for verb, path in attempts[2:]:
        assert ann[f"{verb} {path}"] == "ok", (verb, path, ann)
        assert bob[f"{verb} {path}"] == "PermissionError", (verb, path, bob)
    # And the submission's own name is beyond guessing: what bob could derive of it, without its random end, is no file.
    derived = inbound / ann_copy.name
    assert probe("dlg-bob", [("read", str(derived / f"{NAME}.ipynb"))])[f"read {derived}/{NAME}.ipynb"] == (
        "FileNotFoundError")

    before = {p.pid for p in psutil.process_iter()}
    for step in ("collect", "autograde", "generate_feedback", "release_feedback"):
        nbgrader(course, instructor, step, NAME)
    assert sorted(p.name for p in (course / "submitted").iterdir()) == LEARNERS

    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        def score(cell: str, name: str) -> float:
            return float(gradebook.find_grade(cell, NAME, NAME, name).score)

        assert [score(c, "dlg-ann") for c in ("average-gradients-test", "q1-test", "q2-test")] == [5, 1, 1]
        assert [score(c, "dlg-bob") for c in ("average-gradients-test", "q1-test", "q2-test")] == [0, 0, 0]

    pages: dict[str, Path] = {}
    for name in LEARNERS:
        learner(name, "-m", "nbgrader", "fetch_feedback", NAME)
        found_pages = list(Path(hub.users[name].pw_dir, COURSE_ID, NAME, "feedback").glob(f"*/{NAME}.html"))
        assert len(found_pages) == 1, found_pages
        pages[name] = found_pages[0]
        assert pages[name].stat().st_uid == hub.users[name].pw_uid
    feedback = {name: _text(page.read_text()) for name, page in pages.items()}
    # Each reads what the grader measured on the ranks: the cases passed, or how the gradient was off.
    assert "average-gradients: passed: all 8 cases passed, in worlds of 2 and 3 ranks" in feedback["dlg-ann"]
    assert "Score: 5.0 / 5.0" in feedback["dlg-ann"] and "Score: 1.0 / 1.0" in feedback["dlg-ann"]
    assert "Right: " in feedback["dlg-ann"]  # the quiz's word on the question, with the number
    assert "Right: rank 1 holds 5." in feedback["dlg-ann"]  # the live question, graded on the ranks
    assert "`0.weight`'s gradient is 2 times DDP's, the sum over the ranks, not the mean" in feedback["dlg-bob"]
    assert "is 3 times DDP's" in feedback["dlg-bob"]  # the 3-rank world's cases ran too
    assert "Score: 0.0 / 5.0" in feedback["dlg-bob"] and "Not quite. Too low." in feedback["dlg-bob"]

    # Bob after ann's feedback: the released pages cannot be listed, ann's fetched page is in her home,
    # and claiming her id to fetch_feedback gets him his own page again (the page is found by his secret).
    released = exchange / COURSE_ID / "feedback"
    attempts = [("list", str(released)), ("read", str(pages["dlg-ann"]))]
    ann, bob = probe("dlg-ann", attempts), probe("dlg-bob", attempts)
    assert ann[f"list {released}"] == bob[f"list {released}"] == "PermissionError"
    assert ann[f"read {pages['dlg-ann']}"] == "ok" and bob[f"read {pages['dlg-ann']}"] == "PermissionError"
    learner("dlg-bob", "-m", "nbgrader", "fetch_feedback", NAME, "--student=dlg-ann")
    bobs = list(Path(bob_user.pw_dir, COURSE_ID, NAME, "feedback").glob(f"*/{NAME}.html"))
    assert [_text(p.read_text()) for p in bobs] == [feedback["dlg-bob"]]
    # And ann's page was released (the instructor sees two), so bob's miss is not for want of one.
    assert len(list(released.glob("*.html"))) == 2

    # Nothing of the grading outlived it: the autograde kernels and their labs (by the notebook's last
    # cell, or distlab's reaper where nbclient killed a kernel still stopping them: hence a wait)...
    wait_for(lambda: not spawned_since(before), 120, "the autograde kernels and their labs to end")
    assert not list(instructor.rglob("lab-*.json"))
    # ...and each learner's nbgrader: the server is all they run, and with it stopped, nothing.
    for name in LEARNERS:
        uid = hub.users[name].pw_uid
        server = hub.request("GET", f"/hub/api/users/{name}")[1]["servers"][""]["state"]["pid"]
        assert _pids_of(uid) == {server}, [psutil.Process(p).cmdline() for p in _pids_of(uid)]
        status, _ = hub.request("DELETE", f"/hub/api/users/{name}/server")
        assert status in (202, 204)
        wait_for(lambda u=uid: not _pids_of(u), 60, f"{name}'s processes to end with their server")

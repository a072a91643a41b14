"""The instructor's view of a class (``distlab.classroom.instructor``) on a real hub of system users:
two learners with a lab each and one instructor. The instructor reads every learner's server, labs,
ranks and progress as JSON and stops one learner's lab, leaving the other's running; a learner is
refused the view and the stop; a learner's server that does not answer is shown as such; in
Chromium, the instructor logs in at the hub, sees the class and stops a lab with its button (a learner
logged in at the hub is refused the page), and a POST on the login cookie without the page's xsrf token is refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import pytest
from _browser import chromium_or_skip, launch_options
from _hub import ADMIN_PASSWORD, REPO, USER_PASSWORD, Hub, LearnerKernel
from _jupyter import wait_for

from distlab.classroom.roster import READ_TIMEOUT_S

pytestmark = pytest.mark.e2e

ADA, BO, TUTOR = "dliv-ada", "dliv-bo", "dliv-tutor"
VIEW = "/services/distlab-instructor"
SHOTS = REPO / "test-artifacts" / "classroom"
# Generous: a 2-core machine running other tests too.
DEADLINE_S = 120

# Ada answers one question right (graded by the quiz itself) and gives up on another, as the quiz's
# widget records them (quiz.widget: a revealed answer counts as wrong).
QUIZ = """
from distlab.quiz.loader import bank
from distlab.quiz.progress import Progress
first, second = [q for q in bank() if not q.needs_lab][:2]
attempt = first.draw(seed=1)
result = attempt.check(attempt.answer())
assert result.correct, result
Progress().record(first.id, result.correct)
Progress().record(second.id, False)
print(Progress().path)
"""


@dataclass
class Class:
    hub: Hub
    tokens: dict[str, str]
    kernels: dict[str, LearnerKernel]

    def get(self, path: str, who: str = TUTOR) -> tuple[int, Any]:
        return self.hub.request("GET", path, token=self.tokens[who])

    def post(self, path: str, who: str = TUTOR) -> tuple[int, Any]:
        return self.hub.request("POST", path, token=self.tokens[who])

    def state(self) -> dict[str, Any]:
        status, body = self.get(f"{VIEW}/api/class")
        assert status == 200, (status, body, self.hub.log()[-3000:])
        return {row["name"]: row for row in body["learners"]}

    def panel(self, learner: str) -> list[dict[str, Any]]:
        """The learner's own side panel's labs (their server's endpoint, their token)."""
        status, body = self.get(f"/user/{learner}/distlab/labs", who=learner)
        assert status == 200, (status, body)
        return list(body["labs"])


@pytest.fixture(scope="module")
def klass(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Class]:
    with Hub(tmp_path_factory.mktemp("instructor"), [ADA, BO], [TUTOR]) as hub:
        for name in (ADA, BO):
            hub.start_server(name)
        tokens = {name: hub.user_token(name) for name in (ADA, BO, TUTOR)}
        kernels = {name: LearnerKernel(hub, name, tokens[name], path=f"{name}.ipynb") for name in (ADA, BO)}
        kernels[ADA].run("%load_ext distlab\n%dist start -n 2")
        kernels[BO].run("%load_ext distlab\n%dist start -n 1")
        kernels[ADA].run(QUIZ)
        yield Class(hub, tokens, kernels)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # the test runs as root, in the pid namespace the learners' servers share
    except ProcessLookupError:
        return False
    return True


def _server_process(learner: str) -> psutil.Process:
    (server,) = [p for p in psutil.process_iter(["username", "cmdline"])
                 if p.info["username"] == learner and "jupyterhub.singleuser" in (p.info["cmdline"] or [])]
    return server


def _log_in(page: Any, hub: Hub, name: str, password: str) -> None:
    page.goto(f"{hub.url}/hub/login")
    page.fill("input[name=username]", name)
    page.fill("input[name=password]", password)
    page.click("#login_submit")
    page.wait_for_url(lambda url: "/hub/login" not in url, timeout=DEADLINE_S * 1000)


def _one_line(body: Any) -> str:
    assert isinstance(body, dict) and body.get("message"), body
    assert "\n" not in body["message"], body
    return str(body["message"])


def test_the_instructor_sees_every_learner_with_their_labs_ranks_and_progress(klass: Class) -> None:
    # The learners' servers load the question bank on their first progress read: wait for it.
    state = wait_for(lambda: (s := klass.state()) and all(row["progress"] for row in s.values()) and s,
                     DEADLINE_S, "both learners' progress in the view")
    assert set(state) == {ADA, BO}, state  # the instructor is not listed as a learner
    for name, ranks in ((ADA, 2), (BO, 1)):
        row = state[name]
        assert row["server"] == "running" and row["error"] is None, row
        (lab,) = row["labs"]
        (panel,) = klass.panel(name)
        assert lab["id"] == panel["id"]  # what the learner's panel lists
        # Started and idle, from the lab's state file where it says (newer labs), else unknown.
        assert (lab["started"], lab["last_cell"]) == (panel.get("started"), panel.get("last_cell")), lab
        assert (lab["idle_s"] is None) == (panel.get("started") is None and panel.get("last_cell") is None), lab
        assert lab["notebook"] == f"{name}.ipynb" and lab["world_size"] == ranks, lab
        assert [r["rank"] for r in lab["ranks"]] == list(range(ranks)), lab
        assert all(r["health"] == "ok" and _alive(r["pid"]) for r in lab["ranks"]), lab
        assert lab["busy"] is False and lab["backend"], lab
    ada, bo = state[ADA]["progress"], state[BO]["progress"]
    assert ada["questions"]["answered"] == 2 and ada["questions"]["right"] == 1, ada
    assert sum(topic["answered"] for topic in ada["topics"]) == 2, ada
    assert ada["exercises_attempted"] == 0 and ada["last_seen"], ada
    assert bo["questions"]["answered"] == 0 and bo["last_seen"] is None, bo


def test_a_learner_is_refused_the_view_and_the_stop(klass: Class) -> None:
    (lab,) = klass.state()[BO]["labs"]
    for path in (f"{VIEW}/", f"{VIEW}/api/class"):
        status, body = klass.get(path, who=ADA)
        assert status == 403, (path, status, body)
    status, body = klass.post(f"{VIEW}/api/learners/{BO}/labs/{lab['id']}/stop", who=ADA)
    assert status == 403 and "instructors" in _one_line(body), (status, body)
    # Nobody at all: the page sends a browser to the hub's login, the API answers 403.
    assert klass.hub.request("GET", f"{VIEW}/api/class", token="not-a-token")[0] == 403
    assert [lab["id"]] == [panel["id"] for panel in klass.panel(BO)]  # untouched


def test_the_instructors_stop_ends_one_learners_lab_and_leaves_the_others(klass: Class) -> None:
    state = klass.state()
    (ada_lab,), (bo_lab,) = state[ADA]["labs"], state[BO]["labs"]
    ada_pids = [r["pid"] for r in ada_lab["ranks"]]

    status, body = klass.post(f"{VIEW}/api/learners/{ADA}/labs/{ada_lab['id']}/stop")
    assert status == 200, (status, body)
    assert body["learner"] == ADA and body["id"] == ada_lab["id"] and "stopped" in body["message"], body
    wait_for(lambda: not any(_alive(pid) for pid in ada_pids), DEADLINE_S, "Ada's ranks to end")
    assert klass.panel(ADA) == []
    assert klass.state()[ADA]["labs"] == []
    assert [bo_lab["id"]] == [panel["id"] for panel in klass.panel(BO)]
    assert all(_alive(r["pid"]) for r in bo_lab["ranks"])

    # Wrong requests, each answered in one line: the learner's server's own, forwarded; the view's.
    status, body = klass.post(f"{VIEW}/api/learners/{ADA}/labs/{ada_lab['id']}/stop")
    assert status == 404 and f"{ADA}'s server answered 404" in _one_line(body), (status, body)
    status, body = klass.post(f"{VIEW}/api/learners/{ADA}/labs/not-a-lab/stop")
    assert status == 400 and "is not a lab id" in _one_line(body), (status, body)
    status, body = klass.post(f"{VIEW}/api/learners/nobody-here/labs/{bo_lab['id']}/stop")
    assert status == 404 and "no user 'nobody-here'" in _one_line(body), (status, body)
    status, body = klass.post(f"{VIEW}/api/learners/{TUTOR}/labs/{bo_lab['id']}/stop")
    assert status == 403 and "not a learner" in _one_line(body), (status, body)


def test_a_learners_server_that_does_not_answer_is_shown_as_such_and_the_others_still_are(klass: Class) -> None:
    server = _server_process(BO)
    server.suspend()  # its sockets stay open; nothing answers on them
    try:
        state = klass.state()
    finally:
        server.resume()
    assert state[BO]["labs"] is None and state[BO]["progress"] is None, state[BO]
    assert state[BO]["error"] == f"{BO}'s server did not answer within {READ_TIMEOUT_S:g} s", state[BO]
    assert state[ADA]["error"] is None and state[ADA]["progress"], state[ADA]
    wait_for(lambda: klass.state()[BO]["error"] is None, DEADLINE_S, "Bo's server to answer again")


def test_in_a_browser_the_instructor_sees_the_class_and_stops_a_lab_with_its_button(klass: Class) -> None:
    chromium_or_skip()
    from playwright.sync_api import sync_playwright

    klass.kernels[ADA].run("import distlab\nsecond = distlab.start(ranks=2)")
    (ada_lab,) = klass.state()[ADA]["labs"]
    (bo_lab,) = klass.state()[BO]["labs"]
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(**launch_options())
        try:
            # A learner logged in at the hub is refused the page (the hub's OAuth step refuses it).
            learner = browser.new_page()
            _log_in(learner, klass.hub, BO, USER_PASSWORD)
            refused = learner.goto(f"{klass.hub.url}{VIEW}/")
            assert refused is not None and refused.status == 403, refused and (refused.status, refused.url)
            assert bo_lab["id"] not in learner.content()
            learner.close()

            page = browser.new_page(viewport={"width": 1400, "height": 700})
            _log_in(page, klass.hub, TUTOR, ADMIN_PASSWORD)

            page.goto(f"{klass.hub.url}{VIEW}/")  # through the hub's OAuth, with no confirmation page
            ada = page.locator(f'tbody[data-learner="{ADA}"] tr[data-lab="{ada_lab["id"]}"]')
            bo = page.locator(f'tbody[data-learner="{BO}"] tr[data-lab="{bo_lab["id"]}"]')
            ada.locator(".ranks .count").filter(has_text="2 ranks").wait_for(timeout=DEADLINE_S * 1000)
            bo.locator(".ranks .count").filter(has_text="1 rank").wait_for(timeout=DEADLINE_S * 1000)
            assert page.locator(f'tbody[data-learner="{ADA}"] .quiz').inner_text() == "1 / 2"
            assert page.locator(f'tbody[data-learner="{TUTOR}"]').count() == 0
            page.screenshot(path=str(SHOTS / "instructor.png"), full_page=True)

            # The login cookie alone, without the page's xsrf token, as another site's form would send it.
            refused = page.request.post(f"{klass.hub.url}{VIEW}/api/learners/{ADA}/labs/{ada_lab['id']}/stop")
            assert refused.status == 403, (refused.status, refused.text())
            assert [ada_lab["id"]] == [panel["id"] for panel in klass.panel(ADA)]

            ada.locator("button.stop").click()
            ada.wait_for(state="detached", timeout=DEADLINE_S * 1000)
            page.screenshot(path=str(SHOTS / "instructor-after-stop.png"), full_page=True)
            assert "lab stopped" in page.locator("#said").inner_text()
            assert bo.count() == 1
        finally:
            browser.close()
    assert klass.panel(ADA) == []
    assert [bo_lab["id"]] == [panel["id"] for panel in klass.panel(BO)]
    assert all(_alive(r["pid"]) for r in bo_lab["ranks"])

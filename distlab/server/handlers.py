"""The Jupyter server side of the side panel: the labs in this server's kernels, and acting on them.

    GET  /distlab/labs                  -> {"labs": [...]}
    POST /distlab/labs/<lab id>/<action> -> {"id", "action", "kernel_id", "message"}   (stop, restart; step, continue)
    GET  /distlab/labs/<lab id>/stacks   -> {"id", "text", "seconds", "missing"}   (live stacks)
    GET  /distlab/progress               -> the learner's quiz and exercise progress (``learner_progress``)

Each lab writes its own state file (``distlab.server.registry``); the server reads them, keeps
those whose kernel belongs to this server, and names the kernel's notebook from the session
manager. An action runs ``registry.act`` in the lab's kernel, so it reaches a lab however it was
started (``%dist start`` or ``distlab.start()``). The stacks are read here, in the server, from
outside the ranks' processes (``cluster.stacks``): the lab's kernel is busy with the cell that
hangs, when they are wanted most. The progress is the quiz's own file (``quiz.progress``), read
for a class's instructor (``classroom.instructor``). The handlers are thin: the work is in
``labs_in_server``, ``act_on_lab``, ``stacks_of_lab`` and ``learner_progress``, plain functions.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict, TypeVar

import tornado.web
from jupyter_client.manager import AsyncKernelManager
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager
from jupyter_server.services.sessions.sessionmanager import SessionManager
from jupyter_server.utils import url_path_join

from .kernels import KernelDied, evaluate
from .registry import ACTIONS, LabEntry, read_labs

_Method = TypeVar("_Method", bound=Callable[..., object])


def _authorized(action: str) -> Callable[[_Method], _Method]:
    # jupyter_server's decorator, which has no annotations: it returns a method of the same signature.
    decorator: Callable[[_Method], _Method] = authorized(action=action)
    return decorator

__all__ = [
    "ACTION_TIMEOUT_S", "LabActionError", "act_on_lab", "labs_in_server", "learner_progress", "setup_handlers",
    "stacks_of_lab",
]

#: How long an action may take, from the request to the kernel's answer. An action waits behind a
#: cell running in that kernel, as a typed ``%dist stop`` would; and a restart starts new engines.
ACTION_TIMEOUT_S = 600.0


class ServerLab(LabEntry):
    """A lab of ``GET /distlab/labs``: its file, and the kernel of this server it runs in."""

    kernel_id: str
    kernel_name: str
    notebook: str | None  # the session's path (None: a kernel with no session)


class KeptLab(TypedDict):
    """A kept lab nobody holds (``GET /distlab/labs``'s ``kept``)."""

    id: str
    world_size: int
    backend: str
    ends: float  # Unix time, if nobody attaches it


class ActionDone(TypedDict):
    """What ``POST /distlab/labs/<id>/<action>`` answers."""

    id: str
    action: str
    kernel_id: str
    message: str  # the kernel's own line


class Stacks(TypedDict):
    """What ``GET /distlab/labs/<id>/stacks`` answers."""

    id: str
    text: str
    seconds: float
    missing: dict[int, str]  # rank -> why its stack is not there


class Refusal(TypedDict):
    """An action's or a read's error: one line."""

    message: str


class QuestionCounts(TypedDict):
    answered: int
    right: int  # last answer right
    attempts: int
    in_bank: int


class TopicRow(TypedDict):
    topic: str
    title: str
    questions: int
    answered: int
    right: int


class ExerciseRow(TypedDict):
    name: str
    title: str
    checks: int
    passed: bool  # ever
    last_passed: bool
    last_seen: float  # Unix time


class LearnerProgress(TypedDict):
    """``GET /distlab/progress``: :func:`learner_progress`."""

    path: str
    questions: QuestionCounts
    topics: list[TopicRow]  # those with an answer
    exercises: list[ExerciseRow]
    exercises_passed: int
    exercises_attempted: int
    exercises_total: int
    last_seen: float | None


class LabActionError(Exception):
    """An action that could not be done: the HTTP status and one line saying why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _kernels_by_connection_file(kernel_manager: AsyncMappingKernelManager) -> dict[str, str]:
    """This server's kernels, by the real path of their connection file (what a lab's file names)."""
    kernels = {}
    for kernel_id in kernel_manager.list_kernel_ids():
        connection_file = getattr(kernel_manager.get_kernel(kernel_id), "connection_file", "")
        if connection_file:
            kernels[os.path.realpath(connection_file)] = kernel_id
    return kernels


async def labs_in_server(
    kernel_manager: AsyncMappingKernelManager, session_manager: SessionManager
) -> list[ServerLab]:
    """The running labs whose kernel this server manages, each with ``kernel_id``, ``kernel_name``
    and ``notebook`` (the session's path, or None for a kernel with no session), oldest first."""
    kernels = _kernels_by_connection_file(kernel_manager)
    sessions = {s["kernel"]["id"]: s for s in await session_manager.list_sessions() if s.get("kernel")}
    labs: list[ServerLab] = []
    for lab in read_labs():
        kernel_id = kernels.get(lab.get("connection_file") or "")
        if kernel_id is None:
            continue  # a lab in a script, or in another server's kernel
        session = sessions.get(kernel_id, {})
        kernel_name = kernel_manager.get_kernel(kernel_id).kernel_name  # a str (a traitlet's value)
        labs.append({**lab, "kernel_id": kernel_id, "kernel_name": str(kernel_name), "notebook": session.get("path")})
    return labs


async def act_on_lab(
    kernel_manager: AsyncMappingKernelManager, lab_id: str, action: str, timeout: float = ACTION_TIMEOUT_S
) -> ActionDone:
    """Stop or restart the lab ``lab_id`` in its kernel, which must be one of this server's; what
    the kernel said. Raises LabActionError (4xx: the request is wrong; 5xx: the kernel failed)."""
    if action not in ACTIONS:
        raise LabActionError(400, f"unknown action {action!r}: a lab can be sent {' or '.join(ACTIONS)}")
    _, kernel_id = _lab_of_this_server(kernel_manager, lab_id, f"{action} it")
    # The id is one the registry wrote (a file name), the action one of ACTIONS: repr() quotes both.
    expression = f"__import__('distlab.server.registry', fromlist=['act']).act({lab_id!r}, {action!r})"
    where = f"kernel {kernel_id}"
    try:
        kernel = kernel_manager.get_kernel(kernel_id)
    except KeyError:  # shut down since we looked
        raise LabActionError(404, f"lab {lab_id!r}: its {where} is gone") from None
    # jupyter_server's kernels are asynchronous (its AsyncMappingKernelManager's), though typed as any manager.
    if not isinstance(kernel, AsyncKernelManager):
        raise LabActionError(500, f"{where} is not an asynchronous kernel of jupyter_server: cannot send the {action}")
    try:
        outcome = await evaluate(kernel, expression, timeout)
    except TimeoutError:
        raise LabActionError(
            504, f"{where} did not answer within {timeout:g} s (is a cell still running there?); "
            f"the {action} stays queued in it and runs when the kernel gets to it",
        ) from None
    except KernelDied:
        raise LabActionError(502, f"{where} ended before it answered the {action}") from None
    if outcome["status"] == "aborted":
        raise LabActionError(409, f"{where} dropped the {action} because a cell before it failed: try again")
    if outcome["status"] == "error":
        ename, evalue = outcome["ename"], outcome["evalue"]
        if ename == "LookupError":  # the lab stopped between our read and the kernel's turn
            raise LabActionError(404, evalue)
        if ename in ("ValueError", "LabUsageError"):  # nothing paused to step: the lab's own one line
            raise LabActionError(409, evalue)
        raise LabActionError(500, f"{action} failed in {where}: {ename}: {evalue}")
    return {"id": lab_id, "action": action, "kernel_id": kernel_id, "message": str(outcome["value"])}


async def stacks_of_lab(kernel_manager: AsyncMappingKernelManager, lab_id: str, timeout: float = 10.0) -> Stacks:
    """The live stacks of lab ``lab_id``'s ranks on this machine (the lab's kernel must be one of
    this server's), read without its kernel, which may be running the cell that hangs."""
    import asyncio

    from ..cluster import stacks
    from ..errors import DistlabError
    from ..host import machine_id

    lab, _ = _lab_of_this_server(kernel_manager, lab_id, "read its stacks")
    here = machine_id()
    pids = {row["rank"]: row["pid"] for row in lab["ranks"] if row.get("machine") == here}
    try:
        taken = await asyncio.get_running_loop().run_in_executor(None, stacks.take, pids, False, timeout)
    except DistlabError as exc:  # py-spy missing
        raise LabActionError(501, str(exc)) from None
    for row in lab["ranks"]:
        if row["rank"] not in pids:
            taken.missing[row["rank"]] = f"it runs on {row['host']}: stacks are read on the lab's machine only"
    return {"id": lab_id, "text": taken.text(), "seconds": round(taken.seconds, 3), "missing": taken.missing}


def _lab_of_this_server(kernel_manager: AsyncMappingKernelManager, lab_id: str, doing: str) -> tuple[LabEntry, str]:
    """The registry's entry of ``lab_id`` and its kernel, one of this server's (else LabActionError 404)."""
    lab = next((lab for lab in read_labs() if lab["id"] == lab_id), None)
    if lab is None:
        raise LabActionError(404, f"no running lab {lab_id!r}: GET /distlab/labs lists the running labs")
    kernel_id = _kernels_by_connection_file(kernel_manager).get(lab.get("connection_file") or "")
    if kernel_id is None:
        raise LabActionError(
            404, f"lab {lab_id!r} runs in process {lab['pid']}, which is not a kernel of this server "
            f"(a script, or another server's kernel): {doing} there",
        )
    return lab, kernel_id


def kept_waiting() -> list[KeptLab]:
    """The labs kept past their kernel that no kernel holds now (``notebook.kept``): what a notebook
    of this user may attach, each with its id, ranks, and when it ends if nobody does."""
    from ..notebook.kept import kept_labs

    waiting: list[KeptLab] = []
    for record in kept_labs():
        if record["held"]:
            continue
        let_go = max(float(record.get("detached") or 0), float(record.get("gone") or 0)) or time.time()
        waiting.append({"id": record["id"], "world_size": len(record["world"]["table"]),
                        "backend": record["world"]["backend"], "ends": let_go + float(record["config"]["keep"])})
    return waiting


def learner_progress(path: Path | None = None) -> LearnerProgress:
    """The quiz and exercise progress kept in ``path`` (default: this user's, ``quiz.progress``):
    questions answered and right (their last answer), by topic of the bank; every exercise checked,
    with its last result; each count and ``last_seen`` (Unix time, None before any)."""
    from ..exercises.catalog import EXERCISES
    from ..quiz.loader import bank
    from ..quiz.progress import Progress

    progress = Progress(path)
    summary = progress.summary(bank(), [(e.name, e.title) for e in EXERCISES.values()])
    records, checked = progress.records, progress.exercises
    # Exercises checked that the catalog no longer names still count: they are the learner's work.
    titles = {row.name: row.title for row in summary.exercises}
    exercises: list[ExerciseRow] = [
        {"name": name, "title": titles.get(name, name), "checks": entry.checks, "passed": entry.passed,
         "last_passed": entry.last_passed, "last_seen": entry.last_seen}
        for name, entry in checked.items()
    ]
    exercises.sort(key=lambda row: list(titles).index(row["name"]) if row["name"] in titles else len(titles))
    seen = [entry.last_seen for entry in records.values()] + [entry.last_seen for entry in checked.values()]
    return {
        "path": str(progress.path),
        "questions": {
            "answered": len(records), "right": sum(entry.last_right for entry in records.values()),
            "attempts": sum(entry.attempts for entry in records.values()),
            "in_bank": sum(row.questions for row in summary.topics),
        },
        "topics": [
            {"topic": row.topic, "title": row.title, "questions": row.questions, "answered": row.answered,
             "right": row.mastered}
            for row in summary.topics if row.answered
        ],
        "exercises": exercises,
        "exercises_passed": sum(row["passed"] for row in exercises),
        "exercises_attempted": len(exercises),
        "exercises_total": len(EXERCISES),
        "last_seen": max(seen) if seen else None,
    }


class LabsHandler(APIHandler):
    """``GET /distlab/labs`` -> ``{"labs": [...], "kept": [...]}`` (``kept_waiting``); for logged-in
    users allowed to see kernels."""

    auth_resource = "kernels"

    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        labs = await labs_in_server(self.kernel_manager, self.session_manager)
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps({"labs": labs, "kept": kept_waiting()}))


class LabActionHandler(APIHandler):
    """``POST /distlab/labs/<id>/<action>``; for logged-in users allowed to run code in kernels
    (the action is code run in the lab's kernel). Errors: ``{"message": <one line>}``."""

    auth_resource = "kernels"

    @tornado.web.authenticated
    @_authorized(action="execute")
    async def post(self, lab_id: str, action: str) -> None:
        done: ActionDone | Refusal
        try:
            done = await act_on_lab(self.kernel_manager, lab_id, action)
        except LabActionError as error:
            # Written here, not raised as an HTTPError: tornado would %-format the message (which
            # may quote the URL) when it logs it.
            self.set_status(error.status)
            done = {"message": error.message}
        self.finish(json.dumps(done))


class LabStacksHandler(APIHandler):
    """``GET /distlab/labs/<id>/stacks``; for logged-in users allowed to run code in kernels (a
    stack shows the code and where it runs). Errors: ``{"message": <one line>}``."""

    auth_resource = "kernels"

    @tornado.web.authenticated
    @_authorized(action="execute")
    async def get(self, lab_id: str) -> None:
        done: Stacks | Refusal
        try:
            done = await stacks_of_lab(self.kernel_manager, lab_id)
        except LabActionError as error:
            self.set_status(error.status)
            done = {"message": error.message}
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(done))


class ProgressHandler(APIHandler):
    """``GET /distlab/progress`` -> ``learner_progress()``; for logged-in users allowed to see kernels
    (as the labs are)."""

    auth_resource = "kernels"

    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        import asyncio

        # The first read loads and checks the question bank (a second or two): off the server's loop.
        progress = await asyncio.get_running_loop().run_in_executor(None, learner_progress)
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(progress))


def setup_handlers(web_app: tornado.web.Application) -> None:
    progress = url_path_join(web_app.settings["base_url"], "distlab", "progress")
    labs = url_path_join(web_app.settings["base_url"], "distlab", "labs")
    stacks = url_path_join(labs, "([^/]+)", "stacks")
    # Every id and action reach the handler, so a wrong one gets act_on_lab's line, not a bare 404.
    action = url_path_join(labs, "([^/]+)", "([^/]+)")
    web_app.add_handlers(".*$", [
        (progress, ProgressHandler), (labs, LabsHandler), (stacks, LabStacksHandler), (action, LabActionHandler),
    ])

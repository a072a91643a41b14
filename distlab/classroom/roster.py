"""What the instructor's view reads and does: every learner's server, labs and progress, and a lab's stop.

Plain async functions over two HTTP APIs, both with the instructor service's own token: the hub's
(``JUPYTERHUB_API_URL``: the users and their servers) and each learner's server's distlab endpoints
(``distlab.server.handlers``: ``GET /distlab/labs``, ``GET /distlab/progress``,
``POST /distlab/labs/<id>/stop``), reached through the hub's proxy at the server's own URL (the
servers live in namespaces of their own; the proxy reaches them). Every request has a deadline: a
learner whose server does not answer is shown as such, and the others still are.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from typing import Literal, TypedDict
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.simple_httpclient import HTTPTimeoutError

__all__ = [
    "READ_TIMEOUT_S", "STOP_TIMEOUT_S", "ClassError", "ClassState", "Endpoints", "HubServer", "HubUser", "LabView",
    "LearnerRow", "Stopped", "class_state", "stop_lab",
]

#: How long a learner's server, or the hub, has to answer a read (the page polls every few seconds).
READ_TIMEOUT_S = 5.0
#: How long a stop may take: it waits behind a cell running in the lab's kernel, as ``%dist stop`` would.
STOP_TIMEOUT_S = 60.0
# A lab's id as the registry names its file (``registry.id_of``): nothing else goes into a URL.
_LAB_ID = re.compile(r"^lab-[0-9]+-[0-9a-f]+$")
# The hub's user list, a page at a time (its API's pagination, JupyterHub 2+).
_PAGE = {"Accept": "application/jupyterhub-pagination+json"}


class HubServer(TypedDict, total=False):
    """A user's server in the hub's REST API (the fields read here)."""

    ready: bool
    pending: str | None  # "spawn", "stop", or None
    url: str  # its URL path, e.g. /user/ada/


class HubUser(TypedDict, total=False):
    """A user in the hub's REST API (the fields read here)."""

    name: str
    kind: str  # "user" (a service is another kind)
    admin: bool
    servers: dict[str, HubServer]  # by server name, "" the default one
    last_activity: str | None  # ISO 8601


class _PanelRank(TypedDict, total=False):
    rank: int
    host: str
    pid: int
    health: str
    device: str


class _PanelLab(TypedDict, total=False):
    """A lab as a learner's server's ``GET /distlab/labs`` gives it (``server.handlers``; an older
    distlab's lacks ``started`` and ``last_cell``)."""

    id: str
    notebook: str | None
    kernel_id: str
    world_size: int
    backend: str
    launcher: str
    busy: bool
    started: float | None
    last_cell: float | None
    ranks: list[_PanelRank]
    training: object  # shown as it comes


class LabView(TypedDict):
    """A lab as the instructor's view shows it."""

    id: str
    notebook: str | None
    kernel_id: str | None
    world_size: int | None
    backend: str | None
    launcher: str | None
    busy: bool
    started: float | None
    last_cell: float | None
    idle_s: float | None  # None: never ran a cell, nor says when it started
    ranks: list[dict[str, object]]  # rank, host, pid, health, device: None where not said
    training: object


class LearnerRow(TypedDict):
    """A learner as the instructor's view shows them."""

    name: str
    server: str  # running, starting, stopping or stopped
    last_activity: str | None
    labs: list[LabView] | None  # None: not read (``error`` says why, when it was tried)
    progress: object  # their server's ``GET /distlab/progress``, as it came
    error: str | None


class ClassState(TypedDict):
    learners: list[LearnerRow]
    now: float


class Stopped(TypedDict):
    learner: str
    id: str
    message: str  # what the learner's server said


class ClassError(Exception):
    """A request the view could not do: the HTTP status to answer and one line saying why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Endpoints:
    """Where the view reads from, and as whom."""

    hub_api: str  # JUPYTERHUB_API_URL, e.g. http://198.19.240.1:8081/hub/api
    proxy: str  # the hub's public address, where each server's URL path leads: http://127.0.0.1:8000
    token: str  # the service's own token (JUPYTERHUB_API_TOKEN)
    instructors: frozenset[str]  # the class's instructors: not learners, and allowed to see the view


@dataclass(frozen=True)
class _Answer:
    code: int  # 0: no HTTP answer at all (``error`` says why)
    body: bytes = b""
    reason: str = ""
    error: str = ""


async def _call(
    url: str, token: str, method: str = "GET", timeout: float = READ_TIMEOUT_S, headers: dict[str, str] | None = None
) -> _Answer:
    request = HTTPRequest(
        url, method=method, body=b"" if method == "POST" else None, request_timeout=timeout, connect_timeout=timeout,
        headers={"Authorization": f"token {token}", **(headers or {})}, follow_redirects=False,
    )
    try:
        # raise_error=False spares only the answers of other codes than 200: no answer still raises.
        response = await AsyncHTTPClient().fetch(request, raise_error=False)
    except HTTPTimeoutError:
        return _Answer(0, error=f"did not answer within {timeout:g} s")
    except (HTTPClientError, OSError) as error:
        return _Answer(0, error=f"could not be reached ({error})")
    return _Answer(response.code, response.body or b"", response.reason or "")


def _why(answer: _Answer, who: str) -> str:
    """One line for a request that failed: no answer, or the answer's own message."""
    if not answer.code:
        return f"{who} {answer.error}"
    message = ""
    try:
        message = str(json.loads(answer.body or b"{}").get("message") or "")
    except (ValueError, AttributeError):
        pass
    if answer.code in (301, 302, 303, 307):
        message = "it asked to log in: the instructor service's token lacks access:servers"
    message = message or answer.reason.strip()
    return f"{who} answered {answer.code}: " + " ".join(message.split())


async def _hub_users(ends: Endpoints) -> list[HubUser]:
    users: list[HubUser] = []
    offset = 0
    while True:
        response = await _call(f"{ends.hub_api}/users?offset={offset}", ends.token, headers=_PAGE)
        if response.code != 200:
            raise ClassError(502, _why(response, "the hub"))
        page = json.loads(response.body)
        items = page["items"] if isinstance(page, dict) else page
        users.extend(items)
        following = page.get("_pagination", {}).get("next") if isinstance(page, dict) else None
        if not following or not items:
            return users
        offset = int(following["offset"])


def _is_learner(user: HubUser, ends: Endpoints) -> bool:
    return user.get("kind", "user") == "user" and not user.get("admin") and user["name"] not in ends.instructors


def _server_state(user: HubUser) -> tuple[str, str | None]:
    """(running | starting | stopping | stopped, the server's URL path when it runs)."""
    server = (user.get("servers") or {}).get("")
    if not server:
        return "stopped", None
    if server.get("pending") == "stop":
        return "stopping", None
    if server.get("ready"):
        return "running", str(server["url"])
    return "starting", None


_RankField = Literal["rank", "host", "pid", "health", "device"]
_RANK_FIELDS: tuple[_RankField, ...] = ("rank", "host", "pid", "health", "device")


def _lab_view(lab: _PanelLab, now: float) -> LabView:
    """What the view shows of one lab of the learner's panel endpoint."""
    # ``started`` and ``last_cell`` (Unix time) are in the state files of newer labs only.
    started, last_cell = lab.get("started"), lab.get("last_cell")
    last = last_cell or started
    idle = 0.0 if lab.get("busy") else (max(0.0, now - float(last)) if last else None)
    return {
        "id": lab["id"], "notebook": lab.get("notebook"), "kernel_id": lab.get("kernel_id"),
        "world_size": lab.get("world_size"), "backend": lab.get("backend"), "launcher": lab.get("launcher"),
        "busy": bool(lab.get("busy")), "started": started, "last_cell": last_cell, "idle_s": idle,
        "ranks": [{key: row.get(key) for key in _RANK_FIELDS}
                  for row in lab.get("ranks") or ()],
        "training": lab.get("training"),
    }


async def _learner(user: HubUser, ends: Endpoints, now: float) -> LearnerRow:
    name = user["name"]
    state, url = _server_state(user)
    row: LearnerRow = {"name": name, "server": state, "last_activity": user.get("last_activity"),
                           "labs": None, "progress": None, "error": None}
    if url is None:
        return row
    base = ends.proxy + url.rstrip("/")
    who = f"{name}'s server"
    labs, progress = await asyncio.gather(
        _call(f"{base}/distlab/labs", ends.token), _call(f"{base}/distlab/progress", ends.token)
    )
    errors = []
    try:
        if labs.code == 200:
            row["labs"] = [_lab_view(lab, now) for lab in json.loads(labs.body)["labs"]]
        else:
            errors.append(_why(labs, who))
        if progress.code == 200:
            row["progress"] = json.loads(progress.body)
        elif not errors or progress.code:  # a server that did not answer is said once
            errors.append(_why(progress, who) + " (progress)")
    except (ValueError, KeyError, TypeError) as error:  # not distlab's endpoints answering: the others still show
        errors.append(f"{who} answered what distlab's panel endpoints do not ({type(error).__name__}: {error})")
    row["error"] = "; ".join(errors) or None
    return row


async def class_state(ends: Endpoints) -> ClassState:
    """Every learner (users of the hub who are neither admins nor instructors), by name: their
    server, their labs (None when it could not be read, with ``error``) and their progress."""
    now = time.time()
    users = sorted((u for u in await _hub_users(ends) if _is_learner(u, ends)), key=lambda u: str(u["name"]))
    rows = await asyncio.gather(*(_learner(user, ends, now) for user in users))
    return {"learners": list(rows), "now": now}


async def stop_lab(ends: Endpoints, learner: str, lab_id: str) -> Stopped:
    """Stop lab ``lab_id`` of ``learner`` through their server's panel endpoint; what it said.
    Raises ClassError with the status to answer and one line."""
    if not _LAB_ID.match(lab_id):
        raise ClassError(400, f"{lab_id!r} is not a lab id: ids look like lab-1234-7f3a2b1c (GET api/class lists them)")
    response = await _call(f"{ends.hub_api}/users/{quote(learner, safe='')}", ends.token)
    if response.code == 404:
        raise ClassError(404, f"no user {learner!r} on this hub: GET api/class lists the learners")
    if response.code != 200:
        raise ClassError(502, _why(response, "the hub"))
    user = json.loads(response.body)
    if not _is_learner(user, ends):
        raise ClassError(403, f"{learner} is an instructor, not a learner: the view stops learners' labs only")
    state, url = _server_state(user)
    if url is None:
        raise ClassError(409, f"{learner}'s server is {state}: its labs ended with it")
    where = f"{ends.proxy}{url.rstrip('/')}/distlab/labs/{lab_id}/stop"
    response = await _call(where, ends.token, method="POST", timeout=STOP_TIMEOUT_S)
    if response.code == 200:
        said = json.loads(response.body)
        return {"learner": learner, "id": lab_id, "message": said.get("message", "")}
    why = _why(response, f"{learner}'s server")
    if not response.code:
        timed_out = "did not answer" in response.error
        if timed_out:
            why += " (is a cell still running in the lab's kernel? the stop stays queued there)"
        raise ClassError(504 if timed_out else 502, why)
    raise ClassError(response.code if 400 <= response.code < 600 else 502, why)

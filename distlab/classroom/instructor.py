"""The instructor's view of a class: a JupyterHub managed service, ``distlab-instructor``.

    GET  /services/distlab-instructor/                                   the page (polls api/class)
    GET  /services/distlab-instructor/api/class                          -> roster.class_state
    POST /services/distlab-instructor/api/learners/<name>/labs/<id>/stop -> roster.stop_lab

``configure(c, instructors, proxy_port)`` (called by ``hub.configure``) adds the service, run by the hub as
``python -m distlab.classroom.instructor`` on 127.0.0.1, and its role: list and read the users and
their servers (who the learners are, whose server runs) and ``access:servers`` (to call each
learner's server's ``/distlab`` endpoints with the service's own token). The class's instructors
are given access to the service; JupyterHub's default user role does not give it (``self`` has no
``access:services``), so a learner is refused by the hub's OAuth step already.

Who may use it is checked here too, whatever roles the hub was given: a hub user who is an admin
or one of the class's instructors (``$DISTLAB_INSTRUCTORS``); anyone else gets 403. A browser is
logged in by the hub's OAuth (a cookie of the service's); a script may send an API token of an
instructor (``Authorization: token ...``). A POST on the cookie must carry the page's xsrf token
(``X-XSRFToken``): HubOAuth accepts no cookie on a POST without it, so another site cannot make an
instructor's browser stop a lab. A token-authenticated POST needs none (no browser sends it by itself).
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from .roster import ClassError, Endpoints, HubUser, class_state, stop_lab

if TYPE_CHECKING:
    from tornado.web import Application
    from traitlets.config import Config


__all__ = ["SERVICE", "configure", "main", "make_app"]

SERVICE = "distlab-instructor"
#: The class's instructors, comma-separated, and the hub's public address: the hub passes both to the service.
ENV_INSTRUCTORS = "DISTLAB_INSTRUCTORS"
ENV_PROXY = "DISTLAB_CLASS_PROXY"
#: What the service may do on the hub: see every user and server, and call the learners' servers.
SCOPES = ("list:users", "read:users", "read:servers", "access:servers")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def configure(c: Config, instructors: Sequence[str], proxy_port: int) -> None:
    """Add the view to JupyterHub's configuration ``c`` for a class taught by ``instructors`` whose hub
    is served on ``proxy_port`` (``hub.Class``'s fields: ``hub.configure`` passes them)."""
    port = _free_port()
    c.JupyterHub.services.append({
        "name": SERVICE,
        "url": f"http://127.0.0.1:{port}",
        "command": [sys.executable, "-m", "distlab.classroom.instructor"],
        "oauth_no_confirm": True,  # the hub's own instructors' tool: no "authorize this application?" page
        "display": True,  # in the hub's Services menu, for who may open it
        "environment": {ENV_INSTRUCTORS: ",".join(instructors), ENV_PROXY: f"http://127.0.0.1:{proxy_port}"},
    })
    c.JupyterHub.load_roles.append({"name": SERVICE, "services": [SERVICE], "scopes": list(SCOPES)})
    if instructors:
        # They are the hub's admins (hub.configure), whose role has access:services already; this
        # keeps the view theirs if an instructor is ever made no admin.
        c.JupyterHub.load_roles.append({
            "name": f"{SERVICE}-users", "users": list(instructors),
            "scopes": [f"access:services!service={SERVICE}"],
        })


def _page() -> str:
    return resources.files(__package__).joinpath("instructor.html").read_text(encoding="utf-8")


def make_app(ends: Endpoints, prefix: str) -> Application:
    """The service's tornado application, its pages under ``prefix`` (``$JUPYTERHUB_SERVICE_PREFIX``)."""
    from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated, UserNotAllowed
    from tornado import escape, web
    from tornado.log import app_log

    class Handler(HubOAuthenticated, web.RequestHandler):
        def check_hub_user(self, model: HubUser) -> HubUser:
            # The hub's check first (the service's access scope), then the class's own rule.
            allowed: HubUser = super().check_hub_user(model)
            if allowed.get("kind") != "user" or not (allowed.get("admin") or allowed["name"] in ends.instructors):
                raise UserNotAllowed(allowed)
            return allowed

        def write_error(self, status_code: int, **kwargs: object) -> None:
            exc_info = kwargs.get("exc_info")  # (type, value, traceback) when an exception made the error
            reason = exc_info[1] if isinstance(exc_info, tuple) else None
            # tornado's reason phrase, as its send_error sets it: an HTTPError's own, else the one it
            # was given, else the status's (tornado's httputil.responses is http.client's).
            phrase = (reason.reason if isinstance(reason, web.HTTPError) else None) or kwargs.get("reason")
            message = getattr(reason, "log_message", None) or phrase or \
                http.client.responses.get(status_code, "Unknown")
            if status_code == 403:
                message = (f"{message}: the instructor's view is for the class's instructors "
                           "(log in to the hub as one, or send an instructor's API token)")
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"message": " ".join(str(message).split())}))

        def answer(self, status: int, body: Mapping[str, object]) -> None:
            self.set_status(status)
            self.set_header("Content-Type", "application/json")
            self.set_header("Cache-Control", "no-store")
            self.finish(json.dumps(body))

        def refuse_unless_allowed(self) -> None:
            if not self.current_user:  # nobody, or somebody the class's rule refused
                raise web.HTTPError(403, "not allowed")

    class PageHandler(Handler):
        @web.authenticated
        def get(self) -> None:
            page = _page().replace("{{xsrf}}", str(self.xsrf_token.decode("ascii")))
            page = page.replace("{{user}}", escape.xhtml_escape(self.current_user["name"]))
            self.set_header("Cache-Control", "no-store")
            self.finish(page)

    class ClassHandler(Handler):
        async def get(self) -> None:
            self.refuse_unless_allowed()
            try:
                self.answer(200, await class_state(ends))
            except ClassError as error:
                self.answer(error.status, {"message": error.message})

    class StopHandler(Handler):
        async def post(self, learner: str, lab_id: str) -> None:
            self.refuse_unless_allowed()
            try:
                done = await stop_lab(ends, learner, lab_id)
            except ClassError as error:
                app_log.warning("%s's stop of %s/%s: %s", self.current_user["name"], learner, lab_id, error.message)
                self.answer(error.status, {"message": error.message})
                return
            app_log.info("%s stopped %s's lab %s", self.current_user["name"], learner, lab_id)
            self.answer(200, done)

    prefix = "/" + prefix.strip("/") + "/"
    return web.Application(
        [
            (prefix, PageHandler),
            (prefix + "oauth_callback", HubOAuthCallbackHandler),
            (prefix + "api/class", ClassHandler),
            (prefix + r"api/learners/([^/]+)/labs/([^/]+)/stop", StopHandler),
            (prefix.rstrip("/"), web.RedirectHandler, {"url": prefix}),
        ],
        # Signs the service's login cookie and its xsrf tokens; a new one each start just logs the
        # instructors in again (through the hub, without a page: oauth_no_confirm).
        cookie_secret=os.urandom(32),
    )


def _endpoints_from_environment() -> Endpoints:
    missing = [name for name in ("JUPYTERHUB_API_URL", "JUPYTERHUB_API_TOKEN", "JUPYTERHUB_SERVICE_URL", ENV_PROXY)
               if not os.environ.get(name)]
    if missing:
        raise SystemExit(f"the instructor's view runs as the hub's service (hub.configure adds it); "
                         f"it was started without {', '.join(missing)}")
    return Endpoints(
        hub_api=os.environ["JUPYTERHUB_API_URL"].rstrip("/"),
        proxy=os.environ[ENV_PROXY].rstrip("/"),
        token=os.environ["JUPYTERHUB_API_TOKEN"],
        instructors=frozenset(n for n in os.environ.get(ENV_INSTRUCTORS, "").split(",") if n),
    )


def main() -> None:
    """Serve the view where the hub says (``$JUPYTERHUB_SERVICE_URL``) until the hub stops it."""
    import asyncio

    from tornado.log import enable_pretty_logging

    ends = _endpoints_from_environment()
    where = urlsplit(os.environ["JUPYTERHUB_SERVICE_URL"])
    enable_pretty_logging()

    async def serve() -> None:
        app = make_app(ends, os.environ.get("JUPYTERHUB_SERVICE_PREFIX", f"/services/{SERVICE}/"))
        app.listen(where.port or 80, address=where.hostname or "127.0.0.1")
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()

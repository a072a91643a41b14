"""A real JupyterHub of distlab.classroom for the tests: system users, their own Python, the hub, its API.

The learners are system users made for the test (``useradd``) and removed after it with all they
left; the hub runs as root, as a class's does. This project's interpreter lives in root's home,
which other users may not enter, so the learners run the system's Python of the same release in
a virtual environment that reads this environment's packages (``learner_python``): what
``distlab.classroom.hub.problems`` tells an instructor to do, with a venv of their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from _jupyter import free_port, wait_for

REPO = Path(__file__).resolve().parents[1]
USER_PASSWORD = "learners-" + secrets.token_hex(4)
ADMIN_PASSWORD = "instructors-" + secrets.token_hex(16)


def skip_unless_possible() -> str:
    """The system's python3 of this release (skip, saying why, where a hub of learners cannot run)."""
    if os.geteuid() != 0:
        pytest.skip("a classroom hub runs as root (it starts each learner's server as that learner)")
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("needs the system's python3 for the learners (this interpreter is in root's home)")
    release = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    if release != str(tuple(sys.version_info[:2])):
        pytest.skip(f"the system's python3 is {release}, this environment's {sys.version_info[:2]}: "
                    "its compiled packages would not load")
    return python


def learner_python(folder: Path, system_python: str) -> str:
    """A virtual environment of the system's Python in ``folder`` that reads this environment's packages."""
    venv = folder / "learners-venv"
    subprocess.run([system_python, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = subprocess.run([str(venv / "bin" / "python"), "-c", where],
                          capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    ours = sysconfig.get_path("purelib")
    # addsitedir reads the folder's .pth files too: the editable install of distlab among them.
    Path(site, "distlab-environment.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    return str(venv / "bin" / "python")


def make_user(name: str) -> pwd.struct_passwd:
    remove_user(name)  # a run killed before it cleaned up
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True, timeout=30)
    return pwd.getpwnam(name)


def remove_user(name: str) -> None:
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    subprocess.run(["pkill", "-KILL", "-u", str(uid)], check=False, timeout=30)
    wait_for(lambda: subprocess.run(["pgrep", "-u", str(uid)], capture_output=True, check=False).returncode != 0,
             30, f"the processes of {name} to end")
    subprocess.run(["userdel", "--remove", name], capture_output=True, check=False, timeout=30)


class _PortTaken(AssertionError):
    pass


class Hub:
    """A running classroom hub: ``learners`` and ``instructors`` are system users made for it."""

    def __init__(self, folder: Path, learners: list[str], instructors: list[str], limits: str = "",
                 cores: float | None = None, notebooks: Path | None = None) -> None:
        system_python = skip_unless_possible()
        self.folder = folder
        self.learners, self.instructors = learners, instructors
        # The learners' Python, where they may read it: not in the suite's folder (root's alone).
        self.shared = Path(tempfile.mkdtemp(prefix="distlab-hub-", dir="/tmp"))
        self.shared.chmod(0o755)
        self.python = learner_python(self.shared, system_python)
        self.token = secrets.token_hex(24)
        self.users = {name: make_user(name) for name in learners + instructors}
        self.log_path = folder / "hub.log"
        self.config = folder / "jupyterhub_config.py"
        klass = {"learners": learners, "instructors": instructors, "limits": limits, "cores": cores,
                 "state_dir": str(folder / "hub"), "python": self.python,
                 "notebooks": str(notebooks) if notebooks else None, "authenticator": "shared-password"}
        # A free port is picked before the hub binds it: another process may take it between.
        for attempt in range(3):
            self._start(klass)
            try:
                wait_for(self._healthy, 120, "the hub to answer")
                break
            except _PortTaken:
                if attempt == 2:
                    raise

    def _start(self, klass: dict[str, Any]) -> None:
        learners, instructors = self.learners, self.instructors
        self.port = free_port()
        klass = {**klass, "port": self.port, "hub_port": free_port()}
        self.config.write_text(
            "from distlab.classroom.hub import Class, configure\n"
            f"configure(c, Class(**{{**{klass!r}, 'learners': tuple({learners!r}), "
            f"'instructors': tuple({instructors!r})}}))\n"
            f"c.SharedPasswordAuthenticator.user_password = {USER_PASSWORD!r}\n"
            f"c.SharedPasswordAuthenticator.admin_password = {ADMIN_PASSWORD!r}\n"
            # The test's own hand on the hub: start servers and make users' tokens.
            f"c.JupyterHub.services.append({{'name': 'distlab-test', 'api_token': {self.token!r}}})\n"
            "c.JupyterHub.load_roles.append({'name': 'distlab-test', 'services': ['distlab-test'], "
            "'scopes': ['admin:users', 'admin:servers', 'access:servers', 'tokens', 'read:users']})\n"
            "c.JupyterHub.log_level = 'DEBUG'\n"
        )
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(self.config)], cwd=self.folder,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        said = self.log()
        # EADDRINUSE: the hub exits; its proxy says so and stays up, deaf on the port asked of it.
        if "EADDRINUSE" in said or (self.process.poll() is not None and "already in use" in said):
            with contextlib.suppress(ProcessLookupError):  # the hub and its proxy
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
            self._log.close()
            raise _PortTaken(f"a port the hub was given was taken before it bound it:\n{said[-2000:]}")
        if self.process.poll() is not None:
            raise AssertionError(f"the hub exited ({self.process.returncode}):\n{self.log()[-4000:]}")
        with contextlib.suppress(OSError):
            return self.request("GET", "/hub/api/")[0] == 200
        return False

    def hub_address(self) -> str:
        """The address the hub listens on for its learners' servers (in the /24 it claimed)."""
        import re

        found = re.search(r"Hub API listening on http://([\d.]+):", self.log())
        assert found, "the hub has not said where its API listens"
        return found.group(1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(self, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Authorization": f"token {token or self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                text = resp.read().decode()
                return resp.status, json.loads(text) if text.strip() else None
        except urllib.error.HTTPError as err:
            text = err.read().decode(errors="replace")
            try:
                return err.code, json.loads(text)
            except ValueError:
                return err.code, text

    def start_server(self, name: str) -> None:
        status, said = self.request("POST", f"/hub/api/users/{name}/server")
        assert status in (201, 202), (status, said, self.log()[-6000:])
        def ready() -> bool:
            servers = (self.request("GET", f"/hub/api/users/{name}")[1] or {}).get("servers", {})
            return bool(servers.get("", {}).get("ready"))

        wait_for(ready, 180, f"{name}'s server to be ready")

    def user_token(self, name: str) -> str:
        status, said = self.request("POST", f"/hub/api/users/{name}/tokens",
                                    {"note": "distlab test", "expires_in": 3600})
        assert status == 201, (status, said)
        return str(said["token"])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the hub stops every learner's server first
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        self._log.close()
        for name in self.users:
            remove_user(name)
        shutil.rmtree(self.shared, ignore_errors=True)

    def __enter__(self) -> Hub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def as_learner(
    user: pwd.struct_passwd, netns: str | None, argv: list[str], timeout: float = 120, stdin: str | None = None,
    cwd: str = "/", path: str = "/usr/bin:/bin",
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as the learner would in a terminal of their server: their user, in their network,
    in folder ``cwd`` (their home, say), with ``path`` as PATH (a venv's bin first, as activated)."""
    enter = ["nsenter", f"--net=/run/netns/{netns}"] if netns else []
    become = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups"]
    env = {"PATH": path, "HOME": user.pw_dir, "USER": user.pw_name}
    return subprocess.run([*enter, *become, *argv], capture_output=True, text=True, timeout=timeout,
                          check=False, env=env, cwd=cwd, input=stdin)


def namespaces_of(owner: int) -> list[str]:
    try:
        return sorted(n for n in os.listdir("/run/netns") if n.startswith(f"distlab-{owner}-"))
    except OSError:
        return []


class LearnerKernel:
    """A kernel of a learner's server, opened as their notebook ``path`` (a session: the panel names it),
    driven over the server's websocket as JupyterLab drives it, with the learner's token."""

    def __init__(self, hub: Hub, name: str, token: str, path: str = "class.ipynb") -> None:
        self.hub, self.name, self.token = hub, name, token
        status, said = hub.request("POST", f"/user/{name}/api/sessions",
                                   {"path": path, "type": "notebook", "kernel": {"name": "python3"}}, token=token)
        assert status == 201, (status, said)
        self.kernel_id = said["kernel"]["id"]
        self.session = secrets.token_hex(8)

    def run(self, code: str, timeout: float = 300) -> str:
        """Run ``code``; its printed output, or AssertionError with the error and what it printed."""
        import asyncio

        return asyncio.run(self._run(code, timeout))

    async def _run(self, code: str, timeout: float) -> str:
        import asyncio

        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect

        url = (f"ws://127.0.0.1:{self.hub.port}/user/{self.name}/api/kernels/{self.kernel_id}/channels"
               f"?session_id={self.session}")
        ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {self.token}"}))
        msg_id = secrets.token_hex(8)
        header = {"msg_id": msg_id, "username": self.name, "session": self.session, "msg_type": "execute_request",
                  "version": "5.3", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        ws.write_message(json.dumps({
            "header": header, "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True},
        }))
        out: list[str] = []
        reply: dict[str, Any] | None = None
        idle = False
        end = time.monotonic() + timeout
        try:
            while True:
                raw = await asyncio.wait_for(ws.read_message(), max(end - time.monotonic(), 0.1))
                if raw is None:
                    raise AssertionError(f"{self.name}'s kernel closed its channels:\n" + "".join(out))
                msg = json.loads(raw)
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, content = msg["msg_type"], msg["content"]
                if kind == "stream":
                    out.append(content["text"])
                elif kind == "error":
                    out.append(f"{content['ename']}: {content['evalue']}\n")
                elif kind == "execute_reply":
                    reply = content
                elif kind == "status" and content.get("execution_state") == "idle":
                    idle = True
                # The reply (shell) may come before the last output (iopub): done at both the
                # reply and the kernel's idle for this request.
                if reply is not None and idle:
                    if reply["status"] != "ok":
                        raise AssertionError("".join(out))
                    return "".join(out)
        finally:
            ws.close()

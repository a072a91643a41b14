"""A real JupyterLab server for the extension and browser tests: a free port, a token, private
config/runtime/settings folders, and a stop that always ends it and its kernels."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

__all__ = ["JupyterLab", "execute", "free_port", "wait_for"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: Any, seconds: float, what: str, poll_s: float = 0.2) -> Any:
    """Poll ``condition()`` until it returns something true; fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds:g} s waiting for {what}")
        time.sleep(poll_s)


class _PortTaken(AssertionError):
    """The server exited because its port was bound by another process first."""


class JupyterLab:
    """``jupyter lab`` serving ``root`` on 127.0.0.1, started by ``start()``, ended by ``stop()``."""

    def __init__(self, root: Path, home: Path, python: str = sys.executable) -> None:
        self.root = root
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.runtime_dir = home / "runtime"
        self.log_path = home / "jupyter.log"
        self.env = dict(
            os.environ,
            JUPYTER_RUNTIME_DIR=str(self.runtime_dir),
            JUPYTER_CONFIG_DIR=str(home / "config"),  # no user config; the environment's still applies
            JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
            JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
            DISTLAB_QUIZ_PROGRESS=str(home / "quiz"),
        )
        self.python = python
        # ipyparallel's own server and lab extensions (the "Clusters" panel) would watch every
        # cluster of this user, other test runs' included; these tests are about distlab's.
        config = home / "config"
        (config / "labconfig").mkdir(parents=True, exist_ok=True)
        (config / "jupyter_server_config.json").write_text(
            json.dumps({"ServerApp": {"jpserver_extensions": {"ipyparallel": False}}})
        )
        (config / "labconfig" / "page_config.json").write_text(
            json.dumps({"disabledExtensions": {"ipyparallel-labextension": True}})
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90) -> JupyterLab:
        cmd = [
            self.python, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
            f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
            "--ServerApp.port_retries=0", "--LabApp.extension_manager=readonly",
        ]
        if os.getuid() == 0:  # CI containers
            cmd.append("--allow-root")
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        # The port was free when picked, but another process (a lab's controller on the other worker)
        # can bind it before the server does: the server then exits saying so, and starts again on
        # another port, at most three times.
        for attempt in range(3):
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    [f"--port={self.port}" if a.startswith("--port=") else a for a in cmd], env=self.env, stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True,
                )
            try:
                wait_for(self._ready, timeout, f"jupyter lab on port {self.port}")
                return self
            except _PortTaken:
                self.stop()
                if attempt == 2:
                    raise
                self.port = free_port()
            except BaseException:
                self.stop()
                raise
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            if "already in use" in self.log():
                raise _PortTaken(f"port {self.port} was taken before jupyter lab bound it")
            raise AssertionError(f"jupyter lab exited ({self.proc.returncode}):\n{self.log()}")
        try:
            return self.request("GET", "/api/status")[0] == 200
        except (OSError, http.client.HTTPException):  # not listening yet, or another server on the port
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGTERM (the server shuts its kernels down), then SIGKILL whatever of it is still there."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        _, alive = psutil.wait_procs(family, timeout=10)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass

    def __enter__(self) -> JupyterLab:  # start() returns self
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------- REST

    def request(
        self, method: str, path: str, body: Any = None, token: str | None = "default"
    ) -> tuple[int, Any]:
        """(status, parsed JSON or text) for ``method path``; ``token=None`` sends no credentials."""
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"token {self.token if token == 'default' else token}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                status, text = resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            status, text = err.code, err.read().decode(errors="replace")
        try:
            return status, json.loads(text) if text else None
        except json.JSONDecodeError:
            return status, text

    def labs(self) -> list[dict[str, Any]]:
        status, body = self.request("GET", "/distlab/labs")
        assert status == 200, (status, body)
        return list(body["labs"])

    def kernel_idle(self, path: str) -> bool:
        """Whether the notebook at ``path`` (relative to the root) has a kernel, and it is idle."""
        sessions = self.request("GET", "/api/sessions")[1] or []
        kernel = next((s["kernel"] for s in sessions if s["path"] == path and s.get("kernel")), None)
        if kernel is None:
            return False
        return bool(self.request("GET", f"/api/kernels/{kernel['id']}")[1]["execution_state"] == "idle")

    def new_session(self, path: str) -> dict[str, Any]:
        status, body = self.request(
            "POST", "/api/sessions", {"path": path, "type": "notebook", "name": path, "kernel": {"name": "python3"}}
        )
        assert status == 201, (status, body)
        return dict(body)

    def kernel_client(self, kernel_id: str) -> Any:
        """A blocking client on the kernel's own connection file (the server wrote it)."""
        from jupyter_client import BlockingKernelClient

        client = BlockingKernelClient(connection_file=str(self.runtime_dir / f"kernel-{kernel_id}.json"))
        client.load_connection_file()
        client.start_channels()
        deadline = time.monotonic() + 60
        while True:
            try:
                client.wait_for_ready(timeout=max(1.0, deadline - time.monotonic()))
                return client
            except RuntimeError:
                # A client that did not start the kernel judges it by heartbeats, and on a loaded
                # machine one can go unanswered while the kernel starts ("Kernel died before
                # replying to kernel_info", seen in CI). Ask the server, which started it.
                status, body = self.request("GET", f"/api/kernels/{kernel_id}")
                alive = status == 200 and body.get("execution_state") != "dead"
                if not alive or time.monotonic() > deadline:
                    client.stop_channels()
                    raise
                time.sleep(0.5)


def execute(
    client: Any, code: str, timeout: float = 120, messages: list[dict[str, Any]] | None = None,
    on_message: Any = None,
) -> str:
    """Run ``code`` in a kernel; its stream output, or AssertionError with the traceback.

    ``messages``, if given, receives every IOPub message of the request, in order (comm updates,
    displays, status), for tests that look at what a front end would have been sent; ``on_message``
    is called with each as it arrives (while the cell still runs).
    """
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if messages is not None:
            messages.append(msg)
        if on_message is not None:
            on_message(msg)
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])

    reply = client.execute_interactive(code, timeout=timeout, output_hook=hook)
    content = reply["content"]
    if content["status"] != "ok":
        raise AssertionError(f"{content.get('ename')}: {content.get('evalue')}\n" + "".join(out))
    return "".join(out)

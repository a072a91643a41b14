"""Warm ranks: local engines forked from a template that has already imported torch and the engine.

A cold engine spends ~2.5 s of CPU on imports before it can register (benchmarks/RESULTS.md); a
lab's start, each restart and each world an exercise is graded in paid it again. The template
(``rank.warm_template``) pays it once per notebook process: ``prewarm()`` starts it in the background
(``%load_ext distlab`` does), and every later local lab forks its engines from it.

    pid = current(env).fork("engine", argv, env, cwd, log)   # what cluster/forked.py's launchers do

Local engines (and their controller) are forked; on emulated nodes made by root, each engine is
forked too and joins its node's network namespace (the controller there starts as before); through
another launcher, or on nodes in a user namespace (no root), engines start cold. What the
template was started with that Python and torch read at import (``_IMPORT_TIME``) must be what a
lab would start its engines with; when it changed, the template is replaced. It ends when the
notebook does (its stdin closes).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
from collections.abc import Mapping

from ..errors import DistlabError
from .allocator import engine_environment

__all__ = ["Template", "busy", "current", "enabled", "prewarm", "stop"]

# Read by Python or the libraries a rank imports when they load (or by glibc when the process
# starts): a template whose values differ from a lab's cannot stand in for its engines' start.
_IMPORT_TIME = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "OMP_", "MKL_", "KMP_", "TORCH", "PYTORCH", "OPENBLAS")
_READY_TIMEOUT_S = 120.0  # importing torch on a loaded laptop


def enabled() -> bool:
    """Warm ranks unless ``DISTLAB_WARM=0`` (cold engines, as a launcher other than local starts)."""
    return os.environ.get("DISTLAB_WARM", "1") != "0" and sys.platform.startswith("linux")


def _base_environment(env: Mapping[str, str]) -> dict[str, str]:
    return {**env, **engine_environment(env)}


def _import_time(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME)}


class Template:
    """One template process, and the pipe a lab asks it for engines on."""

    def __init__(self, env: Mapping[str, str]) -> None:
        env = _base_environment(env)
        self.import_env = _import_time(env)
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "distlab.rank.warm_template", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1,
            start_new_session=True,  # a Ctrl-C in a terminal is the notebook's, not the template's
        )
        self._ready = False

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _answer(self, timeout_s: float) -> dict[str, object]:
        stdout = self._proc.stdout
        assert stdout is not None
        result: list[str] = []
        # A thread, so that the wait has a deadline (a pipe's readline has none).
        reader = threading.Thread(target=lambda: result.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not result or not result[0]:
            self.stop()
            raise DistlabError(
                f"the warm-rank template gave no answer within {timeout_s:g} s: "
                "set DISTLAB_WARM=0 to start engines cold, and see its stderr"
            )
        answer: dict[str, object] = json.loads(result[0])
        return answer

    def wait_ready(self, timeout_s: float = _READY_TIMEOUT_S) -> None:
        with self._lock:
            if not self._ready:
                self._answer(timeout_s)
                self._ready = True

    def fork(
        self, entry: str, argv: list[str], env: Mapping[str, str], cwd: str, log: str,
        node: Mapping[str, str] | None = None,
    ) -> int:
        """A new ``entry`` ("engine", "controller") process run as ``argv`` in ``env``, its output
        appended to ``log``: its pid, a session and process group of its own. ``node``: an emulated
        node's ``{"netns": path, "hostname": name}``, which the process joins before it starts."""
        self.wait_ready()
        request: dict[str, object] = {"entry": entry, "argv": argv, "env": dict(env), "cwd": cwd, "log": log}
        if node is not None:
            request["node"] = dict(node)
        with self._lock:
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            answer = self._answer(10.0)
        if "pid" not in answer:
            raise DistlabError(f"the warm-rank template could not fork an engine: {answer.get('error')}")
        pid = answer["pid"]
        assert isinstance(pid, int)
        return pid

    def preload(self, modules: list[str], env: Mapping[str, str], timeout_s: float = 120.0) -> None:
        """Import ``modules`` in the template (``env``: variables they read, set where unset) for the
        processes forked after: a healing lab's torchft, so that a replacement rank starts with it."""
        self.wait_ready()
        with self._lock:
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps({"entry": "preload", "modules": modules, "env": dict(env)}) + "\n")
            self._proc.stdin.flush()
            answer = self._answer(timeout_s)
        if "loaded" not in answer:
            raise DistlabError(f"the warm-rank template could not import {', '.join(modules)}: {answer.get('error')}")

    def busy(self) -> bool:
        """Whether a request now would wait: the template still importing, or serving another request."""
        return not self._ready or self._lock.locked()

    def stop(self) -> None:
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
        if self.alive():
            self._proc.kill()
        self._proc.wait(timeout=5)


_template: Template | None = None
_template_lock = threading.Lock()


def current(env: Mapping[str, str]) -> Template:
    """The template for engines started in ``env``; a new one when what it imported under changed."""
    global _template
    with _template_lock:
        want = _import_time(_base_environment(env))
        if _template is not None and (not _template.alive() or _template.import_env != want):
            _template.stop()
            _template = None
        if _template is None:
            # Made from the environment asked for, so that the next request with it finds it fit.
            _template = Template(env)
        return _template


def busy() -> bool:
    """Whether a fork asked for now would wait (no template, or one importing or serving another request)."""
    template = _template
    return template is None or not template.alive() or template.busy()


def prewarm() -> None:
    """Start the template in the background (returns at once): the first lab's processes are forked."""
    if enabled():
        current(os.environ)


def stop() -> None:
    """End the template (the notebook's exit does; processes already forked belong to their labs)."""
    global _template
    with _template_lock:
        if _template is not None:
            _template.stop()
            _template = None


atexit.register(stop)

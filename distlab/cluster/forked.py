"""ipyparallel's local launchers, with the process forked from the warm-rank template (``cluster.warm``).

ipyparallel follows, signals and stops a forked process exactly as one it started itself (by pid,
in a session of its own; ``psutil`` waits for it), so the rest of distlab sees no difference:

    ipp.Cluster(engine_launcher_class=ForkedEngineSetLauncher, controller_launcher_class=ForkedControllerLauncher)
"""

from __future__ import annotations

import os

import psutil
from ipyparallel.cluster.launcher import (
    LocalControllerLauncher,
    LocalEngineLauncher,
    LocalEngineSetLauncher,
    LocalProcessLauncher,
    ProcessStateError,
)
from traitlets import Float

from ..ipycompat_launchers import start_waiting
from . import warm

__all__ = ["ForkedControllerLauncher", "ForkedEngineSetLauncher"]


class _Forked(LocalProcessLauncher):
    """ipyparallel's local launcher, with the process forked from the template instead of started:
    ipyparallel follows, signals and stops it as one it started (by pid, a session of its own)."""

    entry = "engine"

    def start(self) -> None:
        if self.state != "before":
            raise ProcessStateError(f"The process was already started and has state: {self.state}")
        env = {**os.environ, **self.get_env()}
        argv = self.args[len(self._command()) :]
        # The working directory as this process sees it (ipyparallel's is ".", relative to the
        # notebook's directory, which the template's may not be).
        cwd = os.path.abspath(self.work_dir)
        self.pid = warm.current(env).fork(self.entry, argv, env, cwd, self.output_file)
        self.process = psutil.Process(self.pid)
        self.notify_start(self.pid)
        start_waiting(self)

    def _command(self) -> list[str]:
        raise NotImplementedError


class ForkedEngineLauncher(_Forked, LocalEngineLauncher):
    entry = "engine"

    def _command(self) -> list[str]:
        return list(self.engine_cmd)


class ForkedEngineSetLauncher(LocalEngineSetLauncher):
    """Engines forked from the template: ``Cluster(engine_launcher_class=...)``."""

    launcher_class = ForkedEngineLauncher
    # ipyparallel sleeps 0.1 s between two engines of a set (to order their ids, or spare the machine
    # a flood of Python start-ups): a fork costs milliseconds, and distlab orders ranks itself.
    delay = Float(0.0, config=True, help="seconds between forking two engines of a set")


class ForkedControllerLauncher(_Forked, LocalControllerLauncher):
    """The controller forked from the template: ``Cluster(controller_launcher_class=...)``."""

    entry = "controller"

    def _command(self) -> list[str]:
        return list(self.controller_cmd)

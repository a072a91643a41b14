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
from traitlets import Float, Unicode

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
        self.pid = warm.current(env).fork(self.entry, argv, env, cwd, self.output_file, self._node())
        self.process = psutil.Process(self.pid)
        self.notify_start(self.pid)
        start_waiting(self)

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _node(self) -> dict[str, str] | None:
        """The emulated node the process joins (its set's ``node_netns``), or None: this machine's."""
        netns = getattr(self.parent, "node_netns", "")
        return {"netns": netns, "hostname": self.parent.node_hostname} if netns else None


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
    # On an emulated node (cluster.nodes): the path of its network namespace, and its hostname.
    node_netns = Unicode("", help="the network namespace (a path) the set's engines join; empty: none")
    node_hostname = Unicode("", help="the hostname of the set's engines on their node")


class ForkedControllerLauncher(_Forked, LocalControllerLauncher):
    """The controller forked from the template: ``Cluster(controller_launcher_class=...)``."""

    entry = "controller"

    def _command(self) -> list[str]:
        return list(self.controller_cmd)

"""How a learner's server starts: as their own system user, in their own network, inside their limits.

:class:`ClassroomSpawner` is JupyterHub's ``LocalProcessSpawner`` (the server runs as the learner's
system user, so files, processes and signals are theirs alone: Unix's own isolation, with their
home made 0700 where it was open to others) with three things more, each made before the server
runs and removed after it stops:

- a network namespace of the learner's own (``network``): another learner cannot connect to
  anything their labs listen on;
- a control group (``cgroups``): JupyterHub's own ``cpu_limit`` and ``mem_limit``, which the local
  spawner only passes on as variables, are enforced by the kernel, and every process the learner
  started is ended with the server, whatever escaped its session;
- ``DISTLAB_LIMITS`` in the server's environment, which distlab reads in the learner's kernels
  (``limits``: ranks and labs at once, the idle end; cores as the group enforces them);
- a temporary folder of the learner's own (``TMPDIR``): what their labs keep there (a lab's sockets,
  its watchdog's list) goes with the server even when the group's end kills the watchdog that would
  have removed it.

The hub must run as root (as for any ``LocalProcessSpawner`` serving other users).
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from jupyterhub.spawner import LocalProcessSpawner
from traitlets import Bool, Unicode, default

from .cgroups import LearnerGroup, cgroup_missing
from .network import LearnerNetwork

__all__ = ["ClassroomSpawner"]


class ClassroomSpawner(LocalProcessSpawner):
    """A learner's server: their user, their network namespace, their control group, their limits."""

    python = Unicode(
        sys.executable, config=True,
        help="The Python learners' servers run: with distlab, JupyterLab and torch, readable by every learner.",
    )
    limits = Unicode(
        "", config=True,
        help='distlab\'s limits in each learner\'s kernels, e.g. "ranks=4,labs=2,idle=30m" (distlab.classroom.limits).',
    )
    own_network = Bool(True, config=True, help="Run each learner's server in a network namespace of their own.")
    network = Unicode("", config=True, help="The hub's /24 its learners are addressed from (hub.configure claims it).")
    notebooks = Unicode(
        "", config=True,
        help="A folder of notebooks copied into each learner's home (~/<its name>) when their server first starts.",
    )

    # Learner indices taken by this hub's running servers: each names a namespace and an address.
    _taken: ClassVar[set[int]] = set()

    @default("cmd")
    def _cmd_default(self) -> list[str]:
        return [self.python, "-m", "jupyterhub.singleuser"]

    def _limits_text(self) -> str:
        parts = [self.limits] if self.limits else []
        if self.cpu_limit:
            parts.append(f"cores={self.cpu_limit:g}")
        return ",".join(parts)

    def get_env(self) -> dict[str, str]:
        env: dict[str, str] = super().get_env()
        text = self._limits_text()
        if text:
            env["DISTLAB_LIMITS"] = text
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            env["TMPDIR"] = tmp
        return env

    def make_preexec_fn(self, name: str) -> Callable[[], None]:
        become_learner = super().make_preexec_fn(name)
        network, group = self._network, self._group
        assert group is not None  # start() made it

        def preexec() -> None:
            # Still root here (after fork, before exec): join the group and the namespace, then drop to the learner.
            group.join()
            if network is not None:
                network.enter()
            become_learner()

        return preexec

    async def start(self) -> tuple[str, int]:  # LocalProcessSpawner's: the server's (ip, port)
        memory = int(self.mem_limit) if self.mem_limit else None
        why = cgroup_missing(self.cpu_limit, memory)
        if why:
            raise RuntimeError(why)
        index = next(i for i in range(len(self._taken) + 1) if i not in self._taken)
        self._taken.add(index)
        self._index: int | None = index
        self._network: LearnerNetwork | None = None
        # Debian's useradd makes homes 0755: every learner could read every other's notebooks.
        home = pwd.getpwnam(self.user.name).pw_dir
        if os.path.isdir(home) and os.stat(home).st_mode & 0o077:
            os.chmod(home, 0o700)
        if self.notebooks:
            self._give_notebooks()
        group = LearnerGroup(f"distlab-{os.getpid()}-{self.user.name}", self.cpu_limit or None, memory)
        self._group: LearnerGroup | None = group
        try:
            # In /tmp, where a learner's processes write by default: the hub's own TMPDIR (root's) may be a
            # folder they cannot enter.
            self._tmp: str | None = tempfile.mkdtemp(prefix=f"distlab-{os.getpid()}-{self.user.name}-", dir="/tmp")
            learner = pwd.getpwnam(self.user.name)
            os.chown(self._tmp, learner.pw_uid, learner.pw_gid)  # 0700: theirs alone
            group.make()
            if self.own_network:
                if not self.network:
                    raise RuntimeError("ClassroomSpawner.network is unset: use distlab.classroom.hub.configure")
                self._network = LearnerNetwork(os.getpid(), index, ipaddress.IPv4Network(self.network))
                self._network.make()
                self.ip = self._network.address
            address: tuple[str, int] = await super().start()
            return address
        except BaseException:
            self._release()
            raise

    def _give_notebooks(self) -> None:
        """Copy the class's notebooks into the learner's home, theirs to change; never over their copy."""
        learner = pwd.getpwnam(self.user.name)
        source = Path(self.notebooks)
        target = Path(learner.pw_dir) / source.name
        if target.exists():
            return
        shutil.copytree(source, target, ignore=shutil.ignore_patterns(".*", "__pycache__"))
        for folder, dirs, files in os.walk(target):
            for name in [".", *dirs, *files]:
                os.chown(os.path.join(folder, name), learner.pw_uid, learner.pw_gid)

    async def stop(self, now: bool = False) -> None:
        try:
            await super().stop(now=now)
        finally:
            self._release()

    def _release(self) -> None:
        """End what the learner left running and remove their group and namespace."""
        group = getattr(self, "_group", None)
        if group is not None:
            group.end()
            self._group = None
        network = getattr(self, "_network", None)
        if network is not None:
            network.remove()
            self._network = None
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:  # after the group's end: nothing of theirs is left to write there
            shutil.rmtree(tmp, ignore_errors=True)
            self._tmp = None
        index = getattr(self, "_index", None)
        if index is not None:
            self._taken.discard(index)
            self._index = None

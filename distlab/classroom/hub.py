"""A class's JupyterHub, configured: learners and instructors, their limits, the proxy, the instructor's view.

``configure(c, Class(...))`` fills a JupyterHub configuration (what ``jupyterhub_config.py`` gets as
``c``); ``python -m distlab.classroom hub ...`` writes that file and starts the hub with it.

The hub listens for browsers on 127.0.0.1 (put a TLS proxy in front of it to open it to a class's
network) and, for its learners' servers, on the hub address of the /24 it claims for their
namespaces (``network.claim_network``). It runs as root: it starts each learner's server as that learner.
"""

from __future__ import annotations

import atexit
import os
import pwd
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .network import claim_network, hub_address, release_network

if TYPE_CHECKING:
    from traitlets.config import Config

__all__ = ["Class", "configure", "problems", "proxy_command"]


@dataclass(frozen=True)
class Class:
    """One class: who learns, who teaches, and the instructor's limits."""

    learners: tuple[str, ...]
    instructors: tuple[str, ...] = ()
    #: distlab's limits in the learners' kernels (``limits.Limits``' text: "ranks=4,labs=2,idle=30m").
    limits: str = ""
    #: Cores and bytes of memory per learner, enforced by the kernel (None: no limit).
    cores: float | None = None
    memory: int | None = None
    port: int = 8000
    hub_port: int = 8081
    #: Where the hub keeps its database, cookie secret and configuration.
    state_dir: str = "/srv/distlab-class"
    #: The Python learners' servers run (it must be readable by every learner).
    python: str = sys.executable
    #: A folder of notebooks copied into each learner's home on their first start (None: none).
    notebooks: str | None = None
    #: How learners log in: JupyterHub's authenticator class ("pam": their system password).
    authenticator: str = "pam"
    extra_env: dict[str, str] = field(default_factory=dict)


def proxy_command() -> list[str]:
    """configurable-http-proxy: on PATH, or where ``make`` installs it (beside this environment)."""
    found = shutil.which("configurable-http-proxy")
    if found:
        return [found]
    local = Path(sys.prefix) / "node_modules" / ".bin" / "configurable-http-proxy"
    if local.exists():
        return [str(local)]
    raise RuntimeError(
        "JupyterHub's proxy, configurable-http-proxy, is not installed: "
        f"npm install --prefix {sys.prefix} configurable-http-proxy (make does this)"
    )


def _unreadable(path: str) -> str | None:
    """The first folder on ``path`` that other users may not enter, or None."""
    current = Path(os.path.realpath(path))  # a venv's python links to its base interpreter
    for folder in [*reversed(current.parents), current.parent]:
        if not folder.stat().st_mode & 0o001:
            return str(folder)
    return None


def problems(klass: Class) -> list[str]:
    """What stops this class from starting, one line each (empty: none)."""
    found = []
    if os.geteuid() != 0:
        found.append("the hub runs as root, to start each learner's server as that learner: run it with sudo")
    for name in klass.learners + klass.instructors:
        try:
            pwd.getpwnam(name)
        except KeyError:
            found.append(f"{name} is not a user of this machine: sudo useradd -m {name} && sudo passwd {name}")
    closed = _unreadable(klass.python)
    if closed:
        found.append(
            f"learners cannot run {klass.python}: {closed} is closed to other users; install distlab with a "
            "Python they can read (/usr/bin/python3 -m venv /opt/distlab && /opt/distlab/bin/pip install "
            "'distlab[classroom]') and pass --python /opt/distlab/bin/python"
        )
    if not klass.learners:
        found.append("a class needs learners: --learners alice,bob,carol")
    return found


def configure(c: Config, klass: Class) -> None:
    """Fill JupyterHub's configuration ``c`` for ``klass``."""
    from ..cluster import namespaces
    from . import cgroups

    state = Path(klass.state_dir)
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    # What a hub killed before it could clean up left behind, then the address its learners reach it at.
    namespaces.remove_orphans()
    cgroups.remove_orphans(alive=os.getpid())
    network = claim_network()
    atexit.register(release_network, network)

    c.JupyterHub.ip = "127.0.0.1"
    c.JupyterHub.port = klass.port
    c.JupyterHub.hub_bind_url = f"http://{hub_address(network)}:{klass.hub_port}"
    c.JupyterHub.db_url = f"sqlite:///{state / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(state / "jupyterhub_cookie_secret")
    c.JupyterHub.pid_file = str(state / "jupyterhub.pid")
    c.JupyterHub.cleanup_servers = True  # the learners' servers, labs and namespaces stop with the hub
    c.ConfigurableHTTPProxy.command = proxy_command()
    c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{klass.port + 1}"
    c.ConfigurableHTTPProxy.pid_file = str(state / "proxy.pid")
    c.ConfigurableHTTPProxy.should_start = True

    c.JupyterHub.authenticator_class = klass.authenticator
    c.Authenticator.allowed_users = set(klass.learners) | set(klass.instructors)
    c.Authenticator.admin_users = set(klass.instructors)

    c.JupyterHub.spawner_class = "distlab.classroom.spawner.ClassroomSpawner"
    c.ClassroomSpawner.python = klass.python
    c.ClassroomSpawner.network = str(network)
    c.ClassroomSpawner.limits = klass.limits
    if klass.cores:
        c.Spawner.cpu_limit = klass.cores
    if klass.memory:
        c.Spawner.mem_limit = klass.memory
    if klass.notebooks:
        c.ClassroomSpawner.notebooks = str(Path(klass.notebooks).absolute())
    c.Spawner.default_url = "/lab"
    c.Spawner.http_timeout = 120
    c.Spawner.start_timeout = 180
    env = dict(klass.extra_env)
    if os.path.realpath(klass.python) != os.path.realpath(sys.executable):
        # A learners' interpreter of its own (see problems()) that reads this environment's
        # packages: Jupyter's files (the panel, its server extension, JupyterLab's app) are here.
        env.setdefault("JUPYTER_PATH", str(Path(sys.prefix) / "share" / "jupyter"))
        env.setdefault("JUPYTER_CONFIG_PATH", str(Path(sys.prefix) / "etc" / "jupyter"))
        env.setdefault("JUPYTERLAB_DIR", str(Path(sys.prefix) / "share" / "jupyter" / "lab"))
    c.Spawner.environment = env
    _instructor_view(c, klass)


def _instructor_view(c: Config, klass: Class) -> None:
    """The instructor's view, a hub service (``instructor``)."""
    from .instructor import configure as add_view

    add_view(c, klass.instructors, klass.port)

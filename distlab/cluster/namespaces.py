"""Network namespaces as distlab makes and removes them: the commands, the capabilities they need,
what the kernel offers (netem), and the names by which a lab's namespaces are found again, by
their lab or, once its notebook died, by anyone (``remove_orphans``).

With CAP_NET_ADMIN and CAP_SYS_ADMIN (root) they are named under /run/netns (:class:`NamedNamespaces`,
``ip netns``); without them, in a user namespace of the lab's own (``cluster.userns``), where the
kernel lets users make one. :func:`namespace_host` picks; both take the same calls.

A lab's namespace is ``distlab-<owner pid>-<sequence>-<role>``: ``sw`` its switch (the spine where
it has racks), ``r<k>`` a rack's switch, ``n<i>`` a node, ``probe`` a probe made and removed at once;
``learner`` a classroom learner's own network, whose owner is the hub (``distlab.classroom.network``).
``cluster.nodes`` builds a lab's network out of them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from typing import Protocol

from ..errors import DistlabError, LabUsageError
from .processes import pid_alive, wait_for

__all__ = [
    "NS_PREFIX",
    "RUN_NETNS",
    "NamedNamespaces",
    "NamespaceHost",
    "lab_namespaces",
    "namespace_host",
    "netem_missing",
    "nodes_here",
    "remove_namespaces",
    "remove_orphans",
    "require_namespaces",
    "require_netem",
    "run",
]

NS_PREFIX = "distlab-"
_NS_PATTERN = re.compile(r"^distlab-(\d+)-(\d+)-(sw|probe|learner|n\d+|r\d+)$")
RUN_NETNS = "/run/netns"
_CMD_TIMEOUT_S = 10.0
# Capability bits (linux/capability.h): making namespaces mounts them (SYS_ADMIN); links, addresses
# and queues need NET_ADMIN.
_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21
#: Set (to 1) to make nodes in a user namespace even with root's capabilities: what a user without
#: them gets, to try or to test it as root.
USERNS_ENV = "DISTLAB_USERNS"

def _capabilities() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def _missing_capabilities() -> list[str]:
    caps = _capabilities()
    return [name for bit, name in ((_CAP_NET_ADMIN, "CAP_NET_ADMIN"), (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
            if not caps >> bit & 1]


def _in_user_namespace() -> bool:
    """Whether this lab's nodes go in a user namespace of its own: without root's capabilities, or asked."""
    return bool(_missing_capabilities()) or os.environ.get(USERNS_ENV, "") not in ("", "0")


def require_namespaces(flag: str = "nodes") -> None:
    """Raise one line if this process cannot make network namespaces, links and queues (before anything starts):
    with root's capabilities, or else in a user namespace of its own where the kernel allows one."""
    missing = _missing_capabilities()
    if _in_user_namespace():
        from .userns import userns_missing

        why = userns_missing()
        if why is not None:
            lacks = f"root's {' and '.join(missing)}, or " if missing else ""
            raise LabUsageError(
                f"{flag} needs {lacks}a user namespace to make network namespaces and links, and this machine "
                f"refused one ({why}): run as root, or allow user namespaces (sysctl user.max_user_namespaces; "
                f"a container's seccomp profile); without {flag} every rank runs on loopback"
            )
    tools = [t for t in ("ip", "tc", "unshare", "nsenter") if shutil.which(t) is None]
    if tools:
        raise LabUsageError(
            f"{flag} needs {', '.join(tools)} on PATH (Debian: apt install iproute2 util-linux); "
            f"without {flag} every rank runs on loopback"
        )


class NamespaceHost(Protocol):
    """What holds a lab's namespaces: how to make, enter and remove one, and name it to ``ip``."""

    rootless: bool

    def add(self, name: str) -> None: ...
    def remove(self, names: list[str]) -> None: ...
    def close(self) -> None: ...
    def netns_path(self, name: str) -> str: ...
    def exec_prefix(self, name: str) -> list[str]: ...
    def ip(self, name: str) -> list[str]: ...
    def tc(self, name: str) -> list[str]: ...


class NamedNamespaces:
    """Namespaces named under /run/netns, made by root (``ip netns``): anyone can find them by name."""

    rootless = False

    def add(self, name: str) -> None:
        run(["ip", "netns", "add", name], f"making {name}")

    def remove(self, names: list[str]) -> None:
        remove_namespaces(names)

    def close(self) -> None:
        pass

    def netns_path(self, name: str) -> str:
        return name  # ``ip`` takes a name where it takes a namespace

    def exec_prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", name]

    def ip(self, name: str) -> list[str]:
        return ["ip", "-n", name]

    def tc(self, name: str) -> list[str]:
        return ["tc", "-n", name]


def namespace_host() -> NamespaceHost:
    """Where a new lab's namespaces go: named (root), or a user namespace of the lab's own.
    Call :func:`require_namespaces` first."""
    if not _in_user_namespace():
        return NamedNamespaces()
    from .userns import UserNamespaces

    return UserNamespaces()


def nodes_here(instead: str, what: str = "nodes") -> bool:
    """True if emulated nodes can be made here; else print one line, why not and what runs ``instead``, and False.

    For a notebook that falls back to loopback where it cannot make nodes (Binder, no root):
    ``on_nodes = nodes_here("2 ranks on loopback instead, so the times are CPU copying")``.
    """
    try:
        require_namespaces()
    except LabUsageError as exc:
        print(f"no emulated {what} here ({exc}): {instead}")
        return False
    return True


def run(args: list[str], doing: str) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise DistlabError(f"{doing}: {' '.join(args)} took over {_CMD_TIMEOUT_S:g} s") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise DistlabError(f"{doing}: {' '.join(args)}: {why}")
    return done.stdout



def netem_missing() -> str | None:
    """Why this kernel cannot add delay to a link (no sch_netem), or None if it can.

    Probed in a namespace of its own, made and removed here: the answer is the kernel's.
    """
    host = namespace_host()
    name = f"{NS_PREFIX}{os.getpid()}-0-probe"
    if not host.rootless:
        with contextlib.suppress(DistlabError):
            run(["ip", "netns", "del", name], "removing a probe")
    try:
        host.add(name)
        run([*host.ip(name), "link", "set", "lo", "up"], "probing for netem")
        done = subprocess.run(
            [*host.tc(name), "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
            capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False,
        )
        if done.returncode == 0:
            return None
        return (done.stderr.strip().splitlines() or ["netem refused"])[-1]
    finally:
        with contextlib.suppress(DistlabError):
            host.remove([name])
        host.close()


def require_netem(flag: str) -> None:
    why = netem_missing()
    if why is not None:
        raise LabUsageError(
            f"{flag} needs the kernel's netem queue (sch_netem), which this kernel lacks ({why}): "
            "leave the latency out; the link's rate is still shaped"
        )


def lab_namespaces() -> list[str]:
    try:
        return sorted(n for n in os.listdir(RUN_NETNS) if _NS_PATTERN.match(n))
    except OSError:
        return []


def remove_namespaces(names: list[str]) -> None:
    """Kill what runs in each namespace and delete it; wait (bounded) until the kernel has let go."""
    present = [n for n in names if os.path.exists(os.path.join(RUN_NETNS, n))]
    for name in present:
        with contextlib.suppress(DistlabError):
            for pid in run(["ip", "netns", "pids", name], "listing a node's processes").split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
    for name in present:
        with contextlib.suppress(DistlabError):
            run(["ip", "netns", "del", name], "removing a node")
    wait_for(lambda: not any(os.path.exists(os.path.join(RUN_NETNS, n)) for n in present), 5.0)


def remove_orphans() -> list[str]:
    """Remove the namespaces of labs whose notebook died with them still up (their owner pid is gone)."""
    orphans = []
    for name in lab_namespaces():
        match = _NS_PATTERN.match(name)
        if match and not pid_alive(int(match.group(1))):
            orphans.append(name)
    if orphans:
        remove_namespaces(orphans)
    return orphans

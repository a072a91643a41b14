"""Network namespaces without root: a user namespace of the lab's own holds a lab's nodes and switches.

Making a network namespace in the machine's own user namespace takes CAP_SYS_ADMIN there, and links
and queues CAP_NET_ADMIN: root, or a container given them. A user without them (Binder, a JupyterHub
server, a laptop's own account) may still make a *user* namespace, where they are root, and network
namespaces inside it, whose veth links, bridges and tc queues are the kernel's own, exactly as root's
(user_namespaces(7)). The kernel may refuse: ``user.max_user_namespaces`` at 0, or a seccomp filter
(Docker's default profile refuses ``unshare`` without CAP_SYS_ADMIN); :func:`userns_missing` quotes it.

Such namespaces have no names under /run/netns (bind-mounting one there needs root), so each lives
as long as a process in it: a holder (``sleep``) per namespace, started by a small program that runs
as root inside the user namespace (this module's ``main``). The lab talks to it over a pipe, one line
a request, and enters a namespace with ``nsenter`` into the user namespace and the holder's network
namespace. The program ends its holders, and every process left in their namespaces, once the pipe
closes or the lab's process is gone: nothing outlives the lab, even a notebook killed with SIGKILL.

    python -m distlab.cluster.userns OWNER_PID     (run as: unshare --user --map-root-user -- ...)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time

from ..errors import DistlabError

__all__ = ["UserNamespaces", "userns_missing"]

_REPLY_S = 10.0
_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


def userns_missing() -> str | None:
    """Why this user cannot make a user namespace with a network namespace in it (the kernel's or
    unshare's words), or None if they can. Probed by making one, which goes at once."""
    try:
        done = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "true"],
                              capture_output=True, text=True, timeout=_REPLY_S, check=False)
    except FileNotFoundError:
        return "unshare is not on PATH (Debian: apt install util-linux)"
    except subprocess.TimeoutExpired:
        return f"unshare --user --net took over {_REPLY_S:g} s"
    if done.returncode == 0:
        return None
    return (done.stderr.strip().splitlines() or [f"unshare exited with {done.returncode}"])[-1]


class UserNamespaces:
    """A lab's network namespaces inside a user namespace it made: the same calls as named ones
    (``cluster.namespaces.NamedNamespaces``), each namespace found by its holder's pid."""

    rootless = True

    def __init__(self) -> None:
        self._holders: dict[str, int] = {}
        self._proc = subprocess.Popen(
            ["unshare", "--user", "--map-root-user", "--", sys.executable, "-m", "distlab.cluster.userns",
             str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,  # a Ctrl-C of the notebook's group must not end the nodes under a cell
        )
        first = self._reply("making a user namespace for the nodes")
        if first != "ready":
            self.close()
            raise DistlabError(f"making a user namespace for the nodes: {first}")

    @property
    def pid(self) -> int:
        """The program holding the user namespace (its root)."""
        return self._proc.pid

    def _reply(self, doing: str) -> str:
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], _REPLY_S)
        line = self._proc.stdout.readline() if ready else ""
        if not line:
            why = "no answer" if not ready else "it ended"
            err = ""
            if self._proc.poll() is not None and self._proc.stderr is not None:
                err = (self._proc.stderr.read().strip().splitlines() or [""])[-1]
            raise DistlabError(f"{doing}: the user namespace's holder gave {why} within {_REPLY_S:g} s"
                               + (f" ({err})" if err else ""))
        return line.strip()

    def _ask(self, request: str, doing: str) -> str:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(request + "\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise DistlabError(f"{doing}: the user namespace's holder has ended") from None
        answer = self._reply(doing)
        if answer.startswith("error "):
            raise DistlabError(f"{doing}: {answer[6:]}")
        return answer

    def add(self, name: str) -> None:
        self._holders[name] = int(self._ask(f"add {name}", f"making {name}"))

    def remove(self, names: list[str]) -> None:
        """End what runs in each namespace, and its holder: the kernel frees it with the last process."""
        for name in names:
            if self._holders.pop(name, None) is not None:
                with contextlib.suppress(DistlabError):
                    self._ask(f"del {name}", f"removing {name}")
        if not self._holders:
            self.close()

    def close(self) -> None:
        """End the holder program: it ends every namespace it still holds, and what runs in them."""
        self._holders.clear()
        if self._proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self._proc.stdin is not None
                self._proc.stdin.close()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        for pipe in (self._proc.stdout, self._proc.stderr, self._proc.stdin):
            with contextlib.suppress(OSError, ValueError):
                if pipe is not None:
                    pipe.close()

    def netns_path(self, name: str) -> str:
        """The namespace as a file, where ``ip`` takes a namespace's name (``netns`` of a veth's peer)."""
        return f"/proc/{self._holders[name]}/ns/net"

    def enter(self, name: str) -> list[str]:
        """A prefix that execs a command in ``name``, as root of the user namespace (whose
        capabilities make links and queues there). ``--preserve-credentials``: the user's own ids
        are the namespace's root already, and setgroups is denied in it."""
        return ["nsenter", "--preserve-credentials", f"--user=/proc/{self._proc.pid}/ns/user",
                f"--net={self.netns_path(name)}", "--"]

    def exec_prefix(self, name: str) -> list[str]:
        return self.enter(name)

    def ip(self, name: str) -> list[str]:
        return [*self.enter(name), "ip"]

    def tc(self, name: str) -> list[str]:
        return [*self.enter(name), "tc"]


# ------------------------------------------------------------------ the holder, inside the namespace

def _die_with_parent() -> None:
    # A holder ends with the program that started it (which is single-threaded: PDEATHSIG follows
    # the thread that forked), whatever ended that program.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _netns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _hold(own: str) -> subprocess.Popen[bytes]:
    holder = subprocess.Popen(["unshare", "--net", "--", "sleep", "infinity"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    deadline = time.monotonic() + _REPLY_S
    while _netns(holder.pid) in (own, None):  # until unshare has made the namespace, before its exec
        if holder.poll() is not None:
            raise OSError(f"unshare --net exited with {holder.returncode}")
        if time.monotonic() > deadline:
            holder.kill()
            raise OSError(f"unshare --net made no namespace within {_REPLY_S:g} s")
        time.sleep(0.002)
    return holder


def _end(holders: list[subprocess.Popen[bytes]]) -> None:
    """Kill every process in the holders' namespaces (engines started there with nsenter), then them."""
    spaces = {_netns(h.pid) for h in holders} - {None}
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me and _netns(int(entry)) in spaces:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)
    for holder in holders:
        with contextlib.suppress(ProcessLookupError):
            holder.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            holder.wait(5)


def main(argv: list[str]) -> int:
    owner = int(argv[0])
    own = _netns(os.getpid()) or ""
    holders: dict[str, subprocess.Popen[bytes]] = {}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    try:
        while os.getppid() == owner:
            ready, _, _ = select.select([sys.stdin], [], [], _POLL_S)
            if not ready:
                continue
            line = sys.stdin.readline()
            if not line:
                break  # the lab closed the pipe, or its process is gone
            verb, _, name = line.strip().partition(" ")
            try:
                if verb == "add":
                    holders[name] = _hold(own)
                    print(holders[name].pid, flush=True)
                elif verb == "del":
                    _end([holders.pop(name)] if name in holders else [])
                    print("ok", flush=True)
                else:
                    print(f"error no such request {verb!r}", flush=True)
            except OSError as exc:
                print(f"error {exc}", flush=True)
    finally:
        _end(list(holders.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

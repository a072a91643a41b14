"""A real Slurm on emulated nodes, for the tests: Debian's munged, slurmctld and slurmds.

One munged (its UNIX socket in the cluster's folder: every namespace shares this machine's files,
so the one socket serves them all), slurmctld on the switch namespace where a head node's would run,
and one slurmd per node namespace, each under its node's host name and on its node's address.
Everything lives in one folder written here (key, slurm.conf, state, spools, logs); ``stop`` ends
every daemon and whatever job is left, and removes the folder. Clients find the cluster through
``SLURM_CONF`` (``SlurmCluster.env``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from distlab.cluster.nodes import Network

__all__ = ["CPUS_PER_NODE", "PARTITION", "SlurmCluster", "missing_programs"]

PARTITION = "lab"
# What each node offers Slurm: ranks beyond NODES * CPUS_PER_NODE fit nowhere, and a job of exactly
# that many must spread over every node (a node takes at most its CPUs' worth of tasks).
CPUS_PER_NODE = 2
_PROGRAMS = {"munged": "munge", "mungekey": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd",
             "sbatch": "slurm-client", "squeue": "slurm-client", "scancel": "slurm-client",
             "sinfo": "slurm-client"}


def _which(program: str) -> str | None:
    """Where ``program`` is, on PATH or in the sbin folders (Debian's daemons), which a user's PATH may lack."""
    return shutil.which(program, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def missing_programs() -> list[str]:
    """The Debian packages whose programs are not here (none: Slurm can be started)."""
    return sorted({package for program, package in _PROGRAMS.items() if _which(program) is None})


def _program(name: str) -> str:
    path = _which(name)
    assert path is not None, f"{name} is missing: {missing_programs()}"
    return path


@dataclass
class SlurmCluster:
    net: Network
    #: Short and in /tmp: munged's socket lives here, and a socket's path has at most 107 bytes.
    folder: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="dl-slurm-", dir="/tmp"))
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> str:
        return os.path.join(self.folder, "slurm.conf")

    @property
    def env(self) -> dict[str, str]:
        """The environment Slurm's clients (sbatch, squeue, srun in a job) find this cluster from."""
        return dict(os.environ, SLURM_CONF=self.conf)

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def log(self, name: str) -> str:
        with contextlib.suppress(OSError), open(self.path(name), errors="replace") as f:
            return f.read()
        return ""

    def logs(self, tail: int = 3000) -> str:
        """What the daemons wrote: Slurm's logs, and munged's messages (in the foreground, to its output)."""
        names = ["munged.out", *sorted(name for name in os.listdir(self.folder) if name.endswith(".log"))]
        return "\n".join(f"--- {name}:\n{self.log(name)[-tail:]}" for name in names)

    def client(self, *args: str, timeout: float = 15) -> subprocess.CompletedProcess[str]:
        """A Slurm client command run on the switch, where the notebook runs."""
        return subprocess.run([*self.net.exec_prefix(None), *args], env=self.env, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=timeout)

    def queue(self) -> list[str]:
        """The jobs squeue lists (pending, running or completing): "ID STATE NAME" each."""
        out = self.client("squeue", "--noheader", "--format=%i %T %j")
        assert out.returncode == 0, out.stderr
        return [line for line in out.stdout.splitlines() if line.strip()]

    # ------------------------------------------------------------------ lifecycle

    def start(self, deadline_s: float = 60.0) -> None:
        self._start_munge(deadline_s)
        self._write_conf()
        for name in ["state", *(f"spool-{self.net.hostname(i)}" for i in range(self.net.nodes))]:
            os.makedirs(self.path(name))
        # slurmctld checks that it runs on SlurmctldHost by its host name: the switch keeps this machine's.
        self._daemon("slurmctld", [*self.net.exec_prefix(None), _program("slurmctld"), "-D", "-i", "-f", self.conf])
        for node in range(self.net.nodes):
            name = self.net.hostname(node)
            self._daemon(f"slurmd-{name}", [*self.net.exec_prefix(node), _program("slurmd"), "-D", "-N", name,
                                            "-f", self.conf])
        self._wait_idle(deadline_s)

    def _daemon(self, name: str, argv: list[str]) -> None:
        with open(self.path(f"{name}.out"), "w") as out:
            self.daemons[name] = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                                  stderr=subprocess.STDOUT, start_new_session=True)

    def _start_munge(self, deadline_s: float) -> None:
        key = self.path("munge.key")
        subprocess.run([_program("mungekey"), "--create", "--keyfile", key], check=True, capture_output=True,
                       timeout=30)
        # munged wants its socket's folder open to everyone's clients (it is, to enter, not to list).
        os.chmod(self.folder, 0o711)
        self._daemon("munged", [
            _program("munged"), "--foreground", f"--socket={self.path('munge.socket')}",
            f"--key-file={key}", f"--pid-file={self.path('munged.pid')}", f"--log-file={self.path('munged.log')}",
            f"--seed-file={self.path('munged.seed')}",
        ])
        self._wait(lambda: os.path.exists(self.path("munge.socket")), "munged's socket", deadline_s, "munged")

    def _write_conf(self) -> None:
        addrs = ",".join(self.net.node_addr(i) for i in range(self.net.nodes))
        last = self.net.nodes - 1
        host = socket.gethostname().split(".")[0]
        with open(self.conf, "w") as f:
            f.write(textwrap.dedent(f"""\
                ClusterName=distlab
                SlurmctldHost={host}({self.net.switch_addr})
                SlurmUser=root
                SlurmdUser=root
                AuthType=auth/munge
                CredType=cred/munge
                AuthInfo=socket={self.path('munge.socket')}
                StateSaveLocation={self.path('state')}
                SlurmctldPidFile={self.path('slurmctld.pid')}
                SlurmctldLogFile={self.path('slurmctld.log')}
                SlurmdSpoolDir={self.path('spool-%n')}
                SlurmdPidFile={self.path('slurmd-%n.pid')}
                SlurmdLogFile={self.path('slurmd-%n.log')}
                ProctrackType=proctrack/linuxproc
                TaskPlugin=task/none
                JobAcctGatherType=jobacct_gather/none
                AccountingStorageType=accounting_storage/none
                SelectType=select/cons_tres
                SelectTypeParameters=CR_CPU
                MpiDefault=none
                ReturnToService=2
                KillWait=5
                NodeName=node[0-{last}] NodeAddr={addrs} CPUs={CPUS_PER_NODE} State=UNKNOWN
                PartitionName={PARTITION} Nodes=node[0-{last}] Default=YES MaxTime=INFINITE State=UP
                """))
        # slurmd 22.05 loads a cgroup plugin whatever the other plugins use, autodetected from
        # /sys/fs/cgroup, which a container may not mount; v1's plugin is named outright: it touches
        # no cgroup until a cgroup plugin (proctrack, task, jobacct) asks, and none here does.
        with open(self.path("cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=cgroup/v1\n")

    def _wait_idle(self, deadline_s: float) -> None:
        def idle() -> bool:
            out = self.client("sinfo", "--noheader", "--Node", "--format=%N %t")
            states = [line.split()[-1] for line in out.stdout.splitlines() if line.strip()]
            return out.returncode == 0 and len(states) == self.net.nodes and all(s == "idle" for s in states)

        self._wait(idle, "both nodes idle in sinfo", deadline_s, *self.daemons)

    def _wait(self, ready: Callable[[], bool], what: str, deadline_s: float, *watched: str) -> None:
        deadline = time.monotonic() + deadline_s
        while not ready():
            for name in watched:
                if self.daemons[name].poll() is not None:
                    raise RuntimeError(f"{name} exited ({self.daemons[name].returncode}) before {what}:\n"
                                       f"{self.log(name + '.out')}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {deadline_s:g} s:\n{self.logs()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel what is queued and wait (a while) for it to leave, stop the daemons (slurmds first,
        munged last), remove the folder. A job step still running after that ends with its node's
        namespace (``Network.destroy``)."""
        try:
            if "slurmctld" in self.daemons:
                with contextlib.suppress(OSError, subprocess.SubprocessError, AssertionError):
                    self.client("scancel", "--full", "--user=root", timeout=10)
                    deadline = time.monotonic() + 20
                    while self.queue() and time.monotonic() < deadline:
                        time.sleep(0.2)
            for name in reversed(list(self.daemons)):
                proc = self.daemons[name]
                with contextlib.suppress(ProcessLookupError):
                    proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, 9)
                    proc.wait(timeout=5)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

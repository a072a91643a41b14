"""ipyparallel's own SSH launcher carries distlab across two hosts, as users run small clusters.

Two emulated nodes (network namespaces, ``distlab.cluster.nodes``) each run Debian's OpenSSH server
under the node's host name, on the node's address only. The notebook runs where a user's would: on
a machine that reaches the nodes (the switch), as a child Python process whose only lab set-up is
ipyparallel's profile configuration (``ipcluster_config.py``: the nodes' addresses, how to ssh).
``distlab.start(launcher="ssh")`` then takes its multi-host path, with no distlab shortcut: the
controller on every interface, engines started over ssh by ipyparallel, ranks grouped by the host
names the engines report, rank 0's rendezvous at its node's address (the notebook and the checks of
its result are ``tests/_remote_lab.py``'s, shared with the Slurm launcher's test). The same nodes then
run the lab with ``launcher="mpi"``: Open MPI's mpiexec on the switch starts the engines over the same sshds.

Needs root (namespaces) and ``/usr/sbin/sshd`` (Debian's openssh-server; ``make test`` installs it).
Everything started here (sshd, the notebook, its controller and engines, ssh connections, the
namespaces, the key and profile folders) is ended and removed when the module's tests end, pass or fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from _remote_lab import NODES, check_two_node_lab, run_notebook, write_profile

from distlab.cluster.nodes import Network

pytestmark = pytest.mark.cluster

SSHD = "/usr/sbin/sshd"
RANKS_PER_NODE = 2


@dataclass
class SshNodes:
    """Two nodes, each with an sshd that lets the throwaway key in as root."""

    net: Network
    folder: str  # keys, sshd configs and logs, the notebook's IPYTHONDIR, each node's remote profile
    key: str  # the client's private key
    sshd: list[subprocess.Popen] = field(default_factory=list)

    def addr(self, node: int) -> str:
        return self.net.node_addr(node)

    @property
    def ssh_options(self) -> list[str]:
        """What ssh and scp are given: this key only, no host key checks, no prompts, one connection
        per node for all of ipyparallel's calls (it makes a dozen per engine)."""
        return [
            "-F", "/dev/null",  # no user or system ssh_config
            "-i", self.key, "-o", "IdentitiesOnly=yes",
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "LogLevel=ERROR",
            "-o", "ControlMaster=auto", "-o", f"ControlPath={self.folder}/cm-%C", "-o", "ControlPersist=60",
        ]

    def sshd_log(self, node: int) -> str:
        with contextlib.suppress(OSError), open(os.path.join(self.folder, f"sshd{node}.log")) as f:
            return f.read()
        return ""


def _require(program: str, package: str) -> str:
    path = shutil.which(program) if "/" not in program else (program if os.access(program, os.X_OK) else None)
    if path is None:
        pytest.fail(
            f"{program} is needed to start the nodes' SSH servers: apt-get install {package} "
            "(make test installs it as root)",
            pytrace=False,
        )
    return path


def _start_sshd(nodes: SshNodes, node: int, host_key: str) -> None:
    config = os.path.join(nodes.folder, f"sshd{node}.conf")
    with open(config, "w") as f:
        f.write(textwrap.dedent(f"""\
            ListenAddress {nodes.addr(node)}
            Port 22
            HostKey {host_key}
            PermitRootLogin prohibit-password
            PubkeyAuthentication yes
            AuthorizedKeysFile {nodes.key}.pub
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            StrictModes no
            UsePAM no
            PidFile none
            MaxSessions 50
            MaxStartups 50
            Subsystem sftp internal-sftp
            """))
    with open(os.path.join(nodes.folder, f"sshd{node}.log"), "w") as log:
        # Under the node's prefix: the node's network, and its host name (ssh sessions inherit both).
        nodes.sshd.append(subprocess.Popen(
            [*nodes.net.exec_prefix(node), SSHD, "-D", "-e", "-f", config],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        ))


def _wait_listening(nodes: SshNodes, deadline_s: float = 15.0) -> None:
    deadline = time.monotonic() + deadline_s
    for node, proc in enumerate(nodes.sshd):
        while "Server listening on" not in nodes.sshd_log(node):
            if proc.poll() is not None:
                pytest.fail(f"sshd on node{node} exited ({proc.returncode}):\n{nodes.sshd_log(node)}", pytrace=False)
            if time.monotonic() > deadline:
                pytest.fail(f"sshd on node{node} was not listening within {deadline_s:g} s:\n{nodes.sshd_log(node)}",
                            pytrace=False)
            time.sleep(0.05)


def _stop(nodes: SshNodes) -> None:
    """Close the shared ssh connections, stop the sshds, remove the namespaces (and whatever still
    runs in them: engines, the controller) and the folder. Each step bounded; every step runs."""
    for node in range(NODES):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                [*nodes.net.exec_prefix(None), "ssh", *nodes.ssh_options, "-O", "exit", f"root@{nodes.addr(node)}"],
                stdin=subprocess.DEVNULL, capture_output=True, timeout=5,
            )
    for proc in nodes.sshd:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
    for proc in nodes.sshd:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    try:
        nodes.net.destroy()
    finally:
        shutil.rmtree(nodes.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def ssh_nodes() -> Iterator[SshNodes]:
    _require(SSHD, "openssh-server")
    for program in ("ssh", "scp", "ssh-keygen"):
        _require(program, "openssh-client")
    net = Network.create(NODES, None)
    # Short and in /tmp: ssh's control sockets live here, and a socket's path has at most 107 bytes.
    nodes = SshNodes(net, tempfile.mkdtemp(prefix="dl-ssh-", dir="/tmp"), "")
    try:
        nodes.key = os.path.join(nodes.folder, "client")
        host_key = os.path.join(nodes.folder, "host")
        for path in (nodes.key, host_key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "distlab-test", "-f", path],
                           check=True, capture_output=True, timeout=30)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation folder (Debian)
        for node in range(NODES):
            _start_sshd(nodes, node, host_key)
        _wait_listening(nodes)
        yield nodes
    finally:
        _stop(nodes)
        assert not set(net.namespaces()) & set(os.listdir("/run/netns")), "the nodes' namespaces outlived the test"


def _run_notebook(nodes: SshNodes, launcher: str, settings: str) -> dict:
    """The notebook's RESULT with ``launcher`` and profile ``settings``; the sshds' logs if it failed."""
    def logs() -> str:
        return "\n".join(f"--- sshd on node{i}:\n{nodes.sshd_log(i)[-3000:]}" for i in range(NODES))

    return run_notebook(nodes.net, launcher, write_profile(nodes.folder, settings), logs)


def test_ssh_launcher_starts_ranks_on_two_hosts_grouped_by_host(ssh_nodes: SshNodes) -> None:
    """ipyparallel's SSHEngineSetLauncher, configured as its documentation shows, with 2 engines per host."""
    profile_dirs = {i: os.path.join(ssh_nodes.folder, f"node{i}-profile") for i in range(NODES)}
    settings = textwrap.dedent(f"""\
        c = get_config()  # noqa: F821
        # Engines reach the controller at the switch's address: this machine's host name resolves
        # only to loopback here, as a head node's may where no DNS knows it.
        c.Cluster.controller_location = {ssh_nodes.net.switch_addr!r}
        c.SSHLauncher.ssh_args = {ssh_nodes.ssh_options!r}
        c.SSHLauncher.scp_args = {ssh_nodes.ssh_options!r}
        c.SSHLauncher.remote_python = {sys.executable!r}
        c.SSHEngineSetLauncher.engine_cmd = [{sys.executable!r}, "-m", "ipyparallel.engine"]
        # Each node its own remote profile, as on hosts that share no files with the notebook: the
        # engines read the connection files ipyparallel sent there with scp, not the notebook's.
        c.SSHEngineSetLauncher.engines = {{
            {ssh_nodes.addr(0)!r}: {{"n": {RANKS_PER_NODE}, "remote_profile_dir": {profile_dirs[0]!r}}},
            {ssh_nodes.addr(1)!r}: {{"n": {RANKS_PER_NODE}, "remote_profile_dir": {profile_dirs[1]!r}}},
        }}
        """)
    result = _run_notebook(ssh_nodes, "ssh", settings)
    check_two_node_lab(result, ssh_nodes.net)
    # ipyparallel's ssh ran the engines: each node's sshd let the key in, and scp sent each node
    # the controller's connection file.
    for node in range(NODES):
        assert "Accepted publickey for root" in ssh_nodes.sshd_log(node)
        sent = os.listdir(os.path.join(profile_dirs[node], "security"))
        assert any(name.endswith("-engine.json") for name in sent), sent


@pytest.mark.mpi
def test_mpi_launcher_starts_ranks_on_two_hosts_over_ssh_numbered_as_mpi_numbers_them(ssh_nodes: SshNodes) -> None:
    """Open MPI's mpiexec, on the switch, starts the engines on both nodes through the same sshds."""
    assert shutil.which("mpiexec"), "Open MPI's mpiexec is needed: apt-get install openmpi-bin (make test does)"
    hostfile = os.path.join(ssh_nodes.folder, "hostfile")
    with open(hostfile, "w") as f:
        f.writelines(f"{ssh_nodes.addr(i)} slots={RANKS_PER_NODE}\n" for i in range(NODES))
    mpi_args = [
        "--hostfile", hostfile,
        "--mca", "plm_rsh_agent", "ssh", "--mca", "plm_rsh_args", " ".join(ssh_nodes.ssh_options),
        # Open MPI passes its environment to no process on another host unless told: ipyparallel's
        # engines find their profile and cluster through these two.
        "-x", "IPP_PROFILE_DIR", "-x", "IPP_CLUSTER_ID",
        # Its daemons on the nodes keep their session folders in the run's temporary folder (removed
        # with it), not in /tmp: over ssh they do not inherit TMPDIR (Open MPI 4's name for it).
        "--mca", "orte_tmpdir_base", tempfile.gettempdir(),
    ]
    settings = textwrap.dedent(f"""\
        c = get_config()  # noqa: F821
        # Ranks on other hosts: the controller listens on every interface, at the switch's address.
        c.Cluster.controller_ip = "*"
        c.Cluster.controller_location = {ssh_nodes.net.switch_addr!r}
        c.MPILauncher.mpi_args = {mpi_args!r}
        """)
    result = _run_notebook(ssh_nodes, "mpi", settings)
    check_two_node_lab(result, ssh_nodes.net)
    # Ranks follow MPI's numbering (by slot: the hostfile's first node takes ranks 0 and 1).
    assert {rank: int(seen[3]) for rank, seen in result["seen"].items()} == {str(r): r for r in range(4)}
    assert [r["host"] for r in result["table"]] == ["node0", "node0", "node1", "node1"]

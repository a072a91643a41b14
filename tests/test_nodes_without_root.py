"""Emulated nodes for a user without root: the same namespaces, links and queues, in a user namespace
of the lab's own (``cluster.userns``), and one clear line where the machine refuses even that.

Three kinds of "not root" are made here for real, not pretended:
- root with CAP_NET_ADMIN and CAP_SYS_ADMIN taken out of its bounding set (a container not given
  them): the whole lab, started, measured, killed;
- the same without CAP_SETFCAP too, which may not map its uid into a user namespace (Linux 5.12+):
  the refusal;
- the user ``nobody``, with the system's Python (this project's interpreter may live where ``nobody``
  cannot read): the network itself, a transfer across a shaped link.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

import distlab
from distlab import theory
from distlab.cluster.processes import pid_alive, wait_for

pytestmark = pytest.mark.cluster

NO_NET_ADMIN = ["setpriv", "--bounding-set=-net_admin,-sys_admin"]
NO_USERNS_EITHER = ["setpriv", "--bounding-set=-net_admin,-sys_admin,-setfcap"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(distlab.__file__)))


LAB = """
import json, os, sys, distlab
from distlab.cluster.namespaces import _missing_capabilities
lab = distlab.start(ranks=4, nodes=2, link="100mbit", timeout=60)
host = lab.processes.network.host
size = 2 * 2**20  # bytes of float32, all-reduced by the two ranks of a group across the nodes
lab.run("across = dist.new_group([0, 2])", stream=False)
before = lab.link_bytes()[0]
lab.run(f"dist.all_reduce(torch.ones({size // 4}), group=across)", ranks=[0, 2], stream=False)
said = dict(
    missing=_missing_capabilities(), kind=type(host).__name__, holder=host.pid,
    namespaces=list(host._holders.values()), ranks=[r.pid for r in lab.table],
    hosts=lab.run("import socket; socket.gethostname()", stream=False),
    sent=lab.link_bytes()[0] - before, size=size,
    queues=list(lab.processes.network.queues().values()),
    uids=lab.run("import os; os.getuid()", stream=False),
)
print("SAID " + json.dumps(said), flush=True)
if sys.argv[1] == "stop":
    lab.stop()
else:
    os.kill(os.getpid(), 9)  # the notebook dies with its lab up: nothing of it may stay
"""


@pytest.mark.parametrize("end", ["stop", "sigkill"])
def test_without_root_capabilities_a_lab_on_nodes_runs_in_a_user_namespace_and_leaves_nothing(end: str) -> None:
    done = subprocess.run([*NO_NET_ADMIN, sys.executable, "-c", LAB, end],
                          capture_output=True, text=True, timeout=240, check=False)
    line = next((x for x in done.stdout.splitlines() if x.startswith("SAID ")), None)
    assert line is not None, done.stderr[-3000:]
    said = json.loads(line[5:])
    assert said["missing"] == ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"]  # really without them
    assert said["kind"] == "UserNamespaces"
    assert said["hosts"] == {"0": "node0", "1": "node0", "2": "node1", "3": "node1"}
    assert set(said["uids"].values()) == {0}  # root of the lab's own user namespace, nobody else's
    # The link is the kernel's: shaped at 100 Mbit/s both ways, and a ring across nodes crosses it
    # (a 2-rank all-reduce sends the whole tensor once: theory.collective_bytes).
    assert len(said["queues"]) == 4 and all("tbf" in q and "rate 100Mbit" in q for q in said["queues"])
    assert said["sent"] >= theory.collective_bytes("all_reduce", said["size"], 2).sent_bytes
    if end == "stop":
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        assert done.returncode == -signal.SIGKILL
    # Whether stopped or killed, the holder of the user namespace, the namespaces' holders and the
    # ranks are gone (the holder ends the namespaces once its lab's process is).
    pids = [said["holder"], *said["namespaces"], *said["ranks"]]
    assert wait_for(lambda: not any(pid_alive(p) for p in pids), 30), [p for p in pids if pid_alive(p)]


def test_where_user_namespaces_are_refused_too_nodes_fail_in_one_line_and_loopback_still_works() -> None:
    code = (
        "import distlab, sys\n"
        "try:\n    distlab.start(ranks=2, nodes=2)\n"
        "except distlab.LabUsageError as exc:\n    print(exc); sys.exit(3)\n"
    )
    done = subprocess.run([*NO_USERNS_EITHER, sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 3, done.stderr[-2000:]
    line = done.stdout.strip()
    assert "\n" not in line and "root's CAP_NET_ADMIN and CAP_SYS_ADMIN, or a user namespace" in line
    assert "uid_map" in line  # the refusal in unshare's own words
    assert "loopback" in line
    plain = subprocess.run(
        [*NO_USERNS_EITHER, sys.executable, "-c",
         "import distlab\nwith distlab.start(ranks=2) as lab:\n    print(lab.run('rank', stream=False))"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert plain.returncode == 0 and "{0: 0, 1: 1}" in plain.stdout, plain.stderr[-2000:]
    # The notebooks' fallback: nodes_here says why in one line and what runs instead, and is False.
    probe = "from distlab.cluster.nodes import nodes_here\nprint(nodes_here('loopback instead', what='racks'))"
    refused = subprocess.run([*NO_USERNS_EITHER, sys.executable, "-c", probe],
                             capture_output=True, text=True, timeout=120, check=False)
    why, answer = refused.stdout.strip().splitlines()
    assert why.startswith("no emulated racks here (") and "user namespace" in why
    assert why.endswith("): loopback instead") and answer == "False"
    for allowed_as in ([], NO_NET_ADMIN):
        allowed = subprocess.run([*allowed_as, sys.executable, "-c", probe],
                                 capture_output=True, text=True, timeout=120, check=False)
        assert allowed.stdout == "True\n", allowed.stderr


NETWORK = """
import json, subprocess, sys, time
from distlab.cluster.namespaces import _missing_capabilities
from distlab.cluster.nodes import Link, Network
net = Network.create(nodes=2, link=Link.parse("100mbit"))
size = 12 * 2**20
# The receiver times the bytes from the first to the last: what the sender hands to its socket's
# buffers (megabytes) leaves at once, what arrives has crossed the link.
sink = subprocess.Popen([*net.exec_prefix(1), sys.executable, "-c",
    "import socket, time\\ns = socket.create_server(('', 9000))\\nc, _ = s.accept()\\n"
    "b = c.recv(1 << 20)\\nt, n = time.perf_counter(), len(b)\\n"
    "while (b := c.recv(1 << 20)):\\n    n += len(b)\\nprint(n, time.perf_counter() - t)"],
    stdout=subprocess.PIPE, text=True)
send = ("import socket, time\\n"
        "for _ in range(100):\\n    try:\\n        s = socket.create_connection((%r, 9000)); break\\n"
        "    except OSError: time.sleep(0.05)\\n"
        "s.sendall(bytes(%d)); s.close()")
subprocess.run([*net.exec_prefix(0), sys.executable, "-c", send % (net.node_addr(1), size)],
               capture_output=True, text=True, timeout=60, check=True)
got, took = sink.communicate(timeout=60)[0].split()
got, took = int(got), float(took)
hostname = subprocess.run([*net.exec_prefix(0), "hostname"], capture_output=True, text=True, check=True).stdout
print(json.dumps(dict(missing=_missing_capabilities(), kind=type(net.host).__name__, holder=net.host.pid,
                      got=got, size=size, took=took, sent=net.sent_bytes()[0], host=hostname.strip())))
net.destroy()
"""


def test_a_user_who_is_not_root_makes_nodes_and_a_shaped_link() -> None:
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or python is None:
        pytest.skip("needs root to become the user nobody, and the system's python3 for nobody to run")
    nobody = pwd.getpwnam("nobody")
    # nobody may not read this project's tree or interpreter where they are root's: a copy of the
    # package (its network half needs only the standard library) in a folder nobody can read.
    folder = tempfile.mkdtemp(prefix="distlab-nobody-", dir="/tmp")  # not the suite's (root's only)
    try:
        shutil.copytree(os.path.join(REPO, "distlab"), os.path.join(folder, "distlab"),
                        ignore=shutil.ignore_patterns("labextension", "__pycache__"))
        for root, dirs, files in os.walk(folder):
            for name in [*dirs, *files, "."]:
                os.chmod(os.path.join(root, name), 0o755)
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": folder, "PYTHONPATH": folder}
        done = subprocess.run(
            ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
             python, "-c", NETWORK],
            capture_output=True, text=True, timeout=120, check=False, env=env, cwd=folder,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["missing"] == ["CAP_NET_ADMIN", "CAP_SYS_ADMIN"] and said["kind"] == "UserNamespaces"
    assert said["host"] == "node0"
    assert said["got"] == said["size"] and said["sent"] >= said["size"]  # across node 0's link, counted by tc
    # No faster than the link allows (a bound the kernel sets, not a speed target): all but the first
    # read and the token bucket's 32 KiB of saved credit cross at 100 Mbit/s, 1.0 s for 12 MiB.
    assert said["took"] > 0.9 * said["size"] * 8 / 100e6, said
    assert not pid_alive(said["holder"])

"""A class on one server: a real JupyterHub, learners as system users, and every way one learner might
reach another's labs, tried and refused.

Each attempt is made as the learner would make it from a terminal of their own server (their user,
in their network namespace: ``_hub.as_learner``), against labs another learner started in a kernel
of theirs. Each refused attempt has its control beside it, made as the owner, which succeeds: an
attempt that fails for a reason of its own (a port that was never open, a file that is not there)
proves nothing.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _hub import Hub, LearnerKernel, as_learner, namespaces_of
from _jupyter import wait_for

pytestmark = pytest.mark.e2e

LEARNERS = ["dl-ann", "dl-bob"]
INSTRUCTORS = ["dl-ida"]

# Run as a learner: each attempt, and what it got ("ok", or the error's name and text).
PROBE = r"""
import json, os, socket, sys
targets = json.loads(sys.stdin.read())  # not argv: a command line is readable by all
said = {}
def attempt(key, fn):
    try:
        fn()
        said[key] = "ok"
    except Exception as exc:
        said[key] = f"{type(exc).__name__}: {exc}"
for path in targets["files"]:
    attempt("read " + path, lambda p=path: open(p, "rb").read(1))
for path in targets["folders"]:
    attempt("list " + path, lambda p=path: os.listdir(p))
for host, port in targets["ports"]:
    def connect(h=host, p=port):
        with socket.create_connection((h, p), timeout=3):
            pass
    attempt(f"connect {host}:{port}", connect)
for pid in targets["pids"]:
    attempt(f"signal {pid}", lambda p=pid: os.kill(p, 0))  # 0: the permission check alone, harmless if allowed
    attempt(f"environ {pid}", lambda p=pid: open(f"/proc/{p}/environ", "rb").read(1))
    def enter(p=pid):
        import ctypes
        fd = os.open(f"/proc/{p}/ns/net", os.O_RDONLY)
        if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:
            raise PermissionError(ctypes.get_errno(), "setns refused")
    attempt(f"enter {pid}", enter)
    def enter_user(p=pid):
        import ctypes
        fd = os.open(f"/proc/{p}/ns/user", os.O_RDONLY)
        if ctypes.CDLL(None, use_errno=True).setns(fd, 0x10000000) != 0:
            raise PermissionError(ctypes.get_errno(), "setns refused")
    attempt(f"enter user {pid}", enter_user)
for folder in targets["cgroups"]:
    attempt("leave " + folder, lambda f=folder: open(f + "/cgroup.procs", "w").write(str(os.getpid())))
secrets = targets["secrets"]
exposed = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            line = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        exposed += [s for s in secrets if s in line]
said["secrets in command lines"] = sorted(set(exposed))
print(json.dumps(said))
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    with Hub(tmp_path_factory.mktemp("hub"), LEARNERS, INSTRUCTORS, limits="ranks=4,labs=2", cores=1.0) as running:
        owner = running.process.pid
        hub_address = running.hub_address() + "/32"
        yield running
    # Nothing of the class outlives its hub: namespaces, control groups, temporary folders, the hub's address.
    assert namespaces_of(owner) == []
    assert glob.glob(f"/sys/fs/cgroup/*/distlab-{owner}-*") + glob.glob(f"/sys/fs/cgroup/distlab-{owner}-*") == []
    assert glob.glob(f"/tmp/distlab-{owner}-*") == []  # the learners' temporary folders
    assert f" {hub_address} " not in subprocess.run(["ip", "-o", "addr", "show", "dev", "lo"], capture_output=True,
                                                    text=True, check=True).stdout


@pytest.fixture(scope="module")
def labs(hub: Hub) -> dict[str, Any]:
    """Each learner's server running, with a 2-rank lab in a kernel of theirs; what root sees of it."""
    found: dict[str, Any] = {}
    for name in LEARNERS:
        hub.start_server(name)
        token = hub.user_token(name)
        kernel = LearnerKernel(hub, name, token)
        kernel.run("%load_ext distlab\n%dist start -n 2")
        status, panel = hub.request("GET", f"/user/{name}/distlab/labs", token=token)
        assert status == 200 and len(panel["labs"]) == 1, panel
        nodes = None
        if name == "dl-bob":
            # A network lab too, made by a learner who is not root (nodes in user namespaces of
            # his own, inside his network): its links are his alone.
            nodes = LearnerKernel(hub, name, token, "nodes.ipynb")
            said = nodes.run("%load_ext distlab\n%dist start -n 2 --nodes 2 --link 100mbit")
            assert "on 2 nodes (link 100mbit)" in said, said
            assert nodes.run("%%ddp\nimport socket\nprint(socket.gethostname())").count("node") == 2
        home = hub.users[name].pw_dir
        runtime = f"{home}/.local/share/jupyter/runtime"
        found[name] = {
            "token": token, "kernel": kernel, "lab": panel["labs"][0],
            "nodes_lab": next((lab for lab in hub.request("GET", f"/user/{name}/distlab/labs", token=token)[1]["labs"]
                               if lab["id"] != panel["labs"][0]["id"]), None) if nodes else None,
            "netns": _netns_of(hub, hub.request("GET", f"/hub/api/users/{name}")[1]["servers"][""]["state"]["pid"]),
            "files": sorted(glob.glob(f"{runtime}/kernel-*.json") + glob.glob(f"{runtime}/distlab/lab-*.json")
                            + glob.glob(f"{home}/.ipython/**/security/*.json", recursive=True)),
            "home": home,
        }
    return found


def _netns_of(hub: Hub, pid: int) -> str:
    """The namespace of the hub's that process ``pid`` lives in."""
    inode = os.stat(f"/proc/{pid}/ns/net").st_ino
    return next(n for n in namespaces_of(hub.process.pid) if os.stat(f"/run/netns/{n}").st_ino == inode)


def _address_of(netns: str) -> str:
    out = subprocess.run(["ip", "-n", netns, "-4", "-o", "addr", "show", "dev", "hub0"], capture_output=True,
                         text=True, check=True).stdout
    return out.split()[3].split("/")[0]


def _targets(hub: Hub, owner: dict[str, Any]) -> dict[str, Any]:
    """What of ``owner``'s labs another learner will try: files, every port listening in the owner's
    network (server, kernel, controller, engines, torch's store, gloo), processes, their group."""
    listening = subprocess.run(["ip", "netns", "exec", owner["netns"], "ss", "-ltnH"], capture_output=True,
                               text=True, check=True, timeout=30).stdout.split("\n")
    ports = sorted({(line.split()[3].rsplit(":", 1)[0], int(line.split()[3].rsplit(":", 1)[1]))
                    for line in listening if line.strip()})
    address = _address_of(owner["netns"])
    keys = []
    for path in owner["files"]:
        key = json.loads(Path(path).read_text()).get("key")
        if isinstance(key, str) and key:
            keys.append(key)
    v1 = os.path.isdir("/sys/fs/cgroup/cpu")
    return {
        "files": owner["files"], "folders": [owner["home"]],
        # From another namespace, loopback's ports are tried at 127.0.0.1 and the others at the owner's address.
        "ports": [[host if host != "127.0.0.1" else "127.0.0.1", port] for host, port in ports]
        + [[address, port] for host, port in ports if host == "127.0.0.1"],
        "pids": [row["pid"] for lab in (owner["lab"], owner["nodes_lab"]) if lab for row in lab["ranks"]],
        "cgroups": ["/sys/fs/cgroup/cpu"] if v1 else ["/sys/fs/cgroup"],
        "secrets": keys,
    }


def _probe(hub: Hub, learner: str, netns: str, targets: dict[str, Any]) -> dict[str, Any]:
    done = as_learner(hub.users[learner], netns, [hub.python, "-c", PROBE], stdin=json.dumps(targets))
    assert done.returncode == 0, done.stderr[-3000:]
    said: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return said


def test_a_learner_cannot_reach_another_learners_labs(hub: Hub, labs: dict[str, Any]) -> None:
    ann, bob = labs["dl-ann"], labs["dl-bob"]
    targets = _targets(hub, bob)
    # A kernel's 5 ports, a controller's dozen, each engine's, torch's store: far more than 10.
    assert len(targets["files"]) >= 3 and len(targets["ports"]) >= 20 and len(targets["pids"]) == 4
    assert len(targets["secrets"]) >= 2  # the kernel's key and the controller's
    own_ports = [[h, p] for h, p in targets["ports"] if h == "127.0.0.1" or h == _address_of(bob["netns"])]
    mine = _probe(hub, "dl-bob", bob["netns"], {**targets, "ports": own_ports[: len(own_ports) // 2 + 1],
                                                 "cgroups": [], "secrets": []})
    theirs = _probe(hub, "dl-ann", ann["netns"], targets)

    # The controls: bob reaches all of it (his files, his ports on his loopback, his processes).
    for key, value in mine.items():
        if key.startswith(("read", "list", "connect", "signal", "environ")):
            assert value == "ok", (key, value)

    # Files: bob's home is closed to ann (the spawner made it 0700), and so every file in it.
    for path in targets["files"] + targets["folders"]:
        verb = "list" if path in targets["folders"] else "read"
        assert theirs[f"{verb} {path}"].startswith("PermissionError"), (path, theirs[f"{verb} {path}"])
    # Ports: ann's loopback is her own (her lab's ports are not bob's: refused unless the same number
    # happens to be open in hers), and bob's address has no route from hers.
    ann_ports = {p for h, p in _targets(hub, ann)["ports"] if h == "127.0.0.1"}
    for host, port in targets["ports"]:
        got = theirs[f"connect {host}:{port}"]
        if host == "127.0.0.1" and port not in ann_ports:
            assert got.startswith("ConnectionRefusedError"), (host, port, got)
        elif host != "127.0.0.1":
            assert got.startswith("OSError") and "unreachable" in got, (host, port, got)
    # Processes: no signal, no environment (where a server's tokens are), no entering bob's network.
    for pid in targets["pids"]:
        assert theirs[f"signal {pid}"].startswith("PermissionError"), theirs[f"signal {pid}"]
        assert theirs[f"environ {pid}"].startswith("PermissionError"), theirs[f"environ {pid}"]
        assert theirs[f"enter {pid}"].startswith("PermissionError"), theirs[f"enter {pid}"]
        # Nor the user namespace that holds bob's nodes and links (where he is root, and tc obeys him).
        assert theirs[f"enter user {pid}"].startswith("PermissionError"), theirs[f"enter user {pid}"]
    # Leaving her control group for the machine's root group (and its cores): refused.
    for folder in targets["cgroups"]:
        assert theirs[f"leave {folder}"].startswith("PermissionError"), theirs[f"leave {folder}"]
    # No key of bob's kernel or controller shows in any command line ann can read.
    assert theirs["secrets in command lines"] == []


def test_a_learner_cannot_see_or_stop_another_learners_labs_through_the_servers(
    hub: Hub, labs: dict[str, Any]
) -> None:
    ann, bob = labs["dl-ann"], labs["dl-bob"]
    lab = bob["lab"]["id"]
    for method, path in [("GET", "/user/dl-bob/distlab/labs"), ("POST", f"/user/dl-bob/distlab/labs/{lab}/stop"),
                         ("GET", f"/user/dl-bob/distlab/labs/{lab}/stacks"), ("GET", "/user/dl-bob/api/kernels"),
                         ("GET", f"/user/dl-bob/api/contents/{Path(bob['home']).name}")]:
        status, _ = hub.request(method, path, token=ann["token"])
        assert status == 403, (method, path, status)
    # Ann's own panel lists her lab alone, and cannot act on bob's through her server.
    status, said = hub.request("GET", "/user/dl-ann/distlab/labs", token=ann["token"])
    assert status == 200 and [x["id"] for x in said["labs"]] == [ann["lab"]["id"]]
    status, said = hub.request("POST", f"/user/dl-ann/distlab/labs/{lab}/stop", token=ann["token"])
    assert status == 404, (status, said)
    # And bob's lab is still whole.
    assert bob["kernel"].run("%%ddp\nprint(dist.get_world_size())").count("2") >= 1
    assert all(_alive(row["pid"]) for row in bob["lab"]["ranks"])


def test_the_instructors_limits_reach_each_learners_kernels_and_refuse_in_one_line(
    hub: Hub, labs: dict[str, Any]
) -> None:
    # The class allows 4 ranks and 2 labs a learner (the spawner's DISTLAB_LIMITS, read by distlab in
    # every kernel of theirs). Ann runs 2 ranks: 3 more would be 5.
    ann_more = LearnerKernel(hub, "dl-ann", labs["dl-ann"]["token"], "more.ipynb")
    with pytest.raises(AssertionError) as refused:
        ann_more.run("%load_ext distlab\n%dist start -n 3")
    assert "3 more ranks would make 5 running, over this class's limit of 4 ranks per learner" in str(refused.value)
    # Bob runs 2 labs (4 ranks): a third lab is refused for the labs, whatever its size.
    bob_more = LearnerKernel(hub, "dl-bob", labs["dl-bob"]["token"], "more.ipynb")
    with pytest.raises(AssertionError) as refused:
        bob_more.run("%load_ext distlab\n%dist start -n 1")
    assert "this class allows 2 running labs per learner, and 2 are running" in str(refused.value)
    # Nothing started: each learner's panel lists what it listed before.
    for name, count in (("dl-ann", 1), ("dl-bob", 2)):
        status, said = hub.request("GET", f"/user/{name}/distlab/labs", token=labs[name]["token"])
        assert status == 200 and len(said["labs"]) == count, said
    # Within the limit, a learner starts a second lab.
    assert "1 rank ready" in ann_more.run("%dist start -n 1")


def test_the_hub_enforces_the_cores_and_ends_every_process_of_a_stopped_learner(
    hub: Hub, labs: dict[str, Any]
) -> None:
    ann = labs["dl-ann"]
    folder = next(iter(glob.glob(f"/sys/fs/cgroup/cpu/distlab-{hub.process.pid}-dl-ann")), None)
    if folder is None:  # control groups v2
        folder = f"/sys/fs/cgroup/distlab-{hub.process.pid}-dl-ann"
        assert Path(folder, "cpu.max").read_text().split() == ["100000", "100000"]
    else:
        assert Path(folder, "cpu.cfs_quota_us").read_text().strip() == "100000"  # 1 core of 100 ms periods
    members = {int(p) for p in Path(folder, "cgroup.procs").read_text().split()}
    assert {row["pid"] for row in ann["lab"]["ranks"]} <= members
    # A process of ann's that left its session and its parent is still hers to end: the hub's stop ends it.
    stray = ann["kernel"].run(
        "import subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        "print('stray', p.pid)")
    pid = int(next(line for line in stray.splitlines() if line.startswith("stray ")).split()[1])
    # Her lab's files (its sockets, its watchdog's list) are in a temporary folder of her own, not in /tmp:
    # the group's end kills the watchdog that would remove them.
    uid = pwd.getpwnam("dl-ann").pw_uid
    (tmp,) = glob.glob(f"/tmp/distlab-{hub.process.pid}-dl-ann-*")
    assert os.stat(tmp).st_uid == uid and glob.glob(f"{tmp}/distlab-*.pgids")
    status, _ = hub.request("DELETE", "/hub/api/users/dl-ann/server")
    assert status in (202, 204)
    wait_for(lambda: not _alive(pid) and not any(_alive(r["pid"]) for r in ann["lab"]["ranks"]), 60,
             "ann's processes to end with her server")
    wait_for(lambda: ann["netns"] not in namespaces_of(hub.process.pid) and not os.path.exists(folder), 30,
             "ann's namespace and control group to go")
    wait_for(lambda: not os.path.exists(tmp), 30, "ann's temporary folder to go with her server")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:  # reaped between the two looks
        return False

"""A "notebook" on a login node that starts a 4-rank lab across two emulated nodes through one of
ipyparallel's launchers, and the checks its result must pass (tests/test_ssh_launcher.py and
tests/test_slurm_launcher.py).

The notebook runs where a user's would: on the switch namespace, which reaches the nodes, as a child
Python process whose only lab set-up is ipyparallel's profile configuration (``ipcluster_config.py``
in a fresh IPYTHONDIR). It prints one line, ``RESULT {json}``, which the checks read.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Mapping, Sequence

import pytest

from distlab.cluster.nodes import Network

__all__ = ["check_two_node_lab", "run_notebook", "write_profile"]

NODES = 2
# How long the notebook may take as a whole (start, cells, stop); it takes ~30-45 s on 2 cores.
NOTEBOOK_DEADLINE_S = 240
START_TIMEOUT_S = 90  # distlab.start(timeout=...): each of its waits

# The notebook: start the lab with the launcher named in argv[1], look at it from inside, stop it.
NOTEBOOK = textwrap.dedent(
    """
    import json, sys, time
    import distlab

    ALL_REDUCE_ONE = "t = torch.ones(1)\\ndist.all_reduce(t)\\nt.item()"
    # A few steps of DDP, each rank on its own data: the replicas' weights must stay equal.
    DDP_STEPS = '''
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(16, 8, device=device) + rank
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
    '''
    LAUNCHER_RANK = "os.environ.get('OMPI_COMM_WORLD_RANK') or os.environ.get('SLURM_PROCID')"
    out = {}
    t0 = time.monotonic()
    lab = distlab.start(ranks=4, launcher=sys.argv[1], timeout=float(sys.argv[2]))
    try:
        out["start_s"] = time.monotonic() - t0
        out["table"] = [
            {"rank": r.rank, "host": r.host, "addr": r.addr, "local_rank": r.local_rank, "pid": r.pid}
            for r in lab.table
        ]
        seen = lab.run(
            "import os, socket\\n(os.environ['MASTER_ADDR'], os.environ['LOCAL_RANK'], socket.gethostname(), "
            f"{LAUNCHER_RANK}, {{k: v for k, v in os.environ.items() if k.startswith('SLURM_')}})",
            stream=False,
        )
        out["seen"] = {str(rank): list(value) for rank, value in seen.items()}
        out["all_reduce"] = {str(rank): value for rank, value in lab.run(ALL_REDUCE_ONE, stream=False).items()}
        out["ddp"] = {str(rank): value for rank, value in lab.run(DDP_STEPS, stream=False).items()}
        # A hang across hosts: ranks 0 (node0) and 2 (node1) wait in an all-reduce the others never join.
        pids = [r.pid for r in lab.status()]
        t1 = time.monotonic()
        try:
            lab.run("if rank in (0, 2):\\n    dist.all_reduce(torch.ones(4))\\n", timeout=3, stream=False)
            out["hang"] = "returned"
        except distlab.CellTimeout as exc:
            out["hang"] = "CellTimeout"
            out["hang_text"] = str(exc)
        out["hang_s"] = time.monotonic() - t1
        out["pids_before"], out["pids_after"] = pids, [r.pid for r in lab.status()]
        out["all_reduce_after"] = {str(rank): value for rank, value in lab.run(ALL_REDUCE_ONE, stream=False).items()}
    finally:
        t2 = time.monotonic()
        lab.stop()
        out["stop_s"] = time.monotonic() - t2
    print("RESULT " + json.dumps(out), flush=True)
    """
)


def write_profile(folder: str, settings: str) -> str:
    """A fresh IPYTHONDIR in ``folder`` whose default profile's ipcluster_config.py holds ``settings`` (Python)."""
    ipython_dir = tempfile.mkdtemp(prefix="ipython-", dir=folder)
    os.makedirs(os.path.join(ipython_dir, "profile_default"))
    with open(os.path.join(ipython_dir, "profile_default", "ipcluster_config.py"), "w") as f:
        f.write(settings)
    return ipython_dir


def run_notebook(
    net: Network, launcher: str, ipython_dir: str, logs: Callable[[], str],
    env: Mapping[str, str] | None = None, script: str = NOTEBOOK, args: Sequence[str] = (),
) -> dict:
    """Run ``script`` on the switch with ``launcher``; its RESULT, or a failure with everything it
    said and ``logs()`` (the daemons' side)."""
    out_path = os.path.join(ipython_dir, "notebook.out")
    env = dict(env if env is not None else os.environ, IPYTHONDIR=ipython_dir)
    # Open MPI's mpiexec refuses root without these (CI runs as root); conftest sets them too.
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            [*net.exec_prefix(None), sys.executable, "-c", script, launcher, str(START_TIMEOUT_S), *args],
            env=env, cwd=ipython_dir, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=NOTEBOOK_DEADLINE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    with open(out_path) as f:
        said = f.read()
    results = [line[len("RESULT "):] for line in said.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        pytest.fail(
            f"the notebook (launcher={launcher}) exited {proc.returncode} without a result:\n{said[-12000:]}\n{logs()}",
            pytrace=False,
        )
    return json.loads(results[-1])


def check_two_node_lab(result: dict, net: Network) -> None:
    """Ranks 0-1 on one node and 2-3 on the other, as the engines' own host names say; each rank's
    address its node's; rank 0's node address as MASTER_ADDR; DDP and a hang across the nodes."""
    print({k: round(result[k], 1) for k in ("start_s", "hang_s", "stop_s")})  # shown with -s, or on failure
    table = result["table"]
    assert [r["rank"] for r in table] == [0, 1, 2, 3]
    hosts = [r["host"] for r in table]
    # Ranks 0-1 on one node, 2-3 on the other (node0 first with ipyparallel's engine order, Slurm's block distribution).
    assert sorted(hosts) == ["node0", "node0", "node1", "node1"], table
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], table
    node_of = {f"node{i}": net.node_addr(i) for i in range(NODES)}
    for row in table:
        assert row["addr"] == node_of[row["host"]], table  # the address its node reaches the others at
    assert [r["local_rank"] for r in table] == [0, 1, 0, 1], table
    master = node_of[hosts[0]]
    for rank, (master_addr, local_rank, hostname, *_) in result["seen"].items():
        assert master_addr == master != "127.0.0.1", result["seen"]
        assert int(local_rank) == table[int(rank)]["local_rank"], result["seen"]
        assert hostname == table[int(rank)]["host"], result["seen"]
    assert result["all_reduce"] == {str(r): 4.0 for r in range(4)}
    # DDP trained the replicas alike: every rank's weights equal, bit for bit.
    weights = list(result["ddp"].values())
    assert len(weights) == 4 and all(w == weights[0] for w in weights), result["ddp"]
    # The hang across hosts was released by the cell's deadline, without a restart.
    assert result["hang"] == "CellTimeout", result
    assert result["hang_s"] < 30, result
    assert "never arrived" in result["hang_text"], result["hang_text"]
    assert result["pids_after"] == result["pids_before"]
    assert result["all_reduce_after"] == {str(r): 4.0 for r in range(4)}

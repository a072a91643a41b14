"""ipyparallel's Slurm launchers carry distlab across two hosts, through a real Slurm.

Two emulated nodes (network namespaces, ``distlab.cluster.nodes``) run Debian's Slurm 22.05: one
munged, slurmctld on the switch (the head node), a slurmd on each node under its host name and on
its address (``tests/_slurm.py`` says how). The notebook runs on the switch as a user's would on a
login node (``tests/_remote_lab.py``), with only ipyparallel's profile configuration and
``SLURM_CONF``: ``distlab.start(launcher="slurm")`` submits the engines as one batch job, ``srun``
starts them on the nodes, and the ranks follow Slurm's task numbering. After ``lab.stop()`` the
queue is empty and no engine is left. Bad input (no ``sbatch``, a job Slurm cannot place) is refused
in one line, with nothing queued.

Needs root (namespaces) and Debian's munge, slurmctld, slurmd and slurm-client (``make test``
installs them as root). Everything started here (munged, slurmctld, the slurmds, jobs, the
notebook's controller and engines, the namespaces, the folders) is ended and removed when the
module's tests end, pass or fail.
"""

from __future__ import annotations

import os
import tempfile
import textwrap
import time
from collections.abc import Iterator

import psutil
import pytest
from _remote_lab import NODES, check_two_node_lab, run_notebook, write_profile
from _slurm import CPUS_PER_NODE, PARTITION, SlurmCluster, missing_programs

from distlab.cluster.nodes import Network

pytestmark = pytest.mark.cluster

# A notebook whose start must fail: ranks and timeout in argv[3] and argv[4]. Its RESULT: the error's
# type and message, how long the refusal took, and the processes left with the lab's profile.
REFUSED = textwrap.dedent(
    """
    import json, sys, time
    import distlab

    t0 = time.monotonic()
    try:
        distlab.start(ranks=int(sys.argv[3]), launcher=sys.argv[1], timeout=float(sys.argv[4])).stop()
        out = {"error": None}
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    out["took_s"] = time.monotonic() - t0
    print("RESULT " + json.dumps(out), flush=True)
    """
)
# Where the notebook asks Slurm for a time limit: its jobs end by themselves should a test fail to cancel them.
TIME_LIMIT_MIN = 10


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    missing = missing_programs()
    if missing:
        pytest.skip(f"Slurm is not installed: apt-get install {' '.join(missing)} (make test installs it as root)")
    net = Network.create(NODES, None)
    cluster = SlurmCluster(net)
    try:
        cluster.start()
        yield cluster
    finally:
        try:
            cluster.stop()
        finally:
            net.destroy()
        assert not set(net.namespaces()) & set(os.listdir("/run/netns")), "the nodes' namespaces outlived the test"


def _settings(slurm: SlurmCluster, partition: str = PARTITION, options: str = "") -> str:
    """A profile as a site's user writes one for its Slurm: where engines reach the controller, the
    partition, a time limit, extra sbatch options."""
    return textwrap.dedent(f"""\
        c = get_config()  # noqa: F821
        # Engines on the nodes reach the controller at the head node's address: this machine's host
        # name resolves only to loopback there, as a login node's may where no DNS knows it.
        c.Cluster.controller_location = {slurm.net.switch_addr!r}
        c.SlurmLauncher.queue = {partition!r}
        c.SlurmLauncher.timelimit = "{TIME_LIMIT_MIN}"
        c.SlurmLauncher.options = {options!r}
        """)


def _lab_processes(ipython_dir: str) -> list[str]:
    """Processes (engines, the controller) started for the lab whose profile is in ``ipython_dir``:
    their command lines name it. The notebook itself (``python -c``) does not count."""
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        argv = proc.info["cmdline"] or []
        if any(ipython_dir in arg for arg in argv) and argv[1:2] != ["-c"]:
            left.append(f"{proc.info['pid']}: {' '.join(argv)[:200]}")
    return left


def _lab_jobs(slurm: SlurmCluster, deadline_s: float = 20.0) -> list[str]:
    """The labs' engine jobs in the queue, once none is left or as they are at the deadline (a job
    that is completing takes a moment to leave)."""
    deadline = time.monotonic() + deadline_s
    while (jobs := [job for job in slurm.queue() if " ipengine-" in job]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return jobs


def test_slurm_launcher_starts_ranks_on_two_nodes_numbered_as_slurm_numbers_them(slurm: SlurmCluster) -> None:
    """ipyparallel's SlurmEngineSetLauncher, configured through the profile as a site's user would."""
    ipython_dir = write_profile(slurm.folder, _settings(slurm, options="--ntasks-per-node=2"))
    result = run_notebook(slurm.net, "slurm", ipython_dir, slurm.logs, env=slurm.env)
    check_two_node_lab(result, slurm.net)
    # Ranks follow Slurm's task numbering (block distribution: node0 takes tasks 0 and 1), one job's
    # tasks, submitted with the profile's options.
    seen = result["seen"]
    assert {rank: int(s[3]) for rank, s in seen.items()} == {str(r): r for r in range(4)}, seen
    assert len({s[4]["SLURM_JOB_ID"] for s in seen.values()}) == 1, seen
    assert all(s[4]["SLURM_NTASKS_PER_NODE"] == "2" for s in seen.values()), seen
    assert [r["host"] for r in result["table"]] == ["node0", "node0", "node1", "node1"]
    # stop() left nothing: no job in the queue, no engine or controller, no batch script in the notebook's folder.
    assert _lab_jobs(slurm) == []
    assert _lab_processes(ipython_dir) == []
    assert not [name for name in os.listdir(ipython_dir) if name.endswith(".sbatch")]


def _refused(slurm: SlurmCluster, settings: str, ranks: int = 4, timeout_s: float = 60,
             env: dict[str, str] | None = None) -> dict:
    """The refused start's RESULT, once its lab left nothing: no job queued, no process."""
    ipython_dir = write_profile(slurm.folder, settings)
    result = run_notebook(slurm.net, "slurm", ipython_dir, slurm.logs, env=env or slurm.env, script=REFUSED,
                          args=[str(ranks), str(timeout_s)])
    print(result)  # shown with -s, or on failure
    assert _lab_jobs(slurm) == []
    assert _lab_processes(ipython_dir) == []
    return result


def _path_without(program: str, folder: str) -> str:
    """PATH, with every folder holding ``program`` replaced by a copy (of links) without it."""
    dirs = []
    for i, where in enumerate(os.environ["PATH"].split(os.pathsep)):
        if os.path.exists(os.path.join(where, program)):
            shadow = os.path.join(folder, f"path-{i}")
            os.makedirs(shadow)
            for name in set(os.listdir(where)) - {program}:
                os.symlink(os.path.join(where, name), os.path.join(shadow, name))
            where = shadow
        dirs.append(where)
    return os.pathsep.join(dirs)


def test_no_sbatch_on_path_is_one_line_and_starts_nothing(slurm: SlurmCluster) -> None:
    folder = tempfile.mkdtemp(dir=slurm.folder)
    result = _refused(slurm, _settings(slurm), env=dict(slurm.env, PATH=_path_without("sbatch", folder)))
    assert result["error"] == "LabUsageError", result
    assert "\n" not in result["message"] and "sbatch, which is not on PATH" in result["message"], result


def test_a_partition_slurm_does_not_know_is_one_line_and_queues_nothing(slurm: SlurmCluster) -> None:
    result = _refused(slurm, _settings(slurm, partition="nosuch"))
    assert result["error"] == "LabUsageError", result
    message = result["message"]
    # sbatch's own words, in one line.
    assert "\n" not in message and message.startswith("Slurm refused the engines' job (4 tasks)"), message
    assert "Invalid partition name specified" in message, message


def test_more_ranks_than_the_partition_holds_is_one_line_at_once_and_queues_nothing(slurm: SlurmCluster) -> None:
    """Slurm queues such a job (EnforcePartLimits=NO, its default) where it waits for ever: the start
    reads why from squeue and stops there, instead of waiting out its timeout."""
    ranks = NODES * CPUS_PER_NODE + 1
    result = _refused(slurm, _settings(slurm), ranks=ranks)
    assert result["error"] == "LabUsageError", result
    message = result["message"]
    assert "\n" not in message and f"({ranks} tasks, partition {PARTITION})" in message, message
    assert "PartitionConfig" in message and "ask for fewer ranks" in message, message
    assert result["took_s"] < 30, result  # the timeout was 60 s


def test_no_free_nodes_until_the_timeout_names_the_pending_job_and_cancels_it(slurm: SlurmCluster) -> None:
    """Another job holds every CPU: the lab's job waits in the queue until the start's timeout,
    whose error says so; the lab's job is then cancelled, the other left alone."""
    blocker = slurm.client("sbatch", "--parsable", f"--ntasks={NODES * CPUS_PER_NODE}", f"--time={TIME_LIMIT_MIN}",
                           f"--output={slurm.path('blocker.out')}", "--job-name=blocker", "--wrap=sleep 600")
    assert blocker.returncode == 0, blocker.stderr
    job = blocker.stdout.strip()
    try:
        deadline = time.monotonic() + 30
        while f"{job} RUNNING blocker" not in slurm.queue():
            assert time.monotonic() < deadline, f"the blocking job did not start: {slurm.queue()}\n{slurm.logs()}"
            time.sleep(0.2)
        result = _refused(slurm, _settings(slurm), timeout_s=8)
        assert slurm.queue() == [f"{job} RUNNING blocker"]
    finally:
        slurm.client("scancel", job)
    assert result["error"] == "DistlabError", result
    message = result["message"]
    assert message.startswith("only 0 of 4 engines registered within 8 s"), message
    assert "PENDING, waiting for Resources (partition lab)" in message, message


def test_a_job_whose_engines_cannot_start_ends_the_wait_with_its_last_line(slurm: SlurmCluster) -> None:
    """srun cannot run the engine command on the nodes: the job fails, and the start says so at once
    with the job's own last line, instead of waiting out its timeout."""
    settings = _settings(slurm) + 'c.SlurmEngineSetLauncher.engine_cmd = ["/nonexistent/python3"]\n'
    result = _refused(slurm, settings)
    assert result["error"] == "DistlabError", result
    message = result["message"]
    assert "\n" not in message and "of the engines ended (FAILED) before they all registered" in message, message
    assert "/nonexistent/python3" in message, message
    assert result["took_s"] < 30, result  # the timeout was 60 s

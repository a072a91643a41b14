"""A lab kept past its kernel (``keep=``, ``%dist start --keep``) and taken back (``distlab.attach``).

Each "kernel" is a Python process of its own, as a notebook's kernel is: one starts a kept lab and
dies (SIGKILL, or a clean exit), another attaches it and finds what the ranks held, and a kept lab
nobody attaches ends after its time. Without ``keep`` nothing changes (test_faults and test_kernel_
cleanup hold a lab that is not kept to ending with its kernel).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import distlab
from distlab.cluster.processes import pid_alive, wait_for
from distlab.errors import LabUsageError
from distlab.front.magics import start_parser

pytestmark = pytest.mark.cluster

KERNEL_S = 120


def _kernel(code: str, runtime: Path) -> tuple[int, dict[str, object]]:
    """Run ``code`` as a kernel would (a process of its own); its exit code and the JSON it printed
    on a line starting with SAID. Its output goes to a file: a pipe would be held open by the lab's
    processes it leaves running."""
    out = runtime / "kernel.out"
    with open(out, "w") as f:
        done = subprocess.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, timeout=KERNEL_S,
                              env=dict(os.environ, JUPYTER_RUNTIME_DIR=str(runtime)), check=False)
    text = out.read_text()
    said = next((line[5:] for line in text.splitlines() if line.startswith("SAID ")), None)
    assert said is not None, text[-3000:]
    return done.returncode, json.loads(said)


START = """
import json, os, distlab
lab = distlab.start(ranks=2, keep={keep}, timeout=60)
lab.run("import torch\\nheld = torch.full((3,), float(rank) + 0.5)", stream=False)
from distlab.notebook import labs
print("SAID " + json.dumps(dict(id=labs.id_of(lab), pids=[r.pid for r in lab.table],
                                files=lab.processes.guard.files)), flush=True)
os.kill(os.getpid(), 9)  # the kernel dies with its lab up
"""

ATTACH = """
import json, distlab
lab = distlab.attach({lab_id!r})
held = lab.run("held.tolist()", stream=False)
total = lab.run("t = torch.ones(1)\\ndist.all_reduce(t)\\nt.item()", stream=False)
print("SAID " + json.dumps(dict(held=held, total=total, pids=[r.pid for r in lab.table])), flush=True)
if {stop}:
    lab.stop()
"""


def test_a_kept_lab_outlives_its_killed_kernel_and_another_takes_it_back_ranks_and_all(tmp_path: Path) -> None:
    code, started = _kernel(START.format(keep=600), tmp_path)
    assert code == -signal.SIGKILL
    pids = started["pids"]
    assert isinstance(pids, list) and all(pid_alive(p) for p in pids)  # spared by the watchdog
    records = list((tmp_path / "distlab" / "kept").glob("*.json"))
    assert len(records) == 1

    # A second kernel attaches by id, finds what the cells left on the ranks, and exits cleanly:
    # the lab is let go of again, not stopped.
    code, first = _kernel(ATTACH.format(lab_id=started["id"], stop=False), tmp_path)
    assert code == 0
    assert first == {"held": {"0": [0.5, 0.5, 0.5], "1": [1.5, 1.5, 1.5]}, "total": {"0": 2.0, "1": 2.0},
                     "pids": pids}
    assert all(pid_alive(p) for p in pids) and records[0].exists()

    # A third, with no id (the only kept lab), stops it: everything goes, record and files too.
    code, second = _kernel(ATTACH.format(lab_id=None, stop=True), tmp_path)
    assert code == 0 and second["pids"] == pids
    assert wait_for(lambda: not any(pid_alive(p) for p in pids), 30)
    assert not records[0].exists()
    files = started["files"]
    assert isinstance(files, list)
    assert not [f for pattern in files for f in glob.glob(pattern)]


def test_a_kept_lab_that_nobody_attaches_ends_after_its_time(tmp_path: Path) -> None:
    code, started = _kernel(START.format(keep=2), tmp_path)
    assert code == -signal.SIGKILL
    pids = started["pids"]
    assert isinstance(pids, list)
    assert wait_for(lambda: not any(pid_alive(p) for p in pids), 60)
    assert not list((tmp_path / "distlab" / "kept").glob("*"))
    files = started["files"]
    assert isinstance(files, list) and wait_for(lambda: not [f for p in files for f in glob.glob(p)], 10)


def test_keep_and_attach_refuse_what_they_cannot_do_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lab_factory: Callable[..., distlab.Lab]
) -> None:
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    for bad, says in (
        ({"keep": -1}, "keep must be a number of seconds > 0"),
        ({"keep": True, "spares": 2}, "a lab kept with keep starts its ranks cold"),
        ({"keep": True, "heal": True}, "leave out heal, or keep"),
    ):
        with pytest.raises(LabUsageError, match=says) as info:
            distlab.start(ranks=2, **bad)
        assert "\n" not in str(info.value)
    with pytest.raises(LabUsageError, match="no kept lab to attach here"):
        distlab.attach()
    lab = lab_factory(ranks=2)
    with pytest.raises(LabUsageError, match="only a kept lab can be let go of"):
        lab.detach()
    kept = lab_factory(ranks=2, keep=600)
    from distlab.notebook import labs

    with pytest.raises(LabUsageError, match="no kept lab 'lab-0-0' here: kept are lab-"):
        distlab.attach("lab-0-0")
    # Held by a live kernel (this one): another may not take it.
    code = ("import distlab, sys\ntry:\n    distlab.attach()\n"
            "except distlab.LabUsageError as exc:\n    print('SAID ' + __import__('json').dumps(str(exc)))")
    _, said = _kernel(code, tmp_path)
    assert isinstance(said, str) and said.startswith("no kept lab is free")
    _, said = _kernel(code.replace("attach()", f"attach({labs.id_of(kept)!r})"), tmp_path)
    assert isinstance(said, str) and f"held by process {os.getpid()}" in said and "lab.detach()" in said
    kept.stop()
    assert not list((tmp_path / "distlab" / "kept").glob("*.json"))


def test_the_magic_reads_keep_with_or_without_seconds() -> None:
    assert start_parser().parse_args(["-n", "2"]).keep is False
    assert start_parser().parse_args(["--keep"]).keep is True
    assert start_parser().parse_args(["--keep", "600"]).keep == 600

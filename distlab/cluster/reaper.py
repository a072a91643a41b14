"""A watchdog that ends a lab's processes if the process that owns the lab dies without stopping it.

A kernel killed with SIGKILL runs no atexit handler, and ipyparallel's controller and engines do not
watch the process that launched them. This small process does: started by Lab in a session of its
own (so a kill of the kernel's process group spares it), it polls its parent; once the parent is
gone it kills every process group listed in its file, removes the network namespaces it was given
(an emulated cluster's nodes and switch: their links and queues go with them), the files matching
the patterns (ipyparallel's logs and connection files of the cluster) and the folders (the lab's
sockets). Lab rewrites the file whenever the world changes and terminates the reaper on a
clean stop.

A lab kept past its notebook on purpose (``--keep=SECONDS:RECORD``, ``notebook.kept``) is spared for
that long once its owner is gone: if another process takes it over (the record names a new owner),
this watchdog goes, that process's own watches it from then on; else it ends the lab as above.

    python -m distlab.cluster.reaper OWNER_PID PGID_FILE [--netns=NAME ...] [--glob=PATTERN ...]
        [--keep=SECONDS:RECORD] [FOLDER ...]
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time

_POLL_S = 0.2


def _read_pgids(path: str) -> list[int]:
    try:
        with open(path) as f:
            return [int(line) for line in f.read().split() if line.strip().isdigit()]
    except OSError:
        return []


def _helper_groups(pgids: list[int]) -> list[int]:
    """Groups that the listed groups' leaders started in sessions of their own (an engine's nanny):
    the lab lists those it knew of; a spare engine's may have been too new to be listed."""
    leaders, found = set(pgids), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ppid, pgrp = int(fields[1]), int(fields[2])
        if ppid in leaders and pgrp == int(entry):
            found.append(pgrp)
    return found


def _kill_groups(pgids: list[int]) -> None:
    """SIGTERM every group (each exits as it would on its own), then SIGKILL what is left."""
    pgids = sorted(set(pgids) | set(_helper_groups(pgids)))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in pgids:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGTERM:
            time.sleep(0.3)


def _taken_over(owner_pid: int, keep: str) -> bool:
    """A kept lab: wait its time for another process to take the record over (True), or until the
    record is gone (the lab was stopped: True, nothing left to end); False once the time is out."""
    seconds, record = keep.split(":", 1)
    deadline = time.monotonic() + float(seconds)
    # When the owner went, beside the record (which only its holder writes): when the lab ends.
    with contextlib.suppress(OSError), open(record + ".gone", "w") as f:
        f.write(str(time.time()))
    while time.monotonic() < deadline:
        try:
            with open(record) as f:
                owner = json.load(f).get("owner")
        except FileNotFoundError:
            return True
        except (OSError, ValueError):
            owner = owner_pid  # being replaced: read it again
        if owner != owner_pid:
            return True
        time.sleep(_POLL_S)
    for path in (record, record + ".gone"):
        with contextlib.suppress(OSError):
            os.unlink(path)
    return False


def main(argv: list[str]) -> int:
    owner_pid, pgid_file = int(argv[0]), argv[1]
    namespaces = [a.split("=", 1)[1] for a in argv[2:] if a.startswith("--netns=")]
    patterns = [a.split("=", 1)[1] for a in argv[2:] if a.startswith("--glob=")]
    keep = next((a.split("=", 1)[1] for a in argv[2:] if a.startswith("--keep=")), None)
    folders = [a for a in argv[2:] if not a.startswith(("--netns=", "--glob=", "--keep="))]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.getppid() == owner_pid:
        time.sleep(_POLL_S)
    if keep is not None and _taken_over(owner_pid, keep):
        with contextlib.suppress(OSError):  # the new owner's watchdog has a list of its own
            os.unlink(pgid_file)
        return 0
    _kill_groups(_read_pgids(pgid_file))
    try:
        os.unlink(pgid_file)
    except OSError:
        pass
    if namespaces:
        from .namespaces import remove_namespaces

        remove_namespaces(namespaces)
    if patterns:
        from .processes import remove_files

        remove_files(patterns)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

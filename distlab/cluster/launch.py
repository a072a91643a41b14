"""How a lab's ipyparallel cluster is made and its engines started."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import ipyparallel as ipp

from .allocator import engine_environment

__all__ = ["HEARTBEAT_MISSES", "HEARTBEAT_MS", "engine_start_args", "make_cluster"]

# ipyparallel's hub finishes an engine's registration only when it has seen its heartbeat; at the
# default 3 s period that is most of a cluster's start-up time (measured: 6.6 s -> 2.2 s for 2
# engines at 500 ms). At 250 ms, 20 misses still give a busy machine 5 s before an engine is
# declared dead (the engine answers pings from a C thread, without the GIL).
HEARTBEAT_MS = 250
HEARTBEAT_MISSES = 20


def make_cluster(engines: int, launcher: str, local: bool, timeout_s: float) -> ipp.Cluster:
    """A cluster of ``engines`` engines, not started. ``local``: every engine runs on this machine."""
    return ipp.Cluster(
        n=engines,
        engine_launcher_class=launcher,
        # Listen on loopback unless engines may come from other hosts.
        controller_ip="127.0.0.1" if local else "",
        controller_args=[
            f"--HeartMonitor.period={HEARTBEAT_MS}",
            f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}",
        ],
        delay=0,
        # Engines start at once and wait for the controller's connection file, instead of
        # starting only once the controller is up: their Python start-up overlaps its own.
        send_engines_connection_env=False,
        engine_timeout=max(1, int(timeout_s)),
        # distlab reports dead ranks itself; ipyparallel's warnings would dump engine logs into
        # the notebook. Its default logger in a kernel is the kernel app's, so pass our own.
        log=_ipp_log(),
    )


def engine_start_args(local: bool) -> dict[str, Any]:
    """Keyword arguments for ``Cluster.start_engines_sync``."""
    if local:
        # Engines on this machine run our entry point, which imports torch while they register.
        # Their malloc keeps freed tensor memory instead of faulting it back in every step.
        return {
            "engine_cmd": [sys.executable, "-m", "distlab.cluster.engine"],
            "environment": engine_environment(os.environ),
        }
    # Elsewhere the remote command stays the launcher's own; torch loads after registration.
    return {"engine_args": ["--IPEngine.startup_command=import distlab.rank.group"]}


def _ipp_log() -> logging.Logger:
    """ipyparallel's logger for distlab's clusters: errors only, to stderr."""
    log = logging.getLogger("distlab.ipyparallel")
    if not log.handlers:
        log.addHandler(logging.StreamHandler(sys.stderr))
        log.propagate = False
    log.setLevel(logging.ERROR)
    return log

"""Engine side of distlab's telemetry: what a rank measures about its own training.

    model = DDP(make_model())
    with distlab.watch(model):
        for x, y in batches:
            ...
            distlab.log(loss=loss)

Runs on the ranks only: it never imports the notebook side (``lab``, ``magics``, ``dashboard``);
the two meet in the dicts published through ipyparallel's ``publish_data``.
"""

from __future__ import annotations

from .config import WatchConfig
from .publish import KEY
from .watch import Watch, active, flush, log, watch

__all__ = ["KEY", "Watch", "WatchConfig", "active", "flush", "log", "watch"]

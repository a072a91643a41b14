"""Engine side of distlab's telemetry: what a rank measures about its own training.

    model = DDP(make_model())
    with distlab.watch(model):
        for x, y in batches:
            ...
            distlab.log(loss=loss)

``track_memory()`` measures the peak memory of any block of code on a rank, and
``model_memory(model, optimizer)`` what a rank holds of a model (local shards of sharded tensors).

Runs on the ranks only: it never imports the notebook side (``lab``, ``magics``, ``dashboard``);
the two meet in the dicts published through ipyparallel's ``publish_data``.
"""

from __future__ import annotations

from ..records import PUBLISH_KEY as KEY
from .memory import MemoryUse, model_memory, track_memory
from .watch import Watch, active, flush, log, watch
from .watch_config import WatchConfig

__all__ = ["KEY", "MemoryUse", "Watch", "WatchConfig", "active", "flush", "log", "model_memory", "track_memory",
           "watch"]

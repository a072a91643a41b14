"""Engine entry point for engines on this machine: import torch while the engine registers.

An engine spends ~1 s starting ipyparallel and registering, then ~1.5 s importing torch. Here
the import runs in a thread from the first instant, so the two overlap (see benchmarks/RESULTS.md).

    python -m distlab.cluster.engine [ipengine arguments]
"""

from __future__ import annotations

import threading


def _preload() -> None:
    import distlab.rank.group  # noqa: F401  (imports torch and torch.distributed)


def main() -> None:
    threading.Thread(target=_preload, name="distlab-preload", daemon=True).start()
    from ipyparallel.engine.app import main as engine_main

    engine_main()


if __name__ == "__main__":
    main()

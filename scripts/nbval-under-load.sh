#!/usr/bin/env bash
# nbval of the notebooks whose checked cells compare times, on a loaded machine: a learner's laptop,
# Binder and CI beside other work all are one. Two loads:
#   spin      a process spinning on one core for the whole run (the other core is shared by all)
#   one-core  the whole run (the kernel, its controller, its ranks) pinned to one core, Binder's size, by
#             taskset: the controller and the ranks are the kernel's children and inherit it
# Usage:
#   scripts/nbval-under-load.sh spin|one-core [NOTEBOOK ...]   (default: the timed notebooks)
# Each run prints pytest's summary; benchmarks/RESULTS.md keeps what the last runs gave.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
case "$mode" in
  spin|one-core) shift ;;
  *) echo "usage: scripts/nbval-under-load.sh spin|one-core [NOTEBOOK ...] (got mode '${mode}')" >&2; exit 2 ;;
esac
if [ $# -eq 0 ]; then
  # The notebooks whose nbval-checked cells compare times (speed-ups, idle, who finished first).
  set -- notebooks/{03,04,05,08,11,12,16,18,19,21b,22}-*.ipynb
fi
pytest=(.venv/bin/python -m pytest -p no:cacheprovider -p no:randomly -q "$@")
if [ "$mode" = spin ]; then
  .venv/bin/python -c "while True: pass" &
  spinner=$!
  trap 'kill "$spinner" 2>/dev/null || true' EXIT
  "${pytest[@]}"
else
  taskset -c 0 "${pytest[@]}"
fi

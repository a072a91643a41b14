#!/usr/bin/env bash
# Wheels for distlab's dependencies (torch aside) for a GPU machine that has Python 3.12 and torch
# but no Jupyter or ipyparallel and no package index: downloaded here into .whl/ (git ignores it),
# carried there, installed by scripts/gpu-check.sh. About 31 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
python3 -m pip download -q --only-binary=:all: -d .whl \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "ipyparallel>=9.0" "ipython>=8.12" "ipykernel>=6.29" "ipywidgets>=8.1" "plotly>=6.0" "anywidget>=0.9" \
    "jsonschema>=4.0" "jupyter_core>=5.0" "jupyter_client>=8" "nbval>=0.11" "nbclient>=0.8"
du -sh .whl

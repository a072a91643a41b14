#!/usr/bin/env bash
# Wheels for distlab's dependencies (torch aside) for a GPU machine that has Python 3.12 and torch
# but no Jupyter or ipyparallel and no package index: downloaded here into .whl/ (git ignores it),
# carried there, installed by scripts/gpu-check.sh. About 35 MB.
# The list is pyproject.toml's own dependencies (so a new one cannot be missed there) and what the
# GPU stages run with (nbval for the notebooks). numpy and matplotlib with their dependencies are left
# out: such a machine has them, and carrying them would shadow the builds its torch was made with.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t REQS < <(python3 - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
keep = [d for d in deps if re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() not in {"torch", "numpy", "matplotlib"}]
print("\n".join(keep + ["nbval>=0.11", "nbclient>=0.8", "jupyter_client>=8"]))
PY
)
PYV=${WHL_PYTHON:-3.12}  # the GPU machine's Python; another only to try the set on a machine at hand
rm -rf .whl && mkdir .whl
python3 -m pip download -q --only-binary=:all: -d .whl \
    --python-version "$PYV" --implementation cp --abi "cp${PYV/./}" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 "${REQS[@]}" 2>&1 | grep -v "^WARNING: Location" || true
# What the machine's own stack already provides (its scientific packages, its pytest with plugins).
( cd .whl && rm -f numpy-* matplotlib-* contourpy-* cycler-* fonttools-* kiwisolver-* pillow-* pyparsing-* \
    pytest-* pluggy-* iniconfig-* coverage-* packaging-* typing_extensions-* )
ls .whl | grep -qi '^setproctitle' || { echo "gpu-wheels: setproctitle missing from .whl" >&2; exit 1; }
du -sh .whl

#!/bin/sh
# Regenerate and execute one notebook in place, and say how long it took: run.sh 01
set -e
cd "$(dirname "$0")/../.."
.venv/bin/python "notebooks/_build/make_$1.py"
nb=$(ls notebooks/$1-*.ipynb)
start=$(date +%s)
.venv/bin/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=300 --ExecutePreprocessor.store_widget_state=False "$nb"
echo "$nb executed in $(( $(date +%s) - start )) s"

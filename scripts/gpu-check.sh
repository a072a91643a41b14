#!/usr/bin/env bash
# What only a machine with an NVIDIA GPU can check, in stages that each fit a 10-minute run:
#   scripts/gpu-check.sh tests       the gpu-marked tests (tests/test_gpu.py)
#   scripts/gpu-check.sh notebooks   notebook 00 and the parallelism labs (14, 14b, 14c, 15, 16, 20, 21, 21b, 22) under nbval
#   scripts/gpu-check.sh executed NB...  the notebooks named, run whole (errors kept), saved executed to $OUT
#   scripts/gpu-check.sh bench       time to ready against torchrun, an empty cell against raw
#                                    ipyparallel, a DDP step watched against unwatched
# Where Jupyter and ipyparallel are missing, run scripts/gpu-wheels.sh on a machine with a package
# index first and bring .whl/ along. Logs and tables go to $OUT (default ./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:-tests}
case "$STAGE" in tests|notebooks|executed|bench) ;; *) echo "usage: scripts/gpu-check.sh tests|notebooks|executed NB...|bench" >&2; exit 2 ;; esac
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/distlab-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/distlab-site:$PWD
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi -L; $PY -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))"; } \
    | tee "$OUT/machine.txt"
case "$STAGE" in
tests)
    $PY -m pytest -p no:cacheprovider -m gpu -v -rs tests/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.log" ;;
notebooks)
    $PY -m pytest -p no:cacheprovider -v notebooks/00-start-here.ipynb notebooks/14-collectives.ipynb \
        notebooks/14b-dtensor-tensor-parallel.ipynb notebooks/14c-loss-parallel.ipynb notebooks/15-fsdp2-memory.ipynb notebooks/16-pipeline-schedules.ipynb \
        notebooks/20-context-expert-parallelism.ipynb notebooks/21-uneven-inputs-checkpoints.ipynb notebooks/21b-local-sgd-diloco.ipynb notebooks/22-compile-ddp-fsdp2.ipynb 2>&1 | tee "$OUT/gpu-notebooks.log" ;;
executed)
    shift
    for nb in "$@"; do
        $PY - "$nb" "$OUT/$(basename "$nb")" <<'PY' 2>&1 | tee -a "$OUT/gpu-executed.log"
import sys, time
import nbclient, nbformat
source, target = sys.argv[1:]
nb = nbformat.read(source, as_version=4)
t0 = time.time()
nbclient.NotebookClient(nb, timeout=300, allow_errors=True, kernel_name="python3").execute()
nbformat.write(nb, target)
errors = [i for i, c in enumerate(c for c in nb.cells if c.cell_type == "code")
          if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
print(f"{source}: {time.time() - t0:.0f} s, code cells with an error: {errors or 'none'}")
PY
    done ;;
bench)
    {
        $PY benchmarks/bench_startup.py --ranks 1 --repeats 3 --backend nccl
        $PY benchmarks/bench_startup.py --ranks 2 --repeats 3 --backend auto
        $PY benchmarks/bench_roundtrip.py --ranks 1 2 --calls 200
        $PY benchmarks/bench_watch_device.py --ranks 1 --backend nccl
        $PY benchmarks/bench_watch_device.py --ranks 2 --backend auto
    } 2>&1 | tee "$OUT/gpu-bench.md" ;;
esac

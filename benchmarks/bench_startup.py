"""Time to ready: distlab.start vs torchrun --standalone, on the same machine, in one run.

"Ready" = engines/workers up, process group initialised, first all-reduce done. Both are timed
from launching a fresh Python process to the moment the all-reduce returns, so both pay for
interpreter start-up and `import torch`. Runs are interleaved; the table shows medians.

    python benchmarks/bench_startup.py [--repeats 5] [--ranks 2 4] [--backend gloo|nccl|auto]

With ``--backend nccl`` (a GPU per rank) both sides bind ``cuda:<local rank>`` and all-reduce there;
``auto`` is distlab's choice, against torchrun on gloo with the workers' tensors where distlab put them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from distlab.cluster.gpus import local_gpus

DISTLAB = textwrap.dedent(
    """
    import json, sys, time
    import distlab
    lab = distlab.start(ranks=int(sys.argv[1]), backend=sys.argv[2])
    ready = time.time()
    print(json.dumps({"ready_at": ready, "phases": lab.timings}))
    lab.stop()
    """
)

TORCHRUN_WORKER = textwrap.dedent(
    """
    import json, os, time
    import sys
    import torch, torch.distributed as dist
    backend, device = sys.argv[1], sys.argv[2]
    if device == "cuda":  # as distlab binds a GPU rank: the local rank's GPU, or the GPUs in turn
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    ready = time.time()
    if dist.get_rank() == 0:
        print(json.dumps({"ready_at": ready}))
    dist.destroy_process_group()
    """
)


def _launch(cmd: list[str]) -> float:
    """Seconds from launching ``cmd`` to the ready time it prints."""
    start = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("{"))
    data = json.loads(line)
    _launch.last = data  # type: ignore[attr-defined]
    return data["ready_at"] - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl", "auto"])
    args = parser.parse_args()
    gpus = local_gpus() or 0
    with tempfile.TemporaryDirectory() as tmp:
        dl, tr = os.path.join(tmp, "dl.py"), os.path.join(tmp, "worker.py")
        Path(dl).write_text(DISTLAB)
        Path(tr).write_text(TORCHRUN_WORKER)
        print("| ranks | backend | torchrun --standalone (s) | distlab.start (s) | ratio | distlab phases (median s) |")
        print("|---|---|---|---|---|---|")
        for n in args.ranks:
            ours, theirs, phases = [], [], []
            # torchrun runs what distlab would: NCCL with a GPU per rank, else gloo (on the GPUs if any).
            backend = args.backend if args.backend != "auto" else "nccl" if gpus >= n else "gloo"
            device = "cuda" if backend == "nccl" or (args.backend == "auto" and gpus) else "cpu"
            for _ in range(args.repeats):
                theirs.append(_launch([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       f"--nproc_per_node={n}", tr, backend, device]))
                ours.append(_launch([sys.executable, dl, str(n), args.backend]))
                phases.append(_launch.last["phases"])  # type: ignore[attr-defined]
            med = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
            shown = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in med.items())
            a, b = statistics.median(theirs), statistics.median(ours)
            print(f"| {n} | {backend} ({device}) | {a:.2f} | {b:.2f} | {b / a:.2f}x | {shown} |", flush=True)


if __name__ == "__main__":
    main()

"""What torch's check of each collective (``debug=True``: TORCH_DISTRIBUTED_DEBUG=DETAIL) costs a
training step, against the same step without it, and what the lint costs a cell.

    python benchmarks/bench_collective_check.py [--rounds 5] [--steps 20]

Two labs of 2 gloo ranks, one with the check and one without, started once and used in turns: each
round runs every step kind on both, in alternating order, so the machine's drift falls on both alike.
A round's figure is the median step of ``--steps`` (after 3 unmeasured), the slower rank's; the table
shows the median over rounds and the spread of the rounds without the check (what the machine alone
moves a step by). Step kinds: DDP (4 linear layers of 256), FSDP2 (each layer ``fully_shard``-ed), and
tensor parallelism (a column- then row-parallel MLP of 256 -> 1024 -> 256 on a 2-rank mesh).
"""

from __future__ import annotations

import argparse
import statistics
import time

import distlab
from distlab.notebook.cell_lint import lint

# DDP under the check: torch 2.13's CPU build kills the process (SIGSEGV in DDP's construction,
# ``Logger.set_construction_data_and_log``, on the check's wrapped gloo group; plain torchrun with
# TORCH_DISTRIBUTED_DEBUG=DETAIL does the same). Measured without it only, and said so.
CRASHES_UNDER_CHECK = {"DDP"}

SETUP = {
    "DDP": """
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
model = DDP(net)
""",
    "FSDP2": """
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
for layer in model:
    fully_shard(layer)
fully_shard(model)
""",
    "TP": """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
parallelize_module(model, init_device_mesh("cpu", (world_size,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
""",
}

STEPS = """
import time
torch.set_num_threads(1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 256)
times = []
for step in range({steps} + 3):
    t0 = time.perf_counter()
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    times.append(time.perf_counter() - t0)
t = torch.tensor([sorted(times[3:])[len(times[3:]) // 2]])
dist.all_reduce(t, op=dist.ReduceOp.MAX)
t.item()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    step_code = STEPS.format(steps=args.steps)
    times: dict[tuple[str, bool], list[float]] = {(k, d): [] for k in SETUP for d in (False, True)}
    with distlab.start(ranks=2, debug=False) as plain, distlab.start(ranks=2, debug=True) as checked:
        labs = {False: plain, True: checked}
        for debug, lab in labs.items():
            for kind, setup in SETUP.items():
                if not (debug and kind in CRASHES_UNDER_CHECK):
                    lab.run(setup.replace("model", f"model_{kind}") + "\npass\n", stream=False)  # no value back
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            for kind in SETUP:
                for debug in order:
                    if debug and kind in CRASHES_UNDER_CHECK:
                        continue
                    got = labs[debug].run(step_code.replace("model", f"model_{kind}"), stream=False)
                    times[kind, debug].append(float(got[0]))
    print(f"| step (2 gloo ranks, {args.steps} steps a round, {args.rounds} rounds) | without the check (ms) | "
          "with it (ms) | with / without | rounds' spread without (ms) |")
    print("|---|---|---|---|---|")
    for kind in SETUP:
        off, on = times[kind, False], times[kind, True]
        if not on:
            print(f"| {kind} | {statistics.median(off) * 1e3:.2f} | crashes (torch 2.13, see above) | - | "
                  f"{min(off) * 1e3:.2f}-{max(off) * 1e3:.2f} |")
            continue
        print(f"| {kind} | {statistics.median(off) * 1e3:.2f} | {statistics.median(on) * 1e3:.2f} | "
              f"{statistics.median(on) / statistics.median(off):.2f} | "
              f"{min(off) * 1e3:.2f}-{max(off) * 1e3:.2f} |")
    cell = SETUP["TP"] + step_code
    t0 = time.perf_counter()
    for _ in range(100):
        lint(cell)
    print(f"\nthe lint of a {len(cell.splitlines())}-line cell: {(time.perf_counter() - t0) * 10:.2f} ms")


if __name__ == "__main__":
    main()

"""Writes notebooks/00-start-here.ipynb (without outputs); execute it with nbconvert to fill them.

    python notebooks/_build/make_00.py && jupyter nbconvert --to notebook --execute --inplace notebooks/00-start-here.ipynb
"""

from pathlib import Path

import nbformat as nbf

md = nbf.v4.new_markdown_cell


def code(source: str, *tags: str) -> nbf.NotebookNode:
    """A code cell; tags such as nbval-check-output (compared by nbval) or raises-exception."""
    cell = nbf.v4.new_code_cell(source)
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


cells = [
    md("""# 00 · Start here

distlab turns this notebook into the driver of a small distributed training job. Each **rank** is a
separate Python process (an ipyparallel engine) holding its own copy of the model; `torch.distributed`
connects the ranks. On a GPU machine each rank gets one GPU and the ranks talk over NCCL; here, with no
GPU, they run on the CPU and talk over gloo. Nothing is simulated: what you see below really ran on two
processes.

Load the extension and start two ranks:"""),
    code("%load_ext distlab\n%dist start -n 2"),
    md("""Every `%%ddp` cell now runs on **every** rank. Each rank already has `rank`, `world_size`,
`local_rank`, `device`, `torch`, `dist` (`torch.distributed`, initialised) and `distlab`. Output is
streamed while the cell runs and labelled by rank:"""),
    code('%%ddp\nprint(f"hello from rank {rank} of {world_size} on {device}")'),
    md("""`%dist status` is the rank table: which process is which rank, where it runs, and whether it is
healthy. Ranks are explicit: a rank is not the engine id, and on several machines ranks are grouped by
host."""),
    code("%dist status"),
    md("""## A first collective

`all_reduce` sums a tensor across the ranks and leaves the sum on every rank. Ranks 0 and 1 contribute
`rank + 1`, so both end with 1 + 2 = 3. A cell's last expression is shown for each rank, in rank order:"""),
    code("%%ddp\nt = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nt.item()", "nbval-check-output"),
    md("""## A first DDP model, watched

`DistributedDataParallel` averages the gradients across ranks during `backward()`, so every replica
takes the same step and the replicas stay identical although each rank trains on different data. Here
the data are scikit-learn's handwritten digits (1,797 images of 8x8 pixels, shipped with the package):
each rank takes every second image, its own shard.

`distlab.watch(model)` records what each rank does: the loss (`distlab.log`), every all-reduce bucket
with its bytes and time, per-layer gradient and weight norms, and a checksum of the weights. The
dashboard appears under the cell while it trains."""),
    code("""%%ddp
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP

digits = load_digits()
x = torch.tensor(digits.data, dtype=torch.float32)[rank::world_size] / 16   # this rank's shard
y = torch.tensor(digits.target)[rank::world_size]

torch.manual_seed(0)                      # the same initial weights on every rank
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.5)
with distlab.watch(model, stats_every=1, checksum_every=1):
    for step in range(40):
        batch = torch.arange(step * 16, step * 16 + 16) % len(x)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        loss.backward()                   # gradients are all-reduced here, bucket by bucket
        opt.step()
        distlab.log(loss=loss)
accuracy = (model(x).argmax(1) == y).float().mean().item()
weights = [p.detach().clone() for p in model.parameters()]
print(f"accuracy on my shard {accuracy:.2f}")"""),
    md("""The same records are plain data in the notebook: one per rank per step. Every step all-reduced
exactly the model's gradient bytes (4 bytes for each of its 64·32 + 32 + 32·10 + 10 = 2,410
parameters):"""),
    code("""import distlab

lab = distlab.current_lab()               # the Lab that %dist start made
records = lab.telemetry.records()
print(len(records), "records from ranks", sorted({r["rank"] for r in records}))
print("bytes all-reduced per step:", {sum(b["bytes"] for b in r["allreduce"]) for r in records})""",
         "nbval-check-output"),
    md("Pull the weights back by rank and compare them: the replicas are identical, bit for bit."),
    code("""import torch

w = lab.pull("weights")                   # {rank: [tensor, ...]}
print("replicas identical:", all(torch.equal(a, b) for r in w for a, b in zip(w[0], w[r])))""", "nbval-check-output"),
    md("""## When a rank fails

A failure on one rank is reported once, with the rank named. Rank 0 would otherwise wait in the
all-reduce for rank 1 until the timeout; distlab stops it at once, says where it was waiting, and
rebuilds the process group."""),
    code('%%ddp\nif rank == 1:\n    raise ValueError("rank 1 read a corrupt shard")\nt = torch.ones(1)\ndist.all_reduce(t)', "raises-exception"),
    code("%%ddp\nt = torch.ones(1)\ndist.all_reduce(t)   # the group works again\nt.item()", "nbval-check-output"),
    md("""## A first quiz

Questions are graded in Python; numeric answers come from `distlab.theory`. `%quiz` with no topic
shows how far you are in each of the 15 topics."""),
    code("%quiz data-parallelism -n 3 --seed 0"),
    md("Stop the ranks when you are done: every process distlab started is gone afterwards."),
    code("%dist stop"),
]

nb = nbf.v4.new_notebook(cells=cells)
nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
nb.metadata["language_info"] = {"name": "python"}
nbf.write(nb, Path(__file__).resolve().parents[1] / "00-start-here.ipynb")

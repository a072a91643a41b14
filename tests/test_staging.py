"""Sends and receives through host copies (rank/staging.py), as gloo ranks sharing a GPU make them.

On a GPU the copies stand in for CUDA tensors (tests/test_gpu.py runs that); here the same path runs
on CPU tensors, through the real gloo group's methods: the works it returns must behave as torch's
own for every way a cell posts point-to-point operations.
"""

from __future__ import annotations

# Runs on both ranks of a 2-rank gloo lab. ``staged`` is called with torch's own methods (the
# observed wrappers keep them as __wrapped__), so the copies are made although these tensors are
# already in host memory.
STAGED = """
from distlab.rank import staging
pg = dist.distributed_c10d._get_default_group()
methods = {op: getattr(type(pg), name).__wrapped__ for op, name in (("send", "send"), ("recv", "recv"))}
got = {}
peer = 1 - rank
# blocking: rank 0 sends first, rank 1 receives first; into a leaf that requires grad, as a
# pipeline stage's input buffer is
t = torch.full((3,), 10.0 + rank)
box = torch.zeros(3, requires_grad=True)
for step in ((("send", t),), (("recv", box),)) if rank == 0 else ((("recv", box),), (("send", t),)):
    for op, tensor in step:
        work = staging.staged(methods[op], pg, op, [tensor], peer, 0)
        assert isinstance(work, dist.Work)
        work.wait()
got["blocking"] = (box.tolist(), box.requires_grad, box.grad_fn is None)
# both post a receive first, then a send, then wait on both (what batch_isend_irecv does)
box2 = torch.zeros(2, 2)
r = staging.staged(methods["recv"], pg, "recv", [box2], peer, 1)
s = staging.staged(methods["send"], pg, "send", [torch.eye(2) * (rank + 1)], peer, 1)
got["before_wait"] = box2.sum().item()
for w in (s, r):
    w.wait()
got["posted_first"] = box2.tolist()
got["completed"] = (r.is_completed(), s.is_completed())
# the source of a receive from any rank
if rank == 0:
    anybox = torch.zeros(1)
    w = staging.staged(type(pg).recv_anysource.__wrapped__, pg, "recv", [anybox], 2)
    w.wait()
    got["any"] = (anybox.item(), w._source_rank())
else:
    staging.staged(methods["send"], pg, "send", [torch.tensor([7.0])], 0, 2).wait()
got
"""


def test_staged_sends_and_receives_complete_as_torchs_own_works(lab):
    got = lab.run(STAGED, stream=False)
    assert got[0]["blocking"] == ([11.0] * 3, True, True) and got[1]["blocking"] == ([10.0] * 3, True, True)
    # A staged receive fills its tensor when it is waited on, not before.
    assert got[0]["before_wait"] == got[1]["before_wait"] == 0.0
    assert got[0]["posted_first"] == [[2.0, 0.0], [0.0, 2.0]] and got[1]["posted_first"] == [[1.0, 0.0], [0.0, 1.0]]
    assert got[0]["completed"] == (True, True)
    assert got[0]["any"] == (7.0, 1)


def test_host_tensors_on_gloo_are_sent_as_they_are(lab):
    # Only CUDA tensors need the copies: what a CPU rank sends is never staged.
    got = lab.run(
        "from distlab.rank import staging\n"
        "w = dist.isend(torch.ones(1), 1) if rank == 0 else dist.irecv(torch.ones(1), 0)\n"
        "w.wait()\n"
        "(staging.needs_staging(dist.distributed_c10d._get_default_group(), [torch.ones(2)]), type(w).__name__)",
        stream=False,
    )
    assert got[0][0] is False and got[1][0] is False
    assert "Staged" not in got[0][1] and "Staged" not in got[1][1]


# torch's functional all-gathers (DTensor's Shard -> Replicate, full_tensor) through host copies: on a
# GPU the kernel stands in for CUDA tensors (tests/test_gpu.py); here it is put in front of the CPU
# kernels of a lab of its own, and must give what torch's own gave in the same cell, and be the one run.
FUNCTIONAL = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from distlab.rank import staging

mesh = init_device_mesh("cpu", (2,))
whole = torch.arange(48.0).reshape(8, 6) * (1 + rank) / (1 + rank)   # the same on both ranks


def moves():
    rows, columns = distribute_tensor(whole, mesh, [Shard(0)]), distribute_tensor(whole, mesh, [Shard(1)])
    return [rows.redistribute(mesh, [Replicate()]).to_local(), rows.full_tensor(), columns.full_tensor(),
            distribute_tensor(whole[:, :5], mesh, [Shard(0)]).full_tensor()]


theirs = moves()
runs = []
staging.stage_functional_all_gathers("CPU")
staged_out = staging._all_gather_out
staging._all_gather_out = lambda *a, **k: runs.append(1) or staged_out(*a, **k)
ours = moves()
staging._all_gather_out = staged_out
(len(runs), all(torch.equal(a, b) for a, b in zip(ours, theirs)), all(torch.equal(t, whole) for t in ours[:3]))
"""


def test_functional_all_gathers_run_through_host_copies_and_give_torchs_result(lab_factory):
    lab = lab_factory(ranks=2)
    got = lab.run(FUNCTIONAL, stream=False)
    assert got[0] == got[1] == (4, True, True)

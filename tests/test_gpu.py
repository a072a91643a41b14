"""Ranks on a real GPU: NCCL, ranks sharing one GPU over gloo, DDP on CUDA, watch's CUDA-event timing.

Marked ``gpu``: skipped, with the reason, where the NVIDIA driver shows no GPU (conftest.py); run on a
machine with one (``scripts/gpu-check.sh`` runs these, the notebooks' GPU runs and the GPU benchmarks).
One GPU is enough: a lab of one rank runs NCCL; a lab of two shares it over gloo (backend ``auto``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import python_lines
from test_ddp_correctness import TRAIN, reference

pytestmark = [pytest.mark.gpu, pytest.mark.cluster]


def test_one_rank_runs_nccl_on_its_gpu(lab_factory):
    lab = lab_factory(ranks=1, backend="nccl")
    assert lab.backend == "nccl" and [r.device for r in lab.status()] == ["cuda:0"]
    got = lab.run(
        "t = torch.full((1024,), 3.0, device=device)\ndist.all_reduce(t)\n"
        "(t.device.type, dist.get_backend(), t.sum().item(), torch.cuda.current_device())",
        stream=False,
    )
    assert got[0] == ("cuda", "nccl", 3.0 * 1024, 0)


def test_auto_shares_one_gpu_between_two_ranks_over_gloo_and_says_so(lab_factory):
    from distlab.cluster.gpus import local_gpus

    if (local_gpus() or 0) >= 2:
        pytest.skip("this machine has a GPU per rank: auto runs NCCL here")
    lab = lab_factory(ranks=2)
    assert lab.backend == "gloo"
    assert [r.device for r in lab.status()] == ["cuda:0", "cuda:0"]
    assert "in turn" in lab.note and "NCCL needs a GPU per rank" in lab.note
    got = lab.run(
        "t = torch.arange(4.0, device=device) + rank\ndist.all_reduce(t)\n"
        "(t.device.type, dist.get_backend(), t.tolist())",
        stream=False,
    )
    assert got == {0: ("cuda", "gloo", [1.0, 3.0, 5.0, 7.0]), 1: ("cuda", "gloo", [1.0, 3.0, 5.0, 7.0])}


# Point to point on CUDA tensors between two ranks sharing the GPU over gloo: each way a cell (or
# torch.distributed.pipelining) posts them, and the collectives under torch 2.13's names.
SHARED_P2P = """
peer = 1 - rank
x = torch.arange(3.0, device=device) + 10 * rank
box = torch.zeros(3, device=device)
if rank == 0:
    dist.send(x, 1)
    dist.recv(box, 1)
else:
    dist.recv(box, 0)
    dist.send(x, 0)
got = {"blocking": box.tolist()}
box = torch.zeros(3, device=device)
for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, box, peer), dist.P2POp(dist.isend, x, peer)]):
    work.wait()
got["batch"] = box.tolist()
if rank == 0:
    anybox = torch.zeros(1, device=device)
    got["any_source"] = (dist.recv(anybox), anybox.item())
else:
    dist.send(torch.tensor([7.0], device=device), 0)
shard = torch.empty(1, device=device)
dist.reduce_scatter_single(shard, torch.tensor([1.0, 2.0], device=device) * (rank + 1))
whole = torch.empty(2, device=device)
dist.all_gather_single(whole, shard)
got["reduce_scatter_all_gather"] = whole.tolist()
got["device"] = str(box.device)
got
"""


def test_ranks_sharing_a_gpu_send_and_receive_cuda_tensors(lab_factory):
    lab = lab_factory(ranks=2)
    got = lab.run(SHARED_P2P, stream=False)
    assert got[0]["device"] == got[1]["device"] == "cuda:0"
    assert got[0]["blocking"] == got[0]["batch"] == [10.0, 11.0, 12.0]
    assert got[1]["blocking"] == got[1]["batch"] == [0.0, 1.0, 2.0]
    assert got[0]["any_source"] == (1, 7.0)
    assert got[0]["reduce_scatter_all_gather"] == got[1]["reduce_scatter_all_gather"] == [3.0, 6.0]


# What crashed both ranks before the lab staged torch's functional all-gathers (rank/staging.py): a
# DTensor's Shard(0) -> Replicate, full_tensor(), and FSDP2's state dict gathered whole.
SHARED_DTENSOR = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

mesh = init_device_mesh("cuda", (2,))
whole = torch.arange(48.0, device=device).reshape(8, 6)
rows = distribute_tensor(whole, mesh, [Shard(0)])
got = {"replicate": torch.equal(rows.redistribute(mesh, [Replicate()]).to_local(), whole),
       "full": torch.equal(distribute_tensor(whole, mesh, [Shard(1)]).full_tensor(), whole)}
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
for layer in (model[0], model[2], model):
    fully_shard(layer)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    opt.zero_grad()
    model(torch.randn(8, 16, device=device, generator=torch.Generator(device).manual_seed(rank))).sum().backward()
    opt.step()
state = {k: v.full_tensor() for k, v in model.state_dict().items()}
got["state"] = {k: (str(v.device), v.sum().item()) for k, v in state.items()}
got
"""


def test_ranks_sharing_a_gpu_gather_dtensors_whole(lab_factory):
    lab = lab_factory(ranks=2)
    got = lab.run(SHARED_DTENSOR, stream=False)
    assert got[0]["replicate"] and got[0]["full"] and got[1]["replicate"] and got[1]["full"]
    assert got[0]["state"] == got[1]["state"] and {d for d, _ in got[0]["state"].values()} == {"cuda:0"}


def test_gloo_runs_every_operation_on_cuda_tensors_or_the_probe_names_it():
    # Each collective and point-to-point operation, raw torch, in fresh processes: what gloo itself
    # can do with CUDA tensors here (a failure names the operation; distlab stages sends and receives).
    probe = subprocess.run(
        [sys.executable, "scripts/gpu-gloo-probe.py"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parent.parent,
    )
    lines = dict(line.split(": ", 1) for line in probe.stdout.splitlines()[1:] if ": " in line)
    # Known, torch 2.11 on an H200: sends and receives fail ("writev ... Bad address"; distlab stages
    # them), the list all_to_all is refused ("Backend gloo does not support alltoall"; the
    # all_to_all_single that DTensor uses works), and a DTensor's Shard(0) -> Replicate kills both
    # processes (SIGSEGV), though dist.all_gather_into_tensor on the same tensors works (torch's
    # functional all-gather goes to gloo's coalesced one, which reads device pointers as host memory;
    # a lab stages it: the next test).
    known = {"send_recv", "isend_irecv_batch", "all_to_all", "dtensor_shard0_to_replicate"}
    failed = {op.strip() for op, result in lines.items() if result != "ok"}
    assert len(lines) == 17 and failed <= known, probe.stdout + probe.stderr


def test_ddp_on_cuda_ranks_matches_one_process_on_the_full_batch(lab_factory):
    lab = lab_factory(ranks=2)
    params = lab.run(TRAIN, stream=False)  # test_ddp_correctness's training, on the ranks' device
    for a, b in zip(params[0], params[1]):
        assert torch.equal(a, b), "the replicas differ"
    for got, want in zip(params[0], reference("cuda")):
        # Sums in another order (two half-batches averaged): equal to float32 rounding, not bit for bit.
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()


# Each rank: a watched DDP model with one 16 MiB bucket, three steps profiled. Over gloo a CUDA
# bucket is copied to pinned memory, summed on the CPU and copied back on gloo's streams; the
# watch's CUDA events bracket that on the GPU's clock, and so do the profiler's first copy out
# and last copy back of each all-reduce. The loss is read after the profiler, so those copies
# are the only ones it sees.
PROFILED = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

torch.manual_seed(0)
model = DDP(torch.nn.Linear(2048, 2048, bias=False).to(device), bucket_cap_mb=100)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
w = distlab.watch(model, stats_every=0, checksum_every=0)
x = torch.randn(64, 2048, device=device)
sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)  # the same code runs on CPU ranks

def step():
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()

step(); step()                                   # warm: buckets rebuilt, allocator settled
sync()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        step()
    sync()
w.close()
copies = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and e.name.startswith("Memcpy")),
                key=lambda e: e.time_range.start)
spans, begin = [], None
for e in copies:
    if "DtoH" in e.name and begin is None:
        begin = e.time_range.start
    elif "HtoD" in e.name and begin is not None:
        spans.append((e.time_range.end - begin) / 1e6)   # microseconds -> seconds
        begin = None
watched = [b["seconds"] for r in w.records()[-3:] for b in r["allreduce"]]
(watched, spans)
"""


def test_watch_times_buckets_with_cuda_events_as_the_profiler_does(lab_factory):
    lab = lab_factory(ranks=2)
    for rank, (watched, profiled) in lab.run(PROFILED, stream=False, timeout=300).items():
        assert len(watched) == len(profiled) == 3, (rank, watched, profiled)
        assert sum(watched) == pytest.approx(sum(profiled), rel=0.05), (rank, watched, profiled)


def test_memory_of_a_watched_cuda_step_is_read_from_torch_cuda(lab_factory):
    lab = lab_factory(ranks=1, backend="nccl")
    # torch's own figures for each step, read in hooks that run beside the watch's: what was
    # allocated when the forward began and the allocator's peak when the update ended.
    got = lab.run(
        "model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))"
        ".to(device)\n"
        "opt = torch.optim.Adam(model.parameters())\n"
        "w = distlab.watch(model, stats_every=0, checksum_every=0)\n"
        "began, peaks = [], []\n"
        "model.register_forward_pre_hook(lambda *a: began.append(torch.cuda.memory_allocated(device)))\n"
        "opt.register_step_post_hook(lambda *a: peaks.append(torch.cuda.max_memory_allocated(device)))\n"
        "x = torch.randn(256, 1024, device=device)\n"
        "for _ in range(3):\n"
        "    opt.zero_grad(set_to_none=True)\n"
        "    model(x).square().mean().backward()\n"
        "    opt.step()\n"
        "w.close()\n"
        "(w.meta()['memory'], [r['memory'] for r in w.records()], began, peaks,"
        " sum(p.numel() * 4 for p in model.parameters()), x.numel() * 4)",
        stream=False,
    )
    kind, memory, began, peaks, parameter_bytes, input_bytes = got[0]
    assert kind == "cuda" and len(memory) == len(peaks) == 3, got[0]
    for step, (m, at_begin, peak) in enumerate(zip(memory, began, peaks)):
        assert m["parameters_bytes"] == m["gradients_bytes"] == parameter_bytes
        # Adam: two moments per parameter, and a step counter (a scalar tensor) per parameter tensor.
        assert 2 * parameter_bytes <= m["optimizer_bytes"] <= 2 * parameter_bytes + 4 * 8
        # The step's peak is the model state it began with and what it made; torch's peak also holds
        # what else was live when it began (x, the last loss): the model's state then is the difference.
        resident = parameter_bytes + (2 * parameter_bytes if step else 0)  # no gradients (set to None)
        assert m["peak_bytes"] == pytest.approx(peak - (at_begin - resident), rel=0.02), (step, got[0])
        assert at_begin - resident >= input_bytes, (step, got[0])


def test_the_notebook_process_never_initialises_cuda():
    # A lab's whole life on the GPU in the notebook's process, which never imports torch: a CUDA
    # context made there before the ranks start breaks them (forked state) or takes GPU memory.
    code = (
        "import sys, distlab\n"
        "with distlab.start(ranks=1, backend='nccl') as lab:\n"
        "    lab.run('m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1).to(device))\\n'\n"
        "            'w = distlab.watch(m)\\nm(torch.ones(3, 2, device=device)).sum().backward()', stream=False)\n"
        "    lab.restart()\n"
        "print('torch' in sys.modules)\n"
    )
    printed = python_lines(code, timeout_s=600)
    assert printed[-1] == "False", printed

"""Ranks on a real GPU: NCCL, ranks sharing one GPU over gloo, DDP on CUDA, watch's CUDA-event timing.

Marked ``gpu``: skipped, with the reason, where the NVIDIA driver shows no GPU (conftest.py); run on a
machine with one (``scripts/gpu-check.sh`` runs these, the notebooks' GPU runs and the GPU benchmarks).
One GPU is enough: a lab of one rank runs NCCL; a lab of two shares it over gloo (backend ``auto``).
"""

from __future__ import annotations

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
    got = lab.run(
        "model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024))"
        ".to(device)\n"
        "opt = torch.optim.Adam(model.parameters())\n"
        "w = distlab.watch(model, stats_every=0, checksum_every=0)\n"
        "x = torch.randn(256, 1024, device=device)\n"
        "for _ in range(2):\n"
        "    opt.zero_grad(set_to_none=True)\n"
        "    model(x).square().mean().backward()\n"
        "    opt.step()\n"
        "peak = torch.cuda.max_memory_allocated(device)\n"
        "w.close()\n"
        "(w.meta()['memory'], w.records()[-1]['memory'], peak, sum(p.numel() * 4 for p in model.parameters()))",
        stream=False,
    )
    kind, memory, peak, parameter_bytes = got[0]
    assert kind == "cuda"
    assert memory["parameters_bytes"] == memory["gradients_bytes"] == parameter_bytes
    # Adam: two moments per parameter, and a step counter (a scalar tensor) per parameter tensor.
    assert 2 * parameter_bytes <= memory["optimizer_bytes"] <= 2 * parameter_bytes + 4 * 8
    # The watch reset the peak at the step's start; what else was live then (x) is all that differs.
    assert memory["peak_bytes"] == pytest.approx(peak, rel=0.05)


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

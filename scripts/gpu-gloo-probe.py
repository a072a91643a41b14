"""Which torch.distributed operations gloo runs on CUDA tensors, in this torch, on this machine.

Ranks that share one GPU run gloo on CUDA tensors (distlab's backend ``auto`` with fewer GPUs than
ranks). Each operation runs in a fresh pair of processes, so one that crashes its process (a gloo
transport handed a device pointer) is named without stopping the others. Prints one line per
operation: ok, wrong (the values), error (the message's first line) or crash (the exit codes).

    python scripts/gpu-gloo-probe.py [cpu]    # on a machine with a GPU (scripts/gpu-check.sh tests)
"""

from __future__ import annotations

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ["all_reduce", "broadcast", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
       "all_to_all_single", "all_to_all", "gather", "scatter", "reduce", "barrier", "send_recv",
       "isend_irecv_batch", "dtensor_shard0_to_replicate", "dtensor_shard0_to_shard1",
       "dtensor_partial_to_replicate", "dtensor_partial_to_shard0"]


def _op(name: str, rank: int, dev: torch.device) -> object:
    x = torch.arange(2.0, device=dev) + 10 * rank  # rank 0: [0, 1]; rank 1: [10, 11]
    if name == "all_reduce":
        dist.all_reduce(x)
        return x.tolist()  # [10, 12]
    if name == "broadcast":
        dist.broadcast(x, 0)
        return x.tolist()  # [0, 1]
    if name == "all_gather_into_tensor":
        out = torch.empty(4, device=dev)
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, x)  # the name of torch 2.13
        return out.tolist()  # [0, 1, 10, 11]
    if name == "all_gather":
        outs = [torch.empty(2, device=dev) for _ in range(2)]
        dist.all_gather(outs, x)
        return torch.cat(outs).tolist()
    if name == "reduce_scatter_tensor":
        out = torch.empty(1, device=dev)
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, x)
        return out.tolist()  # rank 0: [10]; rank 1: [12]
    if name == "all_to_all_single":
        out = torch.empty(2, device=dev)
        dist.all_to_all_single(out, x)
        return out.tolist()  # rank 0: [0, 10]; rank 1: [1, 11]
    if name == "all_to_all":
        outs = [torch.empty(1, device=dev) for _ in range(2)]
        dist.all_to_all(outs, list(x.chunk(2)))
        return torch.cat(outs).tolist()
    if name == "gather":
        outs = [torch.empty(2, device=dev) for _ in range(2)] if rank == 0 else None
        dist.gather(x, outs, dst=0)
        return torch.cat(outs).tolist() if outs else None
    if name == "scatter":
        out = torch.empty(2, device=dev)
        dist.scatter(out, [torch.full((2,), 5.0 + r, device=dev) for r in range(2)] if rank == 0 else None, src=0)
        return out.tolist()
    if name == "reduce":
        dist.reduce(x, dst=0)
        return x.tolist() if rank == 0 else None
    if name == "barrier":
        dist.barrier()
        return "done"
    if name.startswith("dtensor"):
        return _dtensor(name, rank, dev)
    box = torch.empty(2, device=dev)
    if name == "send_recv":
        if rank == 0:
            dist.send(x, 1)
        else:
            dist.recv(box, 0)
        return box.tolist() if rank == 1 else None
    ops = [dist.P2POp(dist.isend, x, 1 - rank), dist.P2POp(dist.irecv, box, 1 - rank)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return box.tolist()


def _dtensor(name: str, rank: int, dev: torch.device) -> object:
    """A DTensor redistribution (what notebook 14 shows), on a 1-D mesh of the 2 ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh(dev.type, (2,))
    rows = distribute_tensor(torch.arange(4.0, device=dev).view(2, 2), mesh, [Shard(0)])
    if name == "dtensor_shard0_to_replicate":
        return rows.redistribute(mesh, [Replicate()]).to_local().flatten().tolist()
    if name == "dtensor_shard0_to_shard1":
        return rows.redistribute(mesh, [Shard(1)]).to_local().flatten().tolist()
    partial = DTensor.from_local(torch.tensor([1.0, 2.0], device=dev) * (rank + 1), mesh, [Partial()])
    to = Replicate() if name == "dtensor_partial_to_replicate" else Shard(0)
    return partial.redistribute(mesh, [to]).to_local().tolist()


EXPECTED = {
    "all_reduce": {0: [10, 12], 1: [10, 12]}, "broadcast": {0: [0, 1], 1: [0, 1]},
    "all_gather_into_tensor": {0: [0, 1, 10, 11], 1: [0, 1, 10, 11]},
    "all_gather": {0: [0, 1, 10, 11], 1: [0, 1, 10, 11]},
    "reduce_scatter_tensor": {0: [10], 1: [12]}, "all_to_all_single": {0: [0, 10], 1: [1, 11]},
    "all_to_all": {0: [0, 10], 1: [1, 11]}, "gather": {0: [0, 1, 10, 11], 1: None},
    "scatter": {0: [5, 5], 1: [6, 6]}, "reduce": {0: [10, 12], 1: None}, "barrier": {0: "done", 1: "done"},
    "send_recv": {0: None, 1: [0, 1]}, "isend_irecv_batch": {0: [10, 11], 1: [0, 1]},
    "dtensor_shard0_to_replicate": {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]},
    "dtensor_shard0_to_shard1": {0: [0, 2], 1: [1, 3]},
    "dtensor_partial_to_replicate": {0: [3, 6], 1: [3, 6]}, "dtensor_partial_to_shard0": {0: [3], 1: [6]},
}


def _rank(rank: int, name: str, port: int, device: str, results: object) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        results[rank] = ("value", _op(name, rank, dev))  # type: ignore[index]
    except Exception as e:  # noqa: BLE001 - the probe reports any failure
        results[rank] = ("error", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")  # type: ignore[index]
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda:0"  # cpu: the same probe where gloo is at home
    runs = []
    for name in OPS:
        results = manager.dict()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, name, port, device, results)) for r in range(2)]
        for p in procs:
            p.start()
        runs.append((name, procs, results))
    deadline = time.monotonic() + 120
    bad = 0
    where = torch.cuda.get_device_name(0) if device.startswith("cuda") else "the CPU"
    print(f"torch {torch.__version__}, gloo, 2 ranks, tensors on {device} ({where})")
    for name, procs, results in runs:
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        got = dict(results)
        if len(got) < 2:
            line = f"crash (exit codes {[p.exitcode for p in procs]})"
        elif any(kind == "error" for kind, _ in got.values()):
            line = "error: " + "; ".join(f"rank {r}: {v}" for r, (k, v) in sorted(got.items()) if k == "error")
        elif {r: v for r, (_, v) in got.items()} == EXPECTED[name]:
            line = "ok"
        else:
            line = f"wrong: {got}"
        bad += line != "ok"
        print(f"{name:>24}: {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())

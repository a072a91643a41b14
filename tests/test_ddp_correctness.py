"""DDP on real gloo ranks matches single-process training on the full batch."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cluster

# The same model, data and steps on every rank and in the reference; each rank takes its shard, on
# its device (tests/test_gpu.py runs the same on CUDA ranks).
TRAIN = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

def make_data(step, batch=16):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(batch, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()

model = DDP(make_model().to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    x, y = (t.to(device) for t in make_data(step))
    shard = slice(rank * len(x) // world_size, (rank + 1) * len(x) // world_size)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
    opt.step()
[p.detach().cpu().clone() for p in model.module.parameters()]
"""


def reference(device: str = "cpu") -> list[torch.Tensor]:
    """One process, the full batch, on ``device``: what every rank's parameters must equal (on the CPU)."""
    namespace: dict = {}
    exec(TRAIN.split("model = DDP")[0], namespace)  # noqa: S102 - the cell's own definitions, run here too
    model = namespace["make_model"]().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        x, y = (t.to(device) for t in namespace["make_data"](step))
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_replicas_are_identical_and_match_single_process_training(world, lab_factory, lab):
    target = lab if world == 2 else lab_factory(ranks=world)
    params = target.run(TRAIN, stream=False)
    assert sorted(params) == list(range(world))
    for rank in range(1, world):
        for a, b in zip(params[0], params[rank]):
            assert torch.equal(a, b), f"rank {rank} differs from rank 0"
    want_all = reference()
    initial = _initial_parameters()
    for got, want, start in zip(params[0], want_all, initial):
        assert not torch.equal(want, start)  # training moved the weights
        torch.testing.assert_close(got, want, rtol=1.3e-6, atol=5e-5)


def _initial_parameters() -> list[torch.Tensor]:
    namespace: dict = {}
    exec(TRAIN.split("model = DDP")[0], namespace)  # noqa: S102 - the cell's own definitions, for their weights
    return [p.detach() for p in namespace["make_model"]().parameters()]

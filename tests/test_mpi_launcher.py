"""ipyparallel's MPI launcher carries distlab: Open MPI's mpiexec starts the ranks."""

from __future__ import annotations

import shutil

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]


def test_mpi_launched_ranks_match_mpi_ranks_and_train_with_ddp(lab_factory):
    assert shutil.which("mpiexec"), "Open MPI's mpiexec is needed: apt-get install openmpi-bin (make test does)"
    lab = lab_factory(ranks=2, launcher="mpi")
    assert lab.launcher == "mpi"
    ranks = lab.run(
        "from mpi4py import MPI\n(rank, MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())", stream=False
    )
    assert dict(ranks) == {0: (0, 0, 2), 1: (1, 1, 2)}
    weights = lab.run(
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "torch.manual_seed(0)\n"
        "model = DDP(torch.nn.Linear(4, 2))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.5)\n"
        "for _ in range(3):\n"
        "    opt.zero_grad(); model(torch.randn(4, 4) * (rank + 1)).sum().backward(); opt.step()\n"
        "model.module.weight.detach().clone()",
        stream=False,
    )
    assert weights[0].equal(weights[1])

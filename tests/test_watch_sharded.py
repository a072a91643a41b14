"""distlab.watch on FSDP2 and tensor-parallel models, collectives seen op by op, and memory per rank."""

from __future__ import annotations

import pytest
import torch

from distlab.dashboard import analysis
from distlab.rank.collective_ops import collective_name
from distlab.telemetry import model_memory, track_memory, watch

MiB = 2**20

# Defined on every rank: four 256x256 layers sharded by FSDP2, and a tensor-parallel MLP.
SETUP = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

mesh = init_device_mesh("cpu", (world_size,))

def layers(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])

def fsdp_model(reshard=True):
    model = layers()
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)

def tp_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

def train(model, steps, batch=32, features=256):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        loss = model(torch.randn(batch, features, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        distlab.log(loss=loss)
    return opt
"""

LAYER_BYTES = (256 * 256 + 256) * 4  # one Linear(256, 256) in fp32


# ------------------------------------------------------------------------------ in this process


def test_track_memory_counts_new_storages_once_and_not_views_or_in_place_ops():
    with track_memory() as mem:
        a = torch.empty(MiB // 4)  # 1 MiB
        b = torch.empty(MiB // 4)
        view = a.t()[:10]  # a view: the same storage
        a.add_(1.0)  # in place: nothing new
        del a, view
        c = b + 1  # a new 1 MiB while b is alive
    assert mem.device == "cpu"
    assert mem.peak_bytes == 2 * MiB  # a was freed before c was made
    assert mem.retained_bytes == 2 * MiB
    del b, c


def test_model_memory_counts_parameters_gradients_and_optimizer_state():
    model = torch.nn.Linear(100, 10)
    opt = torch.optim.Adam(model.parameters())
    assert model_memory(model, opt) == {"parameters_bytes": 4040, "gradients_bytes": 0, "optimizer_bytes": 0}
    model(torch.randn(3, 100)).sum().backward()
    opt.step()
    held = model_memory(model, opt)
    # exp_avg and exp_avg_sq per parameter, plus Adam's step counter (a one-element fp32 tensor each)
    assert held == {"parameters_bytes": 4040, "gradients_bytes": 4040, "optimizer_bytes": 2 * 4040 + 2 * 4}


def test_every_record_of_a_plain_model_carries_its_memory_and_the_steps_temporaries():
    big = 4 * MiB

    class Spiky(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)
            self.spike = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.spike:
                torch.zeros(big // 4).sum()  # a temporary of 4 MiB, freed at once
            return self.lin(x)

    model = Spiky()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model, publish=False) as w:
        for spike in (False, True, False):
            model.spike = spike
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
    records = w.records()
    assert w.meta()["memory"] == "cpu: live tensors"
    assert [r["collectives"] for r in records] == [[], [], []]
    params = (64 * 64 + 64) * 4
    for rec in records:
        assert rec["memory"]["parameters_bytes"] == params
        assert rec["memory"]["gradients_bytes"] == params
        assert rec["memory"]["peak_bytes"] >= 2 * params  # weights and their gradients at least
    quiet, spiky, after = (r["memory"]["peak_bytes"] for r in records)
    assert spiky >= params + big  # the weights, and the temporary on top
    assert quiet < big and after < big


def test_an_observer_left_by_a_failed_step_is_removed_at_the_cells_end():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model = torch.nn.Linear(4, 4)
    w = watch(model, publish=False)
    model(torch.randn(2, 4))  # a step begins: its ops are observed
    assert _get_current_dispatch_mode() is not None
    w.flush()  # what a %%ddp cell's end does, whether the cell failed or not
    assert _get_current_dispatch_mode() is None
    w.close()


def test_a_fake_tensor_is_counted_as_no_memory_without_asking_torch_for_its_data_pointer():
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    from distlab.telemetry.memory import LiveTensors

    with FakeTensorMode():
        fake = torch.empty(MiB // 4)  # what DTensor's sharding propagation makes inside a step
    live = LiveTensors()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "Accessing the data pointer of FakeTensor" fails here
        live.add_outputs(fake)
    assert live.current == 0 and live.peak == 0


def test_collectives_are_named_by_the_ops_torch_dispatches():
    assert collective_name(torch.ops.c10d._allgather_base_.default) == "all_gather"
    assert collective_name(torch.ops.c10d._reduce_scatter_base_.default) == "reduce_scatter"
    assert collective_name(torch.ops._c10d_functional.all_reduce.default) == "all_reduce"
    assert collective_name(torch.ops.aten.add.Tensor) is None


# ------------------------------------------------------------------------------ on the ranks


@pytest.mark.cluster
@pytest.mark.parametrize("reshard", [True, False])
def test_an_fsdp2_model_is_watched_with_its_gathers_and_reductions_and_its_shards_memory(lab, reshard):
    lab.run(SETUP, stream=False)
    store = lab.telemetry
    lab.run(f"model = fsdp_model(reshard={reshard})\n"
            "with distlab.watch(model, stats_every=1, checksum_every=1):\n"
            "    train(model, 3)", stream=False)
    records = store.records()
    assert sorted({r["rank"] for r in records}) == [0, 1] and len(records) == 6
    for rec in records:
        ops = [c["op"] for c in rec["collectives"]]
        scatters = [c for c in rec["collectives"] if c["op"] == "reduce_scatter"]
        gathers = [c for c in rec["collectives"] if c["op"] == "all_gather"]
        # Each layer's gradients are reduce-scattered once per step, whole (the theory's convention: the input).
        assert [c["bytes"] for c in scatters] == [LAYER_BYTES] * 4, ops
        # Named by the unit they serve: gradients reduced in backward's order, forward gathered in order.
        assert [c["layer"] for c in scatters] == ["3", "2", "1", "0"]
        assert [c["layer"] for c in gathers][:4] == ["0", "1", "2", "3"]
        assert all(c["bytes"] == LAYER_BYTES and c["ranks"] == 2 for c in gathers)
        # Resharded after forward, every layer is gathered again for backward: 3 passes of the weights
        # per step against 2 (theory.fsdp_bytes_per_step).
        assert len(gathers) == (8 if reshard else 4), ops
        assert all(c["seconds"] >= 0 and c["start_s"] >= 0 for c in rec["collectives"])
        memory = rec["memory"]
        assert memory["parameters_bytes"] == 4 * LAYER_BYTES // 2  # this rank's shard
        assert memory["gradients_bytes"] == 4 * LAYER_BYTES // 2
        assert memory["optimizer_bytes"] == 2 * 4 * LAYER_BYTES // 2 + 8 * 4  # m, v; 8 step counters
        assert memory["peak_bytes"] > memory["parameters_bytes"] + LAYER_BYTES  # a gathered layer at least
        assert rec["grad_norm"] and rec["checksum"] is None  # shards' norms; no replica to compare
    meta = store.meta()
    assert meta[0]["sharded_layers"] == ["0", "1", "2", "3"] and meta[0]["memory"] == "cpu: live tensors"
    verdict = analysis.divergence(records, meta)
    assert not verdict.diverged and "sharded" in verdict.message
    # The dashboard's memory view: measured model state against theory.sharded_memory for FSDP2 over 2
    # ranks, fp32 Adam (16 bytes per parameter / 2). Adam's step counters (4 bytes per tensor) are the error.
    assert meta[0]["layout"] == {"parameters": 4 * LAYER_BYTES // 4, "strategy": "fsdp2", "data_parallel": 2,
                                 "tensor_parallel": 1, "precision": "fp32", "optimizer": "adam"}
    for row in analysis.memory_by_rank(records, meta):
        assert row.theory is not None and row.theory.total_bytes == 16 * LAYER_BYTES // 4 // 2 * 4
        assert row.resident_bytes - row.theory.total_bytes == 8 * 4
    assert "theory (fsdp2" in analysis.memory_message(analysis.memory_by_rank(records, meta), meta)


@pytest.mark.cluster
def test_a_watched_fsdp2_step_makes_distlab_emit_no_warning(lab):
    # Every warning is recorded ("always"): one printed by an earlier test on the shared lab does not hide it.
    lab.run(SETUP, stream=False)
    caught = lab.run("import warnings\n"
                     "with warnings.catch_warnings(record=True) as caught:\n"
                     "    warnings.simplefilter('always')\n"
                     "    model = fsdp_model()\n"
                     "    with distlab.watch(model):\n"
                     "        train(model, 2)\n"
                     "[f'{w.filename}:{w.lineno}: {w.message}' for w in caught\n"
                     " if 'distlab' in w.filename or 'FakeTensor' in str(w.message)]", stream=False)
    assert caught == {0: [], 1: []}


@pytest.mark.cluster
def test_a_tensor_parallel_model_is_watched_with_its_all_reduces_and_replicated_layers_compared(lab):
    lab.run(SETUP, stream=False)
    store = lab.telemetry
    lab.run("model = tp_model()\n"
            "with distlab.watch(model, checksum_every=1):\n"
            "    train(model, 3, batch=8, features=16)", stream=False)
    records = store.records()
    assert len(records) == 6
    for rec in records:
        # RowwiseParallel sums the partial outputs of the second layer: one all-reduce of (8, 16) floats
        # in forward; the input needs no gradient, so ColwiseParallel's backward all-reduce is skipped.
        assert [(c["op"], c["bytes"]) for c in rec["collectives"]] == [("all_reduce", 8 * 16 * 4)]
        assert rec["layer_checksums"] is not None and list(rec["layer_checksums"]) == ["4"]
        assert rec["memory"]["parameters_bytes"] == (16 * 64 + 64 + 64 * 16) * 4 // 2 + 16 * 4 + (16 * 4 + 4) * 4
    assert store.meta()[0]["sharded_layers"] == ["0", "2"]
    assert store.meta()[0]["layout"]["tensor_parallel"] == 2
    assert not analysis.divergence(records, store.meta()).diverged


@pytest.mark.cluster
def test_watching_an_fsdp2_model_changes_none_of_its_weights(lab):
    lab.run(SETUP, stream=False)
    same = lab.run(
        "def weights(watched):\n"
        "    model = fsdp_model()\n"
        "    if watched:\n"
        "        with distlab.watch(model, stats_every=1, checksum_every=1):\n"
        "            train(model, 3)\n"
        "    else:\n"
        "        train(model, 3)\n"
        "    return [p.full_tensor() for p in model.parameters()]\n"
        "all(torch.equal(a, b) for a, b in zip(weights(False), weights(True)))",
        stream=False,
    )
    assert same == {0: True, 1: True}


@pytest.mark.cluster
def test_the_layout_read_for_the_memory_theory_names_ddp_zero1_and_the_optimizer(lab):
    lab.run(SETUP, stream=False)
    store = lab.telemetry
    layouts = {}
    for name, make_opt in (("ddp", "torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)"),
                           ("zero1", "ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam)")):
        lab.run("from torch.distributed.optim import ZeroRedundancyOptimizer\n"
                "from torch.nn.parallel import DistributedDataParallel as DDP\n"
                "model = DDP(layers())\n"
                f"opt = {make_opt}\n"
                "with distlab.watch(model):\n"
                "    for _ in range(2):\n"
                "        model(torch.randn(8, 256)).sum().backward()\n"
                "        opt.step()\n"
                "        opt.zero_grad()", stream=False)
        layouts[name] = store.meta()[1]["layout"]
        rows = analysis.memory_by_rank(store.records(), store.meta())
        assert [row.rank for row in rows] == [0, 1] and all(row.theory is not None for row in rows)
    assert layouts["ddp"] == {"parameters": 4 * LAYER_BYTES // 4, "strategy": "ddp", "data_parallel": 2,
                              "tensor_parallel": 1, "precision": "fp32", "optimizer": "momentum"}
    assert layouts["zero1"]["strategy"] == "zero1" and layouts["zero1"]["optimizer"] == "adam"


@pytest.mark.cluster
def test_the_step_peak_counts_the_weights_fsdp2_gathers(lab):
    # FSDP2 grows and frees the gathered weights' storages in place (no op for the watch to see):
    # kept from forward to backward, all four layers are whole at once; resharded, one or two.
    lab.run(SETUP, stream=False)
    store = lab.telemetry
    peaks = {}
    for reshard in (True, False):
        lab.run(f"model = fsdp_model(reshard={reshard})\n"
                "with distlab.watch(model):\n"
                "    train(model, 2)", stream=False)
        last = [r for r in store.records() if r["step"] == 1]
        peaks[reshard] = {r["rank"]: r["memory"]["peak_bytes"] for r in last}
        for r in last:
            at_rest = r["memory"]["parameters_bytes"] + r["memory"]["optimizer_bytes"]
            gathered = 4 * LAYER_BYTES if not reshard else LAYER_BYTES
            assert r["memory"]["peak_bytes"] >= at_rest + gathered
    for rank in (0, 1):  # the watch missed the gathered weights before, and read the kept run lower
        assert peaks[False][rank] - peaks[True][rank] >= LAYER_BYTES // 2


@pytest.mark.cluster
def test_collectives_a_dtensor_issues_inside_its_own_ops_are_recorded(lab):
    # With sequence parallelism the LayerNorms' gradients are Partial: the optimizer's step sums them
    # across ranks inside DTensor's handling of its update ops (4 blocks x 2 norms x weight and bias,
    # and the final norm's two: 18 all-reduces), where a dispatch mode does not see them by itself.
    lab.run(SETUP, stream=False)
    store = lab.telemetry
    lab.run("from distlab.nn import GPT, GPTConfig, tensor_parallel_plan\n"
            "torch.manual_seed(0)\n"
            "gpt = GPT(GPTConfig(vocab_size=32, seq_len=16, layers=4, hidden=32, heads=4))\n"
            "parallelize_module(gpt, mesh, tensor_parallel_plan(gpt, sequence_parallel=True))\n"
            "opt = torch.optim.SGD(gpt.parameters(), lr=0.1)\n"
            "idx = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))\n"
            "with distlab.watch(gpt):\n"
            "    for _ in range(2):\n"
            "        gpt(idx, idx)[1].backward()\n"
            "        opt.step()\n"
            "        opt.zero_grad()", stream=False)
    for rec in store.records():
        ops = [c["op"] for c in rec["collectives"]]
        assert ops.count("all_reduce") >= 18, ops
        assert "all_gather" in ops and "reduce_scatter" in ops  # sequence parallelism's own

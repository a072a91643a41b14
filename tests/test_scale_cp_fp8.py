"""The published runs' options in the scale dry run: context parallelism and FP8.

Context parallelism: torch's ring attention on CPU ranks (``rank/torchcompat_cp.py``), checked on real
gloo ranks against whole-sequence attention, forward and backward, in both of torch's rotations; a plan
with ``cp > 1`` dry-run against the same plan without cp (per rank the same work on half the tokens,
its collectives on the cp dimension, FSDP over dp_shard x cp) and predicted.

FP8: torchao's Float8 linears (``rank/float8.py``), both recipes: which FLOPs run in fp8, the
weights' all-gathers, and the compute time predicted at each precision's peak."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

from distlab import scale
from distlab.errors import LabUsageError
from distlab.rank.dryrun_counts import ring_attention_scale

_RING_AGAINST_WHOLE = """
import sys, torch, torch.distributed as dist, torch.nn.functional as F
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from distlab.rank.torchcompat_cp import context_parallel

def run(rank, n, path, rotate):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=n)
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 3, 8 * n, 4, generator=g, dtype=torch.float64) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*whole, is_causal=True)
    out.backward(grad)
    buffers = [out.detach().clone(), *(t.grad.clone() for t in whole), q.clone(), k.clone(), v.clone(), grad.clone()]
    with context_parallel(mesh["cp"], buffers, [2] * 8, rotate=rotate):  # every buffer load-balanced alike
        mine = [t.clone().requires_grad_() for t in buffers[4:7]]
        local = F.scaled_dot_product_attention(*mine, is_causal=True)
        local.backward(buffers[7])
    assert local.shape[2] == 8, local.shape  # this rank's share: two chunks of 4 of the 8 n positions
    for got, expected in zip([local.detach(), *(t.grad for t in mine)], buffers[:4]):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)  # torch merges the ring's parts in fp32
    dist.destroy_process_group()

if __name__ == "__main__":
    n, rotate = int(sys.argv[2]), sys.argv[3]
    mp.spawn(run, args=(n, sys.argv[1], rotate), nprocs=n)
    print("equal")
"""


@pytest.mark.cluster
@pytest.mark.parametrize(("ranks", "rotate"), [(2, "alltoall"), (3, "allgather")])
def test_ring_attention_on_cpu_ranks_equals_attention_over_the_whole_sequence(tmp_path, ranks, rotate):
    # real gloo ranks (a file store: no port); each holds chunks r and 2n-1-r of the sequence
    script = tmp_path / "ring_check.py"
    script.write_text(_RING_AGAINST_WHOLE)
    done = subprocess.run([sys.executable, "-W", "ignore", str(script), str(tmp_path / "store"), str(ranks), rotate],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0 and "equal" in done.stdout, done.stderr[-3000:]


_TINY = scale.ModelConfig("tiny-llama", "llama", 64, 2, 4, 2, 128, 512, 512, False)


@functools.cache
def _dry_run(plan: scale.Plan) -> scale.DryRunReport:
    """Each plan dry-run once for the module's tests (a dry run is a process of its own, seconds each)."""
    return scale.dry_run(plan)


def _kind(cp: int, rotate: str = "alltoall", **options: object) -> scale.RankKind:
    # the same micro-batch (one sequence of 256 tokens) on every dp rank: 8 GPUs as dp 8, or dp 4 x cp 2
    plan = scale.Plan(model=_TINY, gpus=8, seq_len=256, global_batch_tokens=256 * 8 // cp, cp=cp,
                      cp_rotate=rotate, **options)  # type: ignore[arg-type]
    (kind,) = _dry_run(plan).kinds
    return kind


@pytest.mark.cluster
def test_a_cp_rank_does_its_share_of_the_work_and_passes_keys_and_values_round_the_ring():
    whole, ring, gathered = _kind(1), _kind(2), _kind(2, "allgather")
    # FLOPs: the matmuls on half the tokens, the ring's attention counted as the whole square counts it
    assert ring.flops_per_micro_batch == pytest.approx(whole.flops_per_micro_batch / 2, rel=1e-9)
    assert gathered.flops_per_micro_batch == ring.flops_per_micro_batch
    # attention's part, apart: torch's formulas, 2 matmuls forward and 5 backward over the whole square
    # (4 heads of 16, 256 positions, 2 blocks), half of it a cp rank's
    assert whole.attention_flops_per_micro_batch == 14 * 4 * 256 * 256 * 16 * 2
    assert ring.attention_flops_per_micro_batch == pytest.approx(whole.attention_flops_per_micro_batch / 2, rel=1e-9)
    # the memory-bound kernels' bytes: fused chains move less than one kernel an op
    assert 0 < whole.fused_bytes_per_micro_batch < 0.8 * whole.streamed_bytes_per_micro_batch
    # the same weights on every cp rank: FSDP shards them over dp_shard x cp, 8 ranks either way
    assert ring.memory["parameters"] == whole.memory["parameters"]
    assert {c.dim for c in ring.collectives if c.op == "reduce_scatter"} == {"dp_shard_cp"}
    assert {c.group_size for c in ring.collectives if c.dim == "dp_shard_cp"} == {8}
    assert ring.memory["activations"] < 0.6 * whole.memory["activations"]
    # keys and values, (batch 1, 4 heads, 128 of 256 positions, head_dim 16) each in bf16, go once round
    # the ring of 2 per block (2 blocks) forward and again backward; their gradients, accumulated in
    # fp32, at each of the ring's 2 steps
    kv = 2 * 4 * 128 * 16 * 2
    cp_ops = sorted((c.op, c.bytes, c.calls_per_micro_batch, c.phase) for c in ring.collectives if c.dim == "cp")
    assert cp_ops == [("permute", kv, 2, "backward"), ("permute", kv, 2, "forward"), ("permute", 2 * kv, 4, "backward")]
    gathered_ops = {(c.op, c.phase) for c in gathered.collectives if c.dim == "cp"}
    assert ("all_gather", "forward") in gathered_ops and ("permute", "forward") not in gathered_ops
    # Megatron's distributed optimizer under cp reduces over the replicas and the cp ranks (4 x 2)
    zero1 = _kind(2, dp="zero1")
    assert {(c.op, c.dim, c.group_size) for c in zero1.collectives if c.phase == "optimizer"} == {
        ("reduce_scatter", "dp_cp", 8), ("all_gather", "dp_cp", 8)}


def test_the_rings_attention_count_is_the_whole_squares_share():
    # cp = n: 2n chunks of c; rank r runs its two against its own (2c x 2c) and n-1 halves (2c x c)
    for n in (2, 4, 8):
        counted = (2 * 2) + (n - 1) * 2  # in units of c^2
        assert counted * ring_attention_scale(n) == pytest.approx((2 * n) ** 2 / n)
    assert ring_attention_scale(1) == 1.0


def test_plan_options_for_cp_and_virtual_stages_say_what_is_wrong_in_one_line():
    with pytest.raises(LabUsageError, match="cp_rotate"):
        scale.Plan(model=_TINY, gpus=8, seq_len=256, global_batch_tokens=1024, cp=2, cp_rotate="ring")
    # DESIGN's vp= is Megatron's name for stages per pipeline rank: the interleaved schedule
    plan = scale.Plan(model="llama3-8b", gpus=64, seq_len=8192, global_batch_tokens=64 * 8192, tp=8, pp=4, vp=2)
    assert (plan.chunks, plan.schedule, len(plan.layers_per_stage)) == (2, "interleaved", 8)
    with pytest.raises(LabUsageError, match="vp=2 and chunks=4"):
        scale.Plan(model="llama3-8b", gpus=64, seq_len=8192, global_batch_tokens=64 * 8192, tp=8, pp=4, vp=2,
                   chunks=4, schedule="interleaved")


@pytest.mark.cluster
def test_a_cp_plan_is_predicted_with_its_ring_as_sends_beside_compute():
    plan = scale.Plan(model=_TINY, gpus=16, seq_len=256, global_batch_tokens=256 * 4, tp=2, cp=2)
    prediction = scale.predict(plan, hardware="h100-sxm", network="ib-400g")
    # tp 2 innermost, cp 2 next: both inside a node of 8; FSDP over dp_shard x cp (8 ranks, 2 apart)
    # crosses nodes
    assert (prediction.links["tp"], prediction.links["cp"], prediction.links["dp_shard_cp"]) == (
        "node", "node", "network")
    assert prediction.breakdown["exposed cp"] > 0
    assert "exposed dp_shard_cp" in prediction.breakdown


def _fp8_plan(recipe: str, precision: str = "fp8") -> scale.Plan:
    return scale.Plan(model=_TINY, gpus=8, seq_len=256, global_batch_tokens=256 * 8, precision=precision,
                      float8_recipe=recipe)


def _fp8(recipe: str, precision: str = "fp8") -> scale.RankKind:
    (kind,) = _dry_run(_fp8_plan(recipe, precision)).kinds
    return kind


@pytest.mark.cluster
def test_fp8_runs_the_blocks_linears_on_torchaos_float8_matmuls_and_gathers_weights_in_fp8():
    bf16, tensorwise, rowwise = _fp8("tensorwise", precision="bf16"), _fp8("tensorwise"), _fp8("rowwise")
    # each block's seven linears (wq, wk, wv, wo, w1, w2, w3) in fp8, forward and both backward matmuls,
    # on 256 tokens; the head (as torchtitan leaves it) and attention in bf16
    per_token = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)
    for kind in (tensorwise, rowwise):
        assert kind.fp8_flops_per_micro_batch == 3 * per_token * 2 * 256
        assert kind.flops_per_micro_batch == bf16.flops_per_micro_batch  # the same work, some of it in fp8
    assert bf16.fp8_flops_per_micro_batch == 0

    def block_gathers(kind: scale.RankKind) -> set[int]:
        return {c.bytes for c in kind.collectives if c.op == "all_gather" and c.calls_per_micro_batch == 2}

    # tensorwise: FSDP gathers the blocks' weights in fp8 (a byte each, and a little padding), rowwise in bf16
    (bf16_bytes,), (fp8_bytes,) = block_gathers(bf16), block_gathers(tensorwise)
    assert bf16_bytes / 2 <= fp8_bytes < 0.51 * bf16_bytes
    assert block_gathers(rowwise) == {bf16_bytes}
    # predicted: the fp8 matmuls at the H100's fp8 peak (about twice bf16's), the rest of the matmuls and
    # attention at bf16's; the casts are memory-bound kernels of their own
    plans = [_fp8_plan("tensorwise", precision) for precision in ("bf16", "fp8")]  # the two dry-run above
    slow, fast = (scale.predict(plan, report=_dry_run(plan)).compute_by_kernel for plan in plans)
    # of the matmuls computed (the model's and none recomputed here), the share in fp8
    share = tensorwise.fp8_flops_per_micro_batch / (
        tensorwise.flops_per_micro_batch + tensorwise.recompute_flops_per_micro_batch
        - tensorwise.attention_flops_per_micro_batch)
    peaks = scale.hardware.HARDWARE["h100-sxm"].peak_flops
    assert fast["matmuls"] / slow["matmuls"] == pytest.approx(1 - share + share * peaks["bf16"] / peaks["fp8"],
                                                              rel=1e-9)
    assert fast["attention"] == pytest.approx(slow["attention"], rel=1e-9)
    assert fast["memory-bound"] > slow["memory-bound"]

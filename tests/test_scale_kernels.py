"""What the dry run's FLOP mode counts for each kind of kernel (``rank/dryrun_counts.py``): attention's
FLOPs apart from the matmuls', and the bytes the memory-bound kernels move, one kernel an op (eager
torch) and with each chain of them between two matmuls fused (``Chains``). Real tensors on the CPU.
And the quiz's question on compute by kernel, held to the predictor's model (``scale/compute.py``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace as NS

import torch

import distlab.quiz
from distlab import scale
from distlab.rank.dryrun_counts import LocalFlops
from distlab.scale.compute import compute_s

B, S, D, H = 2, 16, 32, 4  # batch, sequence, width, heads


def _rms_norm_then_matmul(x: torch.Tensor, w: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    # RMSNorm as eager torch runs it: five memory-bound kernels before the projection's matmul
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    return normed @ proj


def test_a_fused_chain_moves_what_enters_and_leaves_it_and_eager_torch_moves_every_ops_tensors():
    x, w, proj = torch.randn(B, S, D), torch.randn(D), torch.randn(D, D)
    with LocalFlops() as counted:
        _rms_norm_then_matmul(x, w, proj)
    element, row = 4, B * S * 4  # fp32 bytes: one element, one value per row
    whole = B * S * D * element
    # eager: pow (x in, x^2 out), mean (in, rows out), add (rows in, out), rsqrt (rows in, out),
    # mul (x and rows in, out), mul (that and w in, out); the matmul is not memory-bound
    eager = (2 * whole) + (whole + row) + 2 * row + 2 * row + (whole + row + whole) + (whole + D * element + whole)
    assert counted.streamed == eager
    # fused: the chain reads x (pow's, and again for the multiply: two ops take it from outside the
    # chain) and w once each, and writes its output once, for the matmul
    assert counted.chains.bytes == 2 * whole + D * element + whole
    assert counted.flops == 2 * B * S * D * D and counted.attention == 0


def test_attentions_flops_are_counted_apart_and_views_move_nothing():
    q, k, v = (torch.randn(B, H, S, D // H, requires_grad=True) for _ in range(3))
    with LocalFlops() as counted:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.transpose(1, 2).reshape(B, S, D).sum().backward()
    per_square = B * H * S * S * (D // H)
    # torch's formulas: 2 matmuls forward, 5 backward (the scores recomputed), the square counted whole
    assert counted.attention == counted.flops == 14 * per_square
    assert counted.recomputed == 2 * per_square
    # transpose is a view: the reshape copies the (non-contiguous) output, sum and its backward stream
    assert 0 < counted.chains.bytes < counted.streamed


def test_the_quiz_question_on_compute_by_kernel_holds_to_the_predictors_model():
    bank = Path(distlab.quiz.__file__).parent / "bank" / "scaling.json"
    (question,) = [q for q in json.loads(bank.read_text())["questions"] if q["id"] == "scaling/compute-by-kernel"]
    part = dataclasses.replace(
        scale.HARDWARE["h100-sxm"], peak_flops={"bf16": 989e12, "fp8": 1978e12}, memory_bytes_per_s=3.35e12,
        kernel_rates=scale.KernelRates(matmul=792 / 989, attention=523.5 / 989, memory=1.0, source="the question"))
    kind = NS(flops_per_micro_batch=800e12, recompute_flops_per_micro_batch=0.0, fp8_flops_per_micro_batch=0.0,
              attention_flops_per_micro_batch=200e12, streamed_bytes_per_micro_batch=1e12,
              fused_bytes_per_micro_batch=0.0)
    seconds = compute_s(kind, NS(precision="bf16", fused_kernels=False), part, 0.8)
    (correct,) = [o for o in question["options"] if o["correct"]]
    assert correct["text"] == f"About {seconds:.2f} s" == "About 1.56 s"
    # the wrong answers are what each slip gives: one peak for every FLOP, the whole square, no memory-bound time
    texts = {o["id"]: o["text"] for o in question["options"]}
    assert texts["peak"].startswith(f"About {800e12 / 989e12 / 0.8:.2f} s")
    full_square = seconds + 100e12 / 523.5e12 / 0.8
    no_memory = seconds - 1e12 / 3.35e12 / 0.8
    assert (texts["full-square"], texts["no-memory"]) == (f"About {full_square:.2f} s", f"About {no_memory:.2f} s")

"""A rank kind's compute on a machine (``scale.predict``'s model of it): each kind of kernel's work, as
the dry run counted it, at the rate the machine's profile gives that kind (``Hardware.kernel_rates``),
over the efficiency; or, on a lab's calibrated profile, which has no kernel rates, every FLOP at the
peak it measured."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .hardware import Hardware
    from .plan import Plan
    from .report import RankKind

__all__ = ["compute_s", "half_peak", "kernel_s"]


def compute_s(kind: RankKind, plan: Plan, hw: Hardware, efficiency: float) -> float:
    """One micro-batch's compute on ``hw``: each kind of kernel's work at its rate, over ``efficiency``."""
    if hw.kernel_rates is not None:
        return sum(kernel_s(kind, plan, hw).values()) / efficiency
    # a lab's calibrated profile: every FLOP at its peak, the efficiency the fraction of it reached
    half, fp8 = half_peak(plan, hw), kind.fp8_flops_per_micro_batch
    rest = kind.flops_per_micro_batch + kind.recompute_flops_per_micro_batch - fp8
    return (rest / half + (fp8 / hw.peak_flops["fp8"] if fp8 else 0.0)) / efficiency


def half_peak(plan: Plan, hw: Hardware) -> float:
    """The peak of what is not fp8: fp8 plans run only their linears' matmuls in fp8 (twice bf16's
    peak), attention and the rest in bf16 (a lab's calibrated profile has its own precision's alone)."""
    precision = "bf16" if plan.precision == "fp8" else plan.precision
    return hw.peak_flops.get(precision) or hw.peak_flops["bf16"]


def kernel_s(kind: RankKind, plan: Plan, hw: Hardware) -> dict[str, float]:
    """One micro-batch's seconds in each kind of kernel at its own rate (``Hardware.kernel_rates``)."""
    rates = hw.kernel_rates
    assert rates is not None
    fp8, attention = kind.fp8_flops_per_micro_batch, kind.attention_flops_per_micro_batch
    matmuls = kind.flops_per_micro_batch + kind.recompute_flops_per_micro_batch - fp8 - attention
    moved = kind.fused_bytes_per_micro_batch if plan.fused_kernels else kind.streamed_bytes_per_micro_batch
    return {
        "matmuls": (matmuls / half_peak(plan, hw) + (fp8 / hw.peak_flops["fp8"] if fp8 else 0.0)) / rates.matmul,
        # causal: the kernels compute half of the square that torch's count (and PaLM's) holds
        "attention": attention / 2 / (hw.peak_flops["bf16"] * rates.attention),
        "memory-bound": moved / (hw.memory_bytes_per_s * rates.memory),
    }

"""FP8 training as torchtitan runs it: torchao's Float8 linears (``torchao.float8``), for the scale dry run.

``precision="fp8"`` keeps the weights, the optimizer and every op but the linears' matmuls as bf16
training does; each linear casts its input, its weight and (backward) its output's gradient to fp8 and
runs ``torch._scaled_mm`` (the H100's fp8 tensor cores: twice bf16's peak). Two recipes
(``Plan.float8_recipe``):

- "tensorwise": one scale per tensor. Under FSDP the weights are all-gathered in fp8 (torchao's
  ``enable_fsdp_float8_all_gather``: half the bf16 gather's bytes), their scales computed after the
  optimizer's step in one all-reduce (``precompute_float8_dynamic_scale_for_fsdp``); under TP the
  inputs are cast before their all-gather (torchao's ``Float8ColwiseParallel`` and friends).
- "rowwise": a scale per row (more accurate; torchtitan's choice for the largest runs); the gathers
  stay bf16 and the plain TP styles apply.

The dry run's measured step finds its weights' fp8 scales in forward (a 4-byte all-reduce per linear,
over the FSDP group), where torchtitan's steps after the first use the scales made after the previous
step's update: torchao 0.18's FSDP weight wrapper cannot be tracked holding a precomputed scale under
FakeTensor (its ``__tensor_flatten__`` asks the scale tensor for its truth value, which a fake tensor has
not). The bytes are nothing; the calls are latency, overlapped as FSDP's are.

As torchtitan does, the output head stays bf16 (``module_filter_fn``), and so does any linear whose
sides are not multiples of 16 (fp8's matmul needs them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

    from ..scale.plan import PlanJSON

__all__ = ["RECIPES", "after_step", "convert", "tp_styles"]

RECIPES = ("tensorwise", "rowwise")


def _available() -> None:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ValueError("precision='fp8' needs torchao's Float8 training: pip install 'distlab[scale]' "
                         "(torchao), or use precision='bf16'") from None


def _fp8_gathers(plan: PlanJSON) -> bool:
    return plan["float8_recipe"] == "tensorwise" and plan["dp"] in ("fsdp", "hsdp")


def convert(plan: PlanJSON, module: nn.Module) -> None:
    """Swap ``module``'s linears for torchao's Float8 linears (in place), before it is parallelised."""
    if plan["precision"] != "fp8":
        return
    _available()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if plan["float8_recipe"] == "rowwise":
        config = Float8LinearConfig.from_recipe_name("rowwise")
    else:
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=_fp8_gathers(plan))

    def keep(linear: nn.Module, name: str) -> bool:
        assert isinstance(linear, nn.Linear)
        return name.split(".")[-1] != "output" and linear.in_features % 16 == 0 and linear.out_features % 16 == 0

    convert_to_float8_training(module, config=config, module_filter_fn=keep)


def tp_styles(plan: PlanJSON) -> tuple[Callable[..., ParallelStyle], Callable[..., ParallelStyle],
                                      Callable[..., ParallelStyle]] | None:
    """(colwise, rowwise, prepare-input) styles for the tensor-parallel plan: torchao's Float8 ones under
    the tensorwise recipe (inputs cast to fp8 before their all-gather), else None (torch's own)."""
    if plan["precision"] != "fp8" or plan["float8_recipe"] != "tensorwise":
        return None
    _available()
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def after_step(plan: PlanJSON, modules: Sequence[nn.Module]) -> None:
    """What follows the optimizer's step: the fp8 weights' scales for the next step's all-gathers, in
    one all-reduce (tensorwise under FSDP)."""
    if plan["precision"] != "fp8" or not _fp8_gathers(plan):
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    with torch.no_grad():
        for module in modules:
            precompute_float8_dynamic_scale_for_fsdp(module)

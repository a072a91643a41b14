"""What a plan's JSON (``scale.Plan.to_json()``) implies for the ranks that run it: the device mesh's
dimensions, the micro-batches a step, the compute dtype, how a block's input splits along the
sequence. Shared by the dry run (``dryrun.py``) and the plan run on a lab (``planrun.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..scale.plan import PlanJSON

__all__ = ["MESH", "half", "mesh_dims", "micro_batches", "sequence_split"]

#: The device mesh's dimensions, outermost first (torchtitan's order: tp innermost).
MESH = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def half(plan: PlanJSON) -> bool:
    """Whether the plan computes in bf16 (fp8 too: only its linears' matmuls run in fp8)."""
    return plan["precision"] in ("bf16", "fp8")


def sequence_split(plan: PlanJSON) -> int:
    """How many ways a block's input is split along the sequence: cp, and tp under sequence parallelism."""
    return int(plan["cp"]) * (int(plan["tp"]) if plan["sequence_parallel"] else 1)


def _data_parallel(plan: PlanJSON) -> int:
    """The data-parallel ranks: gpus / (tp * pp * cp)."""
    return int(plan["gpus"] // (plan["tp"] * plan["pp"] * plan["cp"]))


def mesh_dims(plan: PlanJSON) -> dict[str, int]:
    """The sizes of the mesh's dimensions but pp: the data-parallel ranks replicated and sharded, cp, tp."""
    dp = _data_parallel(plan)
    shard = {"ddp": 1, "zero1": 1, "fsdp": dp}.get(plan["dp"], plan["shard"] or 1)
    replicate = dp // shard
    return {"dp_replicate": replicate, "dp_shard": shard, "cp": plan["cp"], "tp": plan["tp"]}


def micro_batches(plan: PlanJSON) -> int:
    """Micro-batches a step on each data-parallel rank."""
    return int(plan["global_batch_tokens"] // (plan["seq_len"] * plan["micro_batch_size"] * _data_parallel(plan)))

"""A training plan at scale: the model, the GPUs and how the work is split between them.

Pure Python (no torch): the notebook makes and checks plans; ``scale.dry_run`` sends one, as JSON, to
the process that runs its real torch code. A plan that cannot exist is refused when it is made, with
one line saying why and what to change, as :mod:`distlab.checks` does for every other argument.

    plan = Plan(model="llama3-8b", gpus=1024, tp=8, seq_len=8192, global_batch_tokens=4 * 2**20)
    plan.dp, plan.micro_batches, plan.tokens_per_step      # 128, 4, 4194304
"""

from __future__ import annotations

import difflib
from dataclasses import KW_ONLY, dataclass
from typing import TypedDict

from .. import checks
from ..errors import LabUsageError
from .models import MODELS, ModelConfig, ModelJSON

__all__ = ["CHECKPOINTING", "DP", "PRECISIONS", "SCHEDULES", "Plan", "PlanJSON", "model_named"]

DP = ("ddp", "fsdp", "hsdp", "zero1")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
PRECISIONS = ("fp32", "bf16", "fp8")
CHECKPOINTING = ("none", "selective", "full")
OPTIMIZERS = ("adamw",)
#: How context parallelism's ring passes keys and values (torch's ``set_rotate_method``): "alltoall"
#: one neighbour at a time (ring attention), "allgather" all at once (Llama 3's form).
CP_ROTATIONS = ("alltoall", "allgather")
#: How fp8's scales are kept (torchao's recipes, ``distlab.rank.float8``): one per tensor, or one per row.
FLOAT8_RECIPES = ("tensorwise", "rowwise")


def _divisors(n: int) -> str:
    found = [d for d in range(2, n + 1) if n % d == 0][:6]
    return ", ".join(map(str, found)) if found else "1"


def _default_split(layers: int, stages: int) -> tuple[int, ...]:
    """Equal where ``stages`` divides ``layers``; else torchtitan's split (``Plan.layers_per_stage``)."""
    if layers % stages == 0:
        return (layers // stages,) * stages
    base, extra = divmod(layers + 2, stages)  # the embedding and the head counted as a layer each
    split = [base + (s < extra) for s in range(stages)]
    split[0] -= 1
    split[-1] -= 1
    if min(split) < 1:  # too few layers to give the ends fewer: spread them plainly
        base, extra = divmod(layers, stages)
        split = [base + (s < extra) for s in range(stages)]
    return tuple(split)


def model_named(model: object) -> ModelConfig:
    if isinstance(model, ModelConfig):
        return model
    if not isinstance(model, str):
        raise TypeError(f"model must be a name such as 'llama3-8b' or a scale.ModelConfig (got {model!r})")
    if model not in MODELS:
        close = difflib.get_close_matches(model, list(MODELS), n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"known: {', '.join(MODELS)}"
        raise LabUsageError(f"unknown model {model!r}: {hint} (or pass a scale.ModelConfig)")
    return MODELS[model]


class PlanJSON(TypedDict):
    """A :class:`Plan` as JSON (``Plan.to_json()``), what the dry run and a lab's ranks are sent: its fields,
    the model as its full config, the model's name, and ``sequence_parallel`` as it will run."""

    model: ModelJSON
    gpus: int
    seq_len: int
    global_batch_tokens: int
    tp: int
    pp: int
    cp: int
    dp: str
    shard: int | None
    micro_batch_size: int
    schedule: str
    chunks: int
    precision: str
    checkpointing: str
    optimizer: str
    cp_rotate: str
    float8_recipe: str
    sequence_parallel: bool
    model_name: str
    stage_layers: list[int]


@dataclass(frozen=True)
class Plan:
    """One training step's layout on ``gpus`` GPUs.

    The mesh is ``(pp, dp, cp, tp)``: ``dp = gpus / (tp * pp * cp)`` data-parallel ranks, each a full
    copy of the work split ``tp`` ways within layers, ``pp`` ways across them and ``cp`` ways along the
    sequence. ``dp`` names how the data-parallel ranks hold the model: "ddp" (replicated), "fsdp"
    (sharded over all dp ranks, FSDP2), "hsdp" (sharded within groups of ``shard`` ranks, replicated
    across them), "zero1" (replicated, the optimizer's states sharded: Megatron-LM's distributed
    optimizer, ``distlab.rank.zero1``). ``micro_batch_size`` sequences per rank per micro-batch; a step is
    ``micro_batches`` of them (the pipeline's micro-batches when ``pp > 1``, else gradient
    accumulation). ``chunks``: stages per rank for the "interleaved" schedule. ``stage_layers``: the
    transformer layers of each of the ``pp * chunks`` stages, first to last; None: equal where they
    divide, else torchtitan's split (``layers_per_stage``). ``sequence_parallel``:
    the residual stream and norms split along the sequence between tensor-parallel ranks (Korthikanti
    et al. 2022; all-gathers and reduce-scatters in place of the all-reduces); None: torchtitan's
    choice, on for Llama models with ``tp > 1``. ``vp``: Megatron's name for ``chunks`` (virtual stages
    per pipeline rank; ``vp > 1`` runs the interleaved schedule). ``cp_rotate``: how context
    parallelism's ring attention passes keys and values (``CP_ROTATIONS``). ``float8_recipe``: fp8's
    scaling under ``precision="fp8"`` (torchao's, ``FLOAT8_RECIPES``). ``fused_kernels``: the run fuses
    each chain of memory-bound kernels between two matmuls (norms, activations, casts, residual adds),
    as torch.compile and Transformer Engine do; the predictor then times the bytes that enter and leave
    each chain instead of every op's (the dry run itself runs eager torch and counts both).
    """

    model: str | ModelConfig
    gpus: int
    _: KW_ONLY
    seq_len: int
    global_batch_tokens: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: str = "fsdp"
    shard: int | None = None
    micro_batch_size: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    precision: str = "bf16"
    checkpointing: str = "none"
    optimizer: str = "adamw"
    sequence_parallel: bool | None = None
    stage_layers: tuple[int, ...] | None = None
    cp_rotate: str = "alltoall"
    float8_recipe: str = "tensorwise"
    vp: int | None = None
    fused_kernels: bool = False

    def __post_init__(self) -> None:
        if self.vp is not None:  # Megatron's name: virtual stages per pipeline rank, the interleaved schedule
            checks.whole("vp", self.vp, minimum=1, example="vp=2")
            if self.chunks not in (1, self.vp):
                raise LabUsageError(f"vp={self.vp} and chunks={self.chunks} name the same thing (stages per "
                                    "pipeline rank): give one of them")
            object.__setattr__(self, "chunks", self.vp)
            if self.vp > 1 and self.schedule == "1f1b":
                object.__setattr__(self, "schedule", "interleaved")
        self.check()

    # ------------------------------------------------------------------------------ derived

    @property
    def config(self) -> ModelConfig:
        return model_named(self.model)

    @property
    def sequence_parallel_on(self) -> bool:
        """Sequence parallelism in the tensor-parallel plan: as asked, else torchtitan's choice (on for
        a Llama model split by tp > 1)."""
        if self.sequence_parallel is None:
            return self.tp > 1 and self.config.architecture == "llama"
        return self.sequence_parallel and self.tp > 1

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        """The transformer layers of each pipeline stage (``pp * chunks`` of them), first to last: as
        given (``stage_layers``); equal where they divide; else torchtitan's split
        (``generate_llm_fqn_per_model_part``), which counts the embedding and the output head as one
        layer each and spreads the layers so counted evenly, one more to the first stages where they
        do not divide. Llama 3 405B's 126 layers over 16 stages: 7, 8 x 14, 7, the split its paper
        describes (one layer fewer on the first and the last stage, section 3.3.2)."""
        if self.stage_layers is not None:
            return tuple(self.stage_layers)
        return _default_split(self.config.layers, self.pp * self.chunks)

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks: gpus / (tp * pp * cp)."""
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step on each data-parallel rank."""
        return self.global_batch_tokens // (self.seq_len * self.micro_batch_size * self.dp_degree)

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batches * self.micro_batch_size * self.seq_len * self.dp_degree

    @property
    def dims(self) -> dict[str, int]:
        """Each mesh dimension's size, outermost first (torchtitan's order; tp innermost)."""
        replicate, shard = {"ddp": (self.dp_degree, 1), "zero1": (self.dp_degree, 1), "fsdp": (1, self.dp_degree)}.get(
            self.dp, (self.dp_degree // (self.shard or 1), self.shard or 1)
        )
        return {"pp": self.pp, "dp_replicate": replicate, "dp_shard": shard, "cp": self.cp, "tp": self.tp}

    def to_json(self) -> PlanJSON:
        """The plan as JSON-ready data, the model as its full config (the dry run needs no table)."""
        return PlanJSON(
            model=self.config.to_json(), gpus=self.gpus, seq_len=self.seq_len,
            global_batch_tokens=self.global_batch_tokens, tp=self.tp, pp=self.pp, cp=self.cp, dp=self.dp,
            shard=self.shard, micro_batch_size=self.micro_batch_size, schedule=self.schedule, chunks=self.chunks,
            precision=self.precision, checkpointing=self.checkpointing, optimizer=self.optimizer,
            cp_rotate=self.cp_rotate, float8_recipe=self.float8_recipe, sequence_parallel=self.sequence_parallel_on,
            model_name=self.model if isinstance(self.model, str) else self.model.name,
            stage_layers=list(self.layers_per_stage),
        )

    # ------------------------------------------------------------------------------ checks

    def check(self) -> None:
        """Raise one line (LabUsageError, a ValueError) if this plan cannot exist."""
        cfg = model_named(self.model)
        checks.whole("gpus", self.gpus, minimum=1, example="gpus=1024")
        for name in ("tp", "pp", "cp", "chunks", "micro_batch_size"):
            checks.whole(name, getattr(self, name), minimum=1, example=f"{name}=1")
        checks.whole("seq_len", self.seq_len, minimum=1, example="seq_len=8192")
        checks.whole("global_batch_tokens", self.global_batch_tokens, minimum=1, example="global_batch_tokens=4194304")
        checks.choice("dp", self.dp, DP)
        checks.choice("schedule", self.schedule, SCHEDULES)
        checks.choice("precision", self.precision, PRECISIONS)
        checks.choice("checkpointing", self.checkpointing, CHECKPOINTING)
        checks.choice("optimizer", self.optimizer, OPTIMIZERS)
        checks.choice("cp_rotate", self.cp_rotate, CP_ROTATIONS)
        checks.choice("float8_recipe", self.float8_recipe, FLOAT8_RECIPES)
        checks.flag("fused_kernels", self.fused_kernels)
        split = self.tp * self.pp * self.cp
        if self.gpus % split:
            raise LabUsageError(
                f"the mesh does not cover gpus={self.gpus}: tp*pp*cp = {split} must divide it, leaving "
                f"dp = gpus/(tp*pp*cp) whole; change gpus to a multiple of {split} or the split"
            )
        for what, count in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads)):
            if count % self.tp:
                raise LabUsageError(
                    f"tp={self.tp} does not divide {cfg.name}'s {count} {what}: each tensor-parallel rank takes "
                    f"whole heads; use tp in {_divisors(cfg.kv_heads if what == 'kv_heads' else cfg.heads)}"
                )
        if cfg.ffn_dim % self.tp:
            raise LabUsageError(f"tp={self.tp} does not divide {cfg.name}'s ffn_dim {cfg.ffn_dim}: use tp in "
                                f"{_divisors(cfg.ffn_dim)}")
        if self.sequence_parallel is not None:
            checks.flag("sequence_parallel", self.sequence_parallel)
        if self.sequence_parallel and cfg.architecture != "llama":
            raise LabUsageError(
                f"sequence_parallel=True is dry-run for Llama models (torchtitan's plan); {cfg.name} (learned "
                "positions, tied embeddings) runs tensor parallelism without it: pass sequence_parallel=False"
            )
        if self.sequence_parallel_on and self.seq_len % self.tp:
            raise LabUsageError(f"seq_len={self.seq_len} does not split over tp={self.tp} (sequence parallelism): "
                                "use a multiple of tp, or sequence_parallel=False")
        self._check_pipeline(cfg)
        self._check_data_parallel()
        if self.seq_len > cfg.max_seq_len:
            raise LabUsageError(f"seq_len={self.seq_len} is longer than {cfg.name}'s {cfg.max_seq_len} positions: "
                                f"use seq_len <= {cfg.max_seq_len}")
        if self.seq_len % (2 * self.cp) and self.cp > 1:
            raise LabUsageError(f"seq_len={self.seq_len} must split into 2*cp = {2 * self.cp} equal chunks "
                                "(load-balanced ring attention): use a multiple of it")
        self._check_batch()

    def _check_pipeline(self, cfg: ModelConfig) -> None:
        if self.chunks > 1 and self.schedule != "interleaved":
            raise LabUsageError(f"chunks={self.chunks} is for schedule='interleaved' (stages per rank); "
                                f"with schedule={self.schedule!r} use chunks=1")
        stages = self.pp * self.chunks
        if self.stage_layers is not None:
            given = self.stage_layers
            if not isinstance(given, (tuple, list)) or not all(isinstance(n, int) and n >= 1 for n in given):
                raise LabUsageError(f"stage_layers must be whole numbers of layers, at least 1 per stage (got "
                                    f"{given!r}); e.g. stage_layers={_default_split(cfg.layers, stages)}")
            if len(given) != stages or sum(given) != cfg.layers:
                raise LabUsageError(
                    f"stage_layers={tuple(given)} must give each of the pp*chunks = {stages} stages its layers, "
                    f"{cfg.layers} in all ({cfg.name}); e.g. stage_layers={_default_split(cfg.layers, stages)}"
                )
        elif stages > cfg.layers:
            raise LabUsageError(f"pp*chunks = {stages} stages are more than {cfg.name}'s {cfg.layers} layers: "
                                f"give each stage at least one (pp*chunks <= {cfg.layers})")

    def _check_data_parallel(self) -> None:
        dp = self.dp_degree
        if self.dp == "hsdp":
            if self.shard is None:
                raise LabUsageError("dp='hsdp' needs shard=, the GPUs in each shard group (e.g. shard=8): parameters "
                                    "are sharded within a group and replicated across groups")
            checks.whole("shard", self.shard, minimum=1, example="shard=8")
            if dp % self.shard:
                raise LabUsageError(f"shard={self.shard} does not divide the {dp} data-parallel ranks "
                                    f"(gpus/(tp*pp*cp)): use shard in {_divisors(dp)}")
        elif self.shard is not None:
            raise LabUsageError(f"shard= is for dp='hsdp' (GPUs per shard group); with dp={self.dp!r} leave it out")

    def _check_batch(self) -> None:
        per = self.seq_len * self.micro_batch_size * self.dp_degree
        if self.global_batch_tokens % per or self.global_batch_tokens < per:
            fit = max(1, round(self.global_batch_tokens / per)) * per
            raise LabUsageError(
                f"global_batch_tokens={self.global_batch_tokens:,} is not a whole number of micro-batches: one "
                f"micro-batch on every dp rank is seq_len*micro_batch_size*dp = {per:,} tokens; "
                f"use a multiple of it, e.g. global_batch_tokens={fit}"
            )
        if self.pp > 1 and self.micro_batches < self.pp:
            raise LabUsageError(
                f"{self.micro_batches} micro-batches cannot fill {self.pp} pipeline stages: give at least "
                f"pp = {self.pp} (global_batch_tokens >= {self.pp * per:,}), or a smaller micro_batch_size"
            )

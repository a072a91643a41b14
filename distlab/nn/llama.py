"""The transformers of ``distlab.scale``'s dry run, at the sizes the field trains: Llama 3 and GPT-3.

Built from a ``distlab.scale.models.ModelConfig`` (its ``architecture`` picks the block):

- "llama" (Touvron et al. 2023; Llama 3, Grattafiori et al. 2024): RMSNorm, grouped-query attention with
  rotary positions, a SwiGLU MLP of three matrices, no biases, an untied output head. Module names are
  torchtitan's (``tok_embeddings``, ``layers[i].attention.{wq,wk,wv,wo}``, ``feed_forward.{w1,w2,w3}``,
  ``attention_norm``, ``ffn_norm``, ``norm``, ``output``), so its tensor-parallel plan is torchtitan's.
- "gpt" (GPT-2/3, Megatron-LM's GPT, the notebooks' model): LayerNorm, multi-head attention, a GELU MLP
  (``w1``, ``w2``), biases, learned positions (``pos_embeddings``), the head tied to the embedding or not.

The parameter count is exactly ``distlab.scale.models.parameters(config)`` (a test holds them
together). Made to be built on the meta device and parallelised from outside: attention counts its
heads from the width of its local ``wq`` / ``wk`` outputs, so a tensor-parallel rank runs its own heads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

if TYPE_CHECKING:
    from types import TracebackType

    from torch.distributed.tensor.parallel import ParallelStyle

    from ..scale.models import ModelConfig

__all__ = ["Transformer", "TransformerStage", "recomputing", "stage_modules", "tensor_parallel_plan"]


def _rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    # Rotary positions (Su et al. 2021), Llama 3's base 500,000, computed in forward: a buffer made on
    # the meta device would hold nothing after to_empty, and the work is tiny next to the matmuls.
    half = x.shape[-1] // 2
    freqs = 1.0 / (500_000.0 ** (torch.arange(0, half, device=x.device, dtype=torch.float32) / half))
    angles = torch.outer(positions.float(), freqs)  # (seq, half)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        llama = config.architecture == "llama"
        self.head_dim = config.dim // config.heads
        kv = config.kv_heads * self.head_dim
        self.rotary = llama
        self.wq = nn.Linear(config.dim, config.dim, bias=not llama)
        self.wk = nn.Linear(config.dim, kv, bias=not llama)
        self.wv = nn.Linear(config.dim, kv, bias=not llama)
        self.wo = nn.Linear(config.dim, config.dim, bias=not llama)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: each token's place in the whole sequence (rotary's angle), where this rank holds
        only part of it (context parallelism's load-balanced chunks); None: 0 .. seq - 1."""
        batch, seq, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        heads, kv_heads = q.shape[-1] // self.head_dim, k.shape[-1] // self.head_dim  # this rank's heads
        q = q.view(batch, seq, heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, kv_heads, self.head_dim).transpose(1, 2)
        if self.rotary:
            if positions is None:
                positions = torch.arange(seq, device=x.device)
            q, k = _rotate(q, positions), _rotate(k, positions)
        if kv_heads != heads:  # each KV head serves heads / kv_heads query heads (torchtitan's repeat_kv), so
            # that attention runs as the fused (flash) kernel, which never holds the seq x seq scores
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.wo(y.transpose(1, 2).reshape(batch, seq, heads * self.head_dim))
        return out


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.llama = config.architecture == "llama"
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=not self.llama)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=not self.llama)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False) if self.llama else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            hidden: torch.Tensor = F.silu(self.w1(x)) * self.w3(x)
        else:
            hidden = F.gelu(self.w1(x))
        out: torch.Tensor = self.w2(hidden)
        return out


def _norm(config: ModelConfig) -> nn.Module:
    if config.architecture == "llama":
        return nn.RMSNorm(config.dim, eps=1e-5)
    return nn.LayerNorm(config.dim)


class Block(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = _norm(config)
        self.attention = Attention(config)
        self.ffn_norm = _norm(config)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), positions)
        out: torch.Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


# What selective checkpointing keeps (torchtitan's op-level policy, its ``_save_list``): the matmuls'
# and attention's outputs, the expensive ops, and the tensor-parallel all-reduce's, so that recomputing
# a block repeats no collective; the cheap element-wise ops between them are recomputed.
_SAVED = {
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention", "all_reduce",
    "reduce_scatter_tensor",
}


def _policy(
    ctx: SelectiveCheckpointContext, op: Callable[..., object], *args: object, **kwargs: object
) -> CheckpointPolicy:
    name = op.__name__.split(".")[0]
    return CheckpointPolicy.MUST_SAVE if name in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


class _Recomputation:
    """Entered where torch's checkpoint runs a block again in backward (the second of ``context_fn``'s
    contexts), around the context that recomputation needs (selective checkpointing's), if any."""

    depth = 0  # checkpointed blocks running again now (nested: a block in a block)

    def __init__(self, inner: AbstractContextManager[object] | None = None) -> None:
        self.inner = inner

    def __enter__(self) -> None:
        if self.inner is not None:
            self.inner.__enter__()
        _Recomputation.depth += 1

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        _Recomputation.depth -= 1
        if self.inner is not None:
            self.inner.__exit__(kind, error, trace)


def recomputing() -> bool:
    """Whether a checkpointed block is running its forward again, in backward, now: the ops run then
    are recomputation (the dry run counts their FLOPs apart from the model's)."""
    return _Recomputation.depth > 0


_SELECTIVE = partial(create_selective_checkpoint_contexts, _policy)


def _full_contexts() -> tuple[AbstractContextManager[None], _Recomputation]:
    # torch's checkpoint runs the block under the first context, its recomputation under the second
    return nullcontext(), _Recomputation()


def _selective_contexts() -> tuple[AbstractContextManager[object], _Recomputation]:
    forward, recompute = _SELECTIVE()
    return forward, _Recomputation(recompute)


def _run(block: nn.Module, x: torch.Tensor, positions: torch.Tensor | None, mode: str) -> torch.Tensor:
    if mode == "none" or not torch.is_grad_enabled():
        out: torch.Tensor = block(x, positions)
    elif mode == "full":  # keep only the block's input; everything inside is recomputed in backward
        out = checkpoint(block, x, positions, use_reentrant=False, context_fn=_full_contexts)
    else:
        out = checkpoint(block, x, positions, use_reentrant=False, context_fn=_selective_contexts)
    return out


class TransformerStage(nn.Module):
    """Consecutive blocks of a transformer; the first stage also embeds token ids, the last also ends in
    the final norm and output head (logits). The whole model is the one stage that does both."""

    def __init__(self, config: ModelConfig, layers: Sequence[int], first: bool, last: bool) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab, config.dim) if first else None
        gpt = config.architecture == "gpt"
        self.pos_embeddings = nn.Embedding(config.max_seq_len, config.dim) if first and gpt else None
        # Keyed by the layer's index in the whole model, as torchtitan keys them: a stage's names are the model's.
        self.layers = nn.ModuleDict({str(i): Block(config) for i in layers})
        self.norm = _norm(config) if last else None
        self.output = nn.Linear(config.dim, config.vocab, bias=False) if last else None
        if first and last and config.tied_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight
        self.checkpointing = "none"

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``x``: token ids (the first stage) or the previous stage's output. ``positions``: where this
        rank's tokens sit in the sequence, when it holds only part of it (context parallelism)."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(x)
            if self.pos_embeddings is not None:
                where = positions if positions is not None else torch.arange(x.shape[1], device=x.device)
                h = h + self.pos_embeddings(where)
            x = h
        for block in self.layers.values():
            x = _run(block, x, positions, self.checkpointing)
        if self.norm is not None and self.output is not None:
            x = self.output(self.norm(x))
        return x


def Transformer(config: ModelConfig) -> TransformerStage:
    """The whole model: one stage holding every layer, the embedding and the head."""
    return TransformerStage(config, range(config.layers), first=True, last=True)


def stage_modules(
    config: ModelConfig, pp: int, chunks: int, rank: int, splits: Sequence[int] | None = None
) -> list[TransformerStage]:
    """The stage modules pipeline rank ``rank`` of ``pp`` holds: ``chunks`` of the ``pp * chunks``
    stages (rank r holds r, r + pp, ...: torch's interleaved layout; one stage without interleaving),
    each of consecutive layers: ``splits[s]`` of them for stage s, else ``layers / (pp * chunks)``."""
    stages = pp * chunks
    counts = list(splits) if splits is not None else [config.layers // stages] * stages
    starts = [sum(counts[:s]) for s in range(stages)]
    return [
        TransformerStage(config, range(starts[s], starts[s] + counts[s]), first=s == 0, last=s == stages - 1)
        for s in range(rank, stages, pp)
    ]


#: A tensor-parallel style's class (or whatever makes one from its keyword arguments).
Style = Callable[..., "ParallelStyle"]


def tensor_parallel_plan(
    stage: TransformerStage, loss_parallel: bool = True, sequence_parallel: bool = False,
    styles: tuple[Style, Style, Style] | None = None,
) -> dict[str, ParallelStyle]:
    """torchtitan's Llama plan (its ``apply_tp``): wq, wk, wv, w1, w3 split by output columns, wo and w2
    by input rows (Megatron-LM's split). Without ``sequence_parallel``: per block one all-reduce after
    attention and one after the MLP in forward, and one each for their inputs' gradients in backward
    (attention's and the MLP's input is made one replicated DTensor at their door, so q, k and v share
    it); the embedding is split by vocabulary rows (an all-reduce of its output). With it (torchtitan's
    default; Korthikanti et al. 2022): the residual stream and the norms hold seq / tp positions on each
    rank, an all-gather at attention's and the MLP's door and a reduce-scatter after wo and w2 take the
    all-reduces' place, and the embedding's output is reduce-scattered along the sequence. The head is
    split by vocabulary columns, its logits left sharded for a loss-parallel cross-entropy
    (``loss_parallel``). ``styles``: the (colwise, rowwise, prepare-input) styles for the blocks, where
    not torch's (torchao's Float8 ones, which cast to fp8 before gathering: ``rank.float8``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    Colwise, Rowwise, Prepare = styles or (ColwiseParallel, RowwiseParallel, PrepareModuleInput)

    sequence = Shard(1) if sequence_parallel else Replicate()  # a block's input and output
    door = Prepare(input_layouts=(sequence,), desired_input_layouts=(Replicate(),))
    # attention's second input, the tokens' positions, passes as it is (torchtitan's freqs_cis)
    attention_door = Prepare(input_layouts=(sequence, None), desired_input_layouts=(Replicate(), None))
    plan: dict[str, ParallelStyle] = {}
    for name, block in stage.layers.items():
        p = f"layers.{name}"
        plan.update({f"{p}.attention": attention_door, f"{p}.feed_forward": door})
        plan.update({f"{p}.attention.{w}": Colwise() for w in ("wq", "wk", "wv")})
        plan[f"{p}.attention.wo"] = Rowwise(output_layouts=sequence)
        plan[f"{p}.feed_forward.w1"] = Colwise()
        if isinstance(block, Block) and block.feed_forward.w3 is not None:
            plan[f"{p}.feed_forward.w3"] = Colwise()
        plan[f"{p}.feed_forward.w2"] = Rowwise(output_layouts=sequence)
        if sequence_parallel:
            plan.update({f"{p}.attention_norm": SequenceParallel(), f"{p}.ffn_norm": SequenceParallel()})
    if stage.tok_embeddings is not None and not stage.config.tied_embeddings:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=sequence)
    if stage.output is not None and not stage.config.tied_embeddings:
        if sequence_parallel and stage.norm is not None:
            plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(
            input_layouts=sequence, output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def blocks(stage: TransformerStage) -> list[nn.Module]:
    """The stage's blocks, in order: FSDP's units."""
    return list(stage.layers.values())


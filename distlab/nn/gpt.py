"""The small decoder-only transformer of the modern-parallelism labs, and how it splits.

GPT-2's layout (Radford et al., 2019) with pre-norm residual blocks: token and learned position
embeddings, ``layers`` blocks of causal self-attention and a GELU MLP, a final LayerNorm and a linear head.
Module names are the handles the labs use: ``tok``, ``pos``, ``blocks[i].ln1 / attn.{q,k,v,out} / ln2 /
mlp.{fc,proj}``, ``norm``, ``head``.

It is written to be parallelised from outside, unchanged:

- tensor (and sequence) parallelism: ``parallelize_module(model, mesh, tensor_parallel_plan(model))``;
  attention counts its heads from the width of its local ``q`` output, so a rank holding half of q, k
  and v's columns runs half of the heads.
- FSDP2: ``fully_shard`` each of ``model.blocks``, then the model.
- pipeline parallelism: ``pipeline_stages(model, n)`` cuts it into ``n`` stage modules.
- activation checkpointing: ``model.set_activation_checkpointing(True)`` recomputes each block in backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

from .. import checks

__all__ = ["GPT", "MLP", "Attention", "Block", "GPTConfig", "GPTStage", "pipeline_stages", "tensor_parallel_plan"]


@dataclass
class GPTConfig:
    """The model's shape. The defaults are the labs' model: ~0.8M parameters with a ~100-character
    vocabulary, a training step in tens of milliseconds on one CPU thread."""

    vocab_size: int
    seq_len: int = 64
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    ffn_hidden: int | None = None  # None: 4 * hidden, as in GPT-2
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False  # the head reuses the token embedding's weight

    def __post_init__(self) -> None:
        for name, example in (("vocab_size", 100), ("seq_len", 64), ("layers", 4), ("hidden", 128), ("heads", 4)):
            checks.whole(name, getattr(self, name), minimum=1, example=f"{name}={example}")
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden={self.hidden} must be a multiple of heads={self.heads}: each head gets hidden // heads "
                "features (e.g. hidden=128, heads=4)"
            )
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.hidden
        checks.whole("ffn_hidden", self.ffn_hidden, minimum=1, example="ffn_hidden=512")
        checks.fraction("dropout", self.dropout, open_top=True)
        checks.flag("bias", self.bias)
        checks.flag("tie_embeddings", self.tie_embeddings)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class Attention(nn.Module):
    """Causal multi-head self-attention with separate ``q``, ``k``, ``v`` and ``out`` projections."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        h = config.hidden
        self.q = nn.Linear(h, h, bias=config.bias)
        self.k = nn.Linear(h, h, bias=config.bias)
        self.v = nn.Linear(h, h, bias=config.bias)
        self.out = nn.Linear(h, h, bias=config.bias)
        # The head width, not the head count: under tensor parallelism q's output holds only this rank's
        # heads, and their number is read from it.
        self.head_dim = config.head_dim
        self.attn_dropout = config.dropout
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)  # (batch, seq, local_heads * head_dim) each
        batch, seq, width = q.shape
        heads = width // self.head_dim

        def split(t: torch.Tensor) -> torch.Tensor:  # -> (batch, local_heads, seq, head_dim)
            return t.view(batch, seq, heads, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            split(q), split(k), split(v), is_causal=True, dropout_p=self.attn_dropout if self.training else 0.0
        )
        out: torch.Tensor = self.drop(self.out(y.transpose(1, 2).reshape(batch, seq, width)))
        return out


class MLP(nn.Module):
    """hidden -> ffn_hidden -> GELU -> hidden."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.ffn_hidden is not None  # set by GPTConfig.__post_init__
        self.fc = nn.Linear(config.hidden, config.ffn_hidden, bias=config.bias)
        self.proj = nn.Linear(config.ffn_hidden, config.hidden, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(self.proj(F.gelu(self.fc(x))))
        return out


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden, bias=config.bias)
        self.attn = Attention(config)
        self.ln2 = nn.LayerNorm(config.hidden, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


def _embed(tok: nn.Embedding, pos: nn.Embedding, idx: torch.Tensor) -> torch.Tensor:
    # (batch, seq) ids -> (batch, seq, hidden); the (seq, hidden) positions broadcast over the batch.
    out: torch.Tensor = tok(idx) + pos(torch.arange(idx.shape[1], device=idx.device))
    return out


def _run_blocks(blocks: nn.ModuleList, x: torch.Tensor, checkpointing: bool) -> torch.Tensor:
    for block in blocks:
        if checkpointing and torch.is_grad_enabled():
            # Keep only the block's input; its inner activations are recomputed in backward.
            x = checkpoint(block, x, use_reentrant=False)
        else:
            x = block(x)
    return x


class GPT(nn.Module):
    """The decoder-only transformer: ``model(idx)`` -> logits, ``model(idx, targets)`` -> (logits, loss)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        checks.instance("config", config, GPTConfig, what="a GPTConfig", error=TypeError)
        self.config = config
        self.tok = nn.Embedding(config.vocab_size, config.hidden)
        self.pos = nn.Embedding(config.seq_len, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        blocks = [Block(config) for _ in range(config.layers)]
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(config.hidden, bias=config.bias)
        self.head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.tok.weight
        self.checkpointing = False
        self.apply(self._init_weights)
        # GPT-2: the projections that write into the residual stream start smaller, by 1/sqrt(2 * layers),
        # so the stream's variance does not grow with depth.
        for block in blocks:
            for proj in (block.attn.out, block.mlp.proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * config.layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def set_activation_checkpointing(self, on: bool) -> None:
        """Recompute each block's activations in backward (``torch.utils.checkpoint``, non-reentrant)
        instead of keeping them: memory per block falls to its input, for one more forward's compute."""
        self.checkpointing = checks.flag("on", on)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``idx`` (batch, seq) token ids, seq <= config.seq_len -> logits (batch, seq, vocab_size); with
        ``targets`` (batch, seq), also the mean cross-entropy of predicting each target."""
        if idx.dim() != 2 or idx.shape[1] > self.config.seq_len:
            raise ValueError(
                f"idx must be (batch, seq) token ids with seq <= seq_len={self.config.seq_len} (got shape "
                f"{tuple(idx.shape)}): cut the sequence or build the model with a longer seq_len"
            )
        x = self.drop(_embed(self.tok, self.pos, idx))
        x = _run_blocks(self.blocks, x, self.checkpointing)
        logits: torch.Tensor = self.head(self.norm(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tensor_parallel_plan(model: GPT, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The plan for ``torch.distributed.tensor.parallel.parallelize_module(model, mesh, plan)``.

    Megatron-LM's split (Shoeybi et al., 2019): in each block q, k, v and fc are split by output
    columns (``ColwiseParallel``: each rank computes its heads, its part of the MLP's width), out and proj
    by input rows (``RowwiseParallel``), whose partial outputs are summed: one all-reduce in forward and
    one in backward for attention, the same for the MLP (attention's and the MLP's inputs enter as one
    replicated DTensor each, so q, k and v share one backward all-reduce, as Megatron's fused qkv
    does). Embeddings, norms and head stay whole on every rank.

    ``sequence_parallel`` (Korthikanti et al., 2022) also splits the sequence between ranks outside
    attention and the MLP: the residual stream and the LayerNorms (``SequenceParallel``) hold
    seq / ranks positions each; an all-gather before attention and the MLP and a reduce-scatter after them
    take the place of the all-reduce. The layouts are torchtitan's Llama plan (``parallelize.py``,
    ``apply_tp``); unlike torchtitan, the embeddings and head are not split by vocabulary (the labs'
    vocabulary is ~100 characters): the first block takes its own slice of the sequence, and the final
    norm's output is gathered for the head. The LayerNorms' weights are then replicated DTensors whose
    gradients come out ``Partial`` (each rank's sum over its positions): ``full_tensor()`` adds them up,
    and the optimizer's step does.

    Keep ``dropout=0.0`` under tensor parallelism: each rank draws its own dropout mask, and ranks that
    should hold the same activations would not.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    checks.instance("model", model, GPT, what="a distlab.nn.GPT", error=TypeError)
    checks.flag("sequence_parallel", sequence_parallel)
    # Without sequence parallelism a block's input and output are whole on every rank (Replicate).
    sequence = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    for i in range(len(model.blocks)):
        prefix = f"blocks.{i}"
        plan.update(
            {
                f"{prefix}.attn.q": ColwiseParallel(),
                f"{prefix}.attn.k": ColwiseParallel(),
                f"{prefix}.attn.v": ColwiseParallel(),
                f"{prefix}.attn.out": RowwiseParallel(output_layouts=sequence),
                f"{prefix}.mlp.fc": ColwiseParallel(),
                f"{prefix}.mlp.proj": RowwiseParallel(output_layouts=sequence),
            }
        )
        if not sequence_parallel:
            # q, k and v read the same input: made a DTensor once at attention's door, its gradient is
            # summed across ranks once (Megatron's f), not once per projection; the MLP alike.
            whole = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
            plan.update({f"{prefix}.attn": whole, f"{prefix}.mlp": whole})
        if sequence_parallel:
            plan.update(
                {
                    f"{prefix}.ln1": SequenceParallel(),
                    # The norm's output is a DTensor sharded by sequence: gathered whole for attention's input.
                    f"{prefix}.attn": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                    f"{prefix}.ln2": SequenceParallel(),
                    f"{prefix}.mlp": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                }
            )
    if sequence_parallel:
        plan.update(
            {
                # The embeddings are whole on every rank; each rank keeps its slice of the sequence (no traffic).
                "blocks.0": PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
                ),
                "norm": SequenceParallel(),
                "head": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                ),
            }
        )
    return plan


class GPTStage(nn.Module):
    """One pipeline stage of a GPT: the first stage embeds token ids, the last returns logits; each maps
    the previous stage's output, (batch, seq, hidden) activations. It shares its modules with the model."""

    def __init__(
        self,
        blocks: Sequence[nn.Module],  # Blocks, or Blocks wrapped (activation checkpointing, FSDP)
        *,
        embeddings: tuple[nn.Embedding, nn.Embedding, nn.Dropout] | None = None,
        output: tuple[nn.LayerNorm, nn.Linear] | None = None,
        checkpointing: bool = False,
    ) -> None:
        super().__init__()
        self.tok: nn.Embedding | None = None
        self.pos: nn.Embedding | None = None
        self.drop: nn.Dropout | None = None
        self.norm: nn.LayerNorm | None = None
        self.head: nn.Linear | None = None
        if embeddings is not None:
            self.tok, self.pos, self.drop = embeddings
        self.blocks = nn.ModuleList(blocks)
        if output is not None:
            self.norm, self.head = output
        self.checkpointing = checkpointing

    def set_activation_checkpointing(self, on: bool) -> None:
        self.checkpointing = checks.flag("on", on)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None and self.pos is not None and self.drop is not None:  # set together
            x = self.drop(_embed(self.tok, self.pos, x))
        x = _run_blocks(self.blocks, x, self.checkpointing)
        if self.head is not None and self.norm is not None:
            x = self.head(self.norm(x))
        return x


def pipeline_stages(model: GPT, stages: int) -> list[GPTStage]:
    """``model`` cut into ``stages`` consecutive :class:`GPTStage` modules, blocks shared out evenly
    (the first stages take one more when they do not divide): stage 0 embeds, the last one ends in the
    norm and head, and chaining them is ``model(idx)``. Each rank gives its own to
    ``torch.distributed.pipelining.PipelineStage(stage, index, stages, device)``; with interleaved
    schedules, cut ``ranks * chunks`` stages and give rank r the stages r, r + ranks, r + 2 * ranks, ...
    The stages take the model's activation checkpointing setting as it is now.
    """
    checks.instance("model", model, GPT, what="a distlab.nn.GPT", error=TypeError)
    layers = len(model.blocks)
    count = checks.whole("stages", stages, minimum=1, example="stages=2")
    if count > layers:
        raise ValueError(f"stages={stages} is more than the model's {layers} blocks: each stage needs one block")
    if count > 1 and model.config.tie_embeddings:
        raise ValueError(
            "a model with tie_embeddings=True shares one weight between its first and last stage: build it "
            "with tie_embeddings=False to split it into stages"
        )
    per_stage, extra = divmod(layers, count)
    result, start = [], 0
    for index in range(count):
        end = start + per_stage + (1 if index < extra else 0)
        result.append(
            GPTStage(
                list(model.blocks[start:end]),
                embeddings=(model.tok, model.pos, model.drop) if index == 0 else None,
                output=(model.norm, model.head) if index == count - 1 else None,
                checkpointing=model.checkpointing,
            )
        )
        start = end
    return result

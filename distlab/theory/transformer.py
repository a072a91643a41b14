"""Transformers: the parameters of a GPT-2-style model, the FLOPs of training it per token and the
model FLOPs utilisation, and the activation memory of one layer under tensor and sequence parallelism
and recomputation.

Sources: Kaplan et al. 2020, "Scaling Laws for Neural Language Models" (6N FLOPs per token);
Chowdhery et al. 2022, "PaLM", appendix B (6N + 12LHQT, MFU); Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models" (activations per layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import checks
from ._checks import checked_count, checked_non_negative, checked_positive

# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer in GPT-2's layout (nanoGPT's ``GPT``, Hugging Face's ``GPT2LMHeadModel``).

    ``layers`` blocks of width ``hidden`` with ``heads`` attention heads of ``head_dim`` (default
    hidden / heads), an MLP of ``ffn_hidden`` (default 4 * hidden), sequences of ``seq_len`` tokens
    from a vocabulary of ``vocab``. ``tied_embeddings``: the output layer reuses the token embedding
    (GPT-2 does); ``learned_positions``: a learned position embedding of seq_len rows (GPT-2's; False
    for rotary or sinusoidal positions, which have no parameters).
    """

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn_hidden: int | None = None
    tied_embeddings: bool = True
    learned_positions: bool = True
    head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
            object.__setattr__(self, name, checked_count(name, getattr(self, name)))
        checks.flag("tied_embeddings", self.tied_embeddings)
        checks.flag("learned_positions", self.learned_positions)
        ffn = 4 * self.hidden if self.ffn_hidden is None else checked_count("ffn_hidden", self.ffn_hidden)
        object.__setattr__(self, "ffn_hidden", ffn)
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ValueError(
                    f"hidden ({self.hidden}) is not a multiple of heads ({self.heads}): give head_dim, "
                    "or a hidden size heads divides"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        else:
            object.__setattr__(self, "head_dim", checked_count("head_dim", self.head_dim))

    @property
    def attention_width(self) -> int:
        """heads * head_dim: the width of Q, K and V (hidden, in GPT-2)."""
        return self.heads * int(self.head_dim or 0)

    def layer_parameters(self) -> int:
        """One block: two LayerNorms (weight and bias, 2h each), the fused QKV projection h -> 3A and
        the output projection A -> h, the MLP h -> f -> h, every linear layer with its bias:
        ``4hA + 3A + 2hf + f + 6h`` (``12h^2 + 13h`` with A = h, f = 4h)."""
        h, a, f = self.hidden, self.attention_width, int(self.ffn_hidden or 0)
        layer_norms = 2 * 2 * h
        attention = (h * 3 * a + 3 * a) + (a * h + h)
        mlp = (h * f + f) + (f * h + h)
        return layer_norms + attention + mlp

    def parameters(self) -> int:
        """All parameters, as ``sum(p.numel() for p in model.parameters())`` counts them: the token
        embedding (vocab * h), the learned positions (seq_len * h) if any, the blocks, the final
        LayerNorm (2h), and an output layer (vocab * h, no bias) only when not tied.
        GPT-2 small (12 layers, h = 768, 12 heads, 1,024 positions, vocab 50,257): 124,439,808."""
        h = self.hidden
        embeddings = self.vocab * h + (self.seq_len * h if self.learned_positions else 0)
        output = 0 if self.tied_embeddings else self.vocab * h
        return embeddings + self.layers * self.layer_parameters() + 2 * h + output

    def non_embedding_parameters(self) -> int:
        """Kaplan et al.'s N: everything but the token and position embeddings (and an untied output
        layer): the blocks and the final LayerNorm. 85,056,000 for GPT-2 small."""
        return self.layers * self.layer_parameters() + 2 * self.hidden


def training_flops_per_token(
    shape: TransformerShape, attention: bool = True, parameters: float | None = None
) -> float:
    """FLOPs to train on one token, forward and backward: ``6N``, plus ``12 * layers * A * seq_len`` for
    the attention scores with ``attention`` (Kaplan et al. 2020; PaLM appendix B writes it 6N + 12LHQT).

    A = heads * head_dim, which is hidden in GPT-2 but not always (PaLM 540B: 48 x 256 = 12,288 against
    a hidden size of 18,432). N is the parameters a token multiplies: all but the position embeddings
    and, untied, the input embedding (lookups, no FLOPs); the output layer is counted. Pass
    ``parameters`` to use a published N instead (PaLM 540B: 540.35e9). The scores are counted for the
    full s x s square, as PaLM counts them, although a causal mask needs only half.
    """
    checks.instance("shape", shape, TransformerShape, what="a TransformerShape")
    checks.flag("attention", attention)
    if parameters is None:
        n = float(shape.parameters())
        n -= shape.seq_len * shape.hidden if shape.learned_positions else 0
        n -= 0 if shape.tied_embeddings else shape.vocab * shape.hidden
    else:
        n = checked_positive("parameters", parameters)
    scores = 12 * shape.layers * shape.attention_width * shape.seq_len if attention else 0
    return 6 * n + scores


def model_flops_utilization(tokens_per_s: float, flops_per_token: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: the model FLOPs achieved per second (tokens per second times
    :func:`training_flops_per_token`) over the hardware's peak. Recomputed forwards do not count (that
    is hardware FLOPs utilisation)."""
    tokens = checked_non_negative("tokens_per_s", tokens_per_s)
    achieved = tokens * checked_non_negative("flops_per_token", flops_per_token)
    return achieved / checked_positive("peak_flops_per_s", peak_flops_per_s)


# --------------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------------

RECOMPUTE = ("none", "selective", "full")


def activation_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    bytes_per_element: int = 2,
) -> float:
    """Activation bytes one transformer layer keeps for its backward, per device (Korthikanti et al. 2022,
    Table 2). s = seq_len, b = micro_batch, h = hidden, a = heads, t = tensor_parallel:

    * no parallelism: ``sbh(34 + 5as/h)``;
    * tensor parallel: ``sbh(10 + 24/t + 5as/(ht))``: LayerNorm inputs, the inputs of the first linear
      layers and the dropout masks (10) are replicated on every tensor-parallel rank;
    * tensor + sequence parallel: ``sbh(34 + 5as/h) / t``, nothing replicated;
    * ``recompute="selective"``: the attention scores (the ``5as/h`` term) are recomputed, not kept;
    * ``recompute="full"``: only the layer's input, ``2sbh`` (its sequence shard, / t, with sequence
      parallel); the backward recomputes the rest one layer at a time (that layer's activations come
      on top at the peak).

    The numbers assume 16-bit activations and 1-byte dropout masks, as the paper does.
    ``bytes_per_element`` resizes the activations (4 for fp32); the masks stay 1 byte each.
    """
    s, b = checked_count("seq_len", seq_len), checked_count("micro_batch", micro_batch)
    h, a = checked_count("hidden", hidden), checked_count("heads", heads)
    t = checked_count("tensor_parallel", tensor_parallel)
    checks.flag("sequence_parallel", sequence_parallel)
    checks.choice("recompute", recompute, RECOMPUTE)
    e = checked_count("bytes_per_element", bytes_per_element)
    sbh = s * b * h
    if recompute == "full":
        return e * sbh / (t if sequence_parallel else 1)
    # Per sbh, the paper's 34 is 16 activations of 2 bytes + 2 one-byte masks; its 5as/h is the
    # scores and softmax output (2 bytes each) + their dropout mask (1 byte). 10 + 24/t splits the 34:
    # replicated, 4 activations (two LayerNorm inputs, the QKV and first MLP inputs) + 2 masks.
    scores = 0.0 if recompute == "selective" else (2 * e + 1) * a * s * s * b / t
    if sequence_parallel:
        return (16 * e + 2) * sbh / t + scores
    return (4 * e + 2) * sbh + 12 * e * sbh / t + scores

"""The shapes of the models a plan names, each from its published source, and their exact parameter counts.

Pure data (no torch): the notebook builds plans from these; the dry run (``distlab.rank.dryrun``) builds
the modules from the same fields, and a test holds the two counts together.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TypedDict, cast

__all__ = ["MODELS", "ModelConfig", "ModelJSON", "parameters"]


class ModelJSON(TypedDict):
    """A :class:`ModelConfig` as JSON (``ModelConfig.to_json()``): what the dry run builds the model from."""

    name: str
    architecture: str
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn_dim: int
    vocab: int
    max_seq_len: int
    tied_embeddings: bool


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer's shape.

    ``architecture``: "llama" (RMSNorm, grouped-query attention with RoPE, SwiGLU MLP of three
    matrices, no biases) or "gpt" (LayerNorm, multi-head attention, GELU MLP of two matrices, biases,
    learned positions: GPT-2/3 and Megatron-LM's GPT, and the notebooks' own model).
    """

    name: str
    architecture: str
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn_dim: int
    vocab: int
    max_seq_len: int
    tied_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def to_json(self) -> ModelJSON:
        return cast("ModelJSON", asdict(self))  # the fields are ModelJSON's, one for one


def _llama(name: str, dim: int, layers: int, heads: int, ffn: int) -> ModelConfig:
    # Llama 3 (Grattafiori et al. 2024, "The Llama 3 Herd of Models", table 3) and each model's
    # params.json: 8 KV heads, vocabulary 128,256, untied output head; 8,192 tokens of context
    # in pre-training (3.1 extends it to 131,072 afterwards).
    return ModelConfig(name, "llama", dim, layers, heads, 8, ffn, 128_256, 131_072, False)


def _gpt(name: str, dim: int, layers: int, heads: int, vocab: int, seq: int, tied: bool = True) -> ModelConfig:
    return ModelConfig(name, "gpt", dim, layers, heads, heads, 4 * dim, vocab, seq, tied)


MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        _llama("llama3-8b", 4096, 32, 32, 14_336),
        _llama("llama3-70b", 8192, 80, 64, 28_672),
        _llama("llama3-405b", 16_384, 126, 128, 53_248),
        # GPT-3 (Brown et al. 2020, table 2.1): d_model 12288, 96 layers, 96 heads, 2048 tokens;
        # GPT-2's BPE vocabulary of 50,257 and its tied input/output embedding.
        _gpt("gpt3-175b", 12_288, 96, 96, 50_257, 2048),
        # Megatron-LM 2021 (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
        # Clusters Using Megatron-LM", table 1): hidden, layers, heads; vocabulary 51,200, 2048 tokens.
        *(
            _gpt(f"megatron-{size}", h, layers, heads, 51_200, 2048)
            for size, h, layers, heads in (
                ("1.7b", 2304, 24, 24),
                ("3.6b", 3072, 30, 32),
                ("7.5b", 4096, 36, 32),
                ("18.4b", 6144, 40, 48),
                ("39.1b", 8192, 48, 64),
                ("76.1b", 10_240, 60, 80),
                ("145.6b", 12_288, 80, 96),
                ("310.1b", 16_384, 96, 128),
                ("529.6b", 20_480, 105, 128),
                ("1t", 25_600, 128, 160),
            )
        ),
        # The notebooks' own GPT (distlab/nn/gpt.py GPTConfig's defaults: 4 layers, 128 wide, 4 heads,
        # 64 positions, untied head) on the labs' character vocabulary (CharTokenizer(corpus()): 103).
        _gpt("distlab-gpt", 128, 4, 4, 103, 64, tied=False),
    )
}


def parameters(config: ModelConfig) -> int:
    """The exact number of parameters of the model the dry run builds from ``config``."""
    d, f, v = config.dim, config.ffn_dim, config.vocab
    kv = config.kv_heads * config.head_dim
    head = 0 if config.tied_embeddings else v * d
    if config.architecture == "llama":
        # wq, wk, wv, wo; w1, w2, w3; two RMSNorm weights
        block = d * d + 2 * d * kv + d * d + 3 * d * f + 2 * d
        return v * d + config.layers * block + d + head
    # q, k, v, out with biases; fc, proj with biases; two LayerNorms (weight and bias)
    block = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    return v * d + config.max_seq_len * d + config.layers * block + 2 * d + head

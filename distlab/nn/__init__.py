"""The model, text and measurements the modern-parallelism labs run on the ranks (imports torch).

``import distlab`` does not import this package: the notebook side never imports torch.

    from distlab.nn import GPT, GPTConfig, CharTokenizer, corpus, token_batches
    text = corpus()
    tok = CharTokenizer(text)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size))
    batches = token_batches(tok.encode(text), batch_size=8, seq_len=64, rank=rank, world_size=world_size)
    logits, loss = model(*batches[0])

    text        the corpus (Python's own reference documentation), a character tokenizer, batches per rank
    gpt         GPTConfig and GPT; tensor_parallel_plan and pipeline_stages, how it splits
    peak        peak_matmul_flops_per_s, the denominator of MFU
"""

from __future__ import annotations

from .gpt import GPT, GPTConfig, pipeline_stages, tensor_parallel_plan
from .peak import peak_matmul_flops_per_s
from .text import CharTokenizer, corpus, token_batches

__all__ = [
    "GPT",
    "CharTokenizer",
    "GPTConfig",
    "corpus",
    "peak_matmul_flops_per_s",
    "pipeline_stages",
    "tensor_parallel_plan",
    "token_batches",
]

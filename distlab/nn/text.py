"""Text to train on, characters as tokens, and batches of token windows for each rank.

The text is the Python reference documentation that CPython ships in ``pydoc_data.topics`` (what
``help("assert")`` prints): some 0.5-0.7 MB of English and code on every machine with Python, so a lab
downloads nothing. The same Python gives every rank the same text. Its characters are kept to
``ALPHABET``, so that every Python gives the same vocabulary (a model of the same size, the same
memory to the byte): 3.10 adds a backquote, 3.12 a dollar sign, and these few are dropped.

    text = corpus()
    tok = CharTokenizer(text)
    tokens = tok.encode(text)                        # LongTensor, one id per character
    batches = token_batches(tokens, batch_size=8, seq_len=64, rank=rank, world_size=world_size)
    inputs, targets = batches[step]                  # (8, 64) each; targets are inputs shifted by one
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .. import checks

__all__ = ["ALPHABET", "CharTokenizer", "TokenBatches", "corpus", "token_batches"]

#: The corpus's characters: those of Python 3.11's topics, every one of which each Python 3.10-3.13 has.
ALPHABET = frozenset(
    "\n !\"#%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_abcdefghijklmnopqrstuvwxyz{|}~"
    "\u00b0\u00df\u2013\u2014\u2018\u2019\u201c\u201d\u2026"  # degree, sharp s, dashes, quotes, ellipsis
)


def corpus() -> str:
    """The Python reference documentation's topics, in the order of their sorted names, as one text."""
    try:
        from pydoc_data.topics import topics
    except ImportError as error:  # some distributions split the standard library into packages
        raise RuntimeError(
            "the text corpus is Python's own pydoc_data.topics, which this Python lacks: install the full "
            "standard library (Debian: apt-get install libpython3-stdlib)"
        ) from error
    text = "\n\n".join(topics[name] for name in sorted(topics))
    return "".join(c for c in text if c in ALPHABET) if not ALPHABET.issuperset(text) else text


class CharTokenizer:
    """One token per distinct character of ``text``, numbered in sorted order (so the same text gives the
    same ids on every rank)."""

    def __init__(self, text: str) -> None:
        if not isinstance(text, str) or not text:
            raise ValueError(f"text must be a non-empty str to take the characters from (got {text!r:.40})")
        self.chars: list[str] = sorted(set(text))
        self._ids = {char: i for i, char in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """``text`` as a LongTensor of ids, shape (len(text),)."""
        try:
            return torch.tensor([self._ids[char] for char in text], dtype=torch.long)
        except KeyError as missing:
            raise ValueError(
                f"character {missing.args[0]!r} is not in this tokenizer's vocabulary: build the tokenizer from "
                "a text that contains it"
            ) from None

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """The text of a 1-d tensor or sequence of ids."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return "".join(self.chars[i] for i in ids)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


class TokenBatches:
    """Batches of (inputs, targets) windows of a token sequence; ``batches[step]``, or iterate (endless).

    The tokens are cut into windows of ``seq_len + 1`` tokens that do not overlap (the last token of a
    window is only a target). Each epoch visits every window once in an order drawn from ``seed`` and the
    epoch's number. A step takes the next ``batch_size * world_size`` windows of that order, the global
    batch, and rank ``r`` takes its ``r``-th slice of ``batch_size``: data parallelism, each rank its own
    windows. The global batch does not depend on ``world_size``'s split, so 2 ranks at batch 4 read
    together what 1 rank reads at batch 8.

    With ``world_size=1`` (the default) every caller reads the same batches, whatever its rank: what the
    ranks of one tensor-parallel or pipeline-parallel model need, since they all work on the same batch.

    ``device`` (a rank's ``device``): the batches are made there. The tokens go to it once, and each
    batch is gathered on it, so a GPU rank copies nothing per step; the order of the windows is drawn on
    the CPU, so the batches are the same on every device.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        batch_size: int,
        seq_len: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype != torch.long:
            raise ValueError("tokens must be a 1-d LongTensor of ids, like CharTokenizer(text).encode(text)")
        self.batch_size = checks.whole("batch_size", batch_size, minimum=1, example="batch_size=8")
        self.seq_len = checks.whole("seq_len", seq_len, minimum=1, example="seq_len=64")
        self.world_size = checks.whole("world_size", world_size, minimum=1, example="world_size=2")
        self.rank = checks.whole("rank", rank, example="rank=0")
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be below world_size={world_size} (got rank={rank})")
        self.seed = checks.whole("seed", seed, example="seed=0")
        self.windows = (len(tokens) - 1) // self.seq_len
        global_batch = self.batch_size * self.world_size
        self.steps_per_epoch = self.windows // global_batch  # the windows past the last full step wait an epoch
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{len(tokens)} tokens make {self.windows} windows of seq_len={seq_len}, fewer than one global batch "
                f"of batch_size*world_size={global_batch}: give more tokens or a smaller batch_size or seq_len"
            )
        # Window w is tokens[w*seq_len : (w+1)*seq_len + 1]: inputs its first seq_len, targets its last.
        try:
            self.device = torch.device(device) if device is not None else tokens.device
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"device must name a torch device, like device=device or 'cuda:0' (got {device!r})"
            ) from exc
        self._windows = tokens[: self.windows * self.seq_len + 1].to(self.device)
        self._offsets = torch.arange(self.seq_len + 1, device=self.device)
        self._order: tuple[int, torch.Tensor] | None = None

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            # Drawn on the CPU (the same order on every device), moved once an epoch, not every step.
            self._order = (epoch, torch.randperm(self.windows, generator=generator).to(self.device))
        return self._order[1]

    def __getitem__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, targets) at ``step``, each of shape (batch_size, seq_len)."""
        step = checks.whole("step", step, example="batches[0]")
        epoch, within = divmod(step, self.steps_per_epoch)
        first = (within * self.world_size + self.rank) * self.batch_size
        starts = self._epoch_order(epoch)[first : first + self.batch_size] * self.seq_len
        windows = self._windows[starts[:, None] + self._offsets]  # (batch, seq_len + 1)
        # Contiguous: a pipeline stage checks its inputs' strides against the first micro-batch's
        # (torch 2.11 refuses a view's (seq_len + 1, 1) strides where it expects (seq_len, 1)).
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every step from 0 on, epoch after epoch: stop it with ``zip(range(steps), batches)``."""
        step = 0
        while True:
            yield self[step]
            step += 1

    def __repr__(self) -> str:
        return (
            f"TokenBatches(batch_size={self.batch_size}, seq_len={self.seq_len}, rank={self.rank}, "
            f"world_size={self.world_size}, seed={self.seed}, steps_per_epoch={self.steps_per_epoch}, "
            f"device={str(self.device)!r})"
        )


def token_batches(
    tokens: torch.Tensor,
    batch_size: int,
    seq_len: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> TokenBatches:
    """This rank's batches of (inputs, targets), each (batch_size, seq_len), on ``device``: see :class:`TokenBatches`.

    Data parallelism: pass the rank and world size, and each rank reads its own windows. Tensor or
    pipeline parallelism: leave ``rank=0, world_size=1`` and every rank reads the same batches.
    """
    return TokenBatches(tokens, batch_size, seq_len, rank=rank, world_size=world_size, seed=seed, device=device)

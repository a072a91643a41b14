"""Grader of ``ring-allreduce``: the learner sums a tensor over the ranks, in place, from send/recv alone.

Every rank's input is made from the case's seed and the rank, so each rank can make all of them: the
reference is ``dist.all_reduce`` on a copy of this rank's input (run before the learner's call), and a
wrong result is explained by finding which ranks' inputs the wrong element adds up. During the
learner's call the collectives of ``torch.distributed`` are replaced by functions that record the call
and then make it, and ``send``/``isend`` by functions that count the bytes sent to each peer; the
originals are put back whatever happens. The last case of each world is large and also timed against
``dist.all_reduce``; its send count is compared with the ring's theory
(:func:`distlab.theory.ring_allreduce_sent_bytes`).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import ParamSpec, TypedDict, TypeVar

import torch
import torch.distributed as dist

from ...rank.exercise import Learner, Tolerance, failed, first_difference, passed
from ...rank.torchcompat_c10d import point_to_point_functions, replaced_point_to_point
from ...theory import ring_allreduce_sent_bytes

P = ParamSpec("P")
R = TypeVar("R")

# The collectives a learner could reach for instead of building the ring (those this torch has).
_COLLECTIVES = (
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "all_gather_object",
    "broadcast_object_list",
)
_SENDS = ("send", "isend")
# A solution this many times slower than dist.all_reduce on the same tensor is not a ring of whole chunks.
_ABSURDLY_SLOW = 20.0
_TIMED_REPEATS = 3


class Case(TypedDict):
    name: str
    shape: list[int]
    dtype: str  # a torch dtype's name: "float32"
    timed: bool
    seed: int


def cases(world_size: int, seed: int) -> list[Case]:
    rng = random.Random(seed * 1000 + world_size)
    n = world_size

    def not_divisible(count: int) -> int:
        return count + 1 if count % n == 0 else count

    def two_d() -> list[int]:
        rows, cols = rng.randrange(2, 9), rng.randrange(2, 9)
        rows += rows % n == 0
        while (rows * cols) % n == 0:  # ends: rows is not a multiple of n, and n <= 4
            cols += 1
        return [rows, cols]

    # The plain cases first: the first failure is the one a learner reads, and they explain it best.
    shapes = [
        ([not_divisible(n * rng.randrange(2, 40) + rng.randrange(1, n))], "int64"),
        (two_d(), "float32"),
        (two_d(), "float64"),
        ([n * rng.randrange(2, 6), rng.randrange(2, 6)], "int64"),  # divisible, for once
        ([1], "int64"),  # fewer elements than ranks: all but one chunk are empty
        ([rng.randrange(2, n)] if n > 2 else [3], "float32"),  # at 3 and 4 ranks: fewer elements than ranks
        ([not_divisible(rng.randrange(1_000_000, 1_500_000))], "float32"),  # timed
    ]
    out: list[Case] = []
    for index, (shape, dtype) in enumerate(shapes):
        timed = index == len(shapes) - 1
        elements = math.prod(shape)
        size = "x".join(map(str, shape)) if len(shape) > 1 else f"{elements:,} element{'s' if elements != 1 else ''}"
        name = f"{len(shape)}-D {size}, {dtype}" + (", timed" if timed else "")
        out.append({"name": name, "shape": shape, "dtype": dtype, "timed": timed, "seed": rng.randrange(2**31)})
    return out


def _input(case: Case, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input: the same on every rank that makes it."""
    gen = torch.Generator().manual_seed(case["seed"] + 7919 * rank)
    dtype = getattr(torch, case["dtype"])
    if dtype.is_floating_point:
        return torch.randn(case["shape"], generator=gen, dtype=dtype)
    # Wide enough that a sum of some ranks' values is almost never the sum of others'.
    return torch.randint(-(10**6), 10**6, case["shape"], generator=gen, dtype=dtype)


class _Watch:
    """Records the collectives called and counts the bytes sent to each peer, while :meth:`watching`."""

    def __init__(self) -> None:
        self.collectives: list[str] = []
        self.sent: dict[object, int] = {}  # by peer, as the learner named it
        self._depth = 0  # dist.send may call isend: count only the outermost call

    @property
    def sent_bytes(self) -> int:
        return sum(self.sent.values())

    @contextmanager
    def watching(self) -> Iterator[None]:
        # The sends counted where torch looks them up itself too: batch_isend_irecv checks a P2POp's op
        # against distributed_c10d's own isend, and dist.send calls that isend.
        counted = {name: self._counted(real) for name, real in point_to_point_functions(_SENDS).items()}
        saved: list[tuple[str, object]] = []
        try:
            for name in _COLLECTIVES:
                real = getattr(dist, name, None)
                if real is not None:
                    saved.append((name, real))
                    setattr(dist, name, self._recorded(name, real))
            with replaced_point_to_point(counted):
                yield
        finally:
            for name, real in reversed(saved):
                setattr(dist, name, real)

    def _recorded(self, name: str, real: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(real)
        def recorded(*args: P.args, **kwargs: P.kwargs) -> R:
            self.collectives.append(name)
            return real(*args, **kwargs)

        return recorded

    def _counted(self, real: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(real)  # keeps the name: P2POp tells sends from receives by it
        def counted(tensor: torch.Tensor, *args: object, **kwargs: object) -> R:
            if self._depth == 0:
                peer = args[0] if args else kwargs.get("dst", kwargs.get("group_dst"))
                self.sent[peer] = self.sent.get(peer, 0) + tensor.numel() * tensor.element_size()
            self._depth += 1
            try:
                return real(tensor, *args, **kwargs)
            finally:
                self._depth -= 1

        return counted


def grade(case: Case, learner: Learner) -> Mapping[str, object]:
    world, me = dist.get_world_size(), dist.get_rank()
    inputs = [_input(case, r) for r in range(world)]
    reference = inputs[me].clone()
    dist.all_reduce(reference)  # before the learner's call, on every rank, whatever they do

    tensor = inputs[me].clone()
    watch = _Watch()
    with watch.watching():
        returned = learner["ring_all_reduce"](tensor)

    sent, elements = watch.sent_bytes, tensor.numel()
    size_bytes = elements * tensor.element_size()
    theory = ring_allreduce_sent_bytes(size_bytes, world)
    measured: dict[str, float] = {"sent_bytes": sent, "theory_bytes": theory}
    mistake = (
        _collectives_used(watch)
        or _wrong_result(tensor, returned, reference, inputs, me, one_phase=sent <= _one_phase_bytes(tensor, world))
        or _too_many_bytes(watch, elements, tensor.element_size(), world, theory)
        or (_too_few_bytes(sent, theory) if case["timed"] else None)
    )

    note = ""
    if case["timed"]:
        # Every rank agrees whether to time (a collective every rank makes), so none waits alone.
        all_right = torch.tensor([0 if mistake else 1])
        dist.all_reduce(all_right, op=dist.ReduceOp.MIN)
        if all_right.item():
            mine = _median_s(lambda x: learner["ring_all_reduce"](x), inputs[me])
            torch_s = _median_s(dist.all_reduce, inputs[me])
            slowest = torch.tensor([mine, torch_s], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the slowest rank's times: the same on every rank
            mine, torch_s = slowest.tolist()
            ratio = mine / torch_s
            measured.update(ring_s=mine, all_reduce_s=torch_s, ratio=ratio)
            note = (
                f"ring {mine:.3g} s, dist.all_reduce {torch_s:.3g} s ({ratio:.2g}x); "
                f"sent {sent:,} bytes, theory 2(N-1)/N x {size_bytes:,} = {theory:,.0f}"
            )
            if ratio > _ABSURDLY_SLOW:
                mistake = (
                    f"{ratio:.0f} times slower than dist.all_reduce ({mine:.3g} s against {torch_s:.3g} s) on "
                    f"{elements:,} float32 elements: send each chunk as one tensor, not element by element, "
                    "and do not copy the whole tensor at every step"
                )
    if mistake:
        return failed(mistake, **measured)
    return passed(note, **measured)


# ---------------------------------------------------------------------------- the mistakes, in words


def _collectives_used(watch: _Watch) -> str | None:
    if not watch.collectives:
        return None
    names = ", ".join(f"dist.{name}" for name in dict.fromkeys(watch.collectives))
    return f"used {names}: build it from send/recv (isend/irecv) alone"


def _tolerance(dtype: torch.dtype) -> Tolerance:
    # The ring adds in another order than gloo does: equal within rounding, exactly for integers.
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    if dtype == torch.float64:
        return {"rtol": 1e-12, "atol": 1e-12}
    return {}


def _wrong_result(
    tensor: torch.Tensor,
    returned: object,
    reference: torch.Tensor,
    inputs: list[torch.Tensor],
    me: int,
    *,
    one_phase: bool,
) -> str | None:
    tol = _tolerance(reference.dtype)
    where = first_difference(tensor, reference, **tol)
    if where is None:
        return None
    if not isinstance(tensor, torch.Tensor) or tensor.shape != reference.shape or tensor.dtype != reference.dtype:
        return f"the tensor changed its shape or dtype: {where}"
    if torch.equal(tensor, inputs[me]):
        if isinstance(returned, torch.Tensor) and first_difference(returned, reference, **tol) is None:
            return (
                "it returns the sum but leaves `tensor` unchanged: sum in place, into `tensor` "
                "(work on views of it, or copy the result back with tensor.copy_(...))"
            )
        few = (
            " (with fewer elements than ranks, they all lie in one chunk: is that chunk's index off by one?)"
            if tensor.numel() < len(inputs)
            else ""
        )
        return f"`tensor` is unchanged, this rank's own input: no sum was written into it, in place{few}"
    world = len(inputs)
    if first_difference(tensor, reference * world, **tol) is None:
        return (
            f"the result is {world} times the sum: every value was added once per rank; in the all-gather "
            "phase copy what arrives, do not add it"
        )
    return f"{_explain(tensor, inputs, me, tol, one_phase)}: {where}"


def _explain(tensor: torch.Tensor, inputs: list[torch.Tensor], me: int, tol: Tolerance, one_phase: bool) -> str:
    """What the first wrong element is made of (which ranks' inputs it adds up), and the likely mistake."""
    world = len(inputs)
    got = tensor.reshape(-1)
    xs = [x.reshape(-1) for x in inputs]
    total = sum(xs[1:], xs[0])
    wrong = ~_close(got, total, tol)
    first = int(wrong.nonzero()[0])
    value = got[first]
    mixes = sorted(itertools.product((0, 1, 2), repeat=world), key=lambda c: (sum(c), max(c), c))
    mix = next((c for c in mixes if _close(value, _mixed(c, xs, first), tol)), None)
    ranks = [r for r in range(world) if mix and mix[r]]
    if mix is None:
        return "a wrong element is no sum of the ranks' inputs (received into the wrong place, or a wrong dtype?)"
    if sum(mix) == 0:
        return "a wrong element is 0: that part of the tensor was never received into (a chunk index off by one?)"
    if max(mix) == 2:
        twice = ", ".join(str(r) for r in range(world) if mix[r] == 2)
        return (
            f"a wrong element adds rank {twice}'s value twice: a chunk was added into twice; in the all-gather "
            "phase copy what arrives, do not add it"
        )
    if len(ranks) == 1:
        single = torch.zeros_like(wrong)
        for x in xs:
            single |= _close(got, x, tol)
        if bool(single[wrong].all()):
            # The bytes sent tell the two apart: a missing phase sends half a ring's bytes.
            if one_phase:
                return (
                    "every wrong element is one rank's own value, never a sum, and this rank sent only one "
                    "phase's bytes: the reduce-scatter phase is missing"
                )
            return (
                "every wrong element is one rank's own value, never a sum: the all-gather passes on chunks that "
                "were not fully reduced: an off-by-one in its chunk index (it must start from the chunk this "
                "rank finished reducing, (rank + 1) % N), a reduce-scatter a step short, or one that copies what "
                "it receives instead of adding it"
            )
        whose = "this rank's own value" if ranks[0] == me else f"rank {ranks[0]}'s value alone"
        return (
            f"a wrong element holds {whose}, not the sum: its chunk was never reduced (an off-by-one in a chunk index?)"
        )
    return (
        f"a wrong element is the sum of ranks {', '.join(map(str, ranks))} only, a chunk only partly reduced: an "
        "off-by-one in a chunk index or a step too few, or one phase turning the ring the other way (the "
        "all-gather must start from the chunk this rank finished reducing, (rank + 1) % N)"
    )


def _mixed(counts: tuple[int, ...], xs: list[torch.Tensor], index: int) -> torch.Tensor:
    """Element ``index`` of the sum of ``counts[r]`` times rank r's input (summed as sum() would, without its 0)."""
    return functools.reduce(operator.add, (k * x[index] for k, x in zip(counts, xs)))


def _close(a: torch.Tensor, b: torch.Tensor, tol: Tolerance) -> torch.Tensor:
    if a.is_floating_point():
        return torch.isclose(a, b, **tol)
    return a == b


def _one_phase_bytes(tensor: torch.Tensor, world: int) -> int:
    """The most one ring phase (N-1 chunks) sends, whichever way the chunks are cut (see _too_many_bytes)."""
    elements = tensor.numel()
    return max((world - 1) * -(-elements // world), elements - elements // world) * tensor.element_size()


def _too_many_bytes(watch: _Watch, elements: int, element_size: int, world: int, theory: float) -> str | None:
    # A ring sends N-1 chunks in each phase. Chunks of ceil(n/N) (or a tensor padded to a multiple of N)
    # give 2(N-1) ceil(n/N); a last chunk that takes the remainder gives at most 2(n - n//N).
    most = 2 * max((world - 1) * -(-elements // world), elements - elements // world) * element_size
    sent = watch.sent_bytes
    if sent <= most:
        return None
    whole = elements * element_size
    counts = f"this rank sent {sent:,} bytes of a {whole:,}-byte tensor; a ring sends 2(N-1)/N of it, {theory:,.0f}"
    peers = [peer for peer, count in watch.sent.items() if count >= whole]
    if len(peers) >= world - 1 and len(watch.sent) >= world - 1:
        return f"it sends the whole tensor to every rank: that is not a ring ({counts})"
    if sent >= (world - 1) * whole:
        return (
            f"it sends the whole tensor {sent // whole} times: cut it into N chunks and pass one chunk per step "
            f"({counts})"
        )
    return f"it sends more than a ring does: each rank should send 2(N-1) chunks of about 1/N of the tensor ({counts})"


def _too_few_bytes(sent: int, theory: float) -> str | None:
    # Whatever the algorithm, every rank must send at least (N-1)/N of the tensor, half of the ring's count.
    if sent >= theory / 2:
        return None
    return (
        f"this rank sent only {sent:,} bytes, less than any all-reduce from send/recv must (theory for the ring: "
        f"{theory:,.0f}): was a collective called under another name? Build it from send/recv"
    )


def _median_s(function: Callable[[torch.Tensor], object], data: torch.Tensor) -> float:
    """Median seconds of ``function`` on a fresh copy of ``data``, between barriers, after one warm-up."""
    times = []
    for attempt in range(_TIMED_REPEATS + 1):
        x = data.clone()
        dist.barrier()
        start = time.perf_counter()
        function(x)
        dist.barrier()
        if attempt:
            times.append(time.perf_counter() - start)
    return statistics.median(times)

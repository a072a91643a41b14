from ..model import Exercise

EXERCISE = Exercise(
    name="tensor-parallel-mlp",
    title="A tensor-parallel MLP by hand",
    lesson="14b-dtensor-tensor-parallel.ipynb",
    task="""\
Tensor parallelism splits one layer's weights over the ranks. Megatron-LM splits the MLP
`y = gelu(x @ w1.T + b1) @ w2.T + b2` (`w1`: `[hidden, d]`, `w2`: `[d, hidden]`) so that it needs one
all-reduce in forward and one in backward:

* the first layer **column-parallel**: with `k = hidden // world_size`, rank `r` keeps rows
  `r*k : (r+1)*k` of `w1` and of `b1`, the weights of *its* `k` hidden features, and computes them
  from the whole input; GELU works on each feature alone, so it needs nothing from other ranks;
* the second layer **row-parallel**: rank `r` keeps columns `r*k : (r+1)*k` of `w2`, the ones that
  multiply its hidden features. Its product is a partial sum of the output: an all-reduce adds the
  ranks' partial sums (Megatron's **g**), and `b2`, kept whole on every rank, is added once, after it;
* in backward, each rank's gradient of `x` is only its own hidden features' part: the input goes
  through Megatron's **f**, the identity in forward and an all-reduce of the gradient in backward.
  g's backward is the identity: every rank already holds the whole gradient of the output.

Write `class TPMLP(torch.nn.Module)`:

* `__init__(self, w1, b1, w2, b2)` receives the FULL weights (the same on every rank) and keeps only
  this rank's shards, as parameters named `self.w1` (`[k, d]`), `self.b1` (`[k]`), `self.w2`
  (`[d, k]`) and `self.b2` (`[d]`, whole), in the weights' dtype;
* `forward(self, x)` takes `x` of shape `[..., d]`, the same on every rank, and returns `y`, of
  shape `[..., d]`, whole and the same on every rank. Use `torch.nn.functional.gelu` (its default,
  exact form). The all-reduces must live in autograd Functions (`torch.autograd.Function`), so that
  backward makes its own.

The grader draws full weights, an input and a gradient of the output, and runs your forward and
`y.backward(grad)` on every rank, in worlds of 2 and 4 ranks; `hidden` is always a multiple of the
world size, `d` is anything. The output and `x.grad` must equal the unsplit MLP's (one process),
each shard's gradient the matching slice of the unsplit gradients (equal within float rounding), and
`dist.all_reduce` must be called exactly once in forward and once in backward.""",
    starter="""\
%%ddp
class TPMLP(torch.nn.Module):
    def __init__(self, w1, b1, w2, b2):
        super().__init__()
        k = w1.shape[0] // world_size
        # Keep this rank's shards as torch.nn.Parameter: self.w1, self.b1, self.w2, self.b2.
        ...

    def forward(self, x):
        # x is whole on every rank; return y, whole on every rank.
        ...
""",
    hints=(
        (
            "Draw it for 2 ranks: `x @ w1.T` with `w1`'s rows split gives each rank a slice of the hidden "
            "layer; `hidden_slice @ w2_slice.T` with `w2`'s columns split gives each rank a full-size output "
            "that is a partial sum. Only that needs an all-reduce; add `b2` after it."
        ),
        (
            "An autograd Function has `forward(ctx, ...)` and `backward(ctx, grad)`, both `@staticmethod`, "
            "and is called as `MyFunction.apply(t)`. Write two: g sums over the ranks in forward and returns "
            "the gradient unchanged in backward; f returns `x` unchanged in forward and sums the gradient in "
            "backward."
        ),
        (
            "`dist.all_reduce` writes in place: all-reduce a `.clone()` and return it, in both Functions. "
            "f's forward can return `x.view_as(x)`."
        ),
        (
            "Put each Function where the ranks' views of the activations change: where a tensor every rank holds "
            "whole meets a layer split over the ranks, and where partial results must become one. Anything every "
            "rank would add into a sum counts once per rank."
        ),
    ),
    defines=("TPMLP",),
    world_sizes=(2, 4),
    case_timeout_s=30.0,
)

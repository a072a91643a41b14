from ..model import Exercise

EXERCISE = Exercise(
    name="clip-sharded-gradients",
    title="Clip gradients that FSDP2 shards",
    lesson="19-two-tiers-hsdp.ipynb",
    task="""\
Gradient clipping scales the whole gradient down when its norm is above a bound: with `norm` the
square root of the sum of the squares of every element of every parameter's gradient, each gradient
is multiplied by `max_norm / (norm + 1e-6)` if that is below 1, and left alone otherwise
(`torch.nn.utils.clip_grad_norm_`). Under FSDP2 no rank holds the whole gradient: after backward
each parameter's `.grad` is a DTensor, and `p.grad.to_local()` is this rank's shard of it (a view:
scaling it in place scales the gradient).

Write `clip_grad_norm(model, max_norm)` for a model `fully_shard`-ed over all the ranks: compute the
norm of the **whole** gradient from this rank's shards and one all-reduce of a single number (do not
gather the gradients: that would bring the whole model's gradient to every rank, which is what
FSDP2 is there to avoid), clip every shard in place when the norm is above `max_norm`, and return the
norm as a Python number, the same on every rank. Parameters whose `.grad` is `None` (frozen ones)
count for nothing and stay `None`.

The grader shards small MLPs over worlds of 2 and 3 ranks (3 ranks shard some layers unevenly),
backpropagates each rank's own batch, and sets `max_norm` below the norm in some cases and above it
in others. Your returned norm must be the whole gradient's on every rank (within 1e-4 relative), and
the gradients afterwards, gathered, those clipping gives (within float32 rounding).""",
    starter="""\
%%ddp
def clip_grad_norm(model, max_norm):
    # Each p.grad is a DTensor: p.grad.to_local() is this rank's shard of it.
    # 1. the sum of the squares of this rank's shards
    # 2. the sum over the ranks, then its square root: the whole gradient's norm
    # 3. if the norm is above max_norm, scale every shard in place
    ...
""",
    hints=(
        "`g.pow(2).sum()` over the local shards gives this rank's part of the squared norm; in float64 it "
        "adds up without rounding trouble.",
        "Norms do not add across shards; their squares do. `dist.all_reduce` of the one-number tensor "
        "sums the squares over the ranks, then `.sqrt()`.",
        "Only scale when `max_norm / (norm + 1e-6)` is below 1, and scale the local shards in place "
        "(`g.mul_(scale)`): the gradient is the DTensor whose shard that is.",
    ),
    defines=("clip_grad_norm",),
    world_sizes=(2, 3),
    case_timeout_s=30.0,
)

from ..model import Exercise

EXERCISE = Exercise(
    name="zero-1",
    title="ZeRO-1: shard Adam's state over the ranks",
    lesson="06-memory-sharding.ipynb",
    task="""\
Under DDP every rank keeps the whole of Adam's state, `exp_avg` and `exp_avg_sq`: 8 bytes per fp32
parameter, on every rank, the same numbers everywhere. **ZeRO stage 1** keeps each rank's share only:
flatten all parameters into one vector, cut it into N equal shards (N = world size), and let rank r
keep the state of shard r and update shard r alone. A step is then:

1. **reduce-scatter** the gradients: rank r receives the sum over the ranks of shard r of the
   flattened gradient; divide by N for the mean;
2. **Adam on the shard**: update this rank's `exp_avg`, `exp_avg_sq` and its shard of the parameters;
3. **all-gather** the updated shards, so every rank's parameters are whole and equal again.

Write `class Zero1Adam` with `__init__(self, params, lr)` (`params`: an iterable of parameters, as
`model.parameters()`) and `step(self)`, which reads each rank's own `p.grad` and updates every `p` in
place. Use Adam's defaults: betas (0.9, 0.999), eps 1e-8, no weight decay, with bias correction:
`p -= lr * m_hat / (sqrt(v_hat) + eps)`, `m_hat = exp_avg / (1 - beta1**t)`,
`v_hat = exp_avg_sq / (1 - beta2**t)`, t the number of steps taken, this one included.

On gloo (torch 2.13, measured here), `dist.reduce_scatter_single(output, input)` and
`dist.all_gather_single(output, input)` both work (their older names, `reduce_scatter_tensor` and
`all_gather_into_tensor`, work too but warn that they are deprecated; torch before 2.13 has only
those), and both need equal shards:
`input` of reduce-scatter and `output` of all-gather hold N times the shard. When N does not divide
the number of parameters, pad the flattened vector with zeros to `N * ceil(numel / N)`
(`dist.all_gather` with shards of different sizes fails on gloo).

Grading, in worlds of 2, 3 and 4 ranks, with parameter counts N does not divide: after each of 3 to 5
steps the parameters must equal `torch.optim.Adam`'s on one process fed the mean gradient, within
float32 rounding (some cases make the gradients about 1e-7, where eps makes Adam see whether they were
averaged). After the last step the bytes of the tensors your optimizer object holds (its attributes,
walked; the model's parameters and gradients not counted) are measured against theory,
`2 * 4 * numel / N`: holding as much as full Adam state fails. Keep temporary full-size buffers local
to `step()`.""",
    starter="""\
%%ddp
import math


class Zero1Adam:
    def __init__(self, params, lr):
        self.params = list(params)
        self.lr = lr
        # This rank's shard of the flattened parameters: its size (padded so N divides it), where it
        # starts, and Adam's state for it alone.
        ...

    def step(self):
        # 1. reduce-scatter the flattened gradients (then divide by world_size)
        # 2. Adam on this rank's shard
        # 3. all-gather the updated shards into every p
        ...
""",
    hints=(
        (
            "shard = math.ceil(numel / world_size); rank r owns the flat elements [r * shard, (r + 1) * shard). "
            "`exp_avg` and `exp_avg_sq` are `torch.zeros(shard)`: that is the whole saving."
        ),
        (
            "Flatten with `torch.cat([p.grad.reshape(-1) for p in params])` into a zero tensor of "
            "`shard * world_size` elements; `dist.reduce_scatter_single(grad_shard, padded)` then gives this "
            "rank the sum of its shard."
        ),
        (
            "Adam's bias correction needs the step number, starting at 1 and counted once per `step()`, not once "
            "per parameter. After a shard's update every rank needs the whole parameters again: an all-gather of "
            "the shards, copied back into each parameter where autograd does not see it."
        ),
    ),
    defines=("Zero1Adam",),
    world_sizes=(2, 3, 4),
    case_timeout_s=30.0,
)

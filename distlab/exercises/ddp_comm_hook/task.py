from ..model import Exercise

EXERCISE = Exercise(
    name="ddp-comm-hook",
    title="DDP's averaging as a communication hook",
    lesson="22-compile-ddp-fsdp2.ipynb",
    task="""\
DDP puts the gradients in **buckets** (flat buffers of about `bucket_cap_mb` each, filled in the
order backward produces them) and all-reduces each bucket as soon as it is full, while backward goes
on. What it does with a bucket is a **communication hook**: `model.register_comm_hook(state, hook)`
replaces the default, and torch's compressed (fp16, PowerSGD) hooks plug in there. The compiled
DDP of this lesson keeps the same buckets and the same hook; only the graph is cut around them.

Write `mean_hook(state, bucket)`, the default behaviour: `bucket.buffer()` is the bucket's flat
gradient tensor on this rank; the hook must start averaging it over the ranks **without waiting**
(DDP's backward goes on while it runs) and return a `torch.futures.Future` whose value is the
averaged tensor, which DDP waits for at the end of backward and copies back into the parameters'
`.grad`. `state` is what was registered with the hook (`None` here).

The grader registers your hook on DDP models cut into several buckets (small `bucket_cap_mb`), in
worlds of 2 and 3 ranks, runs a backward on each rank's own batch, and compares every gradient with
DDP's own default (within float rounding); it also counts the buckets your hook was called for.""",
    starter="""\
%%ddp
def mean_hook(state, bucket):
    tensor = bucket.buffer()
    # start the all-reduce without waiting (async_op=True), and return a future of the mean
    ...
""",
    hints=(
        "`dist.all_reduce(tensor, async_op=True)` returns a work object at once; `work.get_future()` is "
        "a Future that completes when the all-reduce has.",
        "A future's value here is a list holding the reduced tensor: `fut.value()[0]`.",
        "The mean is the sum over the world size: divide the bucket in place, before or after the "
        "all-reduce, and chain the future with `then` so that DDP gets the tensor.",
    ),
    defines=("mean_hook",),
    world_sizes=(2, 3),
    case_timeout_s=30.0,
)

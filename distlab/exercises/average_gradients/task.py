from ..model import Exercise

EXERCISE = Exercise(
    name="average-gradients",
    title="Average gradients by hand",
    lesson="01-data-parallelism.ipynb",
    task="""\
Data parallelism keeps one copy of the model on every rank and gives each rank its own slice of the
batch. After `loss.backward()` each rank holds the gradient of *its* loss; before the optimizer steps,
every rank must hold the **mean** of the ranks' gradients, so that all copies take the same step and
stay equal. That is what `DistributedDataParallel` does for you.

Write `average_gradients(model)`: after backward, make every parameter's `.grad` hold its mean over
all ranks, **in place**: the tensor backward put in `.grad` stays there and is changed, as DDP's
buckets change it; a new tensor assigned to `.grad` would leave anything holding the old one (an
optimizer, a hook) with this rank's own gradient. Parameters that do not require a gradient have
`.grad = None`: leave them so.

The grader builds models on every rank in worlds of 2 and 3 ranks, feeds each rank its own batch,
calls your function and compares the gradients with DDP's on the same model and batch (equal within
float rounding); each `.grad` must still be the tensor backward made, in the same memory.""",
    starter="""\
%%ddp
def average_gradients(model):
    # Each rank has its own gradients in p.grad; make every rank's p.grad the mean over the ranks.
    for p in model.parameters():
        ...
""",
    hints=(
        "`dist.all_reduce(tensor)` sums `tensor` over all ranks, in place, on every rank.",
        (
            "The mean is the sum divided by `dist.get_world_size()`, divided in place: Python's augmented "
            "operators write into a tensor, while `x / n` makes a new one."
        ),
        "Skip parameters whose `.grad` is `None` (frozen ones).",
    ),
    defines=("average_gradients",),
    world_sizes=(2, 3),
    case_timeout_s=30.0,
)

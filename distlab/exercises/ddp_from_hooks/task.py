from ..model import Exercise

EXERCISE = Exercise(
    name="ddp-from-hooks",
    title="DDP from hooks: buckets and all-reduce overlapping backward",
    lesson="03-collectives-cost.ipynb",
    task="""\
Averaging the gradients after `loss.backward()` leaves the network idle during backward and the
processors idle during the all-reduce. `DistributedDataParallel` overlaps the two: a gradient is
final as soon as backward has accumulated it, so DDP groups gradients into **buckets** in the order
they become ready (last layers first) and starts all-reducing a bucket, asynchronously, as soon as
it is full, while backward goes on computing the earlier layers.

Write `class HookDDP` with:

* `__init__(self, model, bucket_cap_bytes)`: register, once, a hook on every parameter that requires
  a gradient (`p.register_post_accumulate_grad_hook(hook)` calls `hook(p)` once `p.grad` is final).
  As gradients become ready, add them to the current bucket; once the bucket holds at least
  `bucket_cap_bytes` bytes of gradients, launch its all-reduce with `async_op=True` and start a new
  bucket.
* `finish(self)`: called after `loss.backward()`; launch the last, partly filled bucket, wait for
  every pending all-reduce, and leave every `p.grad` equal to the **mean** of the ranks' gradients.
  Parameters that do not require a gradient keep `.grad = None`.

The same `HookDDP` serves every step: the grader runs 2 or 3 steps (forward with `model(x)` itself,
`loss.backward()`, `finish()`, an optimizer step, gradients zeroed, to None or in place).

Grading, in worlds of 2 and 3 ranks: after every step the gradients must equal DDP's on the same
model and batches, within float rounding, with a cap smaller than any parameter (one bucket per
parameter), a cap of about a third of the model, and a cap larger than the model (one bucket).
While your code runs, the grader watches the gradients become ready and `dist.all_reduce` be called:
the all-reduces launched during backward and in `finish()`, the bucket count, and the share of the
gradient bytes launched while backward still had gradients to compute (beside DDP's buckets' share)
are shown beside each case. A case fails if everything is launched in `finish()` when the cap makes
several buckets (no overlap), if a full bucket is left waiting while backward goes on to the next
gradient (launch it from the hook that fills it), if an all-reduce during backward is synchronous
or waited on before backward returns (`wait()`, its future's, a barrier: it blocks backward), if
gradients are reduced more than once a step, or if the cap is ignored where it would group several
gradients (one all-reduce per parameter, or one for everything).""",
    starter="""\
%%ddp
class HookDDP:
    def __init__(self, model, bucket_cap_bytes):
        # Register a hook on every parameter that requires a gradient: it adds p to the current bucket
        # and launches the bucket's all-reduce (async_op=True) once it holds bucket_cap_bytes.
        ...

    def finish(self):
        # After loss.backward(): launch the last bucket, wait for every all-reduce, and leave in
        # every p.grad the mean over the ranks.
        ...
""",
    hints=(
        (
            "`p.register_post_accumulate_grad_hook(self._ready)` calls `self._ready(p)` during backward, once "
            "`p.grad` is final. A parameter with `requires_grad=False` cannot take a hook: skip it."
        ),
        (
            "A bucket is a list of parameters and a byte count (`p.grad.numel() * p.grad.element_size()`). "
            "When it is full, flatten its gradients into one tensor with `torch.cat([p.grad.reshape(-1) ...])`."
        ),
        (
            "An async all-reduce hands back a request before the sum is done: until something waits on that "
            "request, the tensor it reduces must stay alive and untouched, and what it holds is not yet the sum. "
            "Whatever the hooks gather during one step must be gone before the next step's backward begins."
        ),
    ),
    defines=("HookDDP",),
    world_sizes=(2, 3),
    case_timeout_s=30.0,
)

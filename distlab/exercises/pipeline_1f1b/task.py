from ..model import Exercise

EXERCISE = Exercise(
    name="pipeline-1f1b",
    title="A 1F1B pipeline schedule for two stages",
    lesson="16-pipeline-schedules.ipynb",
    task="""\
Pipeline parallelism puts the first layers of a model on rank 0 (stage 0) and the rest on rank 1
(stage 1), and splits the batch into `m` micro-batches so that both stages can work at once. Stage 0
sends each micro-batch's activation forward; stage 1 computes the loss, runs backward and sends the
gradient of that activation back, with which stage 0 runs its own backward.

**1F1B** orders each stage's work so that few micro-batches are in flight (forward done, backward not
yet): a few warm-up forwards, then one forward and one backward in turn, then the backwards left.
With 2 stages:

* stage 0: `F0 F1 B0 F2 B1 F3 B2 ... B(m-1)` (2 forwards, then a backward and a forward in turn);
* stage 1: `F0 B0 F1 B1 ... F(m-1) B(m-1)`.

GPipe runs all `m` forwards first and so keeps all `m` micro-batches' activations; 1F1B keeps at most
2 on stage 0. The idle time (the bubble) is the same, `(p-1)/(m+p-1)` of the step.

Write `one_f_one_b(stage, micro_batches, targets, loss_fn, activation_shape)`, called on both ranks:

* `stage`: a `torch.nn.Module`, this rank's half of the model (float32), its `.grad`s all `None`;
* `micro_batches`: on rank 0, a list of `m >= 2` input tensors; `None` on rank 1;
* `targets`: on rank 1, the list of the `m` matching targets; `None` on rank 0;
* `loss_fn(output, target)`: the loss of one micro-batch, a 0-d tensor (mean squared error);
* `activation_shape`: the shape of the activation stage 0 sends for one micro-batch (its output), the
  same for every micro-batch, float32: what rank 1 receives into, and rank 0 receives the gradient into.

Run the step in 1F1B order with `dist.send` / `dist.recv` (or `isend` / `irecv`) between the ranks,
calling `stage(...)` once per micro-batch for its forward and `backward` once per micro-batch. The
step's loss is the **mean** of the micro-batches' losses: afterwards the gradients in each stage's
parameters are those of that mean (accumulated over the micro-batches). Rank 1 returns the mean loss
(a number); rank 0's return value is ignored.

The grader runs your function on 2 ranks with 2 to 8 micro-batches and compares each stage's
gradients with those of the whole model in one process (equal within float rounding); it records the
order of each stage's forwards, backwards and messages and checks the forwards and backwards come in
1F1B's order. From both stages' orders it lays the step out (a forward one unit of time, a backward
two, messages free) and grades its idle share against theory's bubble, `(p-1)/(m+p-1)`, which 1F1B
reaches exactly: a stage that sends a tensor later than it could keeps the other waiting, and fails.
The timed case also shows the share of the step each stage was not computing, by the clock (not
graded): on 2 CPU ranks a message costs about as much as a micro-batch's small compute, and a busy
machine adds its own waits (notebook 16 makes compute dominate to show the bubble's shape).""",
    starter="""\
%%ddp
def one_f_one_b(stage, micro_batches, targets, loss_fn, activation_shape):
    if rank == 0:
        m = len(micro_batches)
        # warm-up forwards, then a backward and a forward in turn, then the backwards left
        ...
        return None
    m = len(targets)
    # for each micro-batch: receive the activation, forward, loss, backward, send the gradient back
    ...
    return ...  # the mean loss
""",
    hints=(
        (
            "Stage 0 keeps each micro-batch's output until its backward: `out.backward(grad)`, with `grad` "
            "received from stage 1, sends the gradient through stage 0 and accumulates it into the parameters."
        ),
        (
            "On stage 1 the received tensor is a leaf that autograd knows nothing about: call "
            "`x.requires_grad_()` before the forward, and after `loss.backward()` send `x.grad` to stage 0. "
            "Divide each loss by `m` before its backward: the gradients then add up to those of the mean."
        ),
        (
            "Keep the messages in the same order on both sides: stage 0 sends activation i and later "
            "receives gradient i into `torch.empty(activation_shape)`; stage 1 receives activation i, then "
            "sends gradient i. `dist.isend` lets a stage go on computing while its message travels (keep the "
            "tensor and the request, and `.wait()` for the requests before returning)."
        ),
        (
            "1F1B is a bound on memory: stage 0 never holds more micro-batches in flight than there are stages "
            "from it to the last. Within that bound, neither stage should wait for a tensor the other could "
            "already have sent: the messages' places in your loops decide the bubble as much as the order of "
            "the forwards and backwards."
        ),
    ),
    defines=("one_f_one_b",),
    world_sizes=(2,),
    case_timeout_s=30.0,
)

from ..model import Exercise

EXERCISE = Exercise(
    name="parameter-server",
    title="A synchronous parameter server from send and recv",
    lesson="04-sync-async.ipynb",
    task="""\
A **parameter server** keeps the model's parameters in one place. Each step, the workers compute
gradients and push them to the server; the server averages them, takes the optimizer step and sends
the new parameters back to every worker. In the synchronous version the server waits for *every*
worker before it steps, so all workers always hold the same parameters.

Write `parameter_server_step(params, grads, lr)`, called on every rank with lists of tensors of the
same shapes and dtype on every rank:

- **rank 0 is the server**; ranks `1 .. N-1` are the workers (N is the world size, at least 2).
- Each worker sends its `grads` to rank 0 with `dist.send`; rank 0 receives them with `dist.recv`.
- Rank 0 averages the **workers'** gradients: the sum over the N-1 workers divided by N-1. Rank 0
  computes no gradient of its own: its `grads` are zeros, passed only so that every rank makes the
  same call; leave them out.
- Rank 0 applies plain SGD to its `params`, `p -= lr * mean_grad`, and sends the new parameters to
  every worker.
- When the call returns, every rank's `params` hold the server's new values, updated **in place**
  (the tensors in the list, as a model's parameters are: `p.copy_(...)`, or `dist.recv` straight
  into `p`). Workers do not step on their own.

On entry every rank's `params` hold the server's current values (as the previous step left them).
Use only `dist.send` and `dist.recv` (or `isend` / `irecv`): no collectives.

The grader runs three steps on tensors of random shapes (scalars included), float32 and float64, with
random learning rates, in worlds of 2, 3 and 4 ranks, and compares every rank's params after each step
with a reference step made with collectives (`all_gather` of the gradients, then the SGD step with the
workers' mean), within float rounding. A case that does not return within its deadline (a deadlock:
every rank waiting in `recv`) is stopped and named. Beside each case: the time of one step and the
bytes the server receives per step (it grows with the number of workers, unlike a ring all-reduce).""",
    starter="""\
%%ddp
def parameter_server_step(params, grads, lr):
    if rank == 0:
        # the server: receive every worker's gradients, average, step, send the params back
        ...
    else:
        # a worker: send the gradients, receive the new params into params
        ...
""",
    hints=(
        (
            "Every `dist.send(t, dst=j)` on one rank needs a `dist.recv(buf, src=i)` of the same shape and dtype "
            "on the other, and the order must let both reach it: if everyone receives first, no one sends."
        ),
        (
            "On rank 0: for each worker, `dist.recv` each gradient into a buffer and add it to a running sum; "
            "then divide by `world_size - 1` (the workers, not the world)."
        ),
        (
            "A synchronous server steps only once every worker's gradients are in, and each side must reach its "
            "sends and receives in the order the other expects them. Where a received tensor lands matters too: "
            "the model must see its new parameters without being rebuilt."
        ),
    ),
    defines=("parameter_server_step",),
    world_sizes=(2, 3, 4),
    case_timeout_s=30.0,
)

from ..model import Exercise

EXERCISE = Exercise(
    name="ring-allreduce",
    title="Ring all-reduce from send and recv",
    lesson="03-collectives-cost.ipynb",
    task="""\
`dist.all_reduce(tensor)` leaves on every rank the sum of every rank's `tensor`. gloo does it on a
**ring** (notebooks 03 and 12 measure its bytes against the ring's), as NCCL does for large tensors
(it switches to trees for some sizes): each rank sends only to its right neighbour,
`(rank + 1) % world_size`, and receives only from its left, `(rank - 1) % world_size`. The tensor is
cut into `world_size` chunks, and the all-reduce runs in two phases of `world_size - 1` steps each:

1. **Reduce-scatter**: at every step each rank sends one chunk to the right and adds the chunk it
   receives from the left into its own copy of that chunk. After `world_size - 1` steps each rank
   holds the full sum of one chunk, a different one on every rank.
2. **All-gather**: the finished chunks travel around the ring once more; each rank copies the chunk it
   receives into place (no adding now).

Each rank then has sent `2 (N-1)/N` times the tensor, whatever the number of ranks `N`: that is why
the ring is the bandwidth-optimal all-reduce.

Write `ring_all_reduce(tensor)`: sum `tensor` over all ranks, **in place**, as `dist.all_reduce`
does, using only point-to-point calls (`dist.send`, `dist.recv`, `dist.isend`, `dist.irecv`,
`dist.batch_isend_irecv`); no collectives. The tensor is contiguous, of any shape, and its number
of elements need not be divisible by the world size: it may even be smaller (1 element on 4 ranks).

The grader runs your function on every rank in worlds of 2, 3 and 4 ranks, on 1-D and 2-D tensors
of int64 (must be exact), float32 and float64 (within rounding), and compares the result with
`dist.all_reduce` on a copy of the same input. It also counts the bytes each rank sends (a ring
sends about `2 (N-1)/N` of the tensor: sending the whole tensor to every rank is not a ring), fails
any call of a collective, and times one large float32 tensor per world size against
`dist.all_reduce` and the theory (`distlab.theory.ring_allreduce_sent_bytes`).""",
    starter="""\
%%ddp
def ring_all_reduce(tensor):
    # Sum `tensor` over all ranks, in place, with send/recv only: reduce-scatter, then all-gather.
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    chunks = ...  # world_size views of tensor.view(-1)
    ...
""",
    hints=(
        (
            "`tensor.view(-1).tensor_split(world_size)` gives `world_size` views of the tensor (sizes differ by "
            "at most one element; some are empty when the tensor is smaller than the world): write into a view "
            "and you write into `tensor`."
        ),
        (
            "If every rank first calls a blocking `dist.recv`, nobody ever sends: a deadlock. Start the send with "
            "`request = dist.isend(chunk, right)`, then `dist.recv(buffer, left)`, then `request.wait()`."
        ),
        (
            "Reduce-scatter: at step `s` (0 to N-2) send chunk `(rank - s) % N` and receive into a buffer the left "
            "rank's chunk `(rank - s - 1) % N`, then add the buffer into that chunk. At the end this rank holds the "
            "full sum of chunk `(rank + 1) % N`."
        ),
        (
            "After the reduce-scatter each rank holds one finished chunk, and the all-gather only spreads the "
            "finished chunks around the same ring. Ask what a rank must do with a chunk that arrives already "
            "summed: that is the one thing the second phase does differently."
        ),
    ),
    defines=("ring_all_reduce",),
    world_sizes=(2, 3, 4),
    case_timeout_s=30.0,
)

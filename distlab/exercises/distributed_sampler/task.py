from ..model import Exercise

EXERCISE = Exercise(
    name="distributed-sampler",
    title="A sampler that shards the data over the ranks",
    lesson="02-data-loading.ipynb",
    task="""\
In data parallelism every rank must see its **own** part of the data set each epoch: together the
ranks see every sample, no rank sees another's, and every rank takes the same number of steps (a
rank with one batch more would wait forever in DDP's all-reduce). `DistributedSampler` does this;
here you build it.

Define a class `ShardSampler(dataset_len, num_replicas, rank, shuffle=True, seed=0)`, a sampler of
the indices `0 .. dataset_len - 1`, with:

- `__iter__()`: this rank's indices, as Python ints. With `shuffle=True`, shuffle all the indices
  with a permutation that is the **same on every rank** for a given `seed` and epoch (and differs
  from epoch to epoch), then give each rank its own slice of it. With `shuffle=False`, keep them in
  order and split them either *strided* (rank `r` gets `r, r + N, r + 2N, ...`: what torch does) or
  *contiguous* (rank `r` gets the `r`-th block).
- Every rank gets exactly `ceil(dataset_len / num_replicas)` indices: when the length does not
  divide, pad the list before splitting by repeating indices **from its start** (more than once if the
  data set is smaller than the world). So the only indices that appear twice are the
  `N * ceil(dataset_len / N) - dataset_len` padding ones.
- `__len__()`: the number of indices `__iter__` yields on this rank.
- `set_epoch(epoch)`: the epoch the next `__iter__` shuffles for; before any call it is epoch 0.

The split must depend only on the arguments and the epoch: not on the process's own rank (use the
`rank` argument) nor on the global random state.

The grader builds your sampler on every rank of worlds of 2, 3 and 4 ranks, with data sets divisible
by the world size, not divisible, smaller than it and large, gathers every rank's indices and checks:
equal lengths of `ceil(len / N)`, `len(sampler)`, indices in range, every index covered with repeats
only in the padding, the ordered split for `shuffle=False`, a new order after `set_epoch(1)` and
for another seed, and the same order when `set_epoch(0)` is called again. It also builds the sampler
of every rank on every rank, to see that they agree. Whether your split is exactly torch's is shown
beside each case (`same_as_torch`), not required.""",
    starter="""\
%%ddp
import math


class ShardSampler:
    def __init__(self, dataset_len, num_replicas, rank, shuffle=True, seed=0):
        ...

    def set_epoch(self, epoch):
        ...

    def __iter__(self):
        # This rank's indices: shuffle (the same way on every rank), pad, then take this rank's slice.
        ...

    def __len__(self):
        ...
""",
    hints=(
        (
            "Every rank gets `math.ceil(dataset_len / num_replicas)` indices; the list to split has that many "
            "times `num_replicas`, the padding included."
        ),
        (
            "For the shuffle, make a `torch.Generator()`, seed it with `seed + epoch` (never with the rank) and "
            "draw `torch.randperm(dataset_len, generator=g).tolist()`: every rank then gets the same permutation."
        ),
        (
            "Two properties decide the rest: every rank gets the same number of indices (so the padding reuses "
            "indices the list already has, never new ones), and the ranks' shares never overlap and together "
            "cover the list. torch's `DistributedSampler.__iter__` is short: read it to see how it deals the "
            "list out."
        ),
    ),
    defines=("ShardSampler",),
    world_sizes=(2, 3, 4),
    case_timeout_s=30.0,
)

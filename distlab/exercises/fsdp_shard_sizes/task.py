from ..model import Exercise

EXERCISE = Exercise(
    name="fsdp-shard-sizes",
    title="What each rank holds under FSDP2",
    lesson="23-at-scale.ipynb",
    task="""\
Planning a run starts with memory, and memory starts with what each rank holds of the model. FSDP2
(`fully_shard`) splits every parameter along its first dimension (its rows) over the ranks as
`torch.chunk` does: chunks of `ceil(rows / world_size)` rows, rank 0 first, until the rows run out.
So the later ranks may hold fewer rows than the others, or none at all, and a rank's shard is not
`rows / world_size`. Each rank then allocates its shard padded to the full chunk, so that every
rank's buffer is the same size (an all-gather needs equal inputs): that padded size is what a rank's
memory pays, on every rank.

Write two functions:

- `shard_rows(rows, world_size, rank)`: how many of a parameter's `rows` the shard of rank `rank`
  holds (what `p.to_local().shape[0]` shows there);
- `shard_bytes(shapes, world_size)`: the bytes each rank allocates for float32 parameters of these
  `shapes` (a list of tuples; a 1-D parameter's rows are its length), padding included.

The grader makes parameters of random shapes (some with fewer rows than ranks, some that leave the
last ranks empty), shards them with `fully_shard` over 3 and 4 ranks, and compares your numbers with
each rank's shards: their rows, and the bytes of the storage behind them. At scale the same rule
gives notebook 23's embedding: 128,256 rows over 1,024 ranks are chunks of 126 rows, and the last
six ranks hold none of them.""",
    starter="""\
%%ddp
import math


def shard_rows(rows, world_size, rank):
    # chunks of ceil(rows / world_size) rows, rank 0 first, until the rows run out
    ...


def shard_bytes(shapes, world_size):
    # per parameter: its chunk of rows (padded: the same on every rank) times a row's elements, 4 bytes each
    ...
""",
    hints=(
        "With `chunk = math.ceil(rows / world_size)`, rank `r`'s rows start at `r * chunk`: it holds "
        "`chunk` rows if there are that many left, what is left if fewer, and none past the end.",
        "`torch.chunk(torch.arange(rows), world_size)` on one process shows the split; it may give fewer "
        "than `world_size` chunks.",
        "A row of a parameter shaped `(rows, a, b)` has `a * b` elements (`math.prod(shape[1:])`, 1 for a "
        "1-D parameter); the padded shard is `chunk` of them on every rank, float32 is 4 bytes.",
    ),
    defines=("shard_rows", "shard_bytes"),
    world_sizes=(3, 4),
    case_timeout_s=30.0,
)

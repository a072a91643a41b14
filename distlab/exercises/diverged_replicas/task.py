from ..model import Exercise

EXERCISE = Exercise(
    name="diverged-replicas",
    title="Find the replicas that diverged",
    lesson="18-debugging.ipynb",
    task="""\
Data parallelism keeps a replica of every parameter on every rank, and they must stay equal bit for
bit: a rank that skipped an all-reduce, loaded another checkpoint or ran a kernel that is not
deterministic leaves its replica apart, and training goes on without an error. The check is cheap if
each rank sends a **fingerprint** of each parameter, a few bytes, rather than the parameter.

Write `diverged(model)`: return the sorted list of the names (as `model.named_parameters()` gives
them) of the parameters whose values are not the same, bit for bit, on every rank; the same list on
every rank, `[]` when all agree.

A fingerprint must see every bit and where it is: the grader changes one element by one unit in its
last place (`torch.nextafter`), swaps two elements (the sum and the norm stay as they were), and
changes parameters on some ranks and not others, in float32 and float64 models, in worlds of 2 and 3
ranks.""",
    starter="""\
%%ddp
def diverged(model):
    # 1. a fingerprint of each parameter on this rank (a few bytes, that sees every bit and its place)
    # 2. every rank's fingerprints on every rank
    # 3. the names whose fingerprints are not all equal, sorted
    ...
""",
    hints=(
        "`zlib.crc32(t.numpy().tobytes())` fingerprints a CPU tensor's bytes: one number per parameter.",
        "`dist.all_gather` of a tensor of this rank's fingerprints gives every rank everyone's, one tensor per rank.",
        "Stack the gathered tensors into a table, one row per rank: a parameter diverged when its column "
        "holds more than one value.",
    ),
    defines=("diverged",),
    world_sizes=(2, 3),
    case_timeout_s=30.0,
)

from ..model import Exercise

EXERCISE = Exercise(
    name="atomic-checkpoint",
    title="A checkpoint save that survives a SIGKILL",
    lesson="09-fault-tolerance.ipynb",
    task="""\
A long run resumes from its last checkpoint after a failure, so the checkpoint must be whole however
the writer died. A process killed by `SIGKILL` (out of memory, a preempted machine) stops between two
instructions, with no exception and no clean-up: if it was writing straight onto the checkpoint's
name, it leaves half a file there, and the run has nothing to resume from.

Write two functions:

- `save_checkpoint(state, path)`: `state` is a dict of tensors and numbers. Write it so that at
  **every instant** `path` holds either the previous complete checkpoint or the new complete one,
  never part of one. Write to a temporary file **in the same folder** as `path` (the same
  filesystem, where a rename is atomic), `flush` it, `os.fsync` it, then `os.replace` it onto
  `path`. Fsyncing the folder after the rename is optional: it makes the rename itself survive a
  power loss.
- `load_checkpoint(path)`: return the state saved at `path`, exactly (dtypes, shapes, values,
  numbers). A missing or broken file must **raise**, not return something empty.

Both run on one rank alone: no collectives. The grader runs on every rank of a world of 2, each
rank in a fresh temporary folder of its own:

1. it saves and loads a state of every dtype, with a 0-d and an empty tensor and numbers, in the
   rank's own process, and loads a torn file (half of a checkpoint) and a missing one, which must raise;
2. it starts a process of its own (the same Python; there `rank`, `world_size` and `torch` are set,
   but there is no process group) that saves two states of a few MB in turn, again and again, and
   kills it with `SIGKILL` at random moments, 5 times per case; after each kill it loads `path`
   with your `load_checkpoint`, which must give exactly one of the two states. In that process
   `os.replace`, `os.rename` and `os.fsync` are watched, so that a mistake a kill happens to miss is
   still named: `path` written in place, a temporary file in another folder, a rename before the file
   was complete, no fsync, temporary files that pile up.""",
    starter="""\
%%ddp
import os
import tempfile

def save_checkpoint(state, path):
    # Never write onto `path` itself: a temporary file next to it, flushed and fsync'ed, then renamed.
    ...

def load_checkpoint(path):
    ...
""",
    hints=(
        (
            "`torch.save(state, path)` opens `path` and truncates it first: a kill before it finishes leaves a "
            "torn file under the checkpoint's name. Write somewhere else, then move it in one step."
        ),
        (
            "`os.replace(temp, path)` is atomic when both are on one filesystem: make the temporary file in "
            "`os.path.dirname(path)`, e.g. `tempfile.mkstemp(dir=os.path.dirname(path))`, not in /tmp."
        ),
        (
            "Before the rename the bytes must be in the file: `torch.save(state, f)`, `f.flush()` (Python's "
            "buffer to the OS), `os.fsync(f.fileno())` (the OS's cache to the disk), and only then "
            "`os.replace(temp, path)`."
        ),
        (
            "Three steps, in order: a temporary file next to the checkpoint, its bytes forced to the disk, one "
            "rename over the checkpoint's name. Loading then needs no error handling: the name always holds a "
            "whole checkpoint."
        ),
    ),
    defines=("save_checkpoint", "load_checkpoint"),
    world_sizes=(2,),
    case_timeout_s=60.0,
)

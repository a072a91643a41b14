"""A deep stage's dry run read from two shallow ones (``distlab.rank.dryrun_depth``).

The arithmetic on a made-up step whose largest segment at depth 40 is one that is not the largest
at depth 4 or 5 (fast); then real dry runs of small plans, each stage run whole and from two shallow
runs, equal to the byte, the call and the FLOP (cluster: each starts the dry run's processes).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from distlab import scale
from distlab.rank.dryrun_depth import SHALLOW, Measured, extrapolate, position


def _step(n: int, *, kink: int = 0) -> Measured:
    """A stage of n alike blocks: each holds 10 bytes of states and saves 7 in forward, its sharded
    gradient (2) kept through backward; the first block holds 3 more (an all-gather not prefetched),
    the last forward segment 40 more (the head's logits); the optimizer's step 20 a block. ``kink``
    bends a middle block's segments (blocks that are not alike)."""
    base = 100 + 10 * n
    segments = {"forward/start": base, "optimizer/start": 100 + 20 * n, "backward/start": base + 7 * n + 1}
    for j in range(n):
        bent = kink * (j == 2)
        segments[f"forward/{position(j, n)}"] = base + 7 * (j + 1) + 3 * (j == 0) + 40 * (j == n - 1) + bent
        segments[f"backward/{position(j, n)}"] = base + 7 * j + 2 * (n - 1 - j) + 5 + bent
    memory = {"parameters": 4 * n + 2, "gradients": 4 * n + 2, "optimizer": 6 * n + 5, "activations": 0,
              "peak": max(segments.values()), "saved": 7 * n}
    collectives = [{"op": "all_gather", "dim": "dp_shard", "group_size": 8, "bytes": 64,
                    "calls_per_micro_batch": n + 1, "phase": "forward"}]
    return {"memory": memory, "collectives": collectives, "flops": 1000 * n + 17, "recomputed": 300 * n, "fp8": 600 * n,
            "attention": 100 * n, "streamed": 5000 * n + 3, "fused": 900 * n + 1, "dtensor_ops": 160 * n + 12,
            "segments": segments}


def test_a_peak_that_moves_from_forward_to_the_end_of_backward_is_read_at_its_depth():
    shallow, deeper, whole = _step(SHALLOW), _step(SHALLOW + 1), _step(40)
    at = extrapolate(shallow, deeper, 40)
    assert at is not None
    # at 4 and 5 blocks the step's peak is the last block's forward (the head's logits); at 40 it is
    # the optimizer's step: a line through the two shallow peaks would miss it
    assert max(shallow["segments"], key=shallow["segments"].__getitem__) == "forward/last"
    assert max(deeper["segments"], key=deeper["segments"].__getitem__) == "forward/last"
    assert max(whole["segments"], key=whole["segments"].__getitem__) == "optimizer/start"
    line = shallow["memory"]["peak"] + (40 - SHALLOW) * (deeper["memory"]["peak"] - shallow["memory"]["peak"])
    assert line < whole["memory"]["peak"] == at["memory"]["peak"]
    assert at["memory"]["parameters"] == 162 and at["memory"]["saved"] == 280
    forward_backward = max(v for k, v in whole["segments"].items() if not k.startswith("optimizer"))
    assert at["memory"]["activations"] == forward_backward - (162 + 245)  # less the parameters and states
    assert at["collectives"][0]["calls_per_micro_batch"] == 41
    assert (at["flops"], at["recomputed"], at["fp8"], at["attention"], at["streamed"], at["fused"],
            at["dtensor_ops"]) == (40_017, 12_000, 24_000, 4_000, 200_003, 36_001, 6_412)


def test_blocks_that_are_not_alike_or_runs_that_differ_are_run_whole():
    assert extrapolate(_step(SHALLOW), _step(SHALLOW + 1, kink=1), 40) is None  # a middle block off the line
    other = _step(SHALLOW + 1)
    other["collectives"][0]["bytes"] = 128  # a collective the shallower run did not see
    assert extrapolate(_step(SHALLOW), other, 40) is None


_BOTH_WAYS = """
import json, sys
from distlab.rank import dryrun, dryrun_depth
plan = json.loads(sys.argv[1])
dryrun.DEEP = dryrun_depth.SHALLOW + 2  # stages of 10 blocks read from runs of 4 and 5
read = dryrun.dry_run(plan)
dryrun.DEEP = 10**9  # every stage run whole
whole = dryrun.dry_run(plan)
print(json.dumps([read["kinds"], whole["kinds"]]))
"""


@pytest.mark.cluster
@pytest.mark.parametrize("plan", [
    # pp (two kinds of stage), tp with sequence parallelism, HSDP, full checkpointing
    scale.Plan(model=scale.ModelConfig("ten-a-stage", "llama", 64, 20, 4, 2, 128, 512, 256, False), gpus=16, pp=2,
               tp=2, dp="hsdp", shard=2, seq_len=32, global_batch_tokens=32 * 4 * 2, checkpointing="full",
               sequence_parallel=True),
    # one stage, DDP (FSDP2's replicate-only units), selective checkpointing, GPT's block
    scale.Plan(model=scale.ModelConfig("ten-blocks", "gpt", 64, 10, 4, 4, 256, 512, 256, False), gpus=4, dp="ddp",
               seq_len=32, global_batch_tokens=32 * 4, checkpointing="selective"),
], ids=["pp-tp-sp-hsdp-full", "ddp-selective-gpt"])
def test_a_stage_read_from_two_shallow_runs_is_the_stage_run_whole(plan):
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", _BOTH_WAYS, json.dumps(plan.to_json())],
                          capture_output=True, text=True, timeout=600, check=True)
    read, whole = json.loads(done.stdout)
    assert len(read) == len(whole) >= 1
    for a, b in zip(read, whole, strict=True):
        assert a == b, a["name"]

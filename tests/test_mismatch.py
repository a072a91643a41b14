"""What a lab started with torch's collective check says first, on the torch releases it cannot serve."""

from __future__ import annotations

from distlab.notebook.mismatch import checked_start_note


def test_the_check_on_gloo_names_ddp_only_on_a_torch_whose_cpu_build_crashes_it():
    said = checked_start_note("gloo", "2.13.0+cpu")
    assert "torch 2.13.0+cpu crashes a rank that builds a DDP model" in said and "\n" not in said
    assert "without --debug" in said
    assert checked_start_note("nccl", "2.13.0") == ""  # NCCL's check is another code path, not measured
    assert checked_start_note("gloo", "2.11.0") == checked_start_note("gloo", None) == ""


def test_a_branch_where_one_rank_all_reduces_and_the_other_waits_in_a_barrier_is_one_line_naming_both():
    from distlab.errors import RankFailure
    from distlab.notebook.mismatch import mismatch_note

    # torch 2.13's words (gloo, TORCH_DISTRIBUTED_DEBUG=DETAIL): a barrier's fingerprint has no
    # tensor and no comma before its op.
    said = "Detected mismatch between collectives on ranks. Rank {} is running collective: {}, but Rank {} is ..."
    reduce_ = "CollectiveFingerPrint(SequenceNumber=1, OpType=ALLREDUCE, TensorShape=[1], TensorDtypes=Float, " \
              "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu))"
    barrier = "CollectiveFingerPrint(SequenceNumber=1OpType=BARRIER)"
    failures = {
        0: RankFailure(0, "RuntimeError", said.format(0, reduce_, 1),
                       'File "<rank 0 cell>", line 3, in <module>\n    dist.all_reduce(loss)\n'),
        1: RankFailure(1, "RuntimeError", said.format(1, barrier, 0),
                       'File "<rank 1 cell>", line 4, in <module>\n    dist.barrier()\n'),
    }
    assert mismatch_note(failures) == (
        "collective #2 of its group: the ranks disagree on its op, caught before it ran (torch's check, debug=True): "
        "rank 0: all_reduce of float32[1] at line 3 (dist.all_reduce(loss)); rank 1: barrier at line 4 (dist.barrier())"
    )

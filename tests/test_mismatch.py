"""What a lab started with torch's collective check says first, on the torch releases it cannot serve."""

from __future__ import annotations

from distlab.notebook.mismatch import checked_start_note


def test_the_check_on_gloo_names_ddp_only_on_a_torch_whose_cpu_build_crashes_it():
    said = checked_start_note("gloo", "2.13.0+cpu")
    assert "torch 2.13.0+cpu crashes a rank that builds a DDP model" in said and "\n" not in said
    assert "without --debug" in said
    assert checked_start_note("nccl", "2.13.0") == ""  # NCCL's check is another code path, not measured
    assert checked_start_note("gloo", "2.11.0") == checked_start_note("gloo", None) == ""

"""The link's bandwidth as the dashboard prints and plots it: significant digits, in a unit that fits."""

from __future__ import annotations

from distlab.byte_text import rate
from distlab.dashboard import analysis
from distlab.records import StepRecord


def _records(bandwidth: float, latency_s: float = 1e-4) -> list[StepRecord]:
    """Two ranks' steps whose all-reduces took what the ring model says over 2 ranks: T = S / B + 2a, one
    latency for the reduce-scatter's step and one for the all-gather's (``latency_s`` is the 2a)."""
    sizes = [4096 * 4**i for i in range(5)]  # 4 KB to 1 MB
    return [
        {"rank": rank, "step": step, "t": float(step), "epoch": None, "loss": None, "metrics": {},
         "step_time_s": 1.0, "compute_s": 0.5, "comm_s": 0.5, "idle_s": None,
         "allreduce": [{"bucket": 0, "bytes": size, "seconds": size / bandwidth + latency_s, "start_s": 0.1}],
         "grad_norm": {}, "weight_norm": {}, "update_ratio": {}, "checksum": None, "layer_checksums": None}
        for step, size in enumerate(sizes) for rank in (0, 1)
    ]


def test_rates_are_printed_with_three_significant_digits_in_the_unit_that_fits():
    assert rate(1.234e9) == "1.23 GB/s"
    assert rate(4.56e7) == "45.6 MB/s"
    assert rate(789e3) == "789 KB/s"
    assert rate(12.0) == "12.0 B/s"
    assert rate(999.7e6) == "1.00 GB/s"  # rounded before the unit is chosen
    assert rate(2.5e12) == "2.50 TB/s"
    assert rate(0.0).startswith("no rate") and "no transfer was timed" in rate(0.0)


def test_a_slow_link_is_summarised_in_mb_per_s_not_as_zero_gb_per_s():
    # A gloo link of 2.5 MB/s (emulated nodes, a loaded machine): 0.0025 GB/s printed as "0.00 GB/s" before.
    records = _records(bandwidth=2.5e6)
    link = analysis.link_model(records, world_size=2)
    assert link.fit is not None and abs(link.fit.bandwidth_bytes_per_s - 2.5e6) < 1e3
    assert link.message.endswith("bandwidth 2.50 MB/s"), link.message
    assert link.unit == ("MB/s", 1e6)  # the plots' axis: measured points of about 2.5, not 0.0025
    summary = analysis.summary(records, {}, world_size=2)
    assert any("bandwidth 2.50 MB/s" in line for line in summary), summary
    assert not any("0.00 GB/s" in line for line in summary)


def test_a_fast_link_is_still_summarised_in_gb_per_s():
    link = analysis.link_model(_records(bandwidth=12e9, latency_s=2e-5), world_size=2)
    assert link.message.endswith("bandwidth 12.0 GB/s"), link.message
    assert link.unit == ("GB/s", 1e9)


def test_a_link_with_nothing_timed_says_why_it_has_no_bandwidth():
    assert analysis.link_model([], world_size=2).message == "busbw: no all-reduce timed yet"

"""The lab's process guard: the watchdog's list of process groups is written safely."""

from __future__ import annotations

import os

from distlab.cluster.processes import ProcessGuard


def _guard_writing_to(path: str) -> ProcessGuard:
    guard = ProcessGuard()
    guard._pgid_file = path  # as watch() sets it, without starting the watchdog
    guard._helpers = {1: {4242}, 2: {4343}}  # engine pid -> its helpers' groups
    return guard


def test_the_pgid_list_never_follows_a_link_planted_at_a_predictable_name(tmp_path):
    pgid_file = str(tmp_path / "distlab-abc.pgids")
    victim = tmp_path / "victim"
    victim.write_text("someone else's file")
    # Another user of a shared /tmp could guess "<pgid file>.tmp" and plant a link there.
    os.symlink(victim, pgid_file + ".tmp")

    _guard_writing_to(pgid_file).update()

    assert victim.read_text() == "someone else's file"
    assert os.path.islink(pgid_file + ".tmp")
    assert not os.path.islink(pgid_file)
    with open(pgid_file) as f:
        assert f.read().split() == ["4242", "4343"]


def test_the_pgid_list_is_private_to_its_owner_and_leaves_no_temporary_file(tmp_path):
    pgid_file = str(tmp_path / "distlab-abc.pgids")
    _guard_writing_to(pgid_file).update()

    assert os.stat(pgid_file).st_mode & 0o777 == 0o600
    assert sorted(os.listdir(tmp_path)) == ["distlab-abc.pgids"]

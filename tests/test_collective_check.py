"""torch's check of each collective across ranks (``debug=True``), said as distlab says a hang: a
collective the ranks disagree on stops the cell at once, one line naming each rank's call and line."""

from __future__ import annotations

import re
import time
from importlib import metadata

import pytest

import distlab
from distlab.errors import RankError

pytestmark = pytest.mark.cluster

ONE = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"


def test_a_shape_two_ranks_disagree_on_is_named_at_the_call_not_found_at_the_deadline():
    with distlab.start(ranks=2, debug=True, timeout=60) as lab:
        # The start says what the check cannot take on this torch (its CPU build crashes DDP under it).
        crashes = metadata.version("torch").startswith("2.13.")
        assert ("crashes a rank that builds a DDP model" in lab.note) is crashes, lab.note
        t0 = time.monotonic()
        with pytest.raises(RankError) as info:
            lab.run("t = torch.ones(rank + 1)\ndist.all_reduce(t)\n", stream=False)
        assert time.monotonic() - t0 < lab.timeout / 2  # generous: a hang would take the whole timeout
        note = info.value.notes[0]
        assert re.fullmatch(
            r"collective #\d+ of its group: the ranks disagree on its shape, caught before it ran \(torch's check, "
            r"debug=True\): rank 0: all_reduce of float32\[1\] at line 2 \(dist.all_reduce\(t\)\); "
            r"rank 1: all_reduce of float32\[2\] at line 2 \(dist.all_reduce\(t\)\)", note), note
        assert dict(lab.run(ONE, stream=False)) == {0: 2.0, 1: 2.0}  # the world goes on


def test_a_dtype_the_ranks_of_a_mesh_dimension_disagree_on_is_named_for_every_rank():
    cell = (
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))\n"
        "t = torch.ones(3, dtype=torch.float32 if rank % 2 == 0 else torch.float64)\n"
        "dist.all_reduce(t, group=mesh['tp'].get_group())\n"
    )
    with distlab.start(ranks=4, debug=True, timeout=60) as lab:
        with pytest.raises(RankError) as info:
            lab.run(cell, stream=False)
        note = info.value.notes[0]
        call = r"dist.all_reduce\(t, group=mesh\['tp'\].get_group\(\)\)"
        assert re.fullmatch(
            r"collective #\d+ of its group: the ranks disagree on its dtype, .*: "
            rf"rank 0,2: all_reduce of float32\[3\] at line 4 \({call}\); "
            rf"rank 1,3: all_reduce of float64\[3\] at line 4 \({call}\)", note), note
        assert dict(lab.run(ONE, stream=False)) == dict.fromkeys(range(4), 4.0)

"""The lint a cell gets before it runs: collectives only some ranks reach, named with their line.

Fast: only syntax trees, nothing runs. The notebooks' own cells are the corpus of correct code (their
planted faults are the only findings), and each kind of fault is planted below in the shapes it
takes in training code.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from distlab.notebook.cell_lint import CellLinter, lint

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def said(source: str) -> list[str]:
    return [str(finding) for finding in lint(textwrap.dedent(source))]


def test_every_notebook_cell_on_the_ranks_passes_but_the_faults_the_lessons_plant():
    findings = {}
    cells = 0
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        linter = CellLinter()
        for cell in json.loads(path.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] != "code":
                continue
            if source.startswith("%%ddp"):
                cells += 1
                body = source.partition("\n")[2]
                for finding in linter.check(body):
                    findings[path.stem, body.splitlines()[finding.line - 1].strip()] = finding.message
            elif "%dist start" in source or "%dist restart" in source:
                linter.forget()
    assert cells > 100
    assert set(findings) == {
        # 10: the deadlock behind a rank-conditional; 17: a wrong answer the grader is shown failing;
        # 18: validation on rank 0 only, of a model fully_shard sharded two cells before.
        ("10-pitfalls", "dist.all_reduce(t)            # only rank 0 gets here: it waits for rank 1 forever"),
        ("17-exercises", "dist.recv(p.grad, src=1 - rank)"),
        ("18-debugging", "val = mlp(torch.randn(8, 16, device=device)).square().mean()"),
    }, findings


@pytest.mark.parametrize("source, expected", [
    ("""
     t = torch.ones(1)
     if rank == 0:
         dist.all_reduce(t)
     """, "line 4: dist.all_reduce is called only where 'rank == 0' is true (line 3)"),
    ("""
     if dist.get_rank() != 0:
         pass
     else:
         dist.barrier()
     """, "line 5: dist.barrier is called only where 'dist.get_rank() != 0' is false (line 2)"),
    ("""
     import os
     is_main = int(os.environ["RANK"]) == 0
     if is_main:
         objects = [None]
         dist.broadcast_object_list(objects, src=0)
     """, "line 6: dist.broadcast_object_list is called only where 'is_main' is true (line 4)"),
    ("""
     for step in range(rank + 2):
         dist.all_reduce(grad)
     """, "line 3: dist.all_reduce is in a loop whose count depends on the rank (line 2: range(rank + 2))"),
    ("""
     counts = [3, 4]
     for _ in range(counts[local_rank]):
         dist.all_gather(outs, grad)
     """, "line 4: dist.all_gather is in a loop whose count depends on the rank (line 3: range(counts[local_rank]))"),
    ("""
     for batch in range(10):
         if rank == 1 and batch == 7:
             continue
         dist.all_reduce(grad)
     """, "line 5: dist.all_reduce is not reached by the ranks where 'rank == 1 and batch == 7' is true: "
          "they continue at line 4"),
    ("""
     def sync(t):
         dist.all_reduce(t)
         return t / world_size

     if rank == 0:
         loss = sync(loss)
     """, "line 7: dist.all_reduce (in sync()) is called only where 'rank == 0' is true (line 6)"),
    ("""
     import torch.distributed.checkpoint as dcp
     if rank == 0:
         dcp.save({"model": model.state_dict()}, checkpoint_id="ckpt")
     """, "line 4: dcp.save is called only where 'rank == 0' is true (line 3)"),
    ("""
     from torch.distributed import all_reduce as reduce_all
     leader = dist.get_rank() == 0
     if leader:
         reduce_all(t)
     """, "line 5: reduce_all is called only where 'leader' is true (line 4)"),
    ("""
     peer = rank ^ 1
     mine = torch.full((1024,), float(rank))
     theirs = torch.empty(1024)
     dist.send(mine, peer)
     dist.recv(theirs, peer)
     """, "line 5: every rank sends (line 5) before it receives (line 6)"),
    ("""
     if rank == 0:
         dist.send(t, dst=1)
     """, "line 3: dist.send has no recv or irecv anywhere in the cell"),
])
def test_a_planted_fault_is_named_at_its_line_with_what_to_do(source, expected):
    found = said(source)
    assert len(found) == 1 and found[0].startswith(expected), found


@pytest.mark.parametrize("source", [
    # rank 0 alone prints, logs, saves and plots
    """
    loss = model(x).square().mean()
    loss.backward()
    dist.all_reduce(loss)
    if rank == 0:
        print(f"loss {loss.item():.3f}")
        torch.save(model.state_dict(), "model.pt")
        distlab.log(loss=loss)
    """,
    # a send on one side, its receive on the other; a batched exchange
    """
    if rank == 0:
        dist.send(t, dst=1)
    else:
        dist.recv(t, src=0)
    ops = [dist.P2POp(dist.isend, t, (rank + 1) % world_size), dist.P2POp(dist.irecv, r, (rank - 1) % world_size)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    """,
    # even ranks send first, odd ranks receive first
    """
    peer = rank ^ 1
    if rank % 2 == 0:
        dist.send(mine, peer)
        dist.recv(theirs, peer)
    else:
        dist.recv(theirs, peer)
        dist.send(mine, peer)
    """,
    # a sub-group's collective, called by its members only
    """
    pair = dist.new_group([0, 1])
    if rank in (0, 1):
        dist.all_reduce(t, group=pair)
    """,
    # both sides of the branch make the same collectives
    """
    if rank == 0:
        t = torch.ones(4)
    else:
        t = torch.zeros(4)
    dist.broadcast(t, src=0)
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.all_reduce(t)
    """,
    # each rank in turn, with a barrier every rank reaches
    """
    for r in range(world_size):
        if rank == r:
            print("rank", r, "says hello")
        dist.barrier()
    """,
    # the rank's own shard of the data: its length is not the rank's
    """
    shard = data[rank::world_size]
    for xb in shard.split(8):
        dist.all_reduce(xb.sum())
    """,
    # not Python that parses: running it says why
    "if rank == 0\n    dist.all_reduce(t)\n",
])
def test_correct_code_gets_no_finding(source):
    assert said(source) == []


def test_a_model_sharded_in_one_cell_is_remembered_in_the_next_until_the_world_is_new():
    linter = CellLinter()
    assert linter.check("from torch.distributed.fsdp import fully_shard\nfully_shard(net)\n") == []
    assert linter.check("def step():\n    dist.barrier()\n") == []
    later = "if rank == 0:\n    out = net(x)\n    step()\n"
    assert [f.line for f in linter.check(later)] == [2]
    assert "net(...) (sharded: its forward all-gathers)" in str(linter.check(later)[0])
    linter.forget()
    assert linter.check(later) == []

"""A look inside a failed rank: its kept frames and their locals (``lab.postmortem()``, ``%dist debug``)."""

from __future__ import annotations

import io
import math
import pickle
import re

import pytest
import torch
from _single_rank import single_rank_group

from distlab import CellTimeout, RankError
from distlab.errors import DistlabError, LabUsageError, RankFailure
from distlab.notebook.cell_context import CellOutcome
from distlab.notebook.postmortem import LastCell, Postmortem, first_failed, gone, nothing_kept
from distlab.rank import cell, postmortem
from distlab.rank.namespace import user_namespace

# ------------------------------------------------------------------ the summaries, in this process

# What ``t.norm().item()`` gives for a (3, 4) tensor of 2.0 (float32, then a Python float).
NORM = repr((torch.ones(3, 4) * 2).norm().item())


class _PlainData(pickle.Unpickler):
    """Unpickles builtins only: what a notebook without torch could read."""

    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"{module}.{name} would be imported to read this")


def _travels(data: object) -> object:
    return _PlainData(io.BytesIO(pickle.dumps(data))).load()


def test_a_float_tensor_is_summarised_by_shape_dtype_device_and_statistics():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    s = postmortem.summarise(t)
    assert (s["kind"], s["shape"], s["dtype"], s["device"]) == ("tensor", [3, 4], "float32", "cpu")
    assert s["stats"]["min"] == 0.0 and s["stats"]["max"] == 11.0 and s["stats"]["mean"] == 5.5
    assert math.isclose(s["stats"]["norm"], float(t.norm()), rel_tol=1e-6)
    assert (s["nan"], s["inf"], s["note"]) == (0, 0, "")
    assert _travels(s) == s


def test_nan_and_inf_are_counted_and_the_statistics_are_of_the_finite_values():
    t = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 3.0], dtype=torch.float16, requires_grad=True)
    s = postmortem.summarise(t)
    assert (s["nan"], s["inf"], s["requires_grad"], s["dtype"]) == (1, 2, True, "float16")
    assert s["stats"] == {"min": 1.0, "max": 3.0, "mean": 2.0, "norm": math.sqrt(10)}
    everything_bad = postmortem.summarise(torch.full((4,), float("nan")))
    assert everything_bad["nan"] == 4 and everything_bad["stats"] == {}


def test_integer_bool_complex_empty_and_meta_tensors_get_the_statistics_that_make_sense():
    assert postmortem.summarise(torch.arange(10))["stats"] == {"min": 0, "max": 9, "mean": 4.5}
    assert postmortem.summarise(torch.tensor([True, False, True]))["stats"] == {"true": 2}
    complex_ = postmortem.summarise(torch.tensor([3 + 4j, 0j]))["stats"]
    assert complex_ == {"norm": 5.0, "max_abs": 5.0}
    assert postmortem.summarise(torch.ones(0, 3))["note"] == "empty"
    meta = postmortem.summarise(torch.empty(1 << 40, device="meta"))  # a terabyte that is not there
    assert meta["shape"] == [1 << 40] and meta["stats"] == {} and meta["note"] == "a meta tensor: no values"


def test_a_huge_tensor_is_summarised_from_a_sample_and_a_huge_strided_view_not_at_all():
    big = torch.ones(postmortem.EXACT_LIMIT * 2 + 5)
    big[0] = float("nan")
    s = postmortem.summarise(big)
    step = math.ceil(big.numel() / postmortem.SAMPLE)
    assert s["note"] == f"stats of a sample: 1 element in {step}" and s["nan"] == 1  # the sample starts at 0
    assert s["stats"]["min"] == s["stats"]["max"] == 1.0
    view = postmortem.summarise(big[: postmortem.EXACT_LIMIT * 2].view(2, -1).t())
    assert view["stats"] == {} and "not contiguous" in view["note"]


def test_a_dtensor_shows_its_placements_mesh_and_local_shard():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with single_rank_group():
        mesh = init_device_mesh("cpu", (1,))
        s = postmortem.summarise(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    assert (s["type"], s["shape"], s["local_shape"], s["mesh"]) == ("DTensor", [4, 2], [4, 2], [1])
    assert s["placements"] == ["Shard(dim=0)"] and s["stats"]["norm"] == math.sqrt(8)


def test_modules_containers_and_other_values_are_summarised_and_a_failing_repr_breaks_nothing():
    class Unshowable:
        def __repr__(self) -> str:
            raise ValueError("no")

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    assert postmortem.summarise(model) == {"kind": "module", "type": "Sequential", "parameters": 15, "training": False}
    assert postmortem.summarise([torch.ones(1)] * 3) == {
        "kind": "container",
        "type": "list",
        "length": 3,
        "items": "Tensor",
    }
    assert postmortem.summarise({"a": 1, "b": "x"})["items"] == ""
    assert postmortem.summarise(Unshowable())["repr"] == "<Unshowable: repr raised ValueError>"
    long = postmortem.summarise("x" * 500)["repr"]
    assert len(long) == postmortem.REPR_CHARS and long.endswith("...")


@pytest.fixture
def rank_namespace():
    """The namespace run_cell uses in this process, given a rank's names, and put back afterwards."""
    namespace = user_namespace()
    before = dict(namespace)
    namespace.update(rank=1, world_size=2, torch=torch)
    try:
        yield namespace
    finally:
        namespace.clear()
        namespace.update(before)
        postmortem.drop()


FAILING = """\
import math
def normalise(t):
    norm = t.norm().item()
    __hidden__ = 1
    if rank == 1:
        norm = 1 / 0
    return t / norm
class Shape:
    pass
x = torch.ones(3, 4) * (rank + 1)
model = torch.nn.Linear(4, 2)
y = normalise(x)
"""


def test_a_failed_cell_is_kept_with_its_frames_and_locals_until_the_next_cell_starts(rank_namespace):
    reply = cell.run_cell(FAILING, 1, "repr")
    assert reply["error"]["ename"] == "ZeroDivisionError"
    data = postmortem.describe(12, 30)
    assert _travels(data) == data
    assert (data["ename"], data["evalue"], data["filename"]) == (
        "ZeroDivisionError",
        "division by zero",
        "<rank 1 cell>",
    )
    top, failing = data["frames"]  # distlab's own frames above the cell are not shown
    assert (top["function"], top["line"], top["library"]) == ("<module>", "y = normalise(x)", False)
    assert (failing["function"], failing["line"], failing["lineno"]) == ("normalise", "norm = 1 / 0", 6)
    # At the cell's top level: the names the cell mentions, never modules, functions, classes, distlab's own.
    assert [v["name"] for v in top["locals"]] == ["x", "model"]  # y was never assigned
    x = top["locals"][0]
    assert x["stats"]["min"] == x["stats"]["max"] == x["stats"]["mean"] == 2.0
    assert math.isclose(x["stats"]["norm"], math.sqrt(48))
    assert [v["name"] for v in failing["locals"]] == ["t", "norm"]  # no dunder
    assert failing["locals"][1] == {"kind": "value", "type": "float", "repr": NORM, "name": "norm"}

    text = str(Postmortem(1, data))
    assert text.startswith("rank 1 failed: ZeroDivisionError: division by zero\n")
    assert "  <rank 1 cell>, line 12, in <module>\n      y = normalise(x)\n" in text
    assert "        x = tensor (3, 4) float32 cpu: min 2, max 2, mean 2, norm 6.928\n" in text
    assert "        model = Linear module, 10 parameters\n" in text
    assert "  <rank 1 cell>, line 6, in normalise   <- failed here\n      norm = 1 / 0\n" in text
    page = Postmortem(1, data)._repr_html_()
    assert "<code>normalise</code>" in page and "failed here" in page and "min 2, max 2" in page

    assert cell.run_cell("z = 1", 1, "repr") == {"repr": None}
    assert postmortem.describe(12, 30) is None


def test_library_frames_are_marked_and_capped_and_the_failing_frame_and_the_users_are_always_kept(rank_namespace):
    code = "def deep(n):\n    if n == 0:\n        return int('nope')\n    return deep(n - 1)\ndeep(20)\n"
    cell.run_cell(code, 1, "repr")
    data = postmortem.describe(5, 30)
    frames = data["frames"]
    assert data["frames_total"] == 22 and len(frames) == 5
    assert frames[0]["function"] == "<module>" and frames[-1]["line"] == "return int('nope')"
    assert sum(f["skipped"] for f in frames) == 17 and frames[1]["skipped"] == 17
    assert "... 17 frames left out" in str(Postmortem(1, data))

    cell.run_cell("import json\nsize = 3\njson.loads('{')", 1, "repr")
    frames = postmortem.describe(12, 30)["frames"]
    assert not frames[0]["library"] and all(f["library"] for f in frames[1:])
    assert frames[1]["where"] == "json/__init__.py" and frames[-1]["function"] == "raw_decode"
    assert all(len(f["locals"]) <= postmortem.LIBRARY_LOCALS for f in frames[1:])
    assert [v["name"] for v in frames[0]["locals"]] == ["size"]
    assert "  [library] json/__init__.py, line" in str(Postmortem(1, postmortem.describe(12, 30)))


def test_the_values_a_kept_failure_holds_are_freed_as_the_next_cell_starts(rank_namespace):
    code = (
        "import weakref\n"
        "class Activations:\n"
        "    pass\n"
        "def forward():\n"
        "    held = Activations()\n"
        "    refs.append(weakref.ref(held))\n"
        "    try:\n"
        "        1 / 0\n"
        "    except ZeroDivisionError as exc:\n"
        "        kept = exc  # the frame now holds its own traceback: a cycle\n"
        "        raise\n"
        "forward()\n"
    )
    rank_namespace["refs"] = refs = []
    cell.run_cell(code, 1, "repr")
    assert refs[0]() is not None  # kept for a look inside
    cell.run_cell("pass", 1, "repr")
    assert refs[0]() is None


def test_the_exception_a_failure_interrupted_or_came_from_is_named_in_a_line(rank_namespace):
    cell.run_cell("try:\n    1 / 0\nexcept ZeroDivisionError:\n    raise ValueError('bad')", 1, "repr")
    data = postmortem.describe(12, 30)
    assert data["context"] == "while handling ZeroDivisionError: division by zero"
    assert "\n  (while handling ZeroDivisionError: division by zero)\n" in str(Postmortem(1, data))
    cell.run_cell("raise ValueError('bad') from KeyError('k')", 1, "repr")
    assert postmortem.describe(12, 30)["context"] == "caused by KeyError: 'k'"
    cell.run_cell("try:\n    1 / 0\nexcept ZeroDivisionError:\n    raise ValueError('bad') from None", 1, "repr")
    assert postmortem.describe(12, 30)["context"] == ""


def test_describe_refuses_limits_that_are_not_whole_numbers():
    for bad in ((0, 30), (True, 30), (12, -1), (12, 2.5)):
        with pytest.raises(ValueError, match="must be a whole number"):
            postmortem.describe(*bad)


# ------------------------------------------------------------------ what the lab remembers of its last cell


def _outcome(failures: dict[int, str], killed=(), stopped=()) -> CellOutcome:
    return CellOutcome(
        failures={r: RankFailure(r, ename, "") for r, ename in failures.items()},
        killed=list(killed),
        stopped=list(stopped),
    )


def test_the_rank_to_look_at_first_raised_by_itself_and_ranks_that_died_keep_nothing():
    last = LastCell.of([0, 1, 2, 3], _outcome({0: "Stopped", 1: "EngineError", 3: "ValueError"}, stopped=[0]), False)
    assert (last.failed, last.died) == ((3, 0, 1), (1,))
    assert first_failed(last) == 3
    assert first_failed(LastCell.of([0, 1], _outcome({0: "Stopped", 1: "EngineError"}), False)) == 0
    assert "its process died in the last cell" in gone(1, last)
    assert gone(3, last) is None
    restarted = LastCell.of([0, 1], _outcome({0: "ValueError", 1: "Stopped"}, killed=[1], stopped=[1]), True)
    assert gone(0, restarted) == (
        "rank 0 kept no failure: the world was restarted after the last cell failed (rank 1 was killed), "
        "so every rank's process is new and holds nothing of it"
    )
    assert (
        nothing_kept(2, last) == "rank 2 kept no failure: its last cell succeeded (a failure is kept only until "
        "the next cell starts)"
    )
    assert nothing_kept(1, None) == "rank 1 kept no failure: no cell has run since the world started"
    for nothing in (None, LastCell.of([0, 1], _outcome({}), False)):
        with pytest.raises(DistlabError, match="no failure to look into"):
            first_failed(nothing)


# ------------------------------------------------------------------ on real ranks

CELL = """\
x = torch.ones(3, 4) * (rank + 1)
def normalise(t):
    norm = t.norm().item()
    if rank == 1:
        norm = 1 / 0
    return t / norm
y = normalise(x)
"""


def test_a_rank_that_failed_shows_its_failing_line_its_caller_and_their_tensors(lab):
    with pytest.raises(RankError):
        lab.run(CELL, stream=False)
    found = lab.postmortem()
    assert found.rank == 1 and found.headline == "ZeroDivisionError: division by zero"
    text = str(found)
    assert "  <rank 1 cell>, line 7, in <module>\n      y = normalise(x)\n" in text, text
    assert "        x = tensor (3, 4) float32 cpu: min 2, max 2, mean 2, norm 6.928\n" in text, text
    assert "  <rank 1 cell>, line 5, in normalise   <- failed here\n      norm = 1 / 0\n" in text, text
    assert "        t = tensor (3, 4) float32 cpu: min 2, max 2, mean 2, norm 6.928\n" in text, text
    assert found.to_dict()["frames"][-1]["locals"][1]["repr"] == NORM
    assert str(lab.postmortem(1)) == text

    with pytest.raises(DistlabError) as info:
        lab.postmortem(0)
    assert str(info.value) == (
        "rank 0 kept no failure: its last cell succeeded (a failure is kept only until the next cell starts)"
    )
    for bad, why in (
        (7, "rank 7 does not exist in a world of 2: valid ranks are 0-1"),
        ("1", "rank must be a whole number, like lab.postmortem(1) (got '1')"),
        (-1, "rank must be >= 0"),
    ):
        with pytest.raises(LabUsageError) as info:
            lab.postmortem(bad)
        assert why in str(info.value) and "\n" not in str(info.value)
    assert str(lab.postmortem()) == text  # nothing changed

    lab.run("z = 1", ranks=0, stream=False)  # a cell that rank 1 does not run leaves its failure there
    assert lab.postmortem(1).headline == "ZeroDivisionError: division by zero"
    lab.run("z = 1", stream=False)
    with pytest.raises(DistlabError, match=r"^rank 1 kept no failure: its last cell succeeded"):
        lab.postmortem(1)
    with pytest.raises(DistlabError, match="the lab's last cell failed on no rank"):
        lab.postmortem()


def test_a_rank_stopped_in_a_collective_shows_where_it_was_stuck_after_the_group_is_rebuilt(lab):
    code = "def sync(t):\n    dist.all_reduce(t)\n    return t\nt = torch.full((5,), 3.0)\nif rank == 0:\n    sync(t)\n"
    with pytest.raises(CellTimeout) as info:
        lab.run(code, timeout=2, stream=False)
    assert "process group rebuilt" in str(info.value)  # the engines stayed: the failure too
    found = lab.postmortem()
    assert found.rank == 0
    names = [f["function"] for f in found.frames]
    stuck = names.index("sync")
    assert names[0] == "<module>" and found.frames[0]["line"] == "sync(t)"
    assert found.frames[stuck]["line"] == "dist.all_reduce(t)"
    assert all(f["library"] for f in found.frames[stuck + 1 :])
    assert "        t = tensor (5,) float32 cpu: " in str(found), str(found)
    lab.run("t = torch.ones(1); dist.all_reduce(t)", stream=False)  # the group works; the failure is dropped
    with pytest.raises(DistlabError, match="rank 0 kept no failure"):
        lab.postmortem(0)


def test_after_a_rank_is_killed_and_the_world_restarted_no_rank_keeps_anything_and_says_so(lab):
    # Rank 1 will not stop (SIGINT ignored, and not in a collective): distlab kills it and restarts the world.
    code = (
        "import signal, time\n"
        "if rank == 1:\n"
        "    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "    time.sleep(60)\n"
        "raise ValueError('rank 0 fails by itself')\n"
    )
    with pytest.raises(RankError) as info:
        lab.run(code, stream=False)
    assert "the world was restarted" in str(info.value)
    with pytest.raises(DistlabError) as first:
        lab.postmortem()
    assert str(first.value) == (
        "rank 0 kept no failure: the world was restarted after the last cell failed (rank 1 was killed), "
        "so every rank's process is new and holds nothing of it"
    )
    with pytest.raises(
        DistlabError,
        match=r"^rank 1 kept no failure: its process died in the last cell \(killed, "
        r"or it crashed\), and what it held went with it; the world was restarted since",
    ):
        lab.postmortem(1)


# ------------------------------------------------------------------ %dist debug in a real kernel


@pytest.mark.cluster
def test_dist_debug_in_a_kernel_shows_the_failed_ranks_frames_and_refuses_a_rank_that_does_not_exist():
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    try:

        def run(code: str, timeout: float = 120) -> tuple[dict, list[dict]]:
            shown: list[dict] = []
            reply = kc.execute_interactive(code, timeout=timeout, output_hook=shown.append)
            return reply["content"], shown

        content, _ = run("%load_ext distlab\n%dist start -n 2")
        assert content["status"] == "ok", content
        content, _ = run("%%ddp\n" + CELL)
        assert content["status"] == "error" and "rank 1: ZeroDivisionError" in "\n".join(content["traceback"])

        content, shown = run("%dist debug")
        assert content["status"] == "ok", content
        data = next(m["content"]["data"] for m in shown if m["msg_type"] == "display_data")
        text = data["text/plain"]
        assert text.startswith("rank 1 failed: ZeroDivisionError: division by zero"), text
        assert "      norm = 1 / 0\n" in text and "      y = normalise(x)\n" in text
        assert "x = tensor (3, 4) float32 cpu: min 2, max 2, mean 2, norm 6.928" in text
        assert "<details" in data["text/html"] and "norm 6.928" in data["text/html"]

        content, shown = run("%dist debug 7")
        assert content["status"] == "error" and content["ename"] == "UsageError"
        assert content["evalue"] == "rank 7 does not exist in a world of 2: valid ranks are 0-1"
        content, _ = run("%dist debug x")
        assert content["status"] == "error" and content["evalue"].endswith(
            "the rank must be a whole number, like %dist debug 1 (got 'x')"
        ), content
        content, shown = run("%dist debug 1")
        assert content["status"] == "ok"  # the bad ranks changed nothing
        assert next(m for m in shown if m["msg_type"] == "display_data")["content"]["data"]["text/plain"] == text
        content, _ = run("%dist stop")
        assert content["status"] == "ok"
    finally:
        km.shutdown_kernel(now=False)
        kc.stop_channels()


def test_the_magic_names_debug_among_its_subcommands():
    from distlab.front import magics

    assert "debug" in magics._SUBCOMMANDS
    assert re.search(r"%dist debug \[RANK\]", magics.__doc__ or "")

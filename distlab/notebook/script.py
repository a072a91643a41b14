"""What a lab ran, in order, and the torchrun script made of it (``lab.export``); the scripts it is given.

    history = [CellRan("model = ..."), Pushed(("lr",)), CellRan("train(model, lr)")]
    script = build_script(history, world_size=2, backend="gloo", name="train.py")
    script.text    # torchrun --standalone --nproc_per_node=2 train.py runs it as it is
    script.notes   # what the script lacks of what ran (pushed names, cells on some ranks, magics)

The script gives each rank what a lab's rank has (``rank``, ``world_size``, ``local_rank``,
``device``, ``torch``, ``dist`` initialised, ``distlab`` when a cell uses it), then the cells that
ran on every rank, each under a ``# %%ddp cell N`` comment, then ``dist.destroy_process_group()``.
What it cannot carry is said in comments where it happened, and listed in its header:
- cells run on some ranks only (``%%ddp -r``) are left out, their code kept as comments: a
  torchrun script runs the same code on every rank, and a collective in such a cell would wait
  forever for the ranks that skip it;
- names pushed with ``lab.push`` are not defined: the script says which;
- lines only IPython runs (magics, ``!`` shell escapes) become ``pass`` with the line as a comment;
- scripts run with ``%dist run`` are not copied in.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import LabUsageError, format_ranks

__all__ = [
    "CellRan",
    "Event",
    "Pushed",
    "Restarted",
    "Script",
    "ScriptRan",
    "build_script",
    "export_path",
    "read_script",
    "script_args",
]


@dataclass(frozen=True)
class CellRan:
    """A cell that succeeded; ``ranks`` is None when it ran on every rank."""

    code: str
    ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Pushed:
    """Names ``lab.push`` copied to the ranks (``ranks`` None: to every rank)."""

    names: tuple[str, ...]
    ranks: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ScriptRan:
    """A script that ``lab.run_script`` ran on every rank, with its ``sys.argv``."""

    argv: tuple[str, ...]


@dataclass(frozen=True)
class Restarted:
    """The lab restarted: a fresh world of ``world_size`` ranks, whose namespaces start empty."""

    world_size: int


Event = CellRan | Pushed | ScriptRan | Restarted


@dataclass(frozen=True)
class Script:
    """A torchrun script's text, how many cells it holds, and what it lacks of what the lab ran."""

    text: str
    cells: int
    notes: list[str] = field(default_factory=list)


def build_script(history: list[Event], world_size: int, backend: str, name: str, on_gpus: bool = False) -> Script:
    """The script that ``torchrun --standalone --nproc_per_node=<world_size> <name>`` runs as it is.

    ``on_gpus``: the lab's gloo ranks took the GPUs in turn (fewer GPUs than ranks); the script's do too.
    """
    body: list[str] = []
    written, pushed, subsets, ipython_lines, scripts = 0, [], [], [], []
    number = 0
    for event in history:
        if isinstance(event, CellRan):
            number += 1
            if event.ranks is not None:
                subsets.append(f"cell {number} (rank {_ranks(event.ranks)})")
                body += _left_out(number, event)
                continue
            source, magics = _torchrun_source(event.code)
            source = _without_group_calls(source)
            ipython_lines += [f"cell {number} {_lines(first, last)} ({text})" for first, last, text in magics]
            body += [f"# %%ddp cell {number}", source.rstrip("\n"), ""]
            written += 1
        elif isinstance(event, Pushed):
            where = "" if event.ranks is None else f" (to rank {_ranks(event.ranks)})"
            pushed += [n for n in event.names if n not in pushed]
            body += [f"# lab.push here{where}: {', '.join(event.names)} (not defined in this script)", ""]
        elif isinstance(event, ScriptRan):
            scripts.append(" ".join(event.argv))
            body += [f"# %dist run {' '.join(event.argv)} ran here in the lab (not part of this script)", ""]
        else:
            restart = f"a fresh world of {event.world_size} ranks in the lab, without the names the cells above defined"
            body += [f"# %dist restart here: {restart}", ""]
    notes = []
    if pushed:
        notes.append(f"names the lab pushed to the ranks (lab.push) are not defined here: {', '.join(pushed)}; "
                     "define them before the cells that use them")
    if subsets:
        notes.append(f"cells that ran on some ranks only (%%ddp -r) are left out, their code kept as comments: "
                     f"{', '.join(subsets)}")
    if ipython_lines:
        notes.append(f"lines only IPython runs (magics, ! shell escapes) are commented out, pass in their place: "
                     f"{', '.join(ipython_lines)}")
    if scripts:
        notes.append(f"scripts run with %dist run are not copied in: {', '.join(scripts)}")
    uses_distlab = any(
        isinstance(e, CellRan) and e.ranks is None and re.search(r"\bdistlab\b", e.code) for e in history
    )
    header = _header(world_size, backend, name, notes, uses_distlab, on_gpus)
    text = "\n".join([*header, *body, "dist.destroy_process_group()", ""])
    return Script(text, written, notes)


def _header(
    world_size: int, backend: str, name: str, notes: list[str], uses_distlab: bool, on_gpus: bool = False
) -> list[str]:
    gpu = backend == "nccl"
    names = "rank, world_size, local_rank, device, torch, dist (torch.distributed, initialised)"
    lines = [
        f"# {name}: the %%ddp cells a distlab lab of {world_size} ranks ran, as a script torchrun runs as it is:",
        f"#     torchrun --standalone --nproc_per_node={world_size} {name}",
        f"# Each rank starts with what a lab's rank has: {names}{', distlab' if uses_distlab else ''}.",
    ]
    lines += [f"# Note: {note}." for note in notes]
    lines += ["", "import os", "", "import torch", "import torch.distributed as dist", ""]
    if uses_distlab:
        lines += [
            "import distlab  # watch() and log() work under torchrun too: they record, with no notebook to send to",
            "",
        ]
    lines += ['local_rank = int(os.environ["LOCAL_RANK"])  # torchrun sets it, with RANK, WORLD_SIZE, MASTER_ADDR, ...']
    if gpu:
        lines += [
            "device = torch.device(\"cuda\", local_rank)",
            "torch.cuda.set_device(device)",
            'dist.init_process_group("nccl", device_id=device)',
        ]
    else:
        lines += [
            # As the lab placed its ranks: on the GPUs in turn where it had fewer than ranks, else the CPU.
            'device = torch.device("cuda", local_rank % torch.cuda.device_count())' if on_gpus
            else 'device = torch.device("cpu")',
            *(["torch.cuda.set_device(device)"] if on_gpus else []),
            'dist.init_process_group("gloo")',
            "# As in the lab, the machine's cores are shared among its ranks (torchrun alone sets OMP_NUM_THREADS=1).",
            'torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))',
        ]
    lines += ["rank = dist.get_rank()", "world_size = dist.get_world_size()", "", ""]
    return lines


def _left_out(number: int, cell: CellRan) -> list[str]:
    assert cell.ranks is not None
    ranks = _ranks(cell.ranks)
    lines = [
        f"# %%ddp -r {ranks} cell {number}: ran on rank {ranks} only, so it is left out (every rank runs this script;",
        f"# to keep it, put it under `if rank in {set(cell.ranks)}:` where no other rank waits in a collective)."
        " Its code:",
    ]
    lines += [f"#     {line}".rstrip() for line in cell.code.rstrip("\n").splitlines()]
    return [*lines, ""]


def _torchrun_source(code: str) -> tuple[str, list[tuple[int, int, str]]]:
    """The cell as plain Python, and where the lines only IPython runs are: ``[(first, last, first line)]``.

    IPython's own transformer says which lines are magics or shell escapes (lines in a string are
    not); each becomes ``pass`` at its indentation, the line kept as a comment, so blocks stay valid.
    """
    from IPython.core.inputtransformer2 import TransformerManager

    transformed = TransformerManager().transform_cell(code)
    before, after = code.splitlines(), transformed.splitlines()
    if before == after:
        return code, []
    out: list[str] = []
    found: list[tuple[int, int, str]] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=before, b=after, autojunk=False).get_opcodes():
        if tag == "equal":
            out += before[i1:i2]
            continue
        made = after[j1:j2]
        if not any("get_ipython()" in line for line in made):
            out += made  # what IPython ran (a prompt or a common indent taken off)
            continue
        originals = before[i1:i2] or made
        indent = originals[0][: len(originals[0]) - len(originals[0].lstrip())]
        found.append((i1 + 1, i1 + len(originals), originals[0].strip()))
        out.append(f"{indent}pass  # IPython only, torchrun cannot run it: {originals[0].strip()}")
        out += [f"{indent}# {line.strip()}" for line in originals[1:]]
    return "\n".join(out) + "\n", found


# What a cell's init_process_group or destroy_process_group() became (in the lab, a join and a no-op).
_GROUP_CALL = "pass  # the group is made at this script's top, destroyed at its end (in the lab, it stayed up):"


def _without_group_calls(source: str) -> str:
    """``source`` with its statements ``init_process_group(...)`` and ``destroy_process_group()`` made ``pass``.

    In the lab, a cell's ``init_process_group`` joined the lab's group and ``destroy_process_group()``
    left it up (``rank.torchrun``); under torchrun the first would fail (the script's top has made
    the group) and the second would end the group the cells after it use. A subgroup's destroy stays.
    Only statements on lines of their own (a comment after them aside) are changed; anything else is
    left as it ran.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
            continue
        call = node.value
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        default_destroy = name == "destroy_process_group" and not call.args and not call.keywords
        if name != "init_process_group" and not default_destroy:
            continue
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        before, after = lines[first][: node.col_offset], lines[last][node.end_col_offset or 0 :]
        if before.strip() or after.strip()[:1] not in ("", "#"):
            continue  # shares its line with other code (a comment after it is no code)
        lines[first] = f"{before}{_GROUP_CALL} {lines[first].strip()}"
        for i in range(first + 1, last + 1):
            lines[i] = f"{before}# {lines[i].strip()}"
    return "\n".join(lines) + "\n"


def _lines(first: int, last: int) -> str:
    return f"line {first}" if first == last else f"lines {first}-{last}"


def _ranks(ranks: tuple[int, ...]) -> str:
    return format_ranks(ranks)


# ------------------------------------------------------------------------ the files a user names


def read_script(path: Any) -> tuple[str, str]:
    """``(path as text, the script's source)`` for ``lab.run_script``, checked here before anything runs.

    Read as Python reads a script (its ``# coding:`` line heeded) and compiled once, so that a
    missing file or a syntax error is one line in the notebook, not an error on every rank.
    """
    name = _path_text(path, "lab.run_script('train.py')")
    if os.path.isdir(name):
        raise LabUsageError(
            f"{name} is a folder, not a script: give a Python file, like {os.path.join(name, 'train.py')}"
        )
    try:
        with tokenize.open(name) as source:
            text = source.read()
    except FileNotFoundError:
        raise LabUsageError(
            f"no such file: {name} (looked from {os.getcwd()}); give the script's path, like %dist run train.py"
        ) from None
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        raise LabUsageError(f"cannot read {name}: {exc}") from None
    try:
        compile(text, name, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise LabUsageError(f"{name} line {exc.lineno}: {exc.msg}; nothing ran") from None
    except ValueError as exc:  # a NUL byte
        raise LabUsageError(f"{name} is not Python source: {exc}") from None
    return name, text


def script_args(args: Any) -> list[str]:
    """A script's arguments, ``sys.argv[1:]``: a list of text, as a command line gives them."""
    if isinstance(args, (str, bytes)) or not isinstance(args, Iterable):
        raise LabUsageError(f"args are the script's arguments as a list, like args=['--epochs', '2'] (got {args!r})")
    given = list(args)
    for arg in given:
        if not isinstance(arg, str):
            raise LabUsageError(
                f"each of the script's arguments must be text, as on a command line, like args=['--epochs', '2'] "
                f"(got {arg!r})"
            )
    return given


def export_path(path: Any) -> str:
    """The path ``lab.export`` writes to, as text, once its folder is known to exist."""
    name = _path_text(path, "lab.export('train.py')")
    if os.path.isdir(name):
        raise LabUsageError(f"{name} is a folder: give a file name in it, like {os.path.join(name, 'train.py')}")
    folder = os.path.dirname(os.path.abspath(name))
    if not os.path.isdir(folder):
        raise LabUsageError(f"cannot write {name}: the folder {folder} does not exist; create it, or name another file")
    return name


def _path_text(path: Any, example: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise LabUsageError(f"the script's path must be a file name, like {example} (got {path!r})")
    name = os.fspath(path)
    if not isinstance(name, str) or not name.strip():
        raise LabUsageError(f"the script's path must be a file name, like {example} (got {path!r})")
    return name

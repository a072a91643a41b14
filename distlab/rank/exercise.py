"""Grading a learner's code on a rank: their definitions unpacked, one case of a grader run, its outcome.

The learner defines names (``ring_all_reduce``, a sampler class, ...) in ``%%ddp`` cells of their own
lab. :func:`pack_definitions` pickles them by value on one of its ranks (cloudpickle: a function made
in a cell lives in no importable module), and the grader's world gets the bytes. There
:class:`Learner` unpacks them for each case into objects that see the grading rank's own ``rank``,
``world_size``, ``dist``, ... (a learner's function reads them as globals, and the values it was
pickled with are its own lab's), and :func:`grade_case` runs one case of the exercise's grader,
``distlab.exercises.<module>.grader`` (the exercise's folder; importing it loads neither the
notebook side nor the other exercises: the package ``distlab.exercises`` imports nothing until asked),
which every grader module provides as:

``cases(world_size: int, seed: int) -> list[dict]``
    The cases at this world size, the same on every rank (plain Python from ``random.Random(seed)``);
    each a dict of plain values, with ``"name"``: what the case is, in a few words.
``grade(case: dict, learner: Learner) -> dict``
    Runs on every rank of the grading world; :func:`passed` or :func:`failed` (with what was
    measured). An exception in the learner's code may simply propagate: the notebook reports it
    with the rank, the case and the learner's line.
"""

from __future__ import annotations

import math
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib import import_module
from typing import TYPE_CHECKING, Any, TypedDict

from ..wire import LEARNER_FILE, CellReply
from .cell import run_prepared
from .namespace import LAB_NAMES, user_namespace

if TYPE_CHECKING:
    import torch

__all__ = [
    "LEARNER_FILE",
    "Learner",
    "Tolerance",
    "backward",
    "case_names",
    "failed",
    "first_difference",
    "grad_of",
    "grade_case",
    "pack_definitions",
    "passed",
]


def pack_definitions(names: list[str]) -> CellReply:
    """``{"value": {"blob": bytes}}``, or ``{"value": {"missing": [...]}}`` / ``{"value": {"unpicklable": why}}``."""
    import cloudpickle

    namespace = user_namespace()
    missing = [name for name in names if name not in namespace]
    if missing:
        return {"value": {"missing": missing}}
    try:
        blob = cloudpickle.dumps({name: namespace[name] for name in names})
    except Exception as exc:  # noqa: BLE001 - whatever the learner's objects hold, say what could not travel
        return {"value": {"unpicklable": f"{type(exc).__name__}: {exc}"}}
    return {"value": {"blob": blob}}


class Learner(Mapping[str, Any]):
    """The learner's definitions by name, living in this rank; ``blob`` is what they came as.

    A grader that must run the learner's code in a process of its own (to kill it mid-write) sends
    ``blob`` there and unpacks it with ``Learner(blob, lab_names)``: such a process has no rank
    namespace, so it passes the rank's names (``rank``, ``world_size``, ``torch``, ...) itself.
    """

    def __init__(self, blob: bytes, lab_names: Mapping[str, object] | None = None) -> None:
        import pickle

        self.blob = blob
        self._names: dict[str, Any] = pickle.loads(blob)  # the learner's own code, from their own lab
        if lab_names is None:
            lab_names = {name: value for name, value in user_namespace().items() if name in LAB_NAMES}
        _rebind(self._names.values(), lab_names)

    def __getitem__(self, name: str) -> Any:
        return self._names[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _learners_function(function: types.FunctionType) -> bool:
    # Made by unpickling by value: its globals are its own, not an importable module's dictionary.
    module = sys.modules.get(function.__module__ or "")
    return module is None or function.__globals__ is not vars(module)


def _rebind(objects: Iterable[object], lab_names: Mapping[str, object]) -> None:
    """Point the learner's functions at this rank's lab names, and name their code as the learner's."""
    seen: set[int] = set()
    todo = list(objects)
    while todo:
        thing = todo.pop()
        if id(thing) in seen:
            continue
        seen.add(id(thing))
        if isinstance(thing, (staticmethod, classmethod)):
            todo.append(thing.__func__)
        elif isinstance(thing, property):
            todo.extend(f for f in (thing.fget, thing.fset, thing.fdel) if f is not None)
        elif isinstance(thing, type) and thing.__module__ in (None, "__main__"):
            todo.extend(vars(thing).values())
        elif isinstance(thing, types.FunctionType) and _learners_function(thing):
            thing.__globals__.update(lab_names)
            thing.__code__ = _renamed(thing.__code__)
            todo.extend(thing.__globals__.values())
            todo.extend(cell.cell_contents for cell in thing.__closure__ or () if _filled(cell))


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _renamed(code: types.CodeType) -> types.CodeType:
    # Tracebacks then say "<your code>", not the cell of another rank in another lab.
    consts = tuple(_renamed(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=LEARNER_FILE, co_consts=consts)


def _grader(exercise: str) -> types.ModuleType:
    return import_module(f"distlab.exercises.{exercise.replace('-', '_')}.grader")


def case_names(exercise: str, world_size: int, seed: int) -> CellReply:
    """The names of the exercise's cases at this world size (asked of one rank)."""
    return {"value": [case["name"] for case in _grader(exercise).cases(world_size, seed)]}


def grade_case(exercise: str, blob: bytes, seed: int, index: int, rank: int) -> CellReply:
    """Run case ``index`` of the exercise on this rank, stoppable as a cell is; reply as a cell does."""

    def prepare() -> Callable[[], object]:
        import torch.distributed as dist

        grader = _grader(exercise)
        case = grader.cases(dist.get_world_size(), seed)[index]
        learner = Learner(blob)
        return lambda: grader.grade(case, learner)

    return run_prepared(f"<rank {rank} grader>", prepare, "value")


# ---------------------------------------------------------------------------- what a grader returns


# ``message`` positional only: the numbers measured (a ``**dict``) can never be taken for it.
def passed(message: str = "", /, **measured: object) -> dict[str, object]:
    """This rank's part of the case is right; ``measured``: numbers shown beside the case."""
    return {"passed": True, "message": message, "measured": measured}


def failed(message: str, **measured: object) -> dict[str, object]:
    """This rank's part of the case is wrong: ``message`` says what, where, and the likely mistake."""
    return {"passed": False, "message": message, "measured": measured}


class Tolerance(TypedDict, total=False):
    """How close floats must come (``torch.isclose``'s, ``first_difference``'s keywords); none: exactly."""

    rtol: float
    atol: float


def first_difference(got: object, expected: Any, rtol: float = 0.0, atol: float = 0.0) -> str | None:
    """None if the tensors agree (exactly by default), else the first wrong element, in words.

    "shape (3, 4), expected (4, 4)"; "element [2, 1]: 6.0, expected 3.0 (2 of 12 elements wrong)".
    """
    import torch

    if not isinstance(got, torch.Tensor):
        return f"a {type(got).__name__}, expected a tensor"
    if tuple(got.shape) != tuple(expected.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    if got.dtype != expected.dtype:
        return f"dtype {got.dtype}, expected {expected.dtype}"
    a, b = got.detach().cpu(), expected.detach().cpu()
    if a.is_floating_point():
        wrong = ~torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    else:
        wrong = a != b
    count = int(wrong.sum())
    if count == 0:
        return None
    where = tuple(int(i) for i in wrong.nonzero()[0])
    index = f"[{', '.join(map(str, where))}]" if where else "[]"
    return (
        f"element {index}: {_number(a[where])}, expected {_number(b[where])} "
        f"({count} of {a.numel()} element{'s' if a.numel() != 1 else ''} wrong)"
    )


# ---------------------------------------------------------------------------- the grader's own autograd


def backward(output: torch.Tensor, gradient: torch.Tensor | None = None) -> None:
    """``output.backward(gradient)``, for a grader's own computations."""
    output.backward(gradient)


def grad_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.grad`` after the grader's own backward, which gives every tensor it reaches one."""
    grad = tensor.grad
    if grad is None:
        raise RuntimeError(f"the grader's backward left a tensor of shape {tuple(tensor.shape)} without a gradient")
    return grad


def _number(value: torch.Tensor) -> str:
    x = value.item()
    if isinstance(x, float) and math.isfinite(x):
        return f"{x:.6g}"
    return str(x)

"""Grading an exercise: the learner's definitions taken from their lab, each case run on ranks of its own.

The learner's code never runs in this process: it is pickled on one of their ranks and unpacked on
the grader's ranks (``distlab.rank.exercise``). The grader's ranks are labs of their own, one per
world size the exercises are graded in, each started at the first check that needs it and kept
(restarted only when a case killed one of its ranks) until the learner's lab stops: a check starts
no engine once each size has been used, and its ranks, forked (``cluster/warm.py``), cost ~36 MB
each while idle (benchmarks/RESULTS.md). A case that deadlocks or kills a rank costs the learner
nothing they made, and their lab keeps its size, its names and its state.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from ..errors import CellTimeout, LabUsageError, RankError, RankFailure
from ..notebook import rpc
from ..notebook.script import CellRan
from ..wire import LEARNER_FILE, CellReply
from .catalog import EXERCISES, get
from .model import Exercise
from .results import CaseOutcome, CaseResult, ExerciseResult, Grade

if TYPE_CHECKING:
    from ..notebook.cell_context import Send
    from ..notebook.core import LabCore

__all__ = ["check", "grade_all", "grading_lab"]

_COMPANION = "exercises"  # the grader's labs: "exercises-2", "exercises-3", ...
# How long asking a rank for definitions or case names may take: a small pickle, a few names.
_ASK_TIMEOUT_S = 60.0


def check(
    name: str,
    lab: LabCore | None = None,
    *,
    seed: int | None = None,
    case_timeout_s: float | None = None,
    record: bool = True,
) -> ExerciseResult:
    """Grade the learner's solution of exercise ``name``, as defined on ``lab``'s ranks (the running lab by default).

    Each case runs on every rank of the grader's own world, at each world size the exercise asks;
    a case that passes its deadline is stopped and named, and the cases after it are not run.
    ``seed`` draws the cases again as they were (every result says its seed). The result is saved
    with the quiz progress unless ``record=False``. ``case_timeout_s`` replaces the exercise's deadline
    per case.
    """
    exercise = get(name)
    if case_timeout_s is not None:
        from .. import checks

        exercise = replace(exercise, case_timeout_s=checks.positive("case_timeout_s", case_timeout_s, example="5"))
    learner_lab = _learners_lab(lab, exercise)
    blob = _definitions(learner_lab, exercise)
    seed = random.randrange(2**31) if seed is None else _checked_seed(seed)
    quote = _quoter(learner_lab)
    cases: list[CaseResult] = []
    stopped = False
    for size in sorted(exercise.world_sizes):
        world = grading_lab(learner_lab, size)
        names = _ask(world, _case_names(exercise, size, seed))
        for index, case_name in enumerate(names):
            if stopped:
                cases.append(
                    CaseResult(index, size, case_name, False, "not run: an earlier case was stopped", ran=False)
                )
                continue
            case, stopped = _run_case(world, exercise, blob, seed, index, size, case_name, quote)
            cases.append(case)
    result = _verdict(exercise, tuple(cases), seed)
    if record:
        from ..progress_file import ProgressFile

        ProgressFile().record_exercise(exercise.name, result.passed)
    return result


def grade_all(lab: LabCore | None = None, names: Iterable[str] | None = None) -> dict[str, Grade]:
    """Every exercise (or ``names``) graded on ``lab``: {name: result as plain values, or why it was not}.

    An exercise whose names the learner has not defined is "not attempted", not failed: what
    ``python -m distlab.exercises grade`` reports for a notebook.
    """
    chosen = [get(name).name for name in names] if names is not None else list(EXERCISES)
    grades: dict[str, Grade] = {}
    for name in chosen:
        try:
            grades[name] = check(name, lab, record=False).to_dict()
        except LabUsageError as exc:
            grades[name] = {"passed": False, "attempted": False, "feedback": str(exc)}
    return grades


def grading_lab(learner_lab: LabCore, size: int) -> LabCore:
    """The grader's lab for ``learner_lab`` at ``size`` ranks: started at its first use, or restarted when
    a rank died (a learner's code, an out-of-memory kill), by the learner's lab, which stops it with itself.

    CPU ranks on gloo, whatever the learner's lab runs: a case asks for 2 to 4 ranks, more than a
    laptop's or Colab's one GPU gives NCCL, and what the graders measure (bytes, counts, order,
    results) is the same on any device.
    """
    return learner_lab.companion(f"{_COMPANION}-{size}", size, backend="gloo")


# ---------------------------------------------------------------------------- the steps


def _learners_lab(lab: LabCore | None, exercise: Exercise) -> LabCore:
    if lab is None:
        from ..notebook import labs

        # The lab %dist started in this session, from the registry (whose labs are each a LabCore: a lab
        # adds itself at its start), not from ``front``, which sits above this package (its magics import it).
        lab = cast("LabCore | None", labs.current())
    if lab is None or not lab.running:
        raise LabUsageError(
            f"no lab is running: start one (%dist start -n 2), define {_names(exercise)} in a %%ddp cell, "
            f"then check again (%exercise {exercise.name} shows the task)"
        )
    return lab


def _definitions(lab: LabCore, exercise: Exercise) -> bytes:
    found = _ask(lab, lambda engine, rank: rpc.pack_definitions(engine, list(exercise.defines)))
    if "missing" in found:
        raise LabUsageError(
            f"{_names(found['missing'])} {'is' if len(found['missing']) == 1 else 'are'} not defined on the ranks: "
            f"define {'it' if len(found['missing']) == 1 else 'them'} in a %%ddp cell, then check again "
            f"(%exercise {exercise.name} shows the task and its starter code)"
        )
    if "unpicklable" in found:
        raise LabUsageError(
            f"{_names(exercise)} cannot be sent to the grader's ranks ({found['unpicklable']}): "
            "keep what the solution needs inside it, or in plain functions, classes and numbers it uses"
        )
    blob: bytes = found["blob"]
    return blob


def _case_names(exercise: Exercise, size: int, seed: int) -> Send:
    return lambda engine, rank: rpc.case_names(engine, exercise.name, size, seed)


def _ask(lab: LabCore, send: Send) -> Any:
    """Rank 0's answer to a quick call, under a deadline."""
    return lab.call(send, ranks=[0], timeout=_ASK_TIMEOUT_S)[0]


def _run_case(
    world: LabCore, exercise: Exercise, blob: bytes, seed: int, index: int, size: int, case_name: str, quote: Quote
) -> tuple[CaseResult, bool]:
    """The case's result, and whether it ran past its deadline."""

    def send(engine: rpc.RankTarget, rank: int) -> rpc.Pending[CellReply]:
        return rpc.grade_case(engine, exercise.name, blob, seed, index, rank)

    base = (index, size, case_name)
    try:
        outcomes: dict[int, CaseOutcome] = world.call(send, timeout=exercise.case_timeout_s)
    except CellTimeout as exc:
        message = _stuck(exc.failures, quote, f"stopped after {exercise.case_timeout_s:g} s")
        # A case stopped at its deadline leaves its ranks as the stop found them: an import cut half
        # way (torch._dynamo, seen under load) broke every later check at this size. Fresh ranks for the
        # next check (from the lab's spares: about a second).
        world.restart()
        return CaseResult(*base, passed=False, message=message, rank=min(exc.failures)), True
    except RankError as exc:
        dead = sorted(rank for rank, failure in exc.failures.items() if failure.ename == "EngineError")
        if dead:
            # The world cannot run the next cases: they are not run. The next check gets it whole
            # (``companion`` restarts a lab whose rank died).
            return CaseResult(*base, passed=False, message=_died(dead), rank=dead[0]), True
        waits = {rank: _GLOO_TIMEOUT.search(failure.headline) for rank, failure in exc.failures.items()}
        timed_out = sorted(rank for rank, found in waits.items() if found)
        if timed_out:
            # gloo's own deadline (the lab's timeout) came before the case's: the same hang, found by
            # the backend. Every later case would wait as long again, so none runs; the ranks' pairs
            # that timed out are broken, so the next check gets fresh ranks.
            world.restart()
            waited = waits[timed_out[0]]
            after = f"{int(waited['ms']) / 1000:g} s" if waited and waited["ms"] else "its timeout"
            message = _stuck(exc.failures, quote, f"gloo gave up waiting after {after}")
            return CaseResult(*base, passed=False, message=message, rank=timed_out[0]), True
        rank, failure = _first_cause(exc.failures)
        return CaseResult(*base, passed=False, message=_raised(failure, quote), rank=rank), False
    wrong = [(rank, outcome) for rank, outcome in sorted(outcomes.items()) if not outcome["passed"]]
    if wrong:
        rank, outcome = wrong[0]
        others = [r for r, _ in wrong[1:]]
        also = f" (rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} too)" if others else ""
        case = CaseResult(
            *base, passed=False, message=outcome["message"] + also, rank=rank, measured=outcome["measured"]
        )
        return case, False
    first = outcomes[min(outcomes)]
    return CaseResult(*base, passed=True, message=first["message"], measured=first["measured"]), False


def _died(ranks: list[int]) -> str:
    who = f"rank {ranks[0]}'s process" if len(ranks) == 1 else f"the processes of ranks {', '.join(map(str, ranks))}"
    return (
        f"{who} died during this case: gloo ends a process when a send and its receive differ in size, so "
        "check that each pair of ranks moves chunks of the same number of elements, in the same direction"
    )


def _verdict(exercise: Exercise, cases: tuple[CaseResult, ...], seed: int) -> ExerciseResult:
    failures = [case for case in cases if not case.passed]  # a case not run is not passed
    sizes = sorted({case.world_size for case in cases})
    worlds = " and ".join(map(str, sizes))
    if not failures:
        feedback = f"all {len(cases)} cases passed, in worlds of {worlds} ranks"
        return ExerciseResult(exercise.name, True, feedback, cases, seed)
    first = failures[0]
    named = first.rank is None or first.message.startswith("rank")
    where = "" if named else f" on rank {first.rank}"
    others = sum(case.ran for case in failures[1:])
    skipped = sum(not case.ran for case in cases)
    more = f" ({others} more case{'s' if others > 1 else ''} failed)" if others else ""
    more += f" ({skipped} case{'s' if skipped > 1 else ''} not run)" if skipped else ""
    feedback = f"{first.label}{where}: {first.message}{more}"
    return ExerciseResult(exercise.name, False, feedback, cases, seed)


# ---------------------------------------------------------------------------- failures in words

_STUCK = "never returned"
#: gloo's words when a send or receive waits past the group's timeout (gloo/transport/tcp).
_GLOO_TIMEOUT = re.compile(r"Timed out waiting(?: (?P<ms>\d+)ms)?", re.IGNORECASE)
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)')

#: (function, line) -> the learner's line there, as they wrote it ("" if not found).
Quote = Callable[[str, int], str]


def _quoter(lab: LabCore) -> Quote:
    """Quote the learner's own lines: their code arrives on the grader's ranks without its text.

    A line number in ``<your code>`` counts within the cell that defined the function; the cell is
    the latest in the lab's history that defines a function of that name.
    """
    cells = [event.code for event in reversed(lab.history) if isinstance(event, CellRan)]

    def quote(function: str, line: int) -> str:
        for code in cells:
            text = code.lstrip("\n")  # IPython drops a cell's leading empty lines before compiling it
            try:
                tree = ast.parse(text)
            except SyntaxError:
                continue
            defined = any(
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == function
                for node in ast.walk(tree)
            )
            if defined:
                lines = text.splitlines()
                return lines[line - 1].strip() if 0 < line <= len(lines) else ""
        return ""

    return quote


def _learner_frame(traceback_text: str, quote: Quote) -> str:
    """'line 4 of ring_all_reduce: `dist.recv(t, 1)`', the learner's innermost frame ("" if none)."""
    mine = [m.groupdict() for m in _FRAME.finditer(traceback_text) if m["file"] == LEARNER_FILE]
    if not mine:
        return ""
    function, line = mine[-1]["function"], int(mine[-1]["line"])
    text = quote(function, line)
    return f"line {line} of {function}" + (f": `{text}`" if text else "")


def _stuck(failures: dict[int, RankFailure], quote: Quote, ended: str) -> str:
    """'ranks 0, 1 never returned from line 4 of average_gradients: `dist.recv(...)`, stopped after 5 s: ...'
    (``ended``: how the wait ended)."""
    places: dict[str, list[int]] = {}
    for rank, failure in sorted(failures.items()):
        places.setdefault(_learner_frame(failure.traceback, quote), []).append(rank)
    parts = []
    for place, ranks in places.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        parts.append(f"{who} {_STUCK} from {place}" if place else f"{who} {_STUCK}")
    return (
        f"{'; '.join(parts)}, {ended}: a deadlock? Every send needs a matching "
        "receive that the other rank reaches, and every rank must make the same collectives in the same order"
    )


def _first_cause(failures: dict[int, RankFailure]) -> tuple[int, RankFailure]:
    """The rank whose own code failed, rather than one distlab stopped because of it."""
    for rank, failure in sorted(failures.items()):
        if failure.ename != "Stopped":
            return rank, failure
    rank = min(failures)
    return rank, failures[rank]


def _raised(failure: RankFailure, quote: Quote) -> str:
    where = _learner_frame(failure.traceback, quote)
    return f"raised {failure.headline}" + (f" at {where}" if where else "")


def _names(what: Exercise | Iterable[str]) -> str:
    names = list(what.defines) if isinstance(what, Exercise) else list(what)
    quoted = [f"`{n}`" for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def _checked_seed(seed: object) -> int:
    from .. import checks

    return checks.whole("seed", seed, minimum=0, example="seed=1")

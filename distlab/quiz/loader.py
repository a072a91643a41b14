"""The question bank: JSON files checked against ``schema.json``, then against the rules a schema cannot say
(one right option, theory functions that exist and take the parameters given, units that fit).

Package data is read through :mod:`importlib.resources`, so the bank is found in a wheel as in a checkout.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import jsonschema

from .. import theory
from .bank_json import RawOption, RawParam, RawQuestion, RawTolerance
from .live import LiveQuestion, wrap_cell
from .model import ChoiceQuestion, Option, OrderingQuestion, Question
from .numeric import Mistake, NumericQuestion, Tolerance, theory_function
from .params import ParamSpec, template_fields
from .topics import TOPICS, resolve_difficulty, resolve_topic

if TYPE_CHECKING:
    if sys.version_info >= (3, 11):
        from importlib.resources.abc import Traversable
    else:  # Python 3.10 has it only here
        from importlib.abc import Traversable

__all__ = ["Bank", "BankError", "bank", "load_bank", "schema"]


_PACKAGE = "distlab.quiz"


class _Common(TypedDict):
    """The fields every kind of question has."""

    id: str
    kind: str
    difficulty: str
    prompt: str
    hint: str
    explanation: str
    topic: str
    source: str


class BankError(ValueError):
    """A bank file breaks the schema or a rule of the bank. The message names the file and the question."""


@functools.cache
def schema() -> dict[str, object]:
    """The JSON Schema (draft 2020-12) every bank file must match."""
    text = resources.files(_PACKAGE).joinpath("schema.json").read_text(encoding="utf-8")
    loaded: dict[str, object] = json.loads(text)
    return loaded


class Bank:
    """All questions, by id. Iterating yields them topic by topic, in curriculum order."""

    def __init__(self, questions: Iterable[Question]) -> None:
        order = {topic: index for index, topic in enumerate(TOPICS)}
        self._by_id = {q.id: q for q in sorted(questions, key=lambda q: order.get(q.topic, len(order)))}

    def __iter__(self) -> Iterator[Question]:
        return iter(self._by_id.values())

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, question_id: object) -> bool:
        return question_id in self._by_id

    def __repr__(self) -> str:
        return f"<Bank: {len(self)} questions on {len({q.topic for q in self})} topics>"

    def get(self, question_id: str) -> Question:
        """The question with this id; a ``KeyError`` names the closest ids when there is none."""
        try:
            return self._by_id[question_id]
        except KeyError:
            close = difflib.get_close_matches(str(question_id), self._by_id, n=3)
            guess = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise KeyError(f"no question {question_id!r} in the bank{guess}") from None

    def select(self, topic: str | int, difficulty: str | None = None) -> tuple[Question, ...]:
        """The questions of ``topic`` (slug or number), of one ``difficulty`` if given."""
        slug, level = resolve_topic(topic), resolve_difficulty(difficulty)
        return tuple(q for q in self if q.topic == slug and level in (None, q.difficulty))


@functools.cache
def bank() -> Bank:
    """The bank shipped with distlab (loaded and checked once per process)."""
    return load_bank(resources.files(_PACKAGE).joinpath("bank"))


def load_bank(folder: Traversable | Path) -> Bank:
    """Load and check every ``<topic>.json`` in ``folder``; a :class:`BankError` names the file and question."""
    validator = jsonschema.Draft202012Validator(schema())
    questions: list[Question] = []
    seen_ids: dict[str, str] = {}
    seen_prompts: dict[str, str] = {}
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".json")), key=lambda f: f.name)
    if not files:
        raise BankError(f"{folder}: no question files (<topic>.json) found")
    for file in files:
        for question in _load_file(file, validator):
            where = f"{file.name}, question {question.id!r}"
            if question.id in seen_ids:
                raise BankError(f"{where}: the id is used twice (also in {seen_ids[question.id]})")
            prompt_key = re.sub(r"\W+", " ", question.prompt).strip().lower()
            if prompt_key in seen_prompts:
                raise BankError(f"{where}: the same prompt as question {seen_prompts[prompt_key]!r}")
            seen_ids[question.id] = file.name
            seen_prompts[prompt_key] = question.id
            questions.append(question)
    return Bank(questions)


def _load_file(file: Traversable | Path, validator: jsonschema.protocols.Validator) -> list[Question]:
    name = file.name
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise BankError(f"{name}: not valid JSON at line {error.lineno}, column {error.colno}: {error.msg}") from None
    errors = list(validator.iter_errors(data))
    # When a kind's "then" branch fails, unevaluatedProperties also reports each field of that branch as
    # unexpected; the branch's own error says what is actually wrong, so it is reported first.
    specific = [e for e in errors if e.validator != "unevaluatedProperties"]
    worst = jsonschema.exceptions.best_match(specific or errors)
    if worst is not None:
        raise BankError(f"{name}{_question_of(data, list(worst.absolute_path))}: {_describe(worst)}")
    topic = data["topic"]
    if topic not in TOPICS:
        raise BankError(f"{name}: unknown topic {topic!r}; use one of {', '.join(TOPICS)}")
    if name != f"{topic}.json":
        raise BankError(f"{name}: a file holds one topic and is named after it: rename it {topic}.json")
    raws: list[RawQuestion] = data["questions"]  # as the schema, checked above, says
    questions = []
    for raw in raws:
        try:
            questions.append(_build(raw, topic, name))
        except ValueError as problem:
            raise BankError(f"{name}, question {raw['id']!r}: {problem}") from None
    return questions


def _question_of(data: object, path: list[str | int]) -> str:
    """The part of a schema error's message that names the question the error is in."""
    # The path leads into data: data["questions"][path[1]] is there.
    if len(path) >= 2 and path[0] == "questions" and isinstance(path[1], int) and isinstance(data, dict):
        raw = data["questions"][path[1]]
        label = raw.get("id") if isinstance(raw, dict) else None
        return f", question {label!r}" if isinstance(label, str) else f", question #{path[1] + 1}"
    return ""


def _describe(error: jsonschema.ValidationError) -> str:
    path = list(error.absolute_path)
    inner = path[2:] if path[:1] == ["questions"] else path  # the question itself is named already
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in inner).lstrip(".")
    return f"{where}: {error.message}" if where else error.message


# --------------------------------------------------------------------------------------------------
# From JSON to questions, with the checks a schema cannot make.
# --------------------------------------------------------------------------------------------------


def _build(raw: RawQuestion, topic: str, source: str) -> Question:
    if not raw["id"].startswith(f"{topic}/"):
        raise ValueError(f"ids in {source} start with '{topic}/'")
    common: _Common = {
        "id": raw["id"],
        "kind": raw["kind"],
        "difficulty": raw["difficulty"],
        "prompt": raw["prompt"],
        "hint": raw["hint"],
        "explanation": raw["explanation"],
        "topic": topic,
        "source": source,
    }
    kind = raw["kind"]
    if kind in ("single", "multiple"):
        options = _options(raw["options"])
        right = sum(option.correct for option in options)
        if kind == "single" and right != 1:
            raise ValueError(f"a single-choice question has exactly one right option (found {right})")
        if kind == "multiple" and not 1 <= right < len(options):
            raise ValueError(
                f"a multiple-choice question needs right and wrong options (found {right} of {len(options)} right)"
            )
        return ChoiceQuestion(**common, options=options)
    if kind == "ordering":
        return OrderingQuestion(**common, items=_options(raw["items"]))
    if kind == "numeric":
        return _numeric(raw, common)
    return _live(raw, common)


def _options(raws: Iterable[RawOption]) -> tuple[Option, ...]:
    options = tuple(
        Option(
            id=o["id"], text=o["text"], feedback=o["feedback"], correct=o.get("correct", False), value=o.get("value")
        )
        for o in raws
    )
    for label, values in (("id", [o.id for o in options]), ("text", [o.text for o in options])):
        if len(set(values)) != len(values):
            twice = next(v for v in values if values.count(v) > 1)
            raise ValueError(f"two options have the {label} {twice!r}")
    return options


def _param(name: str, raw: RawParam) -> ParamSpec:
    unit = raw.get("unit", "")
    theory.unit_dimension(unit)  # an unknown unit raises with the list of units
    values = [raw["value"]] if "value" in raw else [*raw.get("choices", []), raw.get("min"), raw.get("max")]
    numbers = [v for v in values if v is not None and not isinstance(v, str)]
    named, measured = theory.dimension_of(name), theory.unit_dimension(unit)
    if numbers and named != measured:
        raise ValueError(
            f"parameter {name!r} is {theory.DIMENSIONS[named]} by its name, but its unit {unit!r} is for "
            f"{theory.DIMENSIONS[measured]}: fix the unit or the name"
        )
    forms = [
        form
        for form, keys in (("value", "value"), ("choices", "choices"), ("min/max/step", "min max step"))
        if any(key in raw for key in keys.split())
    ]
    if len(forms) != 1:
        raise ValueError(
            f"parameter {name!r} is drawn one way: give a value, choices, or min/max/step (not {' and '.join(forms)})"
        )
    if "min" in raw and raw["min"] > raw["max"]:
        raise ValueError(f"parameter {name!r}: min {raw['min']} is above max {raw['max']}")
    return ParamSpec(
        name=name,
        unit=unit,
        value=raw.get("value"),
        choices=tuple(raw.get("choices", ())),
        low=raw.get("min"),
        high=raw.get("max"),
        step=raw.get("step"),
        length=raw.get("length"),
        labels=tuple(raw.get("labels", {}).items()),
    )


def _check_templates(raw: RawQuestion, names: Iterable[str]) -> None:
    known = set(names)
    for key in ("prompt", "hint", "explanation"):
        allowed = known | {"answer"} if key == "explanation" else known
        try:
            unknown = template_fields(raw[key]) - allowed
        except ValueError as error:  # unbalanced braces
            raise ValueError(f"{key}: {error} (write a literal brace as {{{{ or }}}})") from None
        if unknown:
            raise ValueError(f"{key} uses {{{min(unknown)}}}, which is not one of: {', '.join(sorted(allowed))}")


def _numeric(raw: RawQuestion, common: _Common) -> NumericQuestion:
    answer = raw["answer"]
    function = theory_function(answer["theory"])
    params = tuple(_param(name, spec) for name, spec in answer["params"].items())
    _check_signature(function, [p.name for p in params])
    unit = raw["unit"]
    measured, returned = theory.unit_dimension(unit), theory.dimension_of(answer["theory"])
    if measured != returned:
        raise ValueError(
            f"unit {unit!r} is for {theory.DIMENSIONS[measured]}, but {answer['theory']} returns "
            f"{theory.DIMENSIONS[returned]}"
        )
    mistakes = []
    for entry in raw.get("mistakes", ()):
        overrides = entry.get("set", {})
        unknown = sorted(set(overrides) - {p.name for p in params})
        if unknown:
            raise ValueError(f"a mistake sets {unknown[0]!r}, which is not a parameter of the question")
        if "theory" in entry:
            theory_function(entry["theory"])  # raises if there is no such function
        mistakes.append(
            Mistake(feedback=entry["feedback"], overrides=tuple(overrides.items()), theory=entry.get("theory"))
        )
    _check_templates(raw, [p.name for p in params])
    return NumericQuestion(
        **common,
        theory=answer["theory"],
        params=params,
        unit=unit,
        tolerance=_tolerance(raw.get("tolerance", {})),
        mistakes=tuple(mistakes),
    )


def _tolerance(raw: RawTolerance) -> Tolerance:
    return Tolerance(relative=raw.get("relative", 0.0), absolute=raw.get("absolute", 0.0))


def _check_signature(function: Callable[..., object], names: list[str]) -> None:
    signature = inspect.signature(function)
    try:
        signature.bind(**dict.fromkeys(names))
    except TypeError as error:
        expected = ", ".join(signature.parameters)
        raise ValueError(f"the parameters do not fit {function.__name__}({expected}): {error}") from None


def _live(raw: RawQuestion, common: _Common) -> LiveQuestion:
    code = "\n".join(raw["code"])
    params = tuple(_param(name, spec) for name, spec in raw.get("params", {}).items())
    try:
        # Compiled here, never run: a syntax error is the bank's fault and must show at load time.
        compile(wrap_cell(code, {p.name: 0 for p in params}), f"<{common['id']}>", "exec")
    except (SyntaxError, ValueError) as error:
        raise ValueError(f"code: {error}") from None
    reserved = {"rank", "world_size", "torch", "dist"} & {p.name for p in params}
    if reserved:
        raise ValueError(f"parameter {min(reserved)!r} would hide the rank's own name: rename it")
    min_world_size = raw.get("min_world_size", 2)
    rank = raw["rank"]
    if isinstance(rank, int) and rank >= min_world_size:  # else "last"
        raise ValueError(
            f"rank {rank} does not exist in a lab of min_world_size {min_world_size}: raise min_world_size"
        )
    options = _options(raw.get("options", ()))
    values = [option.value for option in options]
    if len({json.dumps(v) for v in values}) != len(values):
        raise ValueError("two options stand for the same lab value")
    _check_templates(raw, [p.name for p in params] + ["world_size", "rank"])
    unit = raw.get("unit", "")
    theory.unit_dimension(unit)  # an unknown unit raises with the list of units
    return LiveQuestion(
        **common,
        code=code,
        params=params,
        rank=rank,
        min_world_size=min_world_size,
        response=raw["response"],
        unit=unit,
        tolerance=_tolerance(raw.get("tolerance", {})),
        options=options,
    )

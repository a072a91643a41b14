"""What a question bank file holds, as ``schema.json`` says: TypedDicts the loader reads a file as,
once the schema has checked it (``loader.py`` then checks what a schema cannot say)."""

from __future__ import annotations

from typing import TypedDict

__all__ = [
    "RawAnswer", "RawMistake", "RawMistakeBase", "RawOption", "RawOptionBase", "RawParam", "RawQuestion",
    "RawQuestionBase", "RawTolerance",
]


class RawOptionBase(TypedDict):
    id: str
    text: str
    feedback: str


class RawOption(RawOptionBase, total=False):
    correct: bool  # choice questions
    value: bool | float | str  # live questions: the lab's result when this option is right


class RawParam(TypedDict, total=False):
    value: float | str
    choices: list[float | str]
    min: float
    max: float
    step: float
    unit: str
    length: int
    labels: dict[str, str]


class RawAnswer(TypedDict):
    theory: str  # a public function of distlab.theory
    params: dict[str, RawParam]


class RawTolerance(TypedDict, total=False):
    relative: float
    absolute: float


class RawMistakeBase(TypedDict):
    feedback: str


class RawMistake(RawMistakeBase, total=False):
    set: dict[str, float | str]
    theory: str


class RawQuestionBase(TypedDict):
    id: str
    kind: str  # "single", "multiple", "numeric", "ordering" or "live"
    difficulty: str
    prompt: str
    hint: str
    explanation: str


class RawQuestion(RawQuestionBase, total=False):
    options: list[RawOption]  # single, multiple, live (choice)
    items: list[RawOption]  # ordering
    answer: RawAnswer  # numeric
    unit: str
    tolerance: RawTolerance
    mistakes: list[RawMistake]
    code: list[str]  # live
    params: dict[str, RawParam]
    rank: int | str  # a rank, or "last"
    min_world_size: int
    response: str  # "numeric" or "choice"

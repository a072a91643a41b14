"""Predict, then measure: the learner commits a guess before a timed cell, then sees it beside the
theory and the measurement.

    p = predict("How long will a 16 MB all-reduce take over this link?", theory="ring_allreduce_time_s",
                unit="ms", size_bytes=16e6, workers=2, bandwidth_bytes_per_s=12.5e6, latency_s=0)
    p                        # the widget: the question, a box, Commit
    ...                      # the timed cells
    p.reveal(measured_s)     # prediction, theory and measurement side by side (a Comparison)

A guess is graded against :mod:`distlab.theory` (a function named as the quiz bank names them, or a
callable built from them), never against the measurement: the point is to learn the model, and then
to see whether this machine follows it. Qualitative predictions take ``choices`` and the ``answer``
the theory gives. Every button can be pressed from Python (``p.commit("2.5 ms")``).
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import ipywidgets as widgets

from .. import theory as _theory
from .numeric import read_number, theory_function
from .params import format_quantity

__all__ = ["Comparison", "Guess", "Prediction", "predict"]

#: A prediction, theory's value or a measurement: a number in base units, or a choice's key.
Guess = float | str


@dataclass(frozen=True)
class Comparison:
    """A prediction beside the theory and the measurement.

    Numbers are in base units (seconds, bytes, fractions); ``ratio`` is measured / theory. For a
    qualitative prediction they are choice keys and ``ratio`` is None.
    """

    prompt: str
    unit: str
    prediction: Guess | None
    theory: Guess
    measured: Guess
    ratio: float | None
    prediction_right: bool | None
    labels: Mapping[str, str] | None = None

    def _show(self, value: Guess | None) -> str:
        if value is None:
            return "none committed"
        return _shown(value, self.labels, self.unit)

    def rows(self) -> list[tuple[str, str, str]]:
        """(what, value, remark) for the prediction, the theory and the measurement."""
        if self.prediction is None:
            guess = ""
        else:
            guess = "agrees with theory" if self.prediction_right else "differs from theory"
        if self.labels is not None:
            measured = "as theory says" if self.measured == self.theory else "not what theory says"
        else:
            measured = f"{self.ratio:.2f} x theory" if self.ratio is not None else ""
        return [
            ("your prediction", self._show(self.prediction), guess),
            ("theory", self._show(self.theory), ""),
            ("measured", self._show(self.measured), measured),
        ]

    def __str__(self) -> str:
        return "\n".join([self.prompt, *(f"  {a:<16} {b:<18} {c}".rstrip() for a, b, c in self.rows())])

    def _repr_html_(self) -> str:
        cells = "".join(
            f"<tr><td>{html.escape(a)}</td><td><b>{html.escape(b)}</b></td><td>{html.escape(c)}</td></tr>"
            for a, b, c in self.rows()
        )
        return f"<p>{html.escape(self.prompt)}</p><table>{cells}</table>"

    def __repr__(self) -> str:
        return str(self)


class Prediction(widgets.VBox):
    """The widget :func:`predict` returns: a question, an answer box (or choices) and Commit."""

    def __init__(
        self,
        prompt: str,
        expected: Guess,
        unit: str,
        tolerance: float,
        source: str,
        choices: Mapping[str, str] | None,
    ) -> None:
        self.prompt, self.expected, self.unit, self.tolerance = prompt, expected, unit, tolerance
        self.source, self.choices = source, choices
        self.value: Guess | None = None  # the committed prediction (base units, or a choice key)
        if choices is None:
            self.entry: widgets.Widget = widgets.Text(placeholder="your estimate", layout=widgets.Layout(width="14em"))
            answer_box: widgets.Widget = widgets.HBox([self.entry, widgets.Label(unit)])
        else:
            self.entry = widgets.RadioButtons(options=[(text, key) for key, text in choices.items()], value=None)
            answer_box = self.entry
        self.commit_button = widgets.Button(description="Commit", button_style="primary")
        self.feedback = widgets.HTML()
        self.commit_button.on_click(lambda _button: self._on_commit())
        super().__init__([widgets.HTML(f"<b>Predict.</b> {html.escape(prompt)}"), answer_box,
                          self.commit_button, self.feedback])

    def _on_commit(self) -> None:
        if self.value is not None:
            return
        try:
            value = self._read()
        except ValueError as error:
            self.feedback.value = html.escape(str(error))
            return
        self.value = value
        self.entry.disabled = self.commit_button.disabled = True
        right = self.right(value)
        verdict = "✔ Close to what theory says" if right else "✘ Theory says otherwise"
        self.feedback.value = html.escape(
            f"{verdict}: {self._show(self.expected)} ({self.source}). Now run the measurement."
        )

    def _read(self) -> Guess:
        if self.choices is not None:
            if self.entry.value is None:
                raise ValueError("choose one of the answers first")
            key: str = self.entry.value  # one of the choices' keys
            return key
        return _theory.to_base_units(read_number(self.entry.value, self.unit), self.unit)

    def _show(self, value: Guess) -> str:
        return _shown(value, self.choices, self.unit)

    def right(self, value: Guess) -> bool:
        """Whether ``value`` (base units, or a choice key) is what theory says, within the tolerance."""
        if self.choices is not None or isinstance(value, str) or isinstance(self.expected, str):
            return bool(value == self.expected)
        return bool(abs(value - self.expected) <= self.tolerance * abs(self.expected))

    def commit(self, answer: object) -> None:
        """Enter ``answer`` ("2.5 ms", 2.5 in the widget's unit, or a choice key) and press Commit."""
        if self.choices is not None:
            self.entry.value = answer
        else:
            self.entry.value = str(answer)
        self.commit_button.click()

    def reveal(self, measured: Guess) -> Comparison:
        """The prediction, the theory and ``measured`` (base units, or the choice key that happened)."""
        if self.choices is not None:
            if measured not in self.choices:
                raise ValueError(f"measured must be one of {sorted(self.choices)}, got {measured!r}")
            ratio = None
        else:
            if isinstance(measured, bool) or not isinstance(measured, (int, float)) or not math.isfinite(measured):
                raise ValueError(f"measured must be a finite number in base units (seconds, bytes), got {measured!r}")
            expected = self.expected  # a number: this prediction has no choices
            ratio = measured / expected if expected and not isinstance(expected, str) else None
        right = None if self.value is None else self.right(self.value)
        return Comparison(self.prompt, self.unit, self.value, self.expected, measured, ratio, right, self.choices)


def _shown(value: Guess, choices: Mapping[str, str] | None, unit: str) -> str:
    """A choice key as its text; a number in base units in ``unit``."""
    if isinstance(value, str):
        return choices[value] if choices is not None else value
    return format_quantity(round(_theory.from_base_units(value, unit), 4), unit)


def predict(
    prompt: str,
    *,
    theory: str | Callable[..., float] | None = None,
    unit: str = "",
    tolerance: float = 0.25,
    choices: Mapping[str, str] | None = None,
    answer: str | None = None,
    **args: object,
) -> Prediction:
    """A prediction widget, graded by theory.

    Numeric: ``theory`` names a :mod:`distlab.theory` function (or is a callable computing from
    them), called with ``args``; a guess within ``tolerance`` (relative) of its value is right.
    Qualitative: ``choices`` maps keys to the texts shown and ``answer`` is the key theory gives.
    """
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("predict needs a question: predict('How long will ...?', theory=..., ...)")
    if choices is not None:
        if theory is not None or args:
            raise ValueError("give either choices= and answer= or theory= and its arguments, not both")
        if not choices or answer is None or answer not in choices:
            raise ValueError(f"answer must be one of the choices' keys {sorted(choices or {})}, got {answer!r}")
        return Prediction(prompt, answer, "", 0.0, "theory", dict(choices))
    if answer is not None:
        raise ValueError("answer= goes with choices=; a numeric prediction takes theory= and its arguments")
    if isinstance(theory, str):
        function, source = theory_function(theory), f"theory.{theory}"
    elif callable(theory):
        function, source = theory, f"{getattr(theory, '__name__', 'the model')}"
    else:
        raise ValueError("predict needs theory= (a distlab.theory function name) or choices= with answer=")
    _theory.unit_dimension(unit)  # raises with the list of units
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 < tolerance < 10:
        raise ValueError(f"tolerance is a relative margin such as 0.25 (25%), got {tolerance!r}")
    expected = float(function(**args))
    return Prediction(prompt, expected, unit, float(tolerance), source, None)

"""The argument checks every theory module uses: distlab.checks, bound once for theory.

Private: the public names are the cost models that call these.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from .. import checks

# --------------------------------------------------------------------------------------------------
# Argument checks: distlab.checks, so a user's mistake raises ValueError with the fix. Bound here to
# what holds for every theory function: a number typed with its unit ("400 MB") is pointed at
# parse_quantity, and counts may come as whole floats (1e6 samples, 4.0 workers; 2.5 workers is refused).
# --------------------------------------------------------------------------------------------------

_TEXT = "convert text first, e.g. parse_quantity('400 MB', 'B')"
checked_number = partial(checks.number, text=_TEXT)
checked_non_negative = partial(checks.non_negative, text=_TEXT)
checked_positive = partial(checks.positive, text=_TEXT)
checked_fraction = partial(checks.fraction, text=_TEXT)
checked_count = partial(checks.whole, minimum=1, integral_floats=True)


def checked_sequence(name: str, value: object) -> Sequence[object]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{name} must be a non-empty list of numbers, got {value!r}")
    return value

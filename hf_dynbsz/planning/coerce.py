"""The value checkers of every setting: strings from a command line, YAML or ``DIFFU_*`` variable to checked values.

One set of functions, used by the settings table (:func:`coerce_setting`), the batch-size plan
(:mod:`hf_dynbsz.planning.plan`), the ``DIFFU_*`` overrides (:mod:`hf_dynbsz.planning.env`), the command line and the
argument checks of the partitioner, the cost model and the token accounting (:func:`check_int`, :func:`check_choice`,
:func:`check_lengths`). Errors name the setting, the value and the fix:
"<name> must be <expected>, got <value>: <fix>".

Pure Python and numpy (no torch, no TRL).
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from hf_dynbsz.planning.settings import Setting, SharePrefix

__all__ = [
    "check_choice",
    "check_int",
    "check_length_list",
    "check_lengths",
    "check_optional_int",
    "coerce_bool",
    "coerce_int",
    "coerce_optional_int",
    "coerce_pad_to_multiple_of",
    "coerce_setting",
    "coerce_sharing",
    "finite_number",
    "is_integer",
    "is_none_text",
    "parse_int",
]

NONE_STRINGS = ("none", "null", "auto")
TRUE_STRINGS = ("true", "1", "yes", "on")
FALSE_STRINGS = ("false", "0", "no", "off")


def is_none_text(value: Any) -> bool:
    """Whether ``value`` means unset: ``None`` or "none"/"null"/"auto" (any case, surrounding spaces ignored)."""
    return value is None or (isinstance(value, str) and value.strip().lower() in NONE_STRINGS)


def parse_int(value: Any, strings: bool = True) -> int | None:
    """``value`` as an ``int``, or None when it is not an integer.

    Integers (numpy's included) are accepted, bools and floats are not; with ``strings``, a string of decimal
    digits (surrounding spaces ignored, no sign) is too.
    """
    if isinstance(value, str):
        text = value.strip()
        return int(text) if strings and text.isascii() and text.isdigit() else None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return None


def coerce_int(name: str, value: Any, expected: str, fix: str | None = None, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``; accepts ints and decimal strings, rejects bools, floats and the rest.

    Raises :class:`ValueError` "<name> must be <expected>, got <value>." (": <fix>" instead of the period when
    ``fix`` is given); a decimal string is shown as the number it reads as.
    """
    number = parse_int(value)
    if number is None or number < minimum:
        shown = value if number is None else number
        raise ValueError(f"{name} must be {expected}, got {shown!r}" + (f": {fix}" if fix else "."))
    return number


def coerce_optional_int(name: str, value: Any, expected: str, fix: str) -> int | None:
    """Like :func:`coerce_int` but ``None`` (or "none"/"null"/"auto") means unset; the error shows ``value`` as given
    and ends with ``fix``."""
    if is_none_text(value):
        return None
    try:
        return coerce_int(name, value, expected)
    except ValueError:
        raise ValueError(f"{name} must be {expected}, got {value!r}: {fix}") from None


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """An algorithm's integer argument >= ``minimum`` (no strings): "<name> must be an integer >= <minimum>"."""
    number = parse_int(value, strings=False)
    if number is None or number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number


def coerce_bool(name: str, value: Any) -> bool:
    """``value`` as a bool: bools, and "true"/"1"/"yes"/"on" or "false"/"0"/"no"/"off" (any case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in TRUE_STRINGS + FALSE_STRINGS:
        return value.strip().lower() in TRUE_STRINGS
    raise ValueError(f"{name} must be true or false, got {value!r}.")


def finite_number(value: Any) -> float | None:
    """``value`` as a finite float (numbers and numeric strings), or None when it is not one."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def coerce_sharing(spec: Setting, value: Any) -> SharePrefix:
    """The :class:`~hf_dynbsz.planning.settings.SharePrefix` of a sharing setting's value: a member, a bool (strings
    as :func:`coerce_bool` reads them; true is the default rule, the tree), or a rule's name in any case ("tree",
    "groups", and "none", the name a saved config writes for false)."""
    from hf_dynbsz.planning.settings import SharePrefix

    if isinstance(value, SharePrefix):
        return value
    if isinstance(value, str) and value.strip().lower() in (*spec.choices, SharePrefix.NONE.value):
        return SharePrefix(value.strip().lower())
    try:
        return SharePrefix.of(coerce_bool(spec.name, value))
    except ValueError:
        raise ValueError(f"{spec.name} must be {spec.expected}, got {value!r}: {spec.fix}") from None


def coerce_pad_to_multiple_of(value: Any) -> int | None:
    """GRPOConfig's ``pad_to_multiple_of``: an int, None, or "auto" (None except on Neuron, where TRL uses 128)."""
    return coerce_optional_int(
        "pad_to_multiple_of",
        value,
        "a positive integer number of tokens",
        "set a positive multiple such as 64, or leave it unset.",
    )


def coerce_setting(spec: Setting, value: Any) -> Any:
    """``value`` of the setting ``spec`` converted (strings from a command line or YAML) and checked.

    Raises :class:`ValueError` "<name> must be <expected>, got <value>: <fix>".
    """
    if spec.kind == "bool":
        return coerce_bool(spec.name, value)
    if spec.kind == "sharing":
        return coerce_sharing(spec, value)
    if spec.kind == "choice":
        if value not in spec.choices:
            raise ValueError(
                f"{spec.name} must be one of {', '.join(map(repr, spec.choices))}, got {value!r}: {spec.fix}"
            )
        return value
    if spec.kind == "number":
        if spec.accepts_none and is_none_text(value):
            return None
        number = finite_number(value)
        if number is None or number <= 0:
            raise ValueError(f"{spec.name} must be {spec.expected}, got {value!r}: {spec.fix}")
        return number
    if spec.accepts_none:
        return coerce_optional_int(spec.name, value, spec.expected, spec.fix)
    return coerce_int(spec.name, value, spec.expected)


# --------------------------------------------------------------------------- #
# The algorithms' arguments (the partitioner and the cost model)
# --------------------------------------------------------------------------- #
def check_choice(name: str, value, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of the strings ``choices``: "<name> must be 'a' or 'b', got <value>"."""
    if not isinstance(value, str) or value not in choices:
        expected = " or ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return value


def is_integer(value) -> bool:
    """Whether ``value`` is an integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_optional_int(name: str, value) -> int | None:
    """None, or an integer >= 1 as :func:`check_int` checks it."""
    if value is None:
        return None
    return check_int(name, value)


def check_length_list(values) -> list[int]:
    """Lengths of one micro-batch as a list of ints (validated like ``lengths``)."""
    return check_lengths(values, name="lengths_in_microbatch").tolist()


def check_lengths(lengths, name: str = "lengths") -> np.ndarray:
    """Return ``lengths`` as a 1-D int64 array, or raise ValueError naming the first bad entry."""
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__len__"):
        raise ValueError(
            f"{name} must be a sequence of positive integers (tokens per sequence), got {type(lengths).__name__}"
        )
    if len(lengths) == 0:
        return np.zeros(0, dtype=np.int64)
    try:
        array = np.asarray(lengths)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name} must be a flat sequence of positive integers (tokens per sequence): {exc}") from None
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional (one token count per sequence), got shape {array.shape}")
    if array.dtype.kind not in "iu":
        if isinstance(lengths, np.ndarray):
            raise ValueError(f"{name} must be an integer array (tokens per sequence), got dtype {array.dtype}")
        for position, value in enumerate(lengths):
            if not is_integer(value):
                raise ValueError(
                    f"{name}[{position}] must be an integer number of tokens, got {value!r} ({type(value).__name__})"
                )
        raise ValueError(f"{name} values must fit in a 64-bit integer, got {array.max()!r}")
    if array.dtype.kind == "u" and array.size and int(array.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} values must fit in a 64-bit integer, got {int(array.max())}")
    array = array.astype(np.int64, copy=False)
    not_positive = np.flatnonzero(array < 1)
    if not_positive.size:
        position = int(not_positive[0])
        raise ValueError(f"{name}[{position}] must be a positive number of tokens (>= 1), got {int(array[position])}")
    return array

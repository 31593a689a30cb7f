"""Token accounting of one pass: the layouts, rounding up to a multiple, the tokens a micro-batch computes.

:func:`microbatch_tokens` is the single definition of what a pass computes (see :mod:`hf_dynbsz.planning.partition`
for the units); the cost model (:mod:`hf_dynbsz.planning.cost`), the partitioner and the schedule import it.

Pure Python (the rounding also takes integer numpy arrays): no torch import.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hf_dynbsz.planning.coerce import check_choice, check_length_list, check_optional_int

__all__ = ["ATTENTION_KINDS", "LAYOUTS", "ceil_div", "microbatch_tokens", "range_positions", "round_up"]

LAYOUTS = ("padding_free", "padded")  # the user-facing names of packing_layout
ATTENTION_KINDS = ("varlen", "dense")


def ceil_div(numerator, denominator):
    """``ceil(numerator / denominator)`` of positive integers (or integer numpy arrays), exactly."""
    return -(-numerator // denominator)


def round_up(length: int, multiple: int | None) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (unchanged when ``multiple`` is None or 1)."""
    if multiple is None or multiple == 1:
        return int(length)
    if multiple < 1:
        raise ValueError(f"pad_to_multiple_of must be an integer >= 1 or None, got {multiple!r}")
    return ceil_div(int(length), int(multiple)) * int(multiple)


def microbatch_tokens(
    lengths_in_microbatch, layout: str = "padding_free", pad_to_multiple_of: int | None = None
) -> int:
    """Tokens actually computed for one micro-batch.

    padding_free = sum of lengths (rounded up to pad_to_multiple_of if given);
    padded = rows * round_up(max length).  An empty micro-batch computes 0 tokens.
    """
    layout = check_choice("layout", layout, LAYOUTS)
    pad_to_multiple_of = check_optional_int("pad_to_multiple_of", pad_to_multiple_of)
    values = check_length_list(lengths_in_microbatch)
    if not values:
        return 0
    if layout == "padding_free":
        return round_up(sum(values), pad_to_multiple_of)
    return len(values) * round_up(max(values), pad_to_multiple_of)


def range_positions(ranges: Sequence[range]) -> np.ndarray:
    """The integers of ``ranges`` (positions along a row, each range ascending by 1), one range after another, as one
    int64 array built in a few array operations whatever the number of ranges (a pass's nodes and paths number dozens
    to hundreds; an array per range costs more than its positions)."""
    lows = np.fromiter((r.start for r in ranges), np.int64, len(ranges))
    sizes = np.fromiter((len(r) for r in ranges), np.int64, len(ranges))
    return np.arange(int(sizes.sum()), dtype=np.int64) + np.repeat(lows - (np.cumsum(sizes) - sizes), sizes)

"""Split one device's batch of sequences into micro-batches under a token budget.

This module is the algorithmic core of ``hf_dynbsz`` (the counterpart of verl's
``use_dynamic_bsz``): given the length of every sequence a device holds for one
optimizer step, it decides which sequences go into which micro-batch.  It is pure
Python + numpy so it can be tested and benchmarked without torch.

Units
-----
* A *length* is the number of real tokens of one sequence (prompt + completion,
  no padding).
* ``max_tokens`` is the budget of tokens **per device per micro-batch**: the
  number of token positions the forward/backward pass of one micro-batch
  actually computes on one device.
* What a micro-batch computes depends on the *layout*:

  - ``"padding_free"``: all sequences of the micro-batch are
    concatenated into a single row, so it computes ``sum(lengths)`` tokens,
    rounded up to ``pad_to_multiple_of`` when that is given.
  - ``"padded"``: one row per sequence, every row padded to the longest length
    of the micro-batch (rounded up to ``pad_to_multiple_of``), so it computes
    ``rows * round_up(max(lengths))`` tokens.

  :func:`microbatch_tokens` is the single definition of this number, and every
  micro-batch returned by :func:`partition_by_token_budget` satisfies
  ``microbatch_tokens(mb) <= max_tokens`` -- except a micro-batch made of one
  single sequence that alone is over the budget (see ``oversize_policy``).
* *Cost* (:class:`hf_dynbsz.planning.cost.WorkloadModel`) is relative compute: a linear term for the
  projections/MLP (proportional to tokens) plus a quadratic term for attention
  (proportional to (query, key) pairs).  It is what the balancing evens out.

Algorithm
---------
1. **How many micro-batches**: the count of first-fit-decreasing (FFD) bin packing of the lengths into bins of
   ``max_tokens`` (:func:`min_num_microbatches`; in the padded layout FFD on the sorted lengths is the optimal
   "contiguous runs" packing). It does not depend on the workload model, so every process can all-reduce the
   maximum and ask for exactly that many micro-batches (exact-k; any count at least the minimum is accepted).
2. **padding_free**: :func:`hf_dynbsz.planning.balance.balance`, the routine cross-rank balancing uses too: longest
   first, each sequence to the least costly micro-batch with room for it, then moves and swaps between the costliest and
   the cheapest; when a tight budget strands a sequence that way, the FFD packing improved by the same moves and
   swaps (it always fits).
3. **padded**: a different problem (a padded micro-batch costs its rows times its longest row, not a sum over its
   sequences), solved by cutting the length-sorted sequences into contiguous runs (similar lengths share a
   micro-batch, so little padding is wasted): bisection on the costliest run's cost with a greedy feasibility test,
   then the costliest runs split until there are exactly as many runs as asked.
4. Every micro-batch lists its sequence indices in ascending order; the micro-batches are ordered by their smallest
   index, and empty micro-batches (only when asked for more micro-batches than there are sequences) come last.

Everything is deterministic: ties are broken by sequence index (stable sorts) and by micro-batch number, never by
hashing or randomness. A step of 4,096 sequences is partitioned in a few milliseconds (``benchmarks/partition.py``).
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import numpy as np

from hf_dynbsz.planning.balance import balance, improve
from hf_dynbsz.planning.coerce import check_choice, check_lengths, check_optional_int
from hf_dynbsz.planning.coerce import check_int as _check_positive_int
from hf_dynbsz.planning.cost import Lengths, WorkloadModel
from hf_dynbsz.planning.tokens import ATTENTION_KINDS, LAYOUTS, ceil_div, microbatch_tokens, round_up

__all__ = [
    "OversizeSequenceError",
    "round_up",  # from planning.tokens, still importable from here
    "microbatch_tokens",  # from planning.tokens, still importable from here
    "item_costs",
    "oversize_error",
    "oversize_indices",
    "token_lower_bound",
    "min_num_microbatches",
    "partition_by_token_budget",
]

#: Passes stop being evened out once the costliest is within this fraction of the mean cost: 0.5% of a pass is
#: below the run-to-run noise of its own time, and the planning of a step of thousands of samples stays at a few ms.
CLOSE_ENOUGH = 5e-3


class OversizeSequenceError(ValueError):
    """A single sequence is longer than the per-micro-batch token budget.

    Raised by the scheduler (:class:`hf_dynbsz.planning.schedule.Scheduler`) with ``oversize_policy="error"``.
    Attributes (``None`` when raised with a bare message): ``index`` (position
    of the sequence in ``lengths``), ``length`` (its tokens), ``max_tokens``
    (the budget) and ``required_tokens`` (the smallest budget that fits every
    sequence of the batch).
    """

    def __init__(
        self,
        message: str,
        *,
        index: int | None = None,
        length: int | None = None,
        max_tokens: int | None = None,
        required_tokens: int | None = None,
    ) -> None:
        super().__init__(message)
        self.index = index
        self.length = length
        self.max_tokens = max_tokens
        self.required_tokens = required_tokens


def oversize_error(
    where: str,
    length: int,
    max_tokens: int,
    *,
    layout: str,
    pad_to_multiple_of: int | None,
    longest: int | None = None,
    others: str = "",
    setting: str = "max_tokens_per_microbatch",
    index: int | None = None,
) -> OversizeSequenceError:
    """The one error for a sequence over the micro-batch budget (partitioner and trainer alike).

    ``where`` names the sequence ("sequence 3", "a sequence on another process"); ``length`` is its tokens;
    ``longest`` the longest sequence over the budget (default ``length``), which sets the budget to suggest;
    ``others`` is appended after the budget (e.g. how many more are over it); ``setting`` names the budget's
    setting (``max_tokens_per_microbatch`` or ``max_tokens_per_microbatch_logprob``).
    """
    multiple = pad_to_multiple_of
    required = round_up(longest if longest is not None else length, multiple)
    rounding = ""
    if multiple not in (None, 1):
        rounding = f" ({round_up(length, multiple)} after rounding up to pad_to_multiple_of={multiple})"
    message = (
        f"{where} has {length} tokens{rounding}, more than the micro-batch budget {setting}={max_tokens} "
        f'(layout={layout!r}){others}. Raise {setting} to >= {required}, or use oversize_policy="warn" to give '
        f"each such sequence a micro-batch of its own."
    )
    return OversizeSequenceError(message, index=index, length=length, max_tokens=max_tokens, required_tokens=required)


def oversize_indices(
    lengths: Lengths, max_tokens: int, layout: str = "padding_free", pad_to_multiple_of: int | None = None
) -> list[int]:
    """Indices (ascending) of the sequences that alone exceed ``max_tokens`` as :func:`microbatch_tokens` counts."""
    return _Problem.build(lengths, max_tokens, layout, pad_to_multiple_of).oversize_indices.tolist()


def item_costs(
    lengths: Lengths,
    layout: str,
    workload: WorkloadModel,
    attention: str = "varlen",
    pad_to_multiple_of: int | None = None,
    pairs=None,
) -> np.ndarray:
    """The cost of each sequence as the balancing sees it: the weight that partitions (and ranks) even out.

    * padding_free + ``"varlen"``: ``linear * L + quad * pairs`` (each sequence attends only to itself; ``pairs``
      defaults to ``L**2``, and is less for a shared-prompt segment, whose blocks do not attend to each other);
    * padding_free + ``"dense"``: ``L``; one row costs ``linear * T + quad * T**2``, increasing in its tokens
      ``T``, so even tokens are even cost;
    * padded: a row of ``R = round_up(L)`` tokens, ``linear * R + quad * R**2`` (similar lengths share a
      micro-batch, so a row costs about its own padded length).
    """
    values = check_lengths(lengths).astype(np.float64)
    if layout == "padded":
        multiple = pad_to_multiple_of or 1
        values = ceil_div(values, multiple) * multiple
    elif attention == "dense":
        return values
    elif pairs is not None:
        return workload.of(values, np.asarray(pairs, dtype=np.float64))
    return workload.of(values, values * values)


def token_lower_bound(lengths: Lengths, max_tokens: int) -> int:
    """Fewest micro-batches any partition can use: ``oversize + ceil(sum of the other lengths / max_tokens)``.

    A sequence longer than ``max_tokens`` (oversize) runs alone in a micro-batch of its own, so each one counts
    one micro-batch and its tokens do not fill the others; every other token needs room under the budget.
    0 for empty input.
    """
    values = check_lengths(lengths)
    max_tokens = _check_positive_int("max_tokens", max_tokens)
    over = values > max_tokens
    return int(over.sum()) + ceil_div(int(values[~over].sum()), max_tokens)


# --------------------------------------------------------------------------- #
# Public partitioning functions
# --------------------------------------------------------------------------- #
def min_num_microbatches(
    lengths: Lengths, max_tokens: int, *, layout: str = "padding_free", pad_to_multiple_of: int | None = None
) -> int:
    """Number of micro-batches partition_by_token_budget uses when num_microbatches is None.

    The trainer all-reduces the MAX of this across ranks and then calls
    ``partition_by_token_budget(..., num_microbatches=that max)``.  Equal to
    the number of micro-batches of first-fit-decreasing (one per
    oversize sequence included); any ``num_microbatches`` at least this large
    is accepted by :func:`partition_by_token_budget`.  Does not depend on the
    workload model, so every rank can compute it from lengths alone.
    """
    problem = _Problem.build(lengths, max_tokens, layout, pad_to_multiple_of)
    return problem.num_oversize + _min_bins_for_fitting(problem)


def partition_by_token_budget(
    lengths: Lengths,
    max_tokens: int,
    *,
    num_microbatches: int | None = None,
    layout: str = "padding_free",
    pad_to_multiple_of: int | None = None,
    workload: WorkloadModel | None = None,
    attention: str = "varlen",
    pairs=None,
) -> list[list[int]]:
    """Partition sequence indices into micro-batches of at most ``max_tokens`` tokens each, balancing compute.

    Args:
        lengths: tokens per sequence (prompt + completion, no padding); a
            sequence of ints or a 1-D integer numpy array, every value >= 1.
        max_tokens: token budget per micro-batch on this device, as counted by
            :func:`microbatch_tokens` for ``layout``.
        num_microbatches: exact number of micro-batches to return.  ``None``
            uses :func:`min_num_microbatches`.  Must be at least that minimum
            (``ValueError`` otherwise).  With more micro-batches than sequences
            the extra micro-batches are empty lists (at the end).
        layout: ``"padding_free"`` (one row: tokens = sum of lengths) or
            ``"padded"`` (tokens = rows x longest length, rounded).
        pad_to_multiple_of: round computed tokens up to this multiple (packed:
            the row total; padded: the row length).
        workload: cost model used for balancing; default
            ``WorkloadModel.default(layout, attention)``.
        attention: ``"varlen"`` (each packed sequence attends to itself) or
            ``"dense"`` (one packed row attends as a whole); picks the cost the
            balancing evens out for packed rows.  Ignored for ``"padded"``.
        A sequence over the budget gets a micro-batch of its own (the scheduler
        decides whether that is allowed, see ``oversize_policy``).
        pairs: attention pairs per item for the ``"varlen"`` cost (default
            ``lengths**2``); an item may be a shared-prompt segment, whose
            blocks do not attend to each other.

    Returns:
        A list of micro-batches, each a list of indices into ``lengths`` in
        ascending order; micro-batches ordered by their smallest index, empty
        ones last.  Every index appears exactly once.  Same input, same output.
    """
    layout = check_choice("layout", layout, LAYOUTS)
    attention = check_choice("attention", attention, ATTENTION_KINDS)
    if workload is None:
        workload = WorkloadModel.default(layout=layout, attention=attention)
    elif not isinstance(workload, WorkloadModel):
        raise ValueError(f"workload must be a WorkloadModel or None, got {type(workload).__name__}")
    if num_microbatches is not None:
        num_microbatches = _check_positive_int("num_microbatches", num_microbatches, minimum=0)

    problem = _Problem.build(lengths, max_tokens, layout, pad_to_multiple_of)

    if layout == "padding_free":
        ffd_bin_of_sorted, fitting_minimum = _first_fit_decreasing_sorted(problem.sorted_sizes, problem.capacity)
    else:
        fitting_minimum = _min_bins_for_fitting(problem)
    minimum = problem.num_oversize + fitting_minimum
    if num_microbatches is None:
        num_microbatches = minimum
    elif num_microbatches < minimum:
        raise ValueError(
            f"num_microbatches={num_microbatches} is too small: these {problem.num_sequences} sequences need at "
            f"least {minimum} micro-batches of max_tokens={problem.max_tokens} tokens (layout={layout!r}); pass "
            f"num_microbatches >= {minimum} (see min_num_microbatches) or None"
        )
    num_fitting_bins = num_microbatches - problem.num_oversize

    if layout == "padding_free":
        sorted_pairs = None if pairs is None else np.asarray(pairs, dtype=np.float64)[problem.sorted_indices]
        bin_of_sorted = _balanced_packed_assignment(
            problem, num_fitting_bins, workload, attention, ffd_bin_of_sorted, sorted_pairs
        )
    else:
        bin_of_sorted = _balanced_padded_assignment(problem, num_fitting_bins, workload)
    return problem.assemble(bin_of_sorted, num_fitting_bins)


# --------------------------------------------------------------------------- #
# Problem set-up shared by all entry points
# --------------------------------------------------------------------------- #
@dataclass
class _Problem:
    """Validated input with the sequences that fit the budget sorted longest first.

    ``sorted_sizes`` are the per-sequence sizes the cap is checked against:
    lengths for the padding_free layout (against ``capacity``, the budget rounded down
    to ``pad_to_multiple_of``) and rounded lengths for the padded layout
    (against ``max_tokens`` per row count).
    """

    lengths: np.ndarray
    max_tokens: int
    layout: str
    pad_to_multiple_of: int | None
    capacity: int
    sorted_indices: np.ndarray  # original indices of fitting sequences, longest first, ties by index
    sorted_sizes: np.ndarray
    oversize_indices: np.ndarray  # ascending

    @classmethod
    def build(cls, lengths, max_tokens, layout, pad_to_multiple_of) -> _Problem:
        layout = check_choice("layout", layout, LAYOUTS)
        max_tokens = _check_positive_int("max_tokens", max_tokens)
        pad_to_multiple_of = check_optional_int("pad_to_multiple_of", pad_to_multiple_of)
        values = check_lengths(lengths)
        multiple = pad_to_multiple_of or 1
        if layout == "padding_free":
            # round_up(sum, m) <= max_tokens  <=>  sum <= floor(max_tokens / m) * m
            capacity = (max_tokens // multiple) * multiple
            sizes = values
        else:
            capacity = max_tokens
            sizes = ceil_div(values, multiple) * multiple
        fits = sizes <= capacity
        fitting = np.flatnonzero(fits)
        # Longest first, ties by index.  Sizes never decrease with length, so this also sorts the sizes
        # (and in the padded layout keeps similar raw lengths together inside one rounding bucket).
        order = fitting[np.argsort(-values[fitting], kind="stable")]
        return cls(
            lengths=values,
            max_tokens=max_tokens,
            layout=layout,
            pad_to_multiple_of=pad_to_multiple_of,
            capacity=capacity,
            sorted_indices=order,
            sorted_sizes=sizes[order],
            oversize_indices=np.flatnonzero(~fits),
        )

    @property
    def num_sequences(self) -> int:
        return int(self.lengths.size)

    @property
    def num_oversize(self) -> int:
        return int(self.oversize_indices.size)

    def assemble(self, bin_of_sorted: np.ndarray, num_fitting_bins: int) -> list[list[int]]:
        """Turn micro-batch numbers of the sorted fitting sequences into the public output format."""
        n = self.num_sequences
        total_bins = num_fitting_bins + self.num_oversize
        if total_bins == 0:
            return []
        bin_of = np.empty(n, dtype=np.int64)
        bin_of[self.sorted_indices] = bin_of_sorted
        bin_of[self.oversize_indices] = num_fitting_bins + np.arange(self.num_oversize, dtype=np.int64)
        members = np.argsort(bin_of, kind="stable")  # grouped by bin, ascending index inside
        counts = np.bincount(bin_of, minlength=total_bins)
        offsets = np.zeros(total_bins + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        non_empty = np.flatnonzero(counts)
        by_first_index = non_empty[np.argsort(members[offsets[non_empty]], kind="stable")]
        flat = members.tolist()
        starts = offsets.tolist()
        result = [flat[starts[b] : starts[b + 1]] for b in by_first_index.tolist()]
        result.extend([] for _ in range(total_bins - non_empty.size))
        return result


def _min_bins_for_fitting(problem: _Problem) -> int:
    """Micro-batches needed by the sequences that fit the budget (FFD count; optimal for padded runs)."""
    if problem.layout == "padding_free":
        return _first_fit_decreasing_sorted(problem.sorted_sizes, problem.capacity)[1]
    return len(_fewest_padded_runs(problem.sorted_sizes, problem.capacity))


# --------------------------------------------------------------------------- #
# Packed layout
# --------------------------------------------------------------------------- #
def _first_fit_decreasing_sorted(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """First-fit of ``sizes`` (sorted descending, each <= capacity) into bins of ``capacity`` tokens.

    The last few results are remembered: the scheduler counts a step's passes (:func:`min_num_microbatches`) and then
    partitions the same sizes, and this is the costliest part of both.
    """
    return _remembered_first_fit(sizes.tobytes(), int(capacity))


@functools.lru_cache(maxsize=8)
def _remembered_first_fit(sizes_bytes: bytes, capacity: int) -> tuple[np.ndarray, int]:
    bin_of_sorted, bins = _first_fit(np.frombuffer(sizes_bytes, dtype=np.int64), capacity)
    bin_of_sorted.flags.writeable = False  # shared between callers
    return bin_of_sorted, bins


def _first_fit(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """The first-fit of :func:`_first_fit_decreasing_sorted`.

    Returns (bin number per position, number of bins).  Equal sizes are placed
    as a group: the leftmost bin with room takes as many as fit, then the next
    one, exactly as item-by-item first-fit would.  A max segment tree over the
    free room of the bins finds the leftmost bin with enough room in O(log bins).
    """
    n = int(sizes.size)
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0
    # First-fit leaves at most one bin at most half full, so it never needs more bins than this.
    max_bins = min(n, 2 * int(sizes.sum()) // capacity + 2)
    leaves = 1
    while leaves < max_bins:
        leaves *= 2
    tree = [0] * (2 * leaves)  # tree[leaves + b] = free room of bin b; inner nodes hold the max of children
    tree[leaves : leaves + max_bins] = [capacity] * max_bins
    for node in range(leaves - 1, 0, -1):
        left, right = tree[2 * node], tree[2 * node + 1]
        tree[node] = left if left > right else right

    group_starts = np.concatenate(([0], np.flatnonzero(np.diff(sizes)) + 1))
    group_counts = np.diff(np.append(group_starts, n)).tolist()
    group_sizes = sizes[group_starts].tolist()

    run_bins: list[int] = []
    run_counts: list[int] = []
    bins_used = 0
    for size, remaining in zip(group_sizes, group_counts):
        while remaining:
            node = 1
            while node < leaves:  # descend to the leftmost leaf with room >= size
                node *= 2
                if tree[node] < size:
                    node += 1
            room = tree[node]
            placed = room // size
            if placed > remaining:
                placed = remaining
            remaining -= placed
            bin_number = node - leaves
            if bin_number >= bins_used:
                bins_used = bin_number + 1
            run_bins.append(bin_number)
            run_counts.append(placed)
            tree[node] = room - placed * size
            node //= 2
            while node:
                left, right = tree[2 * node], tree[2 * node + 1]
                best = left if left > right else right
                if tree[node] == best:
                    break
                tree[node] = best
                node //= 2
    bin_of_sorted = np.repeat(np.asarray(run_bins, dtype=np.int64), np.asarray(run_counts, dtype=np.int64))
    return bin_of_sorted, bins_used


def _balanced_packed_assignment(
    problem: _Problem,
    num_bins: int,
    workload: WorkloadModel,
    attention: str,
    ffd_bin_of: np.ndarray,
    pairs: np.ndarray | None = None,
) -> np.ndarray:
    """Bin number (0..num_bins-1) per sorted fitting sequence for the padding_free layout: :func:`balance`'s
    longest-first with the budget as room, or, when a tight budget strands a sequence that way, the
    first-fit-decreasing assignment ``ffd_bin_of`` (which fits in ``num_bins`` by construction) improved."""
    sizes = problem.sorted_sizes.tolist()
    if not sizes:
        return np.zeros(0, dtype=np.int64)
    weights = item_costs(problem.sorted_sizes, "padding_free", workload, attention, pairs=pairs).tolist()
    assignment = balance(weights, num_bins, sizes, problem.capacity, CLOSE_ENOUGH)
    if assignment is None:
        assignment = improve(ffd_bin_of.tolist(), weights, num_bins, sizes, problem.capacity, CLOSE_ENOUGH)
    return np.asarray(assignment, dtype=np.int64)


# --------------------------------------------------------------------------- #
# Padded layout
# --------------------------------------------------------------------------- #
def _fewest_padded_runs(sizes: np.ndarray, capacity: int) -> list[tuple[int, int]]:
    """Cut rounded lengths (sorted descending) into the fewest contiguous runs with rows * first <= capacity.

    Returns (start, rows) per run.  Greedy is optimal: a run starting later has
    a shorter first row and so can hold at least as many rows.  It is also what
    first-fit-decreasing does for padded micro-batches.
    """
    runs = []
    n = int(sizes.size)
    start = 0
    size_list = sizes.tolist()
    while start < n:
        rows = min(capacity // size_list[start], n - start)
        runs.append((start, rows))
        start += rows
    return runs


def _contiguous_runs_to_bins(runs: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
    """Bin number per sorted position for runs given as (start, rows), in order."""
    rows = np.asarray([r for _, r in runs], dtype=np.int64)
    return np.repeat(np.arange(len(runs), dtype=np.int64), rows), len(runs)


def _balanced_padded_assignment(problem: _Problem, num_bins: int, workload: WorkloadModel) -> np.ndarray:
    """Bin number per sorted fitting sequence: ``num_bins`` contiguous runs minimising the costliest run.

    A run of ``rows`` sequences starting at sorted position ``p`` computes
    ``rows`` rows of ``sizes[p]`` tokens and costs ``rows * row_cost[p]``.  For
    a cost ceiling ``T`` the fewest runs come from the greedy that makes every
    run as long as the ceiling and the token cap allow (a later start has a
    shorter first row, so it can only take more rows); bisection finds the
    smallest ceiling that needs at most ``num_bins`` runs, then the costliest
    runs are split until there are exactly ``num_bins`` (or one per sequence).
    """
    sizes = problem.sorted_sizes
    n = int(sizes.size)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    capacity = problem.capacity
    row_cost = item_costs(sizes, "padded", workload).tolist()  # sizes are rounded already
    row_cap = (capacity // sizes).tolist()
    target_runs = min(num_bins, n)

    def runs_needed(max_cost: float, limit: int) -> int:
        """Greedy run count under ``max_cost`` (stops counting once it exceeds ``limit``)."""
        start = count = 0
        while start < n:
            rows = row_cap[start]
            rows_by_cost = int(max_cost / row_cost[start])
            if rows_by_cost < rows:
                rows = rows_by_cost
            if rows < 1:
                return limit + 1
            count += 1
            if count > limit:
                return count
            start += rows
        return count

    fewest = _fewest_padded_runs(sizes, capacity)
    high = max(rows * row_cost[start] for start, rows in fewest)  # feasible: the fewest-runs cut fits
    low = max(row_cost[0], float(sum(row_cost)) / target_runs)  # no cut into target_runs runs is cheaper
    if runs_needed(low, target_runs) <= target_runs:
        high = low
    else:
        # Invariant: `low` needs more than target_runs runs, `high` does not; 1e-5 relative is plenty.
        while high - low > 1e-5 * high:
            middle = (low + high) / 2
            if runs_needed(middle, target_runs) <= target_runs:
                high = middle
            else:
                low = middle
    runs = []
    start = 0
    while start < n:
        rows = min(row_cap[start], max(1, int(high / row_cost[start])), n - start)
        runs.append((start, rows))
        start += rows
    if len(runs) > target_runs:  # float rounding at the ceiling; the cap-only cut always fits
        runs = fewest
    runs = _split_costliest_runs(runs, target_runs, row_cost)
    bin_of_sorted, _ = _contiguous_runs_to_bins(runs)
    return bin_of_sorted


def _split_costliest_runs(
    runs: list[tuple[int, int]], target_runs: int, row_cost: list[float]
) -> list[tuple[int, int]]:
    """Split the costliest multi-row run in two (at its most even cut) until there are ``target_runs`` runs."""
    splittable = [(-rows * row_cost[start], start, rows) for start, rows in runs if rows > 1]
    single_rows = [(start, rows) for start, rows in runs if rows == 1]
    heapq.heapify(splittable)
    while len(splittable) + len(single_rows) < target_runs and splittable:
        _, start, rows = heapq.heappop(splittable)
        cuts = np.arange(1, rows)
        first_cost = cuts * row_cost[start]
        second_cost = (rows - cuts) * np.asarray(row_cost[start + 1 : start + rows])
        cut = int(cuts[int(np.argmin(np.maximum(first_cost, second_cost)))])
        for part_start, part_rows in ((start, cut), (start + cut, rows - cut)):
            if part_rows > 1:
                heapq.heappush(splittable, (-part_rows * row_cost[part_start], part_start, part_rows))
            else:
                single_rows.append((part_start, part_rows))
    return sorted([(start, rows) for _, start, rows in splittable] + single_rows)

"""Specification of ``hf_dynbsz.planning.partition``: token-budget micro-batches for one device.

Units throughout: a *length* is the real tokens of one sequence (prompt + completion);
``max_tokens`` is the budget per micro-batch per device as counted by ``microbatch_tokens``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_dynbsz.planning.cost import WorkloadModel
from hf_dynbsz.planning.partition import (
    OversizeSequenceError,
    min_num_microbatches,
    partition_by_token_budget,
    token_lower_bound,
)
from hf_dynbsz.planning.tokens import microbatch_tokens, round_up
from hf_dynbsz.testing import first_fit_decreasing

PROPERTY_SETTINGS = settings(max_examples=200, deadline=None)


# --------------------------------------------------------------------------- helpers
def flat_indices(microbatches):
    return [index for microbatch in microbatches for index in microbatch]


def tokens_of(microbatch, lengths, layout="padding_free", pad=None):
    return microbatch_tokens([lengths[i] for i in microbatch], layout, pad)


def is_oversize(length, max_tokens, layout="padding_free", pad=None):
    return microbatch_tokens([length], layout, pad) > max_tokens


def imbalance(microbatches, lengths, workload, layout="padding_free", pad=None, attention="varlen"):
    """max / mean compute cost over the micro-batches (1.0 = perfectly even)."""
    costs = [workload.cost([lengths[i] for i in mb], layout, pad, attention) for mb in microbatches]
    return max(costs) / (sum(costs) / len(costs))


def lognormal_lengths(n, seed, median=300, sigma=1.0, shortest=16, longest=4096):
    """Long-tailed prompt+completion lengths like a GRPO batch."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(math.log(median), sigma, n).astype(np.int64), shortest, longest).tolist()


def naive_first_fit_decreasing(lengths, max_tokens, layout="padding_free", pad=None):
    """Reference FFD, item by item over all open micro-batches (O(n * bins)); oversize items go alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    for index in order:
        if is_oversize(lengths[index], max_tokens, layout, pad):
            bins.append([index])
            continue
        for microbatch in bins:
            if not is_oversize(lengths[microbatch[0]], max_tokens, layout, pad) and (
                tokens_of(microbatch + [index], lengths, layout, pad) <= max_tokens
            ):
                microbatch.append(index)
                break
        else:
            bins.append([index])
    return bins


def canonical(microbatches):
    return sorted(sorted(mb) for mb in microbatches)


# A batch: lengths plus a budget that sometimes is smaller than the longest sequence (oversize).
layouts = st.sampled_from(["padding_free", "padded"])
pads = st.sampled_from([None, 1, 8, 64])
attentions = st.sampled_from(["varlen", "dense"])


@st.composite
def batches(draw, allow_oversize=True, max_size=120):
    """(lengths, max_tokens): a few long sequences, or many short ones with a budget for dozens of micro-batches."""
    longest_allowed = draw(st.sampled_from([3000, 3000, 60]))
    lengths = draw(st.lists(st.integers(1, longest_allowed), min_size=0, max_size=max_size))
    longest = max(lengths, default=1)
    low = 1 if allow_oversize else longest + 64  # + 64 keeps rounded-up lengths under the budget too
    max_tokens = draw(st.integers(low, max(low, 4 * longest + 64)))
    return lengths, max_tokens


# --------------------------------------------------------------------------- token accounting
def test_round_up():
    assert round_up(1, None) == 1
    assert round_up(7, 1) == 7
    assert round_up(7, 8) == 8
    assert round_up(8, 8) == 8
    assert round_up(9, 8) == 16


def test_microbatch_tokens_packed_is_the_sum_rounded_up_once():
    assert microbatch_tokens([3, 5, 9]) == 17
    assert microbatch_tokens([3, 5, 9], "padding_free", 8) == 24
    assert microbatch_tokens([], "padding_free") == 0


def test_microbatch_tokens_padded_is_rows_times_rounded_longest():
    assert microbatch_tokens([3, 5, 9], "padded") == 27
    assert microbatch_tokens([3, 5, 9], "padded", 8) == 3 * 16
    assert microbatch_tokens(np.array([4]), "padded", 8) == 8


def test_token_lower_bound():
    assert token_lower_bound([], 10) == 0
    assert token_lower_bound([10], 10) == 1
    assert token_lower_bound([6, 5], 10) == 2
    assert token_lower_bound(np.array([3] * 7), 7) == 3
    # An oversize sequence runs alone: it counts one micro-batch and leaves the others' room alone.
    assert token_lower_bound([250, 10, 10], 100) == 2
    assert token_lower_bound([250, 150, 60, 60], 100) == 4


@PROPERTY_SETTINGS
@given(batch=batches(), layout=layouts, pad=pads)
def test_lower_bound_holds_with_oversize_sequences(batch, layout, pad):
    lengths, max_tokens = batch
    result = partition_by_token_budget(lengths, max_tokens, layout=layout, pad_to_multiple_of=pad)
    assert token_lower_bound(lengths, max_tokens) <= len(result)


# --------------------------------------------------------------------------- basic behaviour
def test_simple_packed_example():
    lengths = [7, 8, 10, 12, 13]
    result = partition_by_token_budget(lengths, 25)
    assert result == [[0, 1, 2], [3, 4]]  # a perfect fit: 25 + 25 tokens


def test_empty_input():
    assert partition_by_token_budget([], 100) == []
    assert partition_by_token_budget([], 100, num_microbatches=3) == [[], [], []]
    assert min_num_microbatches([], 100) == 0
    assert first_fit_decreasing([], 100) == []


def test_numpy_input_gives_the_same_result_as_a_list():
    lengths = lognormal_lengths(300, seed=1)
    assert partition_by_token_budget(np.array(lengths, dtype=np.int32), 8192) == partition_by_token_budget(
        lengths, 8192
    )


def test_none_is_the_same_as_asking_for_the_minimum():
    lengths = lognormal_lengths(500, seed=2)
    for layout in ("padding_free", "padded"):
        minimum = min_num_microbatches(lengths, 8192, layout=layout)
        assert partition_by_token_budget(lengths, 8192, layout=layout) == partition_by_token_budget(
            lengths, 8192, layout=layout, num_microbatches=minimum
        )


# --------------------------------------------------------------------------- properties (starred requirements)
@PROPERTY_SETTINGS
@given(
    batch=batches(max_size=250),
    layout=layouts,
    pad=pads,
    attention=attentions,
    extra=st.integers(0, 3),
    exact=st.booleans(),
)
def test_every_index_exactly_once_in_deterministic_order(batch, layout, pad, attention, extra, exact):
    lengths, max_tokens = batch
    k = min_num_microbatches(lengths, max_tokens, layout=layout, pad_to_multiple_of=pad) + extra if exact else None
    kwargs = dict(num_microbatches=k, layout=layout, pad_to_multiple_of=pad, attention=attention)
    result = partition_by_token_budget(lengths, max_tokens, **kwargs)
    assert sorted(flat_indices(result)) == list(range(len(lengths)))
    for microbatch in result:
        assert microbatch == sorted(microbatch)
    non_empty = [mb for mb in result if mb]
    assert [mb[0] for mb in non_empty] == sorted(mb[0] for mb in non_empty)  # ordered by first index
    assert result[len(non_empty) :] == [[]] * (len(result) - len(non_empty))  # empty ones last
    # Deterministic: same input, same output (also from a fresh copy of the input).
    assert partition_by_token_budget(list(lengths), max_tokens, **kwargs) == result


@PROPERTY_SETTINGS
@given(batch=batches(max_size=250), layout=layouts, pad=pads, attention=attentions, extra=st.integers(0, 3))
def test_hard_cap_except_lonely_oversize_sequences(batch, layout, pad, attention, extra):
    lengths, max_tokens = batch
    k = min_num_microbatches(lengths, max_tokens, layout=layout, pad_to_multiple_of=pad) + extra
    for num_microbatches in (None, k):
        result = partition_by_token_budget(
            lengths,
            max_tokens,
            num_microbatches=num_microbatches,
            layout=layout,
            pad_to_multiple_of=pad,
            attention=attention,
        )
        for microbatch in result:
            if tokens_of(microbatch, lengths, layout, pad) > max_tokens:
                assert len(microbatch) == 1
                assert is_oversize(lengths[microbatch[0]], max_tokens, layout, pad)
        for index, length in enumerate(lengths):
            if is_oversize(length, max_tokens, layout, pad):
                assert [index] in result  # an oversize sequence is alone


@PROPERTY_SETTINGS
@given(batch=batches(allow_oversize=False), layout=layouts, pad=pads)
def test_count_between_lower_bound_and_first_fit_decreasing(batch, layout, pad):
    lengths, max_tokens = batch
    result = partition_by_token_budget(lengths, max_tokens, layout=layout, pad_to_multiple_of=pad)
    ffd = first_fit_decreasing(lengths, max_tokens, layout, pad)
    assert token_lower_bound(lengths, max_tokens) <= len(result) <= len(ffd)
    assert len(result) == min_num_microbatches(lengths, max_tokens, layout=layout, pad_to_multiple_of=pad)


@PROPERTY_SETTINGS
@given(batch=batches(), layout=layouts, pad=pads)
def test_min_num_microbatches_is_the_default_count_with_oversize_too(batch, layout, pad):
    lengths, max_tokens = batch
    result = partition_by_token_budget(lengths, max_tokens, layout=layout, pad_to_multiple_of=pad)
    assert len(result) == min_num_microbatches(lengths, max_tokens, layout=layout, pad_to_multiple_of=pad)


@PROPERTY_SETTINGS
@given(batch=batches(), layout=layouts, pad=pads, attention=attentions, extra=st.integers(0, 40))
def test_exact_number_of_microbatches(batch, layout, pad, attention, extra):
    lengths, max_tokens = batch
    minimum = min_num_microbatches(lengths, max_tokens, layout=layout, pad_to_multiple_of=pad)
    k = max(minimum + extra, 1)
    result = partition_by_token_budget(
        lengths, max_tokens, num_microbatches=k, layout=layout, pad_to_multiple_of=pad, attention=attention
    )
    assert len(result) == k
    empty = sum(1 for mb in result if not mb)
    assert empty == max(0, k - len(lengths))  # none empty when there are enough sequences
    for microbatch in result:
        if len(microbatch) > 1:
            assert tokens_of(microbatch, lengths, layout, pad) <= max_tokens
    if minimum > 1:
        with pytest.raises(ValueError, match=f"at least {minimum} micro-batches"):
            partition_by_token_budget(
                lengths, max_tokens, num_microbatches=minimum - 1, layout=layout, pad_to_multiple_of=pad
            )


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=200, max_size=400),
    max_tokens=st.integers(40, 120),
    extra=st.sampled_from([0, 0, 1, 5, 50]),
    attention=attentions,
)
def test_invariants_with_many_microbatches(lengths, max_tokens, extra, attention):
    # Dozens of micro-batches: the vectorised spreading rounds do most of the work here.
    minimum = min_num_microbatches(lengths, max_tokens)
    assert minimum <= len(first_fit_decreasing(lengths, max_tokens))
    result = partition_by_token_budget(lengths, max_tokens, num_microbatches=minimum + extra, attention=attention)
    assert len(result) == minimum + extra
    assert sorted(flat_indices(result)) == list(range(len(lengths)))
    assert all(mb == sorted(mb) for mb in result)
    assert max(tokens_of(mb, lengths) for mb in result) <= max_tokens
    assert sum(1 for mb in result if not mb) == max(0, minimum + extra - len(lengths))


@PROPERTY_SETTINGS
@given(lengths=st.lists(st.integers(1, 500), min_size=1, max_size=60), layout=layouts)
def test_ties_are_broken_by_index_not_by_input_identity(lengths, layout):
    # Permuting equal lengths among themselves must not change which positions go together.
    as_array = np.asarray(lengths, dtype=np.int64)
    result = partition_by_token_budget(lengths, 600, layout=layout)
    assert partition_by_token_budget(as_array, 600, layout=layout) == result
    assert partition_by_token_budget(tuple(lengths), 600, layout=layout) == result


# --------------------------------------------------------------------------- baseline FFD
@PROPERTY_SETTINGS
@given(batch=batches(max_size=60), layout=layouts, pad=pads)
def test_first_fit_decreasing_matches_the_textbook_algorithm(batch, layout, pad):
    lengths, max_tokens = batch
    fast = first_fit_decreasing(lengths, max_tokens, layout, pad)
    assert canonical(fast) == canonical(naive_first_fit_decreasing(lengths, max_tokens, layout, pad))


def test_first_fit_decreasing_puts_oversize_sequences_alone():
    assert canonical(first_fit_decreasing([5, 30, 5], 20)) == [[0, 2], [1]]


# --------------------------------------------------------------------------- balance
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n, max_tokens", [(64, 8192), (256, 16384), (1024, 16384), (2048, 32768)])
def test_balances_compute_better_than_first_fit_decreasing(seed, n, max_tokens):
    lengths = lognormal_lengths(n, seed)
    workload = WorkloadModel.default()
    ours = partition_by_token_budget(lengths, max_tokens, workload=workload)
    ffd = first_fit_decreasing(lengths, max_tokens)
    assert len(ours) == len(ffd)
    ours_imbalance = imbalance(ours, lengths, workload)
    if len(ours) > 1:
        assert ours_imbalance < imbalance(ffd, lengths, workload)
    assert ours_imbalance <= 1.3


def test_balances_with_spare_microbatches():
    lengths = lognormal_lengths(1000, seed=7)
    minimum = min_num_microbatches(lengths, 16384)
    result = partition_by_token_budget(lengths, 16384, num_microbatches=minimum + 5)
    assert imbalance(result, lengths, WorkloadModel.default()) < 1.05


def test_dense_attention_balances_tokens():
    lengths = lognormal_lengths(800, seed=3)
    workload = WorkloadModel.default(attention="dense")
    result = partition_by_token_budget(lengths, 16384, attention="dense", workload=workload)
    tokens = [tokens_of(mb, lengths) for mb in result]
    assert max(tokens) / (sum(tokens) / len(tokens)) < 1.05
    assert imbalance(result, lengths, workload, attention="dense") < imbalance(
        first_fit_decreasing(lengths, 16384), lengths, workload, attention="dense"
    )


def test_balance_follows_the_workload_model():
    # 3000 tokens into two micro-batches.  Counting tokens only, 1000 + 500 | 4 x 500 is even (1500 each);
    # with a strong attention term the 1000-token sequence alone already costs about as much as 4 x 500.
    lengths = [1000, 500, 500, 500, 500]
    tokens_only = WorkloadModel(linear_weight=1.0, quadratic_weight=0.0)
    attention_heavy = WorkloadModel(linear_weight=1.0, quadratic_weight=0.01)
    assert partition_by_token_budget(lengths, 3000, num_microbatches=2, workload=tokens_only) == [[0, 3], [1, 2, 4]]
    assert partition_by_token_budget(lengths, 3000, num_microbatches=2, workload=attention_heavy) == [
        [0],
        [1, 2, 3, 4],
    ]


def test_tight_budget_falls_back_to_a_perfect_packing():
    # Spreading by cost (13 | 12 + 10, then 8 next to 13) strands the 7: only {7, 8, 10} + {12, 13}
    # fits two micro-batches of 25 tokens, and that is what comes back.
    assert partition_by_token_budget([7, 8, 10, 12, 13], 25) == [[0, 1, 2], [3, 4]]
    # 73 tokens in two micro-batches of 37 also needs an (almost) perfect fit: {6, 14, 16} + {20, 9, 8}.
    assert partition_by_token_budget([6, 14, 20, 9, 16, 8], 37, num_microbatches=2) == [[0, 1, 4], [2, 3, 5]]


def test_large_tight_batch_keeps_the_cap_and_count():
    # Clipping at max_tokens / 4 makes many sequences pack perfectly, so the minimum count is tight.
    lengths = lognormal_lengths(20000, seed=11, shortest=64)
    minimum = min_num_microbatches(lengths, 16384)
    result = partition_by_token_budget(lengths, 16384)
    assert len(result) == minimum
    assert max(tokens_of(mb, lengths) for mb in result) <= 16384
    assert sorted(flat_indices(result)) == list(range(len(lengths)))


def test_improving_an_assignment_fills_empty_microbatches_within_the_cap():
    # The tight-budget path: the FFD packing plus extra empty bins, evened out by moves and swaps.
    from hf_dynbsz.planning.balance import improve

    sizes = [9, 8, 5, 3, 2, 2, 1]
    packed = [0, 1, 1, 0, 0, 1, 0]  # bins of 15 and 15 tokens, capacity 16
    moved = np.array(improve(list(packed), [float(s) for s in sizes], 4, sizes, 16))
    tokens = np.bincount(moved, weights=sizes, minlength=4)
    assert (tokens > 0).all() and tokens.max() <= 16
    assert tokens.max() < 15


# --------------------------------------------------------------------------- padded layout
@PROPERTY_SETTINGS
@given(batch=batches(max_size=80), pad=pads, extra=st.integers(0, 5))
def test_padded_groups_similar_lengths(batch, pad, extra):
    lengths, max_tokens = batch
    k = min_num_microbatches(lengths, max_tokens, layout="padded", pad_to_multiple_of=pad) + extra
    result = partition_by_token_budget(lengths, max_tokens, num_microbatches=k, layout="padded", pad_to_multiple_of=pad)
    ranges = sorted((min(lengths[i] for i in mb), max(lengths[i] for i in mb)) for mb in result if mb)
    for (_, high), (next_low, _) in zip(ranges, ranges[1:]):
        assert high <= next_low  # contiguous runs of the length-sorted batch never interleave


def test_padded_example_with_rounding():
    lengths = [100, 30, 95, 33, 31, 60]
    result = partition_by_token_budget(lengths, 256, layout="padded", pad_to_multiple_of=64)
    assert canonical(result) == [[0, 2], [1, 3, 4, 5]]  # 2 x 128 and 4 x 64 tokens
    assert [tokens_of(mb, lengths, "padded", 64) for mb in canonical(result)] == [256, 256]


def test_padded_count_is_optimal_and_cheaper_than_packing_by_sum():
    lengths = lognormal_lengths(400, seed=5)
    result = partition_by_token_budget(lengths, 16384, layout="padded")
    assert len(result) == len(first_fit_decreasing(lengths, 16384, "padded"))
    for mb in result:
        assert tokens_of(mb, lengths, "padded") <= 16384


def test_padded_exact_k_splits_the_costliest_runs():
    lengths = [500] * 4 + [100] * 20
    result = partition_by_token_budget(lengths, 2000, layout="padded", num_microbatches=4)
    assert len(result) == 4 and all(result)
    assert max(tokens_of(mb, lengths, "padded") for mb in result) <= 2000


# --------------------------------------------------------------------------- oversize sequences
def test_oversize_warn_gives_a_microbatch_of_its_own():
    result = partition_by_token_budget([100, 5000, 200, 300], 1000)
    assert [1] in result
    assert sorted(flat_indices(result)) == [0, 1, 2, 3]
    assert min_num_microbatches([100, 5000, 200, 300], 1000) == len(result) == 2


def oversize_scheduler(pad_to_multiple_of=None):
    """The one place an oversize sequence stops a run: the scheduler with oversize_policy="error"."""
    from hf_dynbsz.planning.schedule import Scheduler

    return Scheduler(
        layout="padding_free",
        attention="varlen",
        workload=WorkloadModel.default(),
        oversize_policy="error",
        pad_to_multiple_of=pad_to_multiple_of,
        balance_across_ranks=False,
    )


def test_oversize_error_names_index_length_budget_and_fix():
    with pytest.raises(OversizeSequenceError) as info:
        oversize_scheduler().plan([100, 5000, 200], 1000)
    message = str(info.value)
    assert "sequence 1" in message and "5000 tokens" in message and "1000" in message
    assert "max_tokens_per_microbatch to >= 5000" in message and 'oversize_policy="warn"' in message
    assert isinstance(info.value, ValueError)
    assert (info.value.index, info.value.length, info.value.max_tokens) == (1, 5000, 1000)


def test_oversize_error_accounts_for_rounding_and_several_sequences():
    with pytest.raises(OversizeSequenceError, match=r">= 1024") as info:
        oversize_scheduler(pad_to_multiple_of=64).plan([1000, 10, 1001], 1000)
    assert "1024 after rounding" in str(info.value) and "1 more" in str(info.value)
    assert info.value.required_tokens == 1024


def test_oversize_error_comes_before_any_other_work():
    # Every process stops before its first pass: the error is raised at planning, not at partitioning.
    with pytest.raises(OversizeSequenceError):
        oversize_scheduler().plan([10, 2000, 10], 1000)


def test_oversize_error_can_carry_a_plain_message():
    assert str(OversizeSequenceError("custom")) == "custom"


# --------------------------------------------------------------------------- input validation
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lengths=[1, 2], max_tokens=0), r"max_tokens must be an integer >= 1, got 0"),
        (dict(lengths=[1, 2], max_tokens=10.0), r"max_tokens must be an integer >= 1, got 10.0"),
        (dict(lengths=[1, -2], max_tokens=10), r"lengths\[1\] must be a positive number of tokens .* got -2"),
        (dict(lengths=[1, 0], max_tokens=10), r"lengths\[1\] must be a positive number of tokens .* got 0"),
        (dict(lengths=[1, 2.5], max_tokens=10), r"lengths\[1\] must be an integer number of tokens, got 2.5"),
        (dict(lengths=[1, "x"], max_tokens=10), r"lengths\[1\] must be an integer number of tokens, got 'x'"),
        (dict(lengths=[True, False], max_tokens=10), r"lengths\[0\] must be an integer number of tokens, got True"),
        (dict(lengths=np.array([1.0, 2.0]), max_tokens=10), r"lengths must be an integer array .* float64"),
        (dict(lengths=[[1, 2]], max_tokens=10), r"lengths must be one-dimensional"),
        (dict(lengths=5, max_tokens=10), r"lengths must be a sequence"),
        (dict(lengths=[1], max_tokens=10, layout="ragged"), r"layout must be 'padding_free' or 'padded', got 'ragged'"),
        (dict(lengths=[1], max_tokens=10, attention="flash"), r"attention must be 'varlen' or 'dense'"),
        (dict(lengths=[1], max_tokens=10, pad_to_multiple_of=0), r"pad_to_multiple_of must be an integer >= 1"),
        (dict(lengths=[1], max_tokens=10, num_microbatches=-1), r"num_microbatches must be an integer >= 0"),
        (dict(lengths=[1], max_tokens=10, num_microbatches=0), r"num_microbatches=0 is too small"),
        (dict(lengths=[1], max_tokens=10, workload="fast"), r"workload must be a WorkloadModel"),
    ],
)
def test_invalid_arguments_are_named(kwargs, match):
    lengths = kwargs.pop("lengths")
    max_tokens = kwargs.pop("max_tokens")
    with pytest.raises(ValueError, match=match):
        partition_by_token_budget(lengths, max_tokens, **kwargs)


def test_helpers_validate_too():
    with pytest.raises(ValueError, match="lengths"):
        token_lower_bound([1, -1], 10)
    with pytest.raises(ValueError, match="layout"):
        min_num_microbatches([1], 10, layout="rows")
    with pytest.raises(ValueError, match="max_tokens"):
        first_fit_decreasing([1], 0)
    with pytest.raises(ValueError, match="lengths_in_microbatch"):
        microbatch_tokens([0])

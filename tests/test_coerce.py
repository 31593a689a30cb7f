"""Specification of hf_dynbsz.planning.coerce: the one set of value checkers (settings, plan, env, partition)."""

from __future__ import annotations

import numpy as np
import pytest

from hf_dynbsz.planning.coerce import (
    check_choice,
    check_int,
    check_lengths,
    check_optional_int,
    coerce_int,
    coerce_optional_int,
    parse_int,
)
from hf_dynbsz.planning.env import read_env_overrides


@pytest.mark.parametrize(
    "value, expected",
    [
        (3, 3),
        (np.int64(3), 3),
        (" 12 ", 12),
        ("0", 0),
        (True, None),
        (2.0, None),
        ("-1", None),
        ("+5", None),
        ("", None),
    ],
)
def test_parse_int(value, expected):
    assert parse_int(value) == expected


def test_parse_int_without_strings_and_non_ascii_digits():
    assert parse_int("5", strings=False) is None
    assert parse_int("\u0663") is None  # an Arabic-Indic digit: str.isdigit() says yes, a setting says no


def test_coerce_int_shows_the_number_a_string_reads_as_and_the_fix():
    with pytest.raises(ValueError, match=r"^n must be a count, got 0\.$"):
        coerce_int("n", "0", "a count")
    with pytest.raises(ValueError, match=r"^g must be >= 2, got 1: use 2\.$"):
        coerce_int("g", "1", ">= 2", fix="use 2.", minimum=2)


def test_coerce_optional_int_shows_the_value_as_given():
    assert coerce_optional_int("s", "auto", "a count", "unset it.") is None
    with pytest.raises(ValueError, match=r"^s must be a count, got '0': unset it\.$"):
        coerce_optional_int("s", "0", "a count", "unset it.")


def test_check_int_is_the_partitioners_check():
    assert check_int("k", np.int64(0), minimum=0) == 0
    for value in ("3", 3.0, np.bool_(True), True):
        with pytest.raises(ValueError, match=r"^k must be an integer >= 1, got "):
            check_int("k", value)


def test_environment_variables_read_integers_with_the_same_rule():
    assert read_env_overrides({"DIFFU_MAX_TOKENS": " 12 "}) == {"max_tokens_per_microbatch": ("DIFFU_MAX_TOKENS", 12)}
    with pytest.raises(ValueError, match=r"DIFFU_MAX_TOKENS='\+5' is not valid"):
        read_env_overrides({"DIFFU_MAX_TOKENS": "+5"})


# --------------------------------------------------------------------------- the algorithms' arguments
def test_check_choice_names_the_argument_and_the_choices():
    assert check_choice("layout", "padded", ("padding_free", "padded")) == "padded"
    with pytest.raises(ValueError, match="layout must be 'padding_free' or 'padded', got 'rows'"):
        check_choice("layout", "rows", ("padding_free", "padded"))


def test_check_optional_int_passes_none_and_checks_the_rest():
    assert check_optional_int("pad_to_multiple_of", None) is None
    assert check_optional_int("pad_to_multiple_of", np.int32(8)) == 8
    with pytest.raises(ValueError, match="pad_to_multiple_of must be an integer >= 1, got 0"):
        check_optional_int("pad_to_multiple_of", 0)


@pytest.mark.parametrize(
    "lengths, message",
    [
        ("123", "must be a sequence of positive integers"),
        ([[1, 2], [3, 4]], "must be one-dimensional"),
        ([3, 2.5], r"lengths\[1\] must be an integer number of tokens, got 2.5"),
        (np.array([1.0, 2.0]), "must be an integer array"),
        ([4, 0, 2], r"lengths\[1\] must be a positive number of tokens \(>= 1\), got 0"),
    ],
)
def test_check_lengths_names_the_first_bad_entry(lengths, message):
    with pytest.raises(ValueError, match=message):
        check_lengths(lengths)


def test_check_lengths_gives_int64_and_takes_an_empty_list():
    assert check_lengths([3, np.uint8(2)]).dtype == np.int64
    assert check_lengths([]).tolist() == []

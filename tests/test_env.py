"""Specification of hf_dynbsz.planning.env: DIFFU_* environment overrides for batch-size sweeps."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_dynbsz.planning import env
from hf_dynbsz.planning.env import apply_env_overrides, read_env_overrides
from hf_dynbsz.planning.settings import ENV_SETTINGS, SharePrefix

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_log_memory(monkeypatch):
    monkeypatch.setattr(env, "_LOGGED", set())


def make_args(**overrides):
    values = dict(
        per_device_train_batch_size=4,
        per_device_generation_batch_size=None,
        tensor_batch_size=None,
        max_tokens_per_microbatch=None,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


def test_each_variable_maps_to_its_field():
    assert {spec.env: spec.name for spec in ENV_SETTINGS} == {
        "DIFFU_TRAIN_BATCH_SIZE": "per_device_train_batch_size",
        "DIFFU_BATCH_SIZE": "per_device_generation_batch_size",
        "DIFFU_TENSOR_BATCH_SIZE": "tensor_batch_size",
        "DIFFU_MAX_TOKENS": "max_tokens_per_microbatch",
        "DIFFU_MAX_MEMORY_MIB": "max_memory_per_device_mib",
        "DIFFU_MAX_MEMORY_FRACTION": "max_memory_fraction_per_device",
        "DIFFU_SHARE_PROMPT_PREFIX": "share_prompt_prefix",
    }


@pytest.mark.parametrize("raw, value", [("tree", "tree"), ("GROUPS", "groups"), ("false", "none"), ("1", "tree")])
def test_the_sharing_rule_is_a_name_or_a_boolean(raw, value):
    assert read_env_overrides({"DIFFU_SHARE_PROMPT_PREFIX": raw}) == {
        "share_prompt_prefix": ("DIFFU_SHARE_PROMPT_PREFIX", SharePrefix(value))
    }
    with pytest.raises(ValueError, match=r"DIFFU_SHARE_PROMPT_PREFIX='trie' is not valid: expected 'tree', 'groups'"):
        read_env_overrides({"DIFFU_SHARE_PROMPT_PREFIX": "trie"})


def test_read_returns_field_to_variable_and_value():
    environ = {"DIFFU_TRAIN_BATCH_SIZE": "2", "DIFFU_MAX_TOKENS": "8192", "UNRELATED": "x"}
    assert read_env_overrides(environ) == {
        "per_device_train_batch_size": ("DIFFU_TRAIN_BATCH_SIZE", 2),
        "max_tokens_per_microbatch": ("DIFFU_MAX_TOKENS", 8192),
    }


def test_read_with_nothing_set_is_empty():
    assert read_env_overrides({}) == {}


def test_read_defaults_to_process_environment(monkeypatch):
    monkeypatch.setenv("DIFFU_TENSOR_BATCH_SIZE", "4096")
    assert read_env_overrides() == {"tensor_batch_size": ("DIFFU_TENSOR_BATCH_SIZE", 4096)}


def test_surrounding_whitespace_is_tolerated():
    assert read_env_overrides({"DIFFU_BATCH_SIZE": " 16\n"}) == {
        "per_device_generation_batch_size": ("DIFFU_BATCH_SIZE", 16)
    }


@pytest.mark.parametrize("value", ["", " ", "2.5", "abc", "0", "-3", "1e3", "4 4"])
def test_bad_values_raise_naming_variable_value_and_expectation(value):
    with pytest.raises(ValueError) as raised:
        read_env_overrides({"DIFFU_TRAIN_BATCH_SIZE": value})
    message = str(raised.value)
    assert "DIFFU_TRAIN_BATCH_SIZE" in message
    assert repr(value) in message
    assert "a positive integer number of samples per device" in message


def test_token_variables_say_tokens():
    with pytest.raises(ValueError, match="positive integer number of tokens per device"):
        read_env_overrides({"DIFFU_MAX_TOKENS": "lots"})
    with pytest.raises(ValueError, match="positive integer number of tokens per tile"):
        read_env_overrides({"DIFFU_TENSOR_BATCH_SIZE": "-1"})


def test_apply_sets_attributes_and_describes_each_override():
    args = make_args()
    messages = apply_env_overrides(args, {"DIFFU_TRAIN_BATCH_SIZE": "2", "DIFFU_BATCH_SIZE": "8"})
    assert args.per_device_train_batch_size == 2
    assert args.per_device_generation_batch_size == 8
    assert "DIFFU_TRAIN_BATCH_SIZE=2 overrides per_device_train_batch_size=4" in messages
    assert "DIFFU_BATCH_SIZE=8 overrides per_device_generation_batch_size=None" in messages


def test_apply_without_variables_changes_nothing():
    args = make_args()
    assert apply_env_overrides(args, {}) == []
    assert args == make_args()


def test_a_bad_value_changes_nothing():
    args = make_args()
    with pytest.raises(ValueError):
        apply_env_overrides(args, {"DIFFU_TRAIN_BATCH_SIZE": "2", "DIFFU_MAX_TOKENS": "0"})
    assert args == make_args()


def test_each_override_is_logged_once_per_process(caplog):
    environ = {"DIFFU_TRAIN_BATCH_SIZE": "2"}
    with caplog.at_level(logging.INFO, logger="hf_dynbsz"):
        apply_env_overrides(make_args(), environ)
        apply_env_overrides(make_args(), environ)
        second_messages = apply_env_overrides(make_args(), environ)
    logged = [r.getMessage() for r in caplog.records if r.name == "hf_dynbsz"]
    assert logged == ["DIFFU_TRAIN_BATCH_SIZE=2 overrides per_device_train_batch_size=4"]
    assert second_messages == logged  # still reported to the caller every time


def test_module_is_pure_python():
    from hf_dynbsz.testing import loaded_by_import

    assert loaded_by_import("hf_dynbsz.planning.env") == {"torch": False, "trl": False}


@pytest.mark.parametrize("raw, value", [("0.9", 0.9), (" 0.5\n", 0.5), ("1", 1.0)])
def test_the_memory_fraction_variable_reads_a_fraction(raw, value):
    assert read_env_overrides({"DIFFU_MAX_MEMORY_FRACTION": raw}) == {
        "max_memory_fraction_per_device": ("DIFFU_MAX_MEMORY_FRACTION", value)
    }


@pytest.mark.parametrize("raw", ["", "abc", "0", "-0.5", "nan", "inf"])
def test_the_memory_fraction_variable_rejects_what_is_not_a_positive_number(raw):
    with pytest.raises(ValueError, match=r"DIFFU_MAX_MEMORY_FRACTION=.* is not valid: expected a fraction"):
        read_env_overrides({"DIFFU_MAX_MEMORY_FRACTION": raw})

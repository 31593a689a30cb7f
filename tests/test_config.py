"""Specification of hf_dynbsz.configs: DynamicBatchGRPOConfig and ensure_dynamic_batch_fields."""

from __future__ import annotations

import dataclasses
import logging

import pytest
from trl import GRPOConfig

from hf_dynbsz.configs import DynamicBatchGRPOConfig, default_ddp_backend, ensure_dynamic_batch_fields
from hf_dynbsz.planning import env
from hf_dynbsz.planning.plan import BatchSizePlan
from hf_dynbsz.planning.settings import defaults_of

DEFAULTS = defaults_of("grpo")  # the fields a GRPO config adds (a distillation's adds its teacher's budget too)

NEW_FIELDS = (
    "dynamic_batching",
    "max_tokens_per_microbatch",
    "max_tokens_per_microbatch_logprob",
    "per_device_generation_batch_size",
    "tensor_batch_size",
    "oversize_policy",
    "packing_layout",
    "balance_across_ranks",
    "share_prompt_prefix",
    "self_check",
    "peak_tflops_per_device",
    "max_memory_per_device_mib",
    "max_memory_fraction_per_device",
    "sequence_parallel_size",
)


@pytest.fixture(autouse=True)
def _fresh_log_memory(monkeypatch):
    monkeypatch.setattr(env, "_LOGGED", set())


def make_config(tmp_path, cls=DynamicBatchGRPOConfig, **overrides):
    settings = dict(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=4,
        num_generations=4,
    )
    settings.update(overrides)
    return cls(**settings)


# ---- fields ------------------------------------------------------------------------------------------------


def test_defaults(tmp_path):
    config = make_config(tmp_path)
    assert config.dynamic_batching is True
    assert config.max_tokens_per_microbatch is None
    assert config.max_tokens_per_microbatch_logprob is None
    assert config.per_device_generation_batch_size is None
    assert config.tensor_batch_size == 1024
    assert config.oversize_policy == "warn"
    assert config.packing_layout == "auto"
    assert {name: getattr(config, name) for name in NEW_FIELDS} == held_defaults("grpo")


def test_every_new_field_has_help_stating_its_unit():
    own = {f.name: f for f in dataclasses.fields(DynamicBatchGRPOConfig)}
    for name in NEW_FIELDS:
        assert own[name].metadata.get("help"), name
    for name in ("max_tokens_per_microbatch", "max_tokens_per_microbatch_logprob", "tensor_batch_size"):
        assert "tokens" in own[name].metadata["help"], name
        assert "per device" in own[name].metadata["help"], name
    assert "samples" in own["per_device_generation_batch_size"].metadata["help"]
    assert "GLOBAL" in own["per_device_generation_batch_size"].metadata["help"]


def test_budget_help_documents_the_auto_rule_and_pad_to_multiple_of():
    help_text = {f.name: f for f in dataclasses.fields(DynamicBatchGRPOConfig)}["max_tokens_per_microbatch"].metadata[
        "help"
    ]
    assert "per_device_train_batch_size * (longest prompt + longest completion in the generation batch)" in help_text
    assert "pad_to_multiple_of" in help_text


def test_no_new_length_rounding_field():
    assert "pad_to_multiple_of" in {f.name for f in dataclasses.fields(GRPOConfig)}
    stock = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert {f.name for f in dataclasses.fields(DynamicBatchGRPOConfig)} - stock == set(NEW_FIELDS)


def test_trl_generation_batch_size_keeps_its_global_meaning(tmp_path):
    config = make_config(tmp_path, gradient_accumulation_steps=2, per_device_generation_batch_size=3)
    assert config.generation_batch_size == 4 * config.world_size * 2
    assert config.steps_per_generation == 2


def test_string_values_are_converted(tmp_path):
    config = make_config(
        tmp_path, max_tokens_per_microbatch="4096", tensor_batch_size="1024", max_tokens_per_microbatch_logprob="none"
    )
    assert config.max_tokens_per_microbatch == 4096
    assert config.tensor_batch_size == 1024
    assert config.max_tokens_per_microbatch_logprob is None


@pytest.mark.parametrize(
    ("given", "rule"),
    [(True, "tree"), ("tree", "tree"), ("Groups", "groups"), ("false", "none"), (False, "none"), ("none", "none")],
)
def test_the_sharing_rule_is_a_name_or_a_boolean_and_true_is_the_tree(tmp_path, monkeypatch, given, rule):
    """Whatever it was given as, the config holds the rule (``SharePrefix``: a string of the rule's name, false when
    nothing is shared), the one value the scheduler and the layouts carry too."""
    from hf_dynbsz.planning.settings import SharePrefix

    config = make_config(tmp_path, share_prompt_prefix=given)
    assert config.share_prompt_prefix is SharePrefix(rule) and config.share_prompt_prefix == rule
    assert bool(config.share_prompt_prefix) == (rule != "none")
    monkeypatch.setenv("DIFFU_SHARE_PROMPT_PREFIX", "groups")
    assert make_config(tmp_path, share_prompt_prefix="tree").share_prompt_prefix == "groups"


def test_the_sharing_rule_parses_from_the_command_line(tmp_path):
    from trl import TrlParser

    parser = TrlParser(DynamicBatchGRPOConfig)
    for text, value in (("tree", "tree"), ("false", "none"), ("groups", "groups")):
        arguments = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--share_prompt_prefix", text]
        (config,) = parser.parse_args_and_config(arguments)
        assert config.share_prompt_prefix == value


@pytest.mark.parametrize(
    "field, value, phrase",
    [
        ("share_prompt_prefix", "trie", "share_prompt_prefix must be 'tree', 'groups', true or false"),
        ("max_tokens_per_microbatch", 0, "max_tokens_per_microbatch must be a positive integer number of tokens"),
        ("max_tokens_per_microbatch_logprob", -1, "max_tokens_per_microbatch_logprob must be a positive integer"),
        ("per_device_generation_batch_size", 0, "per_device_generation_batch_size must be a positive integer"),
        ("tensor_batch_size", 0, "tensor_batch_size must be a positive integer number of tokens"),
        ("oversize_policy", "skip", "oversize_policy must be one of 'warn', 'error', got 'skip'"),
        ("packing_layout", "varlen", "packing_layout must be one of 'auto', 'padding_free', 'padded'"),
    ],
)
def test_invalid_values_name_setting_value_and_fix(tmp_path, field, value, phrase):
    with pytest.raises(ValueError) as raised:
        make_config(tmp_path, **{field: value})
    assert phrase in str(raised.value)
    assert repr(value) in str(raised.value)


def test_logprob_budget_below_training_budget_is_allowed(tmp_path):
    config = make_config(tmp_path, max_tokens_per_microbatch=4096, max_tokens_per_microbatch_logprob=1024)
    assert config.max_tokens_per_microbatch_logprob == 1024


def test_trl_checks_still_apply(tmp_path):
    with pytest.raises(ValueError, match="num_generations"):
        make_config(tmp_path, per_device_train_batch_size=3, num_generations=4)


# ---- environment overrides ---------------------------------------------------------------------------------


def test_environment_overrides_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFU_TRAIN_BATCH_SIZE", "8")
    monkeypatch.setenv("DIFFU_BATCH_SIZE", "2")
    monkeypatch.setenv("DIFFU_TENSOR_BATCH_SIZE", "2048")
    monkeypatch.setenv("DIFFU_MAX_TOKENS", "3000")
    config = make_config(tmp_path, max_tokens_per_microbatch=9999)
    assert config.per_device_train_batch_size == 8
    assert config.per_device_generation_batch_size == 2
    assert config.tensor_batch_size == 2048
    assert config.max_tokens_per_microbatch == 3000


def test_environment_feeds_trls_generation_batch_derivation(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFU_TRAIN_BATCH_SIZE", "8")
    config = make_config(tmp_path, gradient_accumulation_steps=2)
    assert config.generation_batch_size == 8 * config.world_size * 2


def test_environment_value_is_validated_by_trl_too(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFU_TRAIN_BATCH_SIZE", "3")  # 3 x 1 x 1 is not divisible by num_generations 4
    with pytest.raises(ValueError, match="num_generations"):
        make_config(tmp_path)


def test_error_caused_by_an_environment_value_names_the_variable(tmp_path, monkeypatch):
    # The user's script says per_device_train_batch_size=8; the 3 came from the environment.
    monkeypatch.setenv("DIFFU_TRAIN_BATCH_SIZE", "3")
    with pytest.raises(ValueError) as raised:
        make_config(tmp_path, per_device_train_batch_size=8, num_generations=8)
    message = str(raised.value)
    assert "must be divisible by num_generations (8)" in message
    assert "per_device_train_batch_size from DIFFU_TRAIN_BATCH_SIZE=3" in message


def test_error_caused_by_an_environment_value_names_the_variable_on_a_plain_grpo_config(tmp_path, monkeypatch):
    config = make_config(tmp_path, cls=GRPOConfig, per_device_train_batch_size=8, num_generations=8)
    monkeypatch.setenv("DIFFU_TRAIN_BATCH_SIZE", "3")
    with pytest.raises(ValueError, match=r"from DIFFU_TRAIN_BATCH_SIZE=3"):
        ensure_dynamic_batch_fields(config)


def test_dynamic_field_error_names_the_variable_that_set_the_value(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFU_MAX_TOKENS", "8")  # smaller than one row of pad_to_multiple_of=64
    with pytest.raises(ValueError) as raised:
        make_config(tmp_path, pad_to_multiple_of=64)
    assert "max_tokens_per_microbatch=8 is smaller than one row of pad_to_multiple_of=64" in str(raised.value)
    assert "DIFFU_MAX_TOKENS=8" in str(raised.value)


def test_errors_without_environment_values_do_not_mention_it(tmp_path):
    with pytest.raises(ValueError) as raised:
        make_config(tmp_path, per_device_train_batch_size=3, num_generations=8)
    assert "DIFFU_" not in str(raised.value)


@pytest.mark.parametrize(
    ("field", "value", "phrase"),
    [
        ("loss_type", "grpo2", "loss_type must be one of"),
        ("importance_sampling_level", "batch", "importance_sampling_level must be 'token' or 'sequence'"),
        ("beta", -0.1, "beta must be >= 0"),
        ("epsilon", -0.2, "epsilon must be >= 0"),
        ("epsilon_high", -1.0, "epsilon_high must be >= 0"),
        ("top_entropy_quantile", 0.0, "top_entropy_quantile must be in (0, 1]"),
        ("temperature", 0.0, "temperature must be > 0"),
        ("max_completion_length", 0, "max_completion_length must be at least 1"),
    ],
)
def test_grpo_settings_trl_only_rejects_in_training_are_rejected_at_construction(tmp_path, field, value, phrase):
    with pytest.raises(ValueError) as raised:
        make_config(tmp_path, **{field: value})
    assert phrase in str(raised.value) and repr(value) in str(raised.value)


@pytest.mark.parametrize("value", [0, -5.0, "fast", float("inf")])
def test_peak_tflops_must_be_a_positive_number(tmp_path, value):
    with pytest.raises(ValueError, match=r"peak_tflops_per_device must be a positive number of TFLOP/s"):
        make_config(tmp_path, peak_tflops_per_device=value)


def test_peak_tflops_from_the_command_line_is_a_float(tmp_path):
    assert make_config(tmp_path, peak_tflops_per_device="989.5").peak_tflops_per_device == 989.5


def test_budget_smaller_than_one_padded_row_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"Raise max_tokens_per_microbatch to at least 64"):
        make_config(tmp_path, max_tokens_per_microbatch=32, pad_to_multiple_of=64)


@pytest.mark.parametrize("value", ["", "2.5", "abc", " ", "0", "-4"])
def test_bad_environment_value_fails_construction(tmp_path, monkeypatch, value):
    monkeypatch.setenv("DIFFU_TRAIN_BATCH_SIZE", value)
    with pytest.raises(ValueError) as raised:
        make_config(tmp_path)
    assert "DIFFU_TRAIN_BATCH_SIZE" in str(raised.value)
    assert repr(value) in str(raised.value)


def test_override_is_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DIFFU_MAX_TOKENS", "512")
    with caplog.at_level(logging.INFO, logger="hf_dynbsz"):
        make_config(tmp_path, max_tokens_per_microbatch=100)
    assert "DIFFU_MAX_TOKENS=512 overrides max_tokens_per_microbatch=100" in caplog.messages


def test_override_is_logged_visibly_on_the_main_process_only(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DIFFU_MAX_TOKENS", "512")
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.INFO, logger="hf_dynbsz"):
        make_config(tmp_path)
    assert [record.levelno for record in caplog.records if "DIFFU_MAX_TOKENS" in record.getMessage()] == [logging.INFO]
    monkeypatch.setattr(env, "_LOGGED", set())
    monkeypatch.setenv("RANK", "0")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_dynbsz"):
        make_config(tmp_path)
    assert [r.levelno for r in caplog.records if "DIFFU_MAX_TOKENS" in r.getMessage()] == [logging.WARNING]


def test_plan_table_marks_values_set_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFU_MAX_TOKENS", "512")
    text = BatchSizePlan.from_args(make_config(tmp_path), 1).render()
    budget_row = next(line for line in text.splitlines() if line.startswith("max_tokens_per_microbatch "))
    assert budget_row.endswith("[set by DIFFU_MAX_TOKENS=512]")
    assert "[set by" not in text.replace(budget_row, "")


# ---- ensure_dynamic_batch_fields ---------------------------------------------------------------------------


def test_plain_grpo_config_gets_the_defaults(tmp_path):
    config = make_config(tmp_path, cls=GRPOConfig)
    assert ensure_dynamic_batch_fields(config) is config
    assert {name: getattr(config, name) for name in NEW_FIELDS} == held_defaults("grpo")


def test_plain_grpo_config_keeps_attributes_set_by_the_user(tmp_path):
    config = make_config(tmp_path, cls=GRPOConfig)
    config.max_tokens_per_microbatch = 2048
    ensure_dynamic_batch_fields(config)
    assert config.max_tokens_per_microbatch == 2048


def test_plain_grpo_config_environment_rederives_generation_batch(tmp_path, monkeypatch):
    config = make_config(tmp_path, cls=GRPOConfig, gradient_accumulation_steps=2)
    assert (config.generation_batch_size, config.steps_per_generation) == (8 * config.world_size, 2)
    monkeypatch.setenv("DIFFU_TRAIN_BATCH_SIZE", "2")
    ensure_dynamic_batch_fields(config)
    assert config.per_device_train_batch_size == 2
    assert config.steps_per_generation == 2
    assert config.generation_batch_size == 2 * config.world_size * 2


def test_plain_grpo_config_environment_divisibility_error(tmp_path, monkeypatch):
    config = make_config(tmp_path, cls=GRPOConfig)
    monkeypatch.setenv("DIFFU_TRAIN_BATCH_SIZE", "1")  # 1 x 1 x 1 = 1 not divisible by num_generations 4
    with pytest.raises(ValueError, match=r"must be divisible by num_generations \(4\)"):
        ensure_dynamic_batch_fields(config)


def test_plain_grpo_config_bad_field_value(tmp_path):
    config = make_config(tmp_path, cls=GRPOConfig)
    config.oversize_policy = "drop"
    with pytest.raises(ValueError, match="oversize_policy"):
        ensure_dynamic_batch_fields(config)


def test_ensure_is_idempotent(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFU_TRAIN_BATCH_SIZE", "8")
    config = make_config(tmp_path, cls=GRPOConfig)
    ensure_dynamic_batch_fields(config)
    first = config.to_dict() | {name: getattr(config, name) for name in NEW_FIELDS}
    ensure_dynamic_batch_fields(config)
    assert config.to_dict() | {name: getattr(config, name) for name in NEW_FIELDS} == first
    assert config.generation_batch_size == 8 * config.world_size


def test_ensure_is_a_no_op_on_a_dynamic_config(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFU_TRAIN_BATCH_SIZE", "8")
    config = make_config(tmp_path, max_tokens_per_microbatch=1000)
    before = config.to_dict()
    ensure_dynamic_batch_fields(config)
    assert config.to_dict() == before


# ---- the plan of a config ----------------------------------------------------------------------------------


def test_plan_of_a_config_on_its_own_world_size(tmp_path):
    config = make_config(tmp_path, gradient_accumulation_steps=2)
    plan = BatchSizePlan.from_args(config, num_processes=config.world_size)
    assert (plan.generation_batch_size, plan.steps_per_generation) == (
        config.generation_batch_size,
        config.steps_per_generation,
    )


def test_plan_of_a_config_on_another_world_size_keeps_user_intent(tmp_path):
    given_steps = make_config(tmp_path, steps_per_generation=2)
    assert BatchSizePlan.from_args(given_steps, num_processes=8).generation_batch_size == 4 * 8 * 2
    given_batch = make_config(tmp_path, generation_batch_size=32)
    plan = BatchSizePlan.from_args(given_batch, num_processes=8)
    assert (plan.generation_batch_size, plan.steps_per_generation) == (32, 1)


def test_plan_of_a_plain_config_after_ensure(tmp_path):
    config = ensure_dynamic_batch_fields(make_config(tmp_path, cls=GRPOConfig, gradient_accumulation_steps=2))
    plan = BatchSizePlan.from_args(config, num_processes=4)
    assert (plan.generation_batch_size, plan.steps_per_generation) == (4 * 4 * 2, 2)


# ---- DeepSpeed on CPU --------------------------------------------------------------------------------------


def test_deepspeed_without_accelerator_defaults_to_gloo():
    deepspeed = {"ACCELERATE_USE_DEEPSPEED": "true"}
    assert default_ddp_backend(None, deepspeed, accelerator_available=False) == "gloo"
    assert default_ddp_backend(None, deepspeed, accelerator_available=True) is None
    assert default_ddp_backend(None, {}, accelerator_available=False) is None
    assert default_ddp_backend("ccl", deepspeed, accelerator_available=False) == "ccl"  # explicit choice kept


def test_no_deepspeed_keeps_ddp_backend_unset(tmp_path):
    assert make_config(tmp_path).ddp_backend is None


@pytest.mark.parametrize("fraction", [0.0, 1.5, -0.2])
def test_a_memory_fraction_outside_zero_to_one_is_refused(tmp_path, fraction):
    with pytest.raises(
        ValueError,
        match=r"max_memory_fraction_per_device must be a (fraction of the device's memory,"
        r" 0 < f <= 1|positive)",
    ):
        make_config(tmp_path, max_memory_fraction_per_device=fraction)


# ---- a distillation's config -------------------------------------------------------------------------------
def held_defaults(trainer: str) -> dict:
    """The defaults of ``trainer``'s fields as a config holds them: share_prompt_prefix's True as the rule it means
    (SharePrefix.TREE, equal to "tree")."""
    return dict(defaults_of(trainer), share_prompt_prefix="tree")


def test_a_distillation_config_has_the_plugins_fields_and_its_teachers_budget(tmp_path, monkeypatch):
    """DynamicBatchDistillationConfig: DistillationConfig's fields and checks (beta in [0, 1]), the plugin's fields
    (environment over arguments), the teacher's budget; no generation round; sequence parallelism refused."""
    from trl import DistillationConfig

    from hf_dynbsz import DynamicBatchDistillationConfig

    monkeypatch.setenv("DIFFU_MAX_TOKENS", "99")
    config = DynamicBatchDistillationConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert isinstance(config, DistillationConfig) and config.max_tokens_per_microbatch == 99
    expected = held_defaults("distillation")
    del expected["max_tokens_per_microbatch"]
    assert {name: getattr(config, name) for name in expected} == expected
    assert not hasattr(config, "num_generations")
    with pytest.raises(ValueError, match=r"beta must be in \[0.0, 1.0\], got 2"):
        DynamicBatchDistillationConfig(output_dir=str(tmp_path), use_cpu=True, beta=2.0)
    with pytest.raises(ValueError, match="max_tokens_per_microbatch_teacher must be a positive integer"):
        DynamicBatchDistillationConfig(output_dir=str(tmp_path), use_cpu=True, max_tokens_per_microbatch_teacher=0)
    with pytest.raises(ValueError, match="sequence_parallel_size=2: DynamicBatchDistillationTrainer does not run"):
        DynamicBatchDistillationConfig(output_dir=str(tmp_path), use_cpu=True, sequence_parallel_size=2)


def test_a_plain_distillation_config_gets_its_fields_and_no_grpo_check(tmp_path):
    from trl import DistillationConfig

    config = DistillationConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", temperature=1.5)
    assert ensure_dynamic_batch_fields(config, "distillation") is config
    assert {name: getattr(config, name) for name in defaults_of("distillation")} == held_defaults("distillation")
    grpo = make_config(tmp_path, cls=GRPOConfig)
    ensure_dynamic_batch_fields(grpo)
    assert not hasattr(grpo, "max_tokens_per_microbatch_teacher")  # a GRPO config has no teacher


def test_a_memory_fraction_above_one_from_the_environment_is_refused_naming_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFU_MAX_MEMORY_FRACTION", "1.5")
    with pytest.raises(ValueError, match=r"max_memory_fraction_per_device must be .*DIFFU_MAX_MEMORY_FRACTION=1.5"):
        make_config(tmp_path)
    monkeypatch.setenv("DIFFU_MAX_MEMORY_FRACTION", "0.9")
    assert make_config(tmp_path).max_memory_fraction_per_device == 0.9

"""Specification of hf_dynbsz.planning.plan: the batch-size arithmetic of a GRPO run, per device and global."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_dynbsz.planning.generation_round import USER_BATCH_SETTINGS_ATTR, resolve_generation_round
from hf_dynbsz.planning.plan import BatchSizePlan
from hf_dynbsz.planning.settings import TRL_TENSOR_TILE_TOKENS
from hf_dynbsz.planning.validation import validate_dynamic_batch_fields

REPO = Path(__file__).resolve().parents[1]


def raw_args(**overrides):
    """Raw user settings with GRPOConfig's attribute names and defaults (as the command line passes them)."""
    values = dict(
        per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
        num_generations=8,
        generation_batch_size=None,
        steps_per_generation=None,
        num_iterations=1,
        pad_to_multiple_of="auto",
        bf16=None,
        fp16=False,
    )
    values.update(overrides)
    return SimpleNamespace(**values)


# ---- the generation round, as TRL derives it ---------------------------------------------------------------


def test_default_round_is_one_optimizer_step():
    plan = BatchSizePlan.from_args(raw_args(gradient_accumulation_steps=4), num_processes=2)
    assert plan.steps_per_generation == 4
    assert plan.generation_batch_size == 8 * 2 * 4
    assert plan.generation_round_source == "gradient_accumulation_steps"
    assert plan.optimizer_steps_per_generation_round == 1


def test_given_steps_per_generation():
    plan = BatchSizePlan.from_args(raw_args(steps_per_generation=4, gradient_accumulation_steps=2), num_processes=2)
    assert plan.generation_batch_size == 64
    assert plan.optimizer_steps_per_generation_round == 2
    assert plan.generation_round_source == "steps_per_generation"


def test_given_global_generation_batch_size():
    plan = BatchSizePlan.from_args(raw_args(generation_batch_size=96), num_processes=3)
    assert plan.generation_batch_size == 96  # global: kept whatever the world size
    assert plan.steps_per_generation == 96 // (8 * 3)
    assert plan.per_device_generation_share == 32
    assert plan.prompts_per_generation_round == 12


def test_derived_quantities_per_device_and_global():
    plan = BatchSizePlan.from_args(
        raw_args(per_device_train_batch_size=4, gradient_accumulation_steps=8, num_iterations=2), num_processes=2
    )
    assert plan.global_train_batch_size == 8
    assert plan.per_device_samples_per_optimizer_step == 32
    assert plan.global_samples_per_optimizer_step == 64
    assert plan.prompts_per_optimizer_step == 8
    assert plan.per_device_generation_share == 32
    assert plan.optimizer_steps_per_generation_round_all_iterations == 2


def test_fractional_ratios_stay_exact():
    # steps_per_generation 2 with gradient_accumulation_steps 4: one optimizer step spans two generation rounds
    plan = BatchSizePlan.from_args(
        raw_args(
            per_device_train_batch_size=2, num_generations=4, steps_per_generation=2, gradient_accumulation_steps=4
        ),
        num_processes=1,
    )
    assert plan.optimizer_steps_per_generation_round == Fraction(1, 2)
    assert "1/2" in plan.render()
    assert plan.as_dict()["optimizer_steps_per_generation_round"] == 0.5


@pytest.mark.parametrize(
    "settings, num_processes",
    [
        (dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4), 1),
        (dict(per_device_train_batch_size=2, gradient_accumulation_steps=3, num_generations=6), 2),
        (dict(per_device_train_batch_size=2, steps_per_generation=4, num_generations=8), 2),
        (dict(per_device_train_batch_size=3, generation_batch_size=24, num_generations=4), 2),
    ],
)
def test_matches_trl_on_the_same_world_size(settings, num_processes):
    """TRL's own derivation (GRPOConfig.__post_init__) for a world size, replayed without TRL."""
    args = raw_args(**settings)
    if args.generation_batch_size is None and args.steps_per_generation is None:
        expected_steps = args.gradient_accumulation_steps
        expected_batch = args.per_device_train_batch_size * num_processes * expected_steps
    elif args.steps_per_generation is None:
        expected_batch = args.generation_batch_size
        expected_steps = expected_batch // (args.per_device_train_batch_size * num_processes)
    else:
        expected_steps = args.steps_per_generation
        expected_batch = args.per_device_train_batch_size * num_processes * expected_steps
    plan = BatchSizePlan.from_args(args, num_processes=num_processes)
    assert (plan.generation_batch_size, plan.steps_per_generation) == (expected_batch, expected_steps)


# ---- planning another world size -------------------------------------------------------------------------


def test_post_initialised_config_without_record_keeps_steps_per_generation():
    """A plain GRPOConfig built on 1 process has both values set; planning 8 processes keeps the cadence."""
    built_for_one = raw_args(generation_batch_size=16, steps_per_generation=2, world_size=1)
    plan = BatchSizePlan.from_args(built_for_one, num_processes=8)
    assert plan.steps_per_generation == 2
    assert plan.generation_batch_size == 8 * 8 * 2
    same_world = BatchSizePlan.from_args(built_for_one, num_processes=1)
    assert (same_world.generation_batch_size, same_world.steps_per_generation) == (16, 2)


def test_recorded_user_generation_batch_size_is_kept_on_another_world_size():
    built_for_one = raw_args(generation_batch_size=64, steps_per_generation=8, world_size=1)
    setattr(built_for_one, USER_BATCH_SETTINGS_ATTR, {"generation_batch_size": 64, "steps_per_generation": None})
    plan = BatchSizePlan.from_args(built_for_one, num_processes=4)
    assert plan.generation_batch_size == 64
    assert plan.steps_per_generation == 2
    assert plan.generation_round_source == "generation_batch_size"


def test_recorded_default_cadence_rederives_global_batch():
    built_for_one = raw_args(generation_batch_size=8, steps_per_generation=1, world_size=1)
    setattr(built_for_one, USER_BATCH_SETTINGS_ATTR, {"generation_batch_size": None, "steps_per_generation": None})
    plan = BatchSizePlan.from_args(built_for_one, num_processes=8)
    assert plan.generation_batch_size == 64
    assert plan.generation_round_source == "gradient_accumulation_steps"


# ---- validation with the numbers and the nearest valid values ----------------------------------------------


@pytest.mark.parametrize(
    "fields, num_processes, phrases",
    [
        pytest.param(
            dict(generation_batch_size=12), 1,
            ["generation_batch_size (12) must be divisible by num_generations (8): use 8 or 16"],
            id="not divisible by num_generations",
        ),
        pytest.param(
            dict(generation_batch_size=20), 2, ["generation_batch_size (20", "(4 x 2 = 8)", "use 16 or 24"],
            id="not divisible by the global micro-batch",
        ),
        pytest.param(
            dict(gradient_accumulation_steps=3), 1,
            [
                "generation_batch_size (12 = per_device_train_batch_size x num_processes x steps_per_generation",
                "num_generations (8)",
                "use steps_per_generation 2 or 4 (generation_batch_size 8 or 16)",
                "gradient_accumulation_steps",
            ],
            id="derived from steps_per_generation",
        ),
    ],
)  # fmt: skip
def test_an_indivisible_generation_batch_names_its_numbers_and_the_valid_values(fields, num_processes, phrases):
    """4 samples per device: the message opens with the setting at fault and names the numbers and the nearest valid
    values."""
    with pytest.raises(ValueError) as raised:
        BatchSizePlan.from_args(raw_args(per_device_train_batch_size=4, **fields), num_processes=num_processes)
    message = str(raised.value)
    assert message.startswith(phrases[0]), message
    for phrase in phrases[1:]:
        assert phrase in message


def test_both_round_settings_given_is_an_error():
    with pytest.raises(ValueError, match="cannot both be set"):
        BatchSizePlan.from_args(raw_args(generation_batch_size=16, steps_per_generation=2), num_processes=1)


@pytest.mark.parametrize("num_generations", [1, 0, "x"])
def test_num_generations_at_least_two(num_generations):
    with pytest.raises(ValueError, match="num_generations must be an integer >= 2"):
        BatchSizePlan.from_args(raw_args(num_generations=num_generations), num_processes=1)


@pytest.mark.parametrize(
    "field, value",
    [
        ("per_device_train_batch_size", 0),
        ("gradient_accumulation_steps", -1),
        ("num_iterations", 0),
        ("generation_batch_size", 0),
        ("steps_per_generation", 2.5),
        ("per_device_generation_batch_size", 0),
        ("tensor_batch_size", -5),
        ("max_tokens_per_microbatch", 0),
        ("max_tokens_per_microbatch_logprob", 0),
    ],
)
def test_positive_integers_everywhere(field, value):
    with pytest.raises(ValueError, match=field):
        BatchSizePlan.from_args(raw_args(**{field: value}), num_processes=1)


def test_num_processes_must_be_positive():
    with pytest.raises(ValueError, match="num_processes"):
        BatchSizePlan.from_args(raw_args(), num_processes=0)


def test_string_values_from_the_command_line_are_accepted():
    plan = BatchSizePlan.from_args(
        raw_args(per_device_train_batch_size="4", num_generations="4", max_tokens_per_microbatch="4096"),
        num_processes="2",
    )
    assert (plan.per_device_train_batch_size, plan.num_processes, plan.max_tokens_per_microbatch) == (4, 2, 4096)


# ---- generation chunks, tiles, budgets, launcher -----------------------------------------------------------


def test_generation_chunks_per_device():
    plan = BatchSizePlan.from_args(
        raw_args(gradient_accumulation_steps=4, per_device_generation_batch_size=12), num_processes=1
    )
    assert plan.per_device_generation_share == 32
    assert (plan.generation_chunk_size, plan.generation_chunks_per_device) == (12, 3)


def test_whole_share_at_once_by_default_and_chunk_capped_at_share():
    default = BatchSizePlan.from_args(raw_args(), num_processes=1)
    assert (default.generation_chunk_size, default.generation_chunks_per_device) == (8, 1)
    large = BatchSizePlan.from_args(raw_args(per_device_generation_batch_size=100), num_processes=1)
    assert (large.generation_chunk_size, large.generation_chunks_per_device) == (8, 1)


def test_tensor_batch_defaults_to_trls_tile():
    assert (
        BatchSizePlan.from_args(raw_args(tensor_batch_size=None), 1).effective_tensor_batch_size
        == TRL_TENSOR_TILE_TOKENS
        == 4096
    )
    assert BatchSizePlan.from_args(raw_args(), 1).effective_tensor_batch_size == 1024
    assert BatchSizePlan.from_args(raw_args(tensor_batch_size=2048), 1).effective_tensor_batch_size == 2048


def test_logprob_budget_defaults_to_twice_the_training_budget():
    def logprob_budget(**settings):
        return BatchSizePlan.from_args(raw_args(**settings), 1).effective_max_tokens_per_microbatch_logprob

    assert logprob_budget(max_tokens_per_microbatch=4096) == 8192
    assert logprob_budget() is None  # 2 x auto, known per generation batch only
    assert logprob_budget(max_tokens_per_microbatch=4096, max_tokens_per_microbatch_logprob=1000) == 1000


def test_trl_tile_constant_matches_installed_trl():
    kernel = pytest.importorskip("trl.kernels.chunked_logprob")
    assert kernel.TOKEN_CHUNK_SIZE == TRL_TENSOR_TILE_TOKENS


def test_launcher_settings_and_their_defaults():
    plan = BatchSizePlan.from_args(raw_args(), 2, zero_stage=3, mixed_precision="fp16", layout="padded")
    assert (plan.zero_stage, plan.mixed_precision, plan.layout) == (3, "fp16", "padded")
    defaults = BatchSizePlan.from_args(raw_args(), 2)
    assert (defaults.zero_stage, defaults.mixed_precision, defaults.layout) == (None, "bf16", "auto")
    assert BatchSizePlan.from_args(raw_args(bf16=False), 1).mixed_precision == "no"
    assert BatchSizePlan.from_args(raw_args(fp16=True, bf16=False), 1).mixed_precision == "fp16"
    from_dict = BatchSizePlan.from_args(raw_args(deepspeed={"zero_optimization": {"stage": 2}}), 1)
    assert from_dict.zero_stage == 2
    with pytest.raises(ValueError, match="zero_stage"):
        BatchSizePlan.from_args(raw_args(), 1, zero_stage=4)


def test_pad_to_multiple_of():
    assert BatchSizePlan.from_args(raw_args(pad_to_multiple_of="auto"), 1).pad_to_multiple_of is None
    assert BatchSizePlan.from_args(raw_args(pad_to_multiple_of="64"), 1).pad_to_multiple_of == 64
    assert BatchSizePlan.from_args(raw_args(pad_to_multiple_of=None), 1).pad_to_multiple_of is None


def test_plan_is_frozen():
    plan = BatchSizePlan.from_args(raw_args(), 1)
    with pytest.raises(AttributeError):
        plan.num_processes = 2


def test_from_args_does_not_modify_args():
    args = raw_args(max_tokens_per_microbatch="4096")
    BatchSizePlan.from_args(args, 1)
    assert args.max_tokens_per_microbatch == "4096"


# ---- output ------------------------------------------------------------------------------------------------


def test_render_is_an_aligned_table_with_units():
    plan = BatchSizePlan.from_args(
        raw_args(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_tokens_per_microbatch=4096), 4
    )
    lines = plan.render().splitlines()
    assert lines[0].split()[:4] == ["setting", "per", "device", "global"]
    assert set(lines[1]) <= {"-", " "}
    global_column_end = lines[0].index("global") + len("global")
    for line in lines[2:]:  # the global column is right-aligned under its header
        assert line[global_column_end - 1] != " "
    text = "\n".join(lines)
    for phrase in ("samples per optimizer step", "generation_batch_size", "tokens per training micro-batch"):
        assert phrase in text
    budget_row = next(line for line in lines if line.startswith("max_tokens_per_microbatch "))
    assert "4096" in budget_row and "16384" in budget_row  # per device and x 4 processes


def test_render_says_auto_when_budget_unset():
    text = BatchSizePlan.from_args(raw_args(per_device_train_batch_size=4, num_generations=4), 1).render()
    assert "auto = 4 x (longest prompt + longest completion)" in text


def test_as_dict_is_plain_values():
    data = BatchSizePlan.from_args(raw_args(), 1).as_dict()
    assert data["global_samples_per_optimizer_step"] == 8
    assert data["prompts_per_optimizer_step"] == 1
    assert all(isinstance(v, (int, float, str, bool, type(None))) for v in data.values())


# ---- helpers -----------------------------------------------------------------------------------------------


def test_resolve_generation_round_is_trls_rule():
    assert resolve_generation_round(
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        num_processes=2,
        num_generations=4,
        generation_batch_size=None,
        steps_per_generation=None,
    ) == (16, 4, "gradient_accumulation_steps")


def test_validate_dynamic_batch_fields_coerces_strings_in_place():
    args = SimpleNamespace(
        dynamic_batching="false",
        max_tokens_per_microbatch="auto",
        max_tokens_per_microbatch_logprob="none",
        per_device_generation_batch_size="4",
        tensor_batch_size=None,
        oversize_policy="error",
        packing_layout="padded",
    )
    validate_dynamic_batch_fields(args)
    assert args.dynamic_batching is False
    assert args.max_tokens_per_microbatch is None
    assert args.max_tokens_per_microbatch_logprob is None
    assert args.per_device_generation_batch_size == 4


@pytest.mark.parametrize(
    "field, value, phrase",
    [
        ("oversize_policy", "ignore", "oversize_policy must be one of 'warn', 'error', got 'ignore'"),
        ("packing_layout", "packed", "packing_layout must be one of 'auto', 'padding_free', 'padded', got 'packed'"),
        ("max_tokens_per_microbatch", 0, "max_tokens_per_microbatch must be a positive integer number of tokens"),
        ("dynamic_batching", "maybe", "dynamic_batching must be true or false"),
    ],
)
def test_validate_dynamic_batch_fields_errors(field, value, phrase):
    with pytest.raises(ValueError) as raised:
        validate_dynamic_batch_fields(SimpleNamespace(**{field: value}))
    assert phrase in str(raised.value)


def test_module_is_pure_python():
    from hf_dynbsz.testing import loaded_by_import

    assert loaded_by_import("hf_dynbsz.planning.plan") == {"torch": False, "trl": False}


def test_a_distillation_plans_one_completion_per_prompt_generated_once_per_optimizer_step():
    """DistillationConfig has no generation round settings: its round is the optimizer step (n = 1, one pass)."""
    from types import SimpleNamespace

    args = SimpleNamespace(
        per_device_train_batch_size=4, gradient_accumulation_steps=3, max_tokens_per_microbatch_teacher=512
    )
    plan = BatchSizePlan.from_args(args, num_processes=2, trainer="distillation")
    assert (plan.num_generations, plan.steps_per_generation, plan.num_iterations) == (1, 3, 1)
    assert plan.generation_batch_size == plan.global_samples_per_optimizer_step == 24
    assert plan.max_tokens_per_microbatch_teacher == 512 and plan.stock_trainer == "DistillationTrainer"
    with pytest.raises(ValueError, match="trainer must be one of 'grpo', 'rloo', 'distillation'"):
        BatchSizePlan.from_args(args, num_processes=2, trainer="sft")

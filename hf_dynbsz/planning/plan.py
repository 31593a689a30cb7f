"""Batch-size arithmetic of a GRPO run, per device and global.

:class:`BatchSizePlan` turns the batch-size settings of a ``GRPOConfig`` (or anything with the same
attribute names) and a number of processes into every derived quantity: samples per training micro-batch,
per optimizer step and per generation round, prompts per optimizer step, optimizer steps per generation
round, generation chunks, token budgets. It validates every divisibility that TRL and DeepSpeed require and
says which values would be valid. The trainer logs :meth:`BatchSizePlan.render` at start and the
``hf-dynbsz plan`` command prints it.

Units used throughout: *samples* are completions (one prompt repeated ``num_generations`` times is
``num_generations`` samples); *tokens* are prompt + completion tokens; *per device* means one process of the
data-parallel group, *global* means summed over ``num_processes``.

This module is pure Python (no torch, no TRL): it is importable by the command-line planner on any machine.
The validation of the dynamic-batching fields (:func:`validate_dynamic_batch_fields`) lives here too so that
the configuration class and the command line share it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import Any

from hf_dynbsz.planning.env import env_sources
from hf_dynbsz.planning.model_support import images_stay_on_their_process
from hf_dynbsz.planning.partition import ceil_div
from hf_dynbsz.planning.settings import DEFAULTS, SETTINGS, TRL_TENSOR_TILE_TOKENS, Setting, setting

__all__ = [
    "BatchSizePlan",
    "TRL_TENSOR_TILE_TOKENS",
    "USER_BATCH_SETTINGS_ATTR",
    "resolve_generation_round",
    "validate_dynamic_batch_fields",
    "validate_grpo_fields",
    "validate_train_dataset_size",
]

#: Name of the attribute where ``DynamicBatchGRPOConfig`` records the ``generation_batch_size`` and
#: ``steps_per_generation`` the user gave, before TRL derives one from the other for its world size.
USER_BATCH_SETTINGS_ATTR = "_hf_dynbsz_user_batch_settings"

_NONE_STRINGS = ("none", "null", "auto")
_TRUE_STRINGS = ("true", "1", "yes", "on")
_FALSE_STRINGS = ("false", "0", "no", "off")


# --------------------------------------------------------------------------------------------------------------
# Coercion helpers (the command line and YAML files hand over strings)
# --------------------------------------------------------------------------------------------------------------


def _coerce_int(name: str, value: Any, expected: str) -> int:
    """``value`` as an int >= 1; accepts ints and decimal strings, rejects bools, floats and the rest."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be {expected}, got {value!r}.")
    return value


def _coerce_optional_int(name: str, value: Any, expected: str, fix: str) -> int | None:
    """Like :func:`_coerce_int` but ``None`` (or "none"/"null"/"auto") means unset."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_STRINGS):
        return None
    try:
        return _coerce_int(name, value, expected)
    except ValueError:
        raise ValueError(f"{name} must be {expected}, got {value!r}: {fix}") from None


def _coerce_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE_STRINGS + _FALSE_STRINGS:
        return value.strip().lower() in _TRUE_STRINGS
    raise ValueError(f"{name} must be true or false, got {value!r}.")


def _finite_number(value: Any) -> float | None:
    """``value`` as a finite float (numbers and numeric strings), or None when it is not one."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _coerce_pad_to_multiple_of(value: Any) -> int | None:
    """GRPOConfig's ``pad_to_multiple_of``: an int, None, or "auto" (None except on Neuron, where TRL uses 128)."""
    return _coerce_optional_int(
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
        return _coerce_bool(spec.name, value)
    if spec.kind == "choice":
        if value not in spec.choices:
            raise ValueError(
                f"{spec.name} must be one of {', '.join(map(repr, spec.choices))}, got {value!r}: {spec.fix}"
            )
        return value
    if spec.kind == "number":
        if spec.accepts_none and (value is None or (isinstance(value, str) and value.strip().lower() in _NONE_STRINGS)):
            return None
        number = _finite_number(value)
        if number is None or number <= 0:
            raise ValueError(f"{spec.name} must be {spec.expected}, got {value!r}: {spec.fix}")
        return number
    if spec.accepts_none:
        return _coerce_optional_int(spec.name, value, spec.expected, spec.fix)
    return _coerce_int(spec.name, value, spec.expected)


# --------------------------------------------------------------------------------------------------------------
# Validation of the dynamic-batching fields
# --------------------------------------------------------------------------------------------------------------


#: TRL 1.16 GRPOTrainer's loss types and importance-sampling levels (it checks them only at the first loss).
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "sapo", "cispo", "vespo", "luspo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def validate_grpo_fields(args: Any) -> None:
    """GRPOConfig settings that TRL only rejects deep inside training (or not at all), rejected here, at once.

    Training (``DynamicBatchGRPOConfig`` and the trainer) and ``hf-dynbsz plan`` call this same function. Raises
    :class:`ValueError` naming the setting, the value and what is valid.
    """

    def number(name: str, default: float) -> float:
        value = _finite_number(getattr(args, name, default))
        if value is None:
            raise ValueError(f"{name} must be a finite number, got {getattr(args, name)!r}.")
        return value

    loss_type = getattr(args, "loss_type", "dapo")
    if loss_type not in LOSS_TYPES:
        raise ValueError(
            f"loss_type must be one of {', '.join(map(repr, LOSS_TYPES))}, got {loss_type!r}: the loss "
            "types TRL's GRPOTrainer implements (it would only fail at the first loss computation)."
        )
    level = getattr(args, "importance_sampling_level", "token")
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}.")
    if number("beta", 0.0) < 0:
        raise ValueError(f"beta must be >= 0 (the KL coefficient; 0 turns the KL term off), got {args.beta!r}.")
    if number("epsilon", 0.2) < 0:
        raise ValueError(f"epsilon must be >= 0 (the lower clipping range), got {args.epsilon!r}.")
    if getattr(args, "epsilon_high", None) is not None and number("epsilon_high", 0.0) < 0:
        raise ValueError(f"epsilon_high must be >= 0 or unset (the upper clipping range), got {args.epsilon_high!r}.")
    quantile = number("top_entropy_quantile", 1.0)
    if not 0 < quantile <= 1:
        raise ValueError(
            f"top_entropy_quantile must be in (0, 1] (the share of highest-entropy tokens trained on; 1 "
            f"trains on all), got {args.top_entropy_quantile!r}."
        )
    if number("temperature", 1.0) <= 0:
        raise ValueError(f"temperature must be > 0 (it divides the logits), got {args.temperature!r}.")
    if getattr(args, "max_completion_length", 1) is not None and number("max_completion_length", 1) < 1:
        raise ValueError(f"max_completion_length must be at least 1 token, got {args.max_completion_length!r}.")


def validate_train_dataset_size(num_rows: int, args: Any) -> None:
    """Reject a ``train_dataset`` with fewer prompts than one generation round takes.

    TRL's sampler yields only whole rounds of ``generation_batch_size / num_generations`` prompts (global), so such
    a dataset (an empty one included) trains no step at all, and the Trainer only logs that. ``args`` is the
    post-initialised config.
    """
    prompts = args.generation_batch_size // args.num_generations
    if num_rows < prompts:
        raise ValueError(
            f"train_dataset has {num_rows} rows (prompts), fewer than the {prompts} prompts one generation round "
            f"takes (generation_batch_size {args.generation_batch_size} / num_generations {args.num_generations}, all "
            "processes): training would not take a single step. Give at least that many prompts, or lower "
            "per_device_train_batch_size, gradient_accumulation_steps or steps_per_generation."
        )


def validate_dynamic_batch_fields(args: Any) -> None:
    """Coerce and check the fields that dynamic batching adds, in place.

    Works on a ``DynamicBatchGRPOConfig``, on a plain ``GRPOConfig`` after
    :func:`~hf_dynbsz.config.ensure_dynamic_batch_fields`, and on an ``argparse.Namespace``. Missing fields are
    read as their defaults (and not set). String values (command line, YAML) are converted to ``int``/``bool``.
    Raises :class:`ValueError` naming the setting, the value and a fix (the texts of :mod:`hf_dynbsz.planning.settings`).
    """
    for spec in SETTINGS:
        if spec.trl_field:
            continue
        value = coerce_setting(spec, getattr(args, spec.name, spec.default))
        if hasattr(args, spec.name):
            setattr(args, spec.name, value)
    fraction = getattr(args, "max_memory_fraction_per_device", None)
    if fraction is not None and not 0 < float(fraction) <= 1:
        raise ValueError(
            f"max_memory_fraction_per_device must be {setting('max_memory_fraction_per_device').expected},"
            f" got {fraction!r}: {setting('max_memory_fraction_per_device').fix}"
        )
    budget = getattr(args, "max_tokens_per_microbatch", None)
    multiple = _coerce_pad_to_multiple_of(getattr(args, "pad_to_multiple_of", None))
    if budget is not None and multiple is not None and int(budget) < multiple:
        raise ValueError(
            f"max_tokens_per_microbatch={budget} is smaller than one row of pad_to_multiple_of={multiple} tokens: every "
            f"sequence would run alone, over the budget. Raise max_tokens_per_microbatch to at least {multiple} (a "
            "multiple of pad_to_multiple_of wastes nothing), or lower pad_to_multiple_of."
        )


# --------------------------------------------------------------------------------------------------------------
# Generation round (TRL's generation_batch_size / steps_per_generation)
# --------------------------------------------------------------------------------------------------------------


def _nearest_multiples(value: int, step: int) -> list[int]:
    """The positive multiples of ``step`` just below and just above ``value``."""
    below = (value // step) * step
    above = below + step
    return [m for m in (below, above) if m > 0 and m != value]


def _either(values: list[int]) -> str:
    return " or ".join(str(v) for v in values)


def resolve_generation_round(
    *,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    num_processes: int,
    num_generations: int,
    generation_batch_size: int | None,
    steps_per_generation: int | None,
) -> tuple[int, int, str]:
    """TRL 1.16's derivation of the generation round, with the divisibility checks and helpful errors.

    ``generation_batch_size`` is GLOBAL (samples per generation round, all processes);
    ``steps_per_generation`` is the number of training steps (slices of ``per_device_train_batch_size``
    samples per device) one generation round serves. At most one of them may be given; with neither,
    ``steps_per_generation = gradient_accumulation_steps``.

    Returns ``(generation_batch_size, steps_per_generation, source)`` where ``source`` names the setting the
    round was derived from: "generation_batch_size", "steps_per_generation" or "gradient_accumulation_steps".
    """
    global_micro = per_device_train_batch_size * num_processes
    micro_text = (
        f"per_device_train_batch_size x num_processes "
        f"({per_device_train_batch_size} x {num_processes} = {global_micro})"
    )
    if generation_batch_size is not None and steps_per_generation is not None:
        raise ValueError(
            f"generation_batch_size ({generation_batch_size}) and steps_per_generation ({steps_per_generation}) "
            "cannot both be set: generation_batch_size = per_device_train_batch_size x num_processes x "
            "steps_per_generation. Set only one of them."
        )
    if generation_batch_size is not None:
        valid_step = math.lcm(global_micro, num_generations)
        if generation_batch_size % global_micro != 0:
            raise ValueError(
                f"generation_batch_size ({generation_batch_size}, global samples per generation round) must be "
                f"divisible by {micro_text}: use {_either(_nearest_multiples(generation_batch_size, valid_step))} "
                f"(multiples of both {global_micro} and num_generations {num_generations})."
            )
        if generation_batch_size % num_generations != 0:
            raise ValueError(
                f"generation_batch_size ({generation_batch_size}) must be divisible by num_generations "
                f"({num_generations}): use {_either(_nearest_multiples(generation_batch_size, valid_step))}."
            )
        return generation_batch_size, generation_batch_size // global_micro, "generation_batch_size"

    if steps_per_generation is not None:
        source = "steps_per_generation"
    else:
        steps_per_generation = gradient_accumulation_steps
        source = "gradient_accumulation_steps"
    generation_batch_size = global_micro * steps_per_generation
    if generation_batch_size % num_generations != 0:
        step_multiple = num_generations // math.gcd(global_micro, num_generations)
        valid_steps = _nearest_multiples(steps_per_generation, step_multiple)
        hint = ""
        if source == "gradient_accumulation_steps":
            hint = (
                " (steps_per_generation defaults to gradient_accumulation_steps: set steps_per_generation or "
                "change gradient_accumulation_steps)"
            )
        raise ValueError(
            f"generation_batch_size ({generation_batch_size} = per_device_train_batch_size x num_processes x "
            f"steps_per_generation = {per_device_train_batch_size} x {num_processes} x {steps_per_generation}) "
            f"must be divisible by "
            f"num_generations ({num_generations}): use steps_per_generation {_either(valid_steps)} "
            f"(generation_batch_size {_either([s * global_micro for s in valid_steps])}){hint}, or change "
            f"per_device_train_batch_size or num_generations."
        )
    return generation_batch_size, steps_per_generation, source


def _user_generation_settings(args: Any) -> tuple[int | None, int | None]:
    """The ``(generation_batch_size, steps_per_generation)`` the user asked for, before any world-size derivation.

    1. A ``DynamicBatchGRPOConfig`` recorded them before TRL's ``__post_init__`` (:data:`USER_BATCH_SETTINGS_ATTR`).
    2. A post-initialised plain ``GRPOConfig`` (recognised by its ``world_size`` attribute) has both set, one of
       them derived by TRL for ``args.world_size`` processes, and does not say which. We keep
       ``steps_per_generation`` (TRL's default cadence, which does not depend on the world size) and re-derive the
       global ``generation_batch_size``; for the world size the config was built for this gives back TRL's value.
    3. Anything else (an ``argparse.Namespace`` of raw values, as the command line passes) is taken as given.
    """
    recorded = getattr(args, USER_BATCH_SETTINGS_ATTR, None)
    if recorded is not None:
        return recorded.get("generation_batch_size"), recorded.get("steps_per_generation")
    generation_batch_size = getattr(args, "generation_batch_size", None)
    steps_per_generation = getattr(args, "steps_per_generation", None)
    if generation_batch_size is not None and steps_per_generation is not None and hasattr(args, "world_size"):
        return None, steps_per_generation
    return generation_batch_size, steps_per_generation


def _mixed_precision_from_args(args: Any) -> str:
    """Mixed precision as TRL resolves it: fp16 if set, else bf16 unless ``bf16=False`` (TRL defaults to bf16)."""
    if getattr(args, "fp16", False) in (True, "true", "True"):
        return "fp16"
    bf16 = getattr(args, "bf16", None)
    if bf16 is None or bf16 in (True, "true", "True"):
        return "bf16"
    return "no"


def _zero_stage_from_args(args: Any) -> int | None:
    deepspeed = getattr(args, "deepspeed", None)
    if isinstance(deepspeed, Mapping):
        stage = deepspeed.get("zero_optimization", {}).get("stage")
        if isinstance(stage, int):
            return stage
    return None


# --------------------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------------------


def _fraction_text(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _plain(value: Any) -> Any:
    if isinstance(value, Fraction):
        return value.numerator if value.denominator == 1 else float(value)
    return value


@dataclass(frozen=True)
class BatchSizePlan:
    """Every batch size of a GRPO run, per device and global, validated.

    Build it with :meth:`from_args`. Stored fields are the settings after derivation; properties give the
    derived quantities. Ratios that need not be integers (optimizer steps per generation round, prompts per
    optimizer step) are :class:`fractions.Fraction`.
    """

    #: data-parallel processes (devices)
    num_processes: int
    #: samples per device per training step (stock TRL's fixed micro-batch)
    per_device_train_batch_size: int
    #: training steps per optimizer step
    gradient_accumulation_steps: int
    #: completions (samples) per prompt
    num_generations: int
    #: GLOBAL samples per generation round (TRL's ``generation_batch_size``)
    generation_batch_size: int
    #: training steps served by one generation round
    steps_per_generation: int
    #: "generation_batch_size", "steps_per_generation" or "gradient_accumulation_steps": what the round came from
    generation_round_source: str
    #: optimisation passes (mu) over each generation round
    num_iterations: int
    #: samples generated at once per device; None = the whole per-device share
    per_device_generation_batch_size: int | None
    #: tokens per tile of vocabulary-sized work; None = TRL's tile
    tensor_batch_size: int | None
    #: tokens per device per training micro-batch; None = auto
    max_tokens_per_microbatch: int | None
    #: tokens per device per no-grad log-prob micro-batch; None = 2 x the training budget
    max_tokens_per_microbatch_logprob: int | None
    #: lengths rounded up to a multiple of this many tokens (GRPOConfig's ``pad_to_multiple_of``); None = no rounding
    pad_to_multiple_of: int | None
    dynamic_batching: bool
    oversize_policy: str
    balance_across_ranks: bool
    share_prompt_prefix: bool
    #: the layouts are checked against each sample alone before the first pass
    self_check: bool
    #: "auto", "padding_free" or "padded"
    layout: str
    #: DeepSpeed ZeRO stage; None = no DeepSpeed
    zero_stage: int | None
    #: "no", "fp16", "bf16" (or what accelerate was given)
    mixed_precision: str | None
    #: {setting: "DIFFU_X=value"} for the settings a ``DIFFU_*`` environment variable set (shown in the table)
    env_sources: Mapping[str, str] = field(default_factory=dict)
    #: how image steps train: None (a text model, or not known), "repacked" or "stock" (fixed micro-batches)
    vision_language: str | None = None
    #: the MoE router aux loss TRL trains: None (none), "repacked", or why stock math runs
    router_aux: str | None = None
    #: with a memory limit: ``(setting, per-device value, meaning)`` rows of :func:`hf_dynbsz.planning.memory.plan_rows`
    memory_rows: tuple = ()
    #: processes sharing each pass's row (DeepSpeed Ulysses, :mod:`hf_dynbsz.parallel.sequence_parallel`); 1 = off
    sequence_parallel_size: int = 1

    # ---- construction ----------------------------------------------------------------------------------------

    @classmethod
    def from_args(
        cls,
        args: Any,
        num_processes: int,
        zero_stage: int | None = None,
        mixed_precision: str | None = None,
        layout: str | None = None,
        vision_language: str | None = None,
        router_aux: str | None = None,
        memory_rows: Sequence[tuple[str, str, str]] = (),
    ) -> BatchSizePlan:
        """Plan the batch sizes of ``args`` on ``num_processes`` processes.

        ``args`` is a ``GRPOConfig``/``DynamicBatchGRPOConfig`` (post-initialised or not) or any object with the
        same attribute names; the dynamic-batching fields default when absent. ``num_processes`` may differ from
        the world size ``args`` was built for (planning an 8-GPU run on a laptop): the generation round is then
        re-derived from what the user asked for, not from TRL's derived values (see
        :func:`_user_generation_settings`): a user-given global ``generation_batch_size`` is kept and
        ``steps_per_generation`` follows from it; otherwise ``steps_per_generation`` is kept (defaulting to
        ``gradient_accumulation_steps``) and ``generation_batch_size = per_device_train_batch_size x
        num_processes x steps_per_generation``, exactly as TRL derives it.

        ``zero_stage`` and ``mixed_precision`` describe the launcher (accelerate/DeepSpeed); when None they are
        read from ``args.deepspeed`` (a dict) and ``args.fp16``/``args.bf16``. ``layout`` is the concrete packing
        layout if known; None shows ``args.packing_layout``. ``vision_language`` (see
        :func:`hf_dynbsz.planning.model_support.vision_language_mode`) adds a row saying how image steps train, and
        ``router_aux`` ("repacked", or why not) one saying how the MoE router aux loss trains. ``memory_rows``
        (:func:`hf_dynbsz.planning.memory.plan_rows`) show a memory limit's model and budgets.

        Raises :class:`ValueError` with the numbers and the nearest valid values when a divisibility TRL or
        DeepSpeed requires does not hold.
        """
        num_processes = _coerce_int("num_processes", num_processes, "a positive integer number of processes")
        per_device_train_batch_size = _coerce_int(
            "per_device_train_batch_size",
            getattr(args, "per_device_train_batch_size", None),
            "a positive integer number of samples per device",
        )
        gradient_accumulation_steps = _coerce_int(
            "gradient_accumulation_steps",
            getattr(args, "gradient_accumulation_steps", 1),
            "a positive integer number of training steps per optimizer step",
        )
        num_generations = getattr(args, "num_generations", 8)
        if isinstance(num_generations, str) and num_generations.strip().isdigit():
            num_generations = int(num_generations)
        if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
            raise ValueError(
                f"num_generations must be an integer >= 2 (completions per prompt; GRPO's advantages compare the "
                f"completions of one prompt), got {num_generations!r}: use 2 or more."
            )
        num_iterations = _coerce_int(
            "num_iterations", getattr(args, "num_iterations", 1), "a positive integer number of passes"
        )
        user_generation_batch_size, user_steps_per_generation = _user_generation_settings(args)
        user_generation_batch_size = _coerce_optional_int(
            "generation_batch_size",
            user_generation_batch_size,
            "a positive integer number of samples (global, per generation round)",
            "leave it unset to derive it from steps_per_generation.",
        )
        user_steps_per_generation = _coerce_optional_int(
            "steps_per_generation",
            user_steps_per_generation,
            "a positive integer number of training steps per generation round",
            "leave it unset to use gradient_accumulation_steps.",
        )
        generation_batch_size, steps_per_generation, source = resolve_generation_round(
            per_device_train_batch_size=per_device_train_batch_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            num_processes=num_processes,
            num_generations=num_generations,
            generation_batch_size=user_generation_batch_size,
            steps_per_generation=user_steps_per_generation,
        )
        # Dynamic-batching fields: validate a copy so that a namespace or config is not modified here.
        dynamic = _FieldView(args)
        validate_dynamic_batch_fields(dynamic)
        size = int(dynamic.sequence_parallel_size or 1)
        if num_processes % size:
            raise ValueError(
                f"sequence_parallel_size={size} does not divide num_processes={num_processes}: "
                f"{setting('sequence_parallel_size').fix}"
            )
        if zero_stage is not None:
            zero_stage = int(zero_stage)
            if zero_stage not in (0, 1, 2, 3):
                raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}.")
        else:
            zero_stage = _zero_stage_from_args(args)
        return cls(
            num_processes=num_processes,
            per_device_train_batch_size=per_device_train_batch_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            num_generations=num_generations,
            generation_batch_size=generation_batch_size,
            steps_per_generation=steps_per_generation,
            generation_round_source=source,
            num_iterations=num_iterations,
            per_device_generation_batch_size=dynamic.per_device_generation_batch_size,
            tensor_batch_size=dynamic.tensor_batch_size,
            max_tokens_per_microbatch=dynamic.max_tokens_per_microbatch,
            max_tokens_per_microbatch_logprob=dynamic.max_tokens_per_microbatch_logprob,
            pad_to_multiple_of=_coerce_pad_to_multiple_of(getattr(args, "pad_to_multiple_of", None)),
            dynamic_batching=dynamic.dynamic_batching,
            oversize_policy=dynamic.oversize_policy,
            balance_across_ranks=dynamic.balance_across_ranks,
            share_prompt_prefix=dynamic.share_prompt_prefix,
            self_check=dynamic.self_check,
            layout=layout if layout is not None else dynamic.packing_layout,
            zero_stage=zero_stage,
            mixed_precision=mixed_precision if mixed_precision is not None else _mixed_precision_from_args(args),
            env_sources=dict(env_sources(args)),
            vision_language=vision_language,
            router_aux=router_aux,
            memory_rows=tuple(tuple(row) for row in memory_rows),
            sequence_parallel_size=size,
        )

    # ---- derived quantities ----------------------------------------------------------------------------------

    @property
    def global_train_batch_size(self) -> int:
        """Samples per training step over all processes (stock micro-batch x processes)."""
        return self.per_device_train_batch_size * self.num_processes

    @property
    def per_device_samples_per_optimizer_step(self) -> int:
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def global_samples_per_optimizer_step(self) -> int:
        return self.per_device_samples_per_optimizer_step * self.num_processes

    @property
    def prompts_per_optimizer_step(self) -> Fraction:
        """Global samples per optimizer step / num_generations (need not be an integer)."""
        return Fraction(self.global_samples_per_optimizer_step, self.num_generations)

    @property
    def per_device_generation_share(self) -> int:
        """Samples each device generates per generation round (generation_batch_size / num_processes)."""
        return self.generation_batch_size // self.num_processes

    @property
    def prompts_per_generation_round(self) -> int:
        return self.generation_batch_size // self.num_generations

    @property
    def optimizer_steps_per_generation_round(self) -> Fraction:
        """steps_per_generation / gradient_accumulation_steps, for one pass over the round."""
        return Fraction(self.steps_per_generation, self.gradient_accumulation_steps)

    @property
    def optimizer_steps_per_generation_round_all_iterations(self) -> Fraction:
        """Optimizer steps taken on one generation round over its num_iterations passes."""
        return self.optimizer_steps_per_generation_round * self.num_iterations

    @property
    def generation_chunk_size(self) -> int:
        """Samples generated at once per device (capped at the per-device share)."""
        if self.per_device_generation_batch_size is None:
            return self.per_device_generation_share
        return min(self.per_device_generation_batch_size, self.per_device_generation_share)

    @property
    def generation_chunks_per_device(self) -> int:
        return ceil_div(self.per_device_generation_share, self.generation_chunk_size)

    @property
    def effective_tensor_batch_size(self) -> int:
        return self.tensor_batch_size if self.tensor_batch_size is not None else TRL_TENSOR_TILE_TOKENS

    @property
    def effective_max_tokens_per_microbatch_logprob(self) -> int | None:
        """The log-prob budget in tokens, or None while the training budget is automatic (then 2 x auto)."""
        if self.max_tokens_per_microbatch_logprob is not None:
            return self.max_tokens_per_microbatch_logprob
        if self.max_tokens_per_microbatch is not None:
            return 2 * self.max_tokens_per_microbatch
        return None

    # ---- output ----------------------------------------------------------------------------------------------

    def as_dict(self) -> dict[str, Any]:
        """Settings and derived quantities as plain JSON-friendly values (fractions become int or float); the
        ``DIFFU_*`` sources are in :attr:`env_sources`, a memory limit's rows in :attr:`memory_rows`."""
        result = {
            f.name: _plain(getattr(self, f.name)) for f in fields(self) if f.name not in ("env_sources", "memory_rows")
        }
        for name in (
            "global_train_batch_size",
            "per_device_samples_per_optimizer_step",
            "global_samples_per_optimizer_step",
            "prompts_per_optimizer_step",
            "per_device_generation_share",
            "prompts_per_generation_round",
            "optimizer_steps_per_generation_round",
            "optimizer_steps_per_generation_round_all_iterations",
            "generation_chunk_size",
            "generation_chunks_per_device",
            "effective_tensor_batch_size",
            "effective_max_tokens_per_microbatch_logprob",
        ):
            result[name] = _plain(getattr(self, name))
        return result

    def rows(self) -> list[tuple[str, str, str, str]]:
        """The table of :meth:`render` as ``(setting, per device, global, meaning)`` rows."""
        n = self.num_processes
        stay = images_stay_on_their_process(self.vision_language)  # this family's samples are not balanced
        train_budget = self.max_tokens_per_microbatch
        logprob_budget = self.effective_max_tokens_per_microbatch_logprob
        if self.per_device_generation_batch_size is None:
            chunk_text = f"{self.generation_chunk_size} (all)"
        else:
            chunk_text = str(self.generation_chunk_size)
        spg_text = {
            "generation_batch_size": "= generation_batch_size / (per_device_train_batch_size x processes)",
            "steps_per_generation": "set by the user",
            "gradient_accumulation_steps": "defaults to gradient_accumulation_steps",
        }[self.generation_round_source]
        rows = [
            ("processes", "-", str(n), "data-parallel processes (devices)"),
            (
                "per_device_train_batch_size",
                str(self.per_device_train_batch_size),
                str(self.global_train_batch_size),
                setting("per_device_train_batch_size").summary,
            ),
            (
                "gradient_accumulation_steps",
                str(self.gradient_accumulation_steps),
                "-",
                "training steps per optimizer step",
            ),
            (
                "samples per optimizer step",
                str(self.per_device_samples_per_optimizer_step),
                str(self.global_samples_per_optimizer_step),
                "per_device_train_batch_size x gradient_accumulation_steps (x processes)",
            ),
            (
                "prompts per optimizer step",
                "-",
                _fraction_text(self.prompts_per_optimizer_step),
                "global samples per optimizer step / num_generations",
            ),
            ("num_generations", "-", str(self.num_generations), "completions (samples) per prompt"),
            (
                "generation_batch_size",
                str(self.per_device_generation_share),
                str(self.generation_batch_size),
                "samples per generation round (TRL's generation_batch_size is the global one)",
            ),
            (
                "prompts per generation round",
                "-",
                str(self.prompts_per_generation_round),
                "generation_batch_size / num_generations",
            ),
            (
                "steps_per_generation",
                str(self.steps_per_generation),
                "-",
                f"training steps per generation round; {spg_text}",
            ),
            (
                "optimizer steps per generation round",
                _fraction_text(self.optimizer_steps_per_generation_round),
                "-",
                "steps_per_generation / gradient_accumulation_steps",
            ),
            ("num_iterations", str(self.num_iterations), "-", "passes (mu) over each generation round"),
            (
                "optimizer steps per round x num_iterations",
                _fraction_text(self.optimizer_steps_per_generation_round_all_iterations),
                "-",
                "optimizer steps taken on one generation round",
            ),
            (
                "per_device_generation_batch_size",
                chunk_text,
                "-",
                setting("per_device_generation_batch_size").summary,
            ),
            (
                "generation chunks",
                str(self.generation_chunks_per_device),
                "-",
                "generate calls per device per generation round",
            ),
            (
                "tensor_batch_size",
                str(self.effective_tensor_batch_size) + (" (TRL)" if self.tensor_batch_size is None else ""),
                "-",
                setting("tensor_batch_size").summary,
            ),
            (
                "max_tokens_per_microbatch",
                "auto" if train_budget is None else str(train_budget),
                "-" if train_budget is None else str(train_budget * n),
                (
                    f"tokens per training micro-batch; auto = {self.per_device_train_batch_size} x (longest prompt + "
                    "longest completion) per generation batch"
                    if train_budget is None
                    else setting("max_tokens_per_microbatch").summary
                ),
            ),
            (
                "max_tokens_per_microbatch_logprob",
                ("2 x auto" if logprob_budget is None else str(logprob_budget)),
                "-" if logprob_budget is None else str(logprob_budget * n),
                setting("max_tokens_per_microbatch_logprob").summary
                + ("; default 2 x training budget" if self.max_tokens_per_microbatch_logprob is None else ""),
            ),
            (
                "pad_to_multiple_of",
                "none" if self.pad_to_multiple_of is None else str(self.pad_to_multiple_of),
                "-",
                "lengths rounded up to a multiple of this many tokens",
            ),
            (
                "dynamic_batching",
                "on" if self.dynamic_batching else "off",
                "-",
                setting("dynamic_batching").summary if self.dynamic_batching else "stock GRPOTrainer behaviour",
            ),
            ("packing layout", self.layout, "-", setting("packing_layout").summary),
            (
                "oversize_policy",
                self.oversize_policy,
                "-",
                setting("oversize_policy").summary,
            ),
            (
                "share_prompt_prefix",
                "on" if self.share_prompt_prefix else "off",
                "-",
                setting("share_prompt_prefix").summary
                if self.share_prompt_prefix
                else "every sample computes its prompt",
            ),
            (
                "self_check",
                "on" if self.self_check else "off",
                "-",
                setting("self_check").summary if self.self_check else "the layout read off the model is trusted",
            ),
            (
                "balance_across_ranks",
                ("on" if self.balance_across_ranks and not stay else "off") + (" (1 process)" if n == 1 else ""),
                "-",
                "no-op on one process"
                if n == 1
                else (
                    "this family's image inputs stay on their process"
                    if stay
                    else setting("balance_across_ranks").summary
                ),
            ),
            (
                "DeepSpeed ZeRO stage",
                "none" if self.zero_stage is None else str(self.zero_stage),
                "-",
                "from the launcher",
            ),
            ("mixed precision", str(self.mixed_precision), "-", "from the launcher or fp16/bf16"),
        ]
        if self.vision_language is not None:
            rows.append(
                (
                    "image inputs",
                    self.vision_language,
                    "-",
                    "each sample's images move with it (into its micro-batch, to another process); padding-free rows "
                    "hold a shared prompt's images once (encoded once per pass)"
                    if self.vision_language == "repacked"
                    else "image steps run stock GRPOTrainer micro-batches: this model family is not repacked",
                )
            )
        if self.router_aux is not None:
            repacked = self.router_aux == "repacked"
            rows.append(
                (
                    "router aux loss",
                    "repacked" if repacked else "stock math",
                    "-",
                    "per sample, from one extra no-grad router pass over each optimizer step (log-prob budget)"
                    if repacked
                    else self.router_aux,
                )
            )
        size = self.sequence_parallel_size
        if size > 1:
            rows.append(
                (
                    "sequence_parallel_size",
                    str(size),
                    f"{max(n // size, 1)} group(s)",
                    "processes sharing each packed row (DeepSpeed Ulysses); data parallelism across groups",
                )
            )
            for name, budget, default in (("training", train_budget, "auto"), ("logprob", logprob_budget, "2 x auto")):
                rows.append(
                    (
                        f"tokens per {name} pass (group)",
                        f"{size} x {default}" if budget is None else str(size * budget),
                        "-",
                        f"the longest sequence one {name} pass holds without running "
                        f"oversize: {size} x the per-device budget, each process holding 1/{size} of the row",
                    )
                )
        rows.extend((name, value, "-", meaning) for name, value, meaning in self.memory_rows)
        # Values a DIFFU_* variable set say so, where the user looks for them.
        return [
            (
                name,
                device,
                total,
                f"{meaning} [set by {self.env_sources[name]}]" if name in self.env_sources else meaning,
            )
            for name, device, total, meaning in rows
        ]

    def render(self) -> str:
        """An aligned plain-text table: setting | per device | global | meaning."""
        return "\n".join(text_table(("setting", "per device", "global", "meaning"), self.rows(), "<>>-"))


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str) -> list[str]:
    """The lines of an aligned plain-text table (header, a rule, the rows), columns two spaces apart: ``align`` has
    one character per column, ``<`` left, ``>`` right, ``-`` left and not padded (a last free-text column)."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    free = [i for i, kind in enumerate(align) if kind == "-"]
    rule_widths = [len(header[i]) if i in free else width for i, width in enumerate(widths)]

    def line(row: Sequence[str]) -> str:
        cells = [
            cell if kind == "-" else cell.ljust(width) if kind == "<" else cell.rjust(width)
            for cell, width, kind in zip(row, widths, align, strict=True)
        ]
        return "  ".join(cells).rstrip()

    return [line(header), line(["-" * width for width in rule_widths]), *(line(row) for row in rows)]


class _FieldView:
    """A copy of the dynamic-batching fields of ``args`` (defaults where absent), for validation without mutation."""

    def __init__(self, args: Any) -> None:
        for name, default in DEFAULTS.items():
            setattr(self, name, getattr(args, name, default))

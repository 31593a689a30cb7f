"""Validation of a GRPO configuration that training (``DynamicBatchGRPOConfig``, the trainer) and ``hf-dynbsz plan``
share: one function per check, so that the planner rejects exactly what training rejects, with the same message.

* :func:`validate_dynamic_batch_fields`: the fields dynamic batching adds (the texts of
  :mod:`hf_dynbsz.planning.settings`), converted in place, and a LOMO optimizer refused
  (:func:`refuse_fused_update_optimizers`);
* :func:`validate_grpo_fields`: GRPOConfig settings that TRL only rejects deep inside training (or not at all);
* :func:`validate_train_dataset_size`: a dataset too small for one generation round.

Pure Python (no torch, no TRL): the batch-size plan (:mod:`hf_dynbsz.planning.plan`) validates with it too.
"""

from __future__ import annotations

from typing import Any

from hf_dynbsz.planning.coerce import coerce_pad_to_multiple_of, coerce_setting, finite_number
from hf_dynbsz.planning.settings import DEFAULTS, SETTINGS, setting

__all__ = [
    "FUSED_UPDATE_OPTIMIZERS",
    "IMPORTANCE_SAMPLING_LEVELS",
    "LOSS_TYPES",
    "refuse_fused_update_optimizers",
    "validate_dynamic_batch_fields",
    "validate_grpo_fields",
    "validate_train_dataset_size",
    "validated_fields",
]

#: TRL 1.16 GRPOTrainer's loss types and importance-sampling levels (it checks them only at the first loss).
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "sapo", "cispo", "vespo", "luspo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def validate_grpo_fields(args: Any) -> None:
    """GRPOConfig settings that TRL only rejects deep inside training (or not at all), rejected here, at once.

    Training (``DynamicBatchGRPOConfig`` and the trainer) and ``hf-dynbsz plan`` call this same function. Raises
    :class:`ValueError` naming the setting, the value and what is valid.
    """

    def number(name: str, default: float) -> float:
        value = finite_number(getattr(args, name, default))
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
    if getattr(args, "num_generations", None) is None:  # a distillation: one completion per prompt, a round a step
        prompts = args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps
        takes = (
            f"per_device_train_batch_size {args.per_device_train_batch_size} x processes {args.world_size} x "
            f"gradient_accumulation_steps {args.gradient_accumulation_steps}"
        )
        lower = "per_device_train_batch_size or gradient_accumulation_steps"
    else:
        prompts = args.generation_batch_size // args.num_generations
        takes = (
            f"generation_batch_size {args.generation_batch_size} / num_generations {args.num_generations}, all "
            "processes"
        )
        lower = "per_device_train_batch_size, gradient_accumulation_steps or steps_per_generation"
    if num_rows < prompts:
        raise ValueError(
            f"train_dataset has {num_rows} rows (prompts), fewer than the {prompts} prompts one generation round "
            f"takes ({takes}): training would not take a single step. Give at least that many prompts, or lower "
            f"{lower}."
        )


def validate_dynamic_batch_fields(args: Any) -> None:
    """Coerce and check the fields that dynamic batching adds, in place.

    Works on a ``DynamicBatchGRPOConfig``, on a plain ``GRPOConfig`` after
    :func:`~hf_dynbsz.configs.build.ensure_dynamic_batch_fields`, and on an ``argparse.Namespace``. Missing fields are
    read as their defaults (and not set). String values (command line, YAML) are converted to ``int``/``bool``.
    Raises :class:`ValueError` naming the setting, the value and a fix (the texts of
    :mod:`hf_dynbsz.planning.settings`).
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
    refuse_fused_update_optimizers(args)
    budget = getattr(args, "max_tokens_per_microbatch", None)
    multiple = coerce_pad_to_multiple_of(getattr(args, "pad_to_multiple_of", None))
    if budget is not None and multiple is not None and int(budget) < multiple:
        raise ValueError(
            f"max_tokens_per_microbatch={budget} is smaller than one row of pad_to_multiple_of={multiple} tokens: "
            f"every sequence would run alone, over the budget. Raise max_tokens_per_microbatch to at least {multiple} "
            "(a multiple of pad_to_multiple_of wastes nothing), or lower pad_to_multiple_of."
        )


#: transformers' optimizers that update the parameters inside the backward (``Trainer.training_step`` passes them the
#: learning rate through ``accelerator.backward``).
FUSED_UPDATE_OPTIMIZERS = ("lomo", "adalomo")


def refuse_fused_update_optimizers(args: Any) -> None:
    """A LOMO optimizer (``optim`` "lomo" or "adalomo") with dynamic batching: refused before any work. It updates the
    parameters in each backward, so a step's update depends on how the step is cut into backwards, and the plugin
    cuts it into its own passes (stock runs one backward per micro-batch)."""
    optim = getattr(args, "optim", None)
    optim = getattr(optim, "value", optim)  # (transformers' OptimizerNames)
    if optim in FUSED_UPDATE_OPTIMIZERS and getattr(args, "dynamic_batching", DEFAULTS["dynamic_batching"]):
        raise ValueError(
            f"optim={optim!r} with dynamic_batching=True: LOMO optimizers update the parameters inside each backward "
            "(transformers' Trainer passes them the learning rate through accelerator.backward), so the update "
            "depends on how a step is cut into backwards, and the plugin runs a step in passes of its own, not "
            "stock's micro-batches. Choose another optimizer (e.g. optim='adamw_torch'), or set "
            "dynamic_batching=False for stock's trainer."
        )


class _FieldView:
    """A copy of the dynamic-batching fields of ``args`` (defaults where absent), for validation without mutation."""

    def __init__(self, args: Any) -> None:
        for name, default in DEFAULTS.items():
            setattr(self, name, getattr(args, name, default))


def validated_fields(args: Any) -> Any:
    """The dynamic-batching fields of ``args`` (defaults where absent), converted and checked, as attributes of a
    copy: ``args`` itself (a namespace, a config) is not modified."""
    view = _FieldView(args)
    validate_dynamic_batch_fields(view)
    return view

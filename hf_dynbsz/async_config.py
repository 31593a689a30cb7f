"""``DynamicBatchAsyncGRPOConfig``: TRL's ``AsyncGRPOConfig`` (``trl.experimental.async_grpo``) plus the plugin's
settings (the fields of :class:`~hf_dynbsz.config.DynamicBatchFields`).

A module of its own: importing TRL's experimental package costs seconds and warns, which the synchronous trainers'
configs (:mod:`hf_dynbsz.config`) do not pay.

The optimizer step is defined by samples: ``per_device_train_batch_size x gradient_accumulation_steps x processes``
samples from the rollout queue, what stock's fixed-count mode (``token_budget <= 0``) trains per optimizer step.
Stock's ``token_budget`` keeps its meaning, the tokens one device forwards at once, as the plugin's training budget
per pass: ``token_budget > 0`` sets ``max_tokens_per_microbatch`` (:func:`take_token_budget`); unset (or ``<= 0``),
the budget is the plugin's automatic one: from memory with ``max_memory_per_device_mib`` (or
``max_memory_fraction_per_device``), else what stock's fixed-count mode forwards per device for the same samples.
The vLLM server is never asked for its ``max_model_len`` (stock's default budget), and no sample is dropped for its
length: one longer than the budget gets a pass of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trl.experimental.async_grpo import AsyncGRPOConfig

from hf_dynbsz.config import DynamicBatchFields, default_ddp_backend, refuse_sequence_parallelism
from hf_dynbsz.planning.env import apply_env_overrides, with_env_sources
from hf_dynbsz.planning.settings import config_docstring, defaults_of
from hf_dynbsz.planning.validation import validate_dynamic_batch_fields

__all__ = ["AsyncFields", "DynamicBatchAsyncGRPOConfig", "async_trainer_config", "take_token_budget"]

#: The trainer name of the plugin's settings and plan (``hf-dynbsz plan --trainer async_grpo``).
TRAINER = "async_grpo"


def take_token_budget(args) -> None:
    """Stock's ``token_budget`` as the plugin's training budget, in place: ``> 0`` sets ``max_tokens_per_microbatch``
    (tokens per device per pass); a different ``max_tokens_per_microbatch`` beside it is refused; ``None`` or
    ``<= 0`` leaves the budget to the plugin (from memory, else stock's fixed-count row)."""
    budget = getattr(args, "token_budget", None)
    if budget is None or int(budget) <= 0:
        return
    configured = getattr(args, "max_tokens_per_microbatch", None)
    if configured is not None and int(configured) != int(budget):
        raise ValueError(
            f"token_budget={budget} and max_tokens_per_microbatch={configured} disagree: both are the tokens one "
            "device forwards at once in DynamicBatchAsyncGRPOTrainer. Set one of them (or both to the same value)."
        )
    args.max_tokens_per_microbatch = int(budget)


def _check_async_fields(args) -> None:
    refuse_sequence_parallelism(
        args,
        "DynamicBatchAsyncGRPOTrainer",
        "stock AsyncGRPOTrainer refuses it too; a sample longer than the token budget trains in a pass of its own",
    )
    take_token_budget(args)
    validate_dynamic_batch_fields(args)


@dataclass
class AsyncFields(DynamicBatchFields):
    """The plugin's fields on TRL's ``AsyncGRPOConfig`` and their checks: after the environment, TRL's own
    ``AsyncGRPOConfig.__post_init__`` (no generation round to derive: the rollout worker generates continuously),
    then stock's ``token_budget`` taken as the training budget and the plugin's fields checked."""

    def _dynbsz_check_and_derive(self) -> None:
        super(DynamicBatchFields, self).__post_init__()  # TRL's AsyncGRPOConfig.__post_init__
        _check_async_fields(self)


@dataclass
class DynamicBatchAsyncGRPOConfig(AsyncFields, AsyncGRPOConfig):
    pass


DynamicBatchAsyncGRPOConfig.__doc__ = f"""
    Configuration of [`~hf_dynbsz.DynamicBatchAsyncGRPOTrainer`]: every
    [`~trl.experimental.async_grpo.AsyncGRPOConfig`] parameter plus the ones below (written once, in
    `hf_dynbsz.planning.settings`). An optimizer step trains `per_device_train_batch_size x
    gradient_accumulation_steps x processes` samples of the rollout queue, as stock's fixed-count mode; `token_budget >
    0` is the tokens one device forwards at once (`max_tokens_per_microbatch`); unset, the budget comes from memory
    (`max_memory_per_device_mib`) or is what stock's fixed-count mode forwards. With `dynamic_batching=False` the
    trainer behaves exactly like TRL's `AsyncGRPOTrainer`. Precedence: `DIFFU_*` environment variables over arguments
    over defaults.

    Parameters:
{config_docstring(TRAINER)}
    """


def async_trainer_config(args, model):
    """The trainer's config: stock's default when ``args`` is None (:class:`DynamicBatchAsyncGRPOConfig` with stock's
    output directory, ``<model>-AsyncGRPO``); a plain ``AsyncGRPOConfig`` gains the plugin's fields (defaults, then the
    ``DIFFU_*`` overrides) and their checks. Raises before any work when DeepSpeed runs without a GPU and
    ``ddp_backend`` is unset (:func:`~hf_dynbsz.config.default_ddp_backend`)."""
    if args is None:
        name = model if isinstance(model, str) else model.config.name_or_path
        return DynamicBatchAsyncGRPOConfig(output_dir=f"{str(name).split('/')[-1]}-AsyncGRPO")
    if not isinstance(args, AsyncFields):
        for name, default in defaults_of(TRAINER).items():
            if not hasattr(args, name):
                setattr(args, name, default)
        apply_env_overrides(args)
        try:
            _check_async_fields(args)
        except ValueError as error:  # name the DIFFU_* variables behind the values
            raise with_env_sources(error, args) from None
    if default_ddp_backend(args.ddp_backend) != args.ddp_backend and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "DeepSpeed without a GPU needs ddp_backend='gloo' (ddp_backend=None now): use "
            "hf_dynbsz.DynamicBatchAsyncGRPOConfig (sets it for you) or pass ddp_backend='gloo'."
        )
    return args

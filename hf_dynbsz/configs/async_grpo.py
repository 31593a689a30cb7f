"""``DynamicBatchAsyncGRPOConfig``: TRL's ``AsyncGRPOConfig`` (``trl.experimental.async_grpo``) plus the plugin's
settings, which are the fields of :class:`~hf_dynbsz.configs.shared.DynamicBatchFields` and ``async_step``.

It is a module of its own because importing TRL's experimental package takes seconds and warns. The other configs do
not pay for it, since :mod:`hf_dynbsz.configs` imports each module on first use.

``async_step`` picks the optimizer step. With ``"stock"`` (the default) the step is stock's at the user's config.
Then ``token_budget > 0`` keeps stock's meaning: its ``TokenBudgetBatcher`` decides which samples a step holds. An
unset ``token_budget`` is the vLLM server's ``max_model_len``, as in stock. The size of the plugin's passes comes from
``max_tokens_per_microbatch`` or the memory budget, and when neither is set from the tokens stock's row of the
micro-batch forwards.

With ``"samples"`` the step is the plugin's own: ``per_device_train_batch_size x gradient_accumulation_steps x
processes`` samples from the rollout queue, normalised by the step's tokens. Stock's ``token_budget`` is then the
plugin's training budget per pass, so ``token_budget > 0`` sets ``max_tokens_per_microbatch``
(:func:`take_token_budget`). When it is unset or not positive the plugin sets the budget itself. The vLLM server is
never asked for its ``max_model_len``, and no sample is dropped for its length: a sample longer than the budget gets a
pass of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trl.experimental.async_grpo import AsyncGRPOConfig

from hf_dynbsz.configs.shared import DynamicBatchFields, default_ddp_backend, plugin_field, refuse_sequence_parallelism
from hf_dynbsz.planning.env import apply_env_overrides, with_env_sources
from hf_dynbsz.planning.settings import config_docstring, defaults_of
from hf_dynbsz.planning.validation import validate_dynamic_batch_fields

__all__ = [
    "AsyncFields",
    "DynamicBatchAsyncGRPOConfig",
    "async_trainer_config",
    "samples_step",
    "take_token_budget",
]

#: The trainer name of the plugin's settings and plan (``hf-dynbsz plan --trainer async_grpo``).
TRAINER = "async_grpo"


def samples_step(args) -> bool:
    """Whether ``args`` trains the plugin's samples-defined step (``async_step="samples"``), not stock's."""
    return getattr(args, "async_step", "stock") == "samples"


def take_token_budget(args) -> None:
    """Stock's ``token_budget`` as the plugin's training budget (``async_step="samples"``), in place: ``> 0`` sets
    ``max_tokens_per_microbatch`` (tokens per device per pass); a different ``max_tokens_per_microbatch`` beside it is
    refused; ``None`` or ``<= 0`` leaves the budget to the plugin (from memory, else stock's fixed-count row)."""
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
    validate_dynamic_batch_fields(args)
    if samples_step(args):
        take_token_budget(args)
        validate_dynamic_batch_fields(args)


@dataclass
class AsyncFields(DynamicBatchFields):
    """The plugin's fields on TRL's ``AsyncGRPOConfig`` and their checks. There is no generation round to derive,
    because the rollout worker generates continuously. After the environment and TRL's own
    ``AsyncGRPOConfig.__post_init__``, the plugin's fields are checked. For the samples-defined step, stock's
    ``token_budget`` is then taken as the training budget."""

    async_step: str = plugin_field("async_step")

    def _dynbsz_after_stock(self) -> None:
        _check_async_fields(self)


@dataclass
class DynamicBatchAsyncGRPOConfig(AsyncFields, AsyncGRPOConfig):
    pass


DynamicBatchAsyncGRPOConfig.__doc__ = f"""
    Configuration of [`~hf_dynbsz.DynamicBatchAsyncGRPOTrainer`]: every
    [`~trl.experimental.async_grpo.AsyncGRPOConfig`] parameter plus the ones below (written once, in
    `hf_dynbsz.planning.settings`). By default (`async_step="stock"`) an optimizer step is stock's at this config
    (`token_budget` decides its samples as stock's batchers do, each micro-batch normalised by its own tokens) and the
    passes' size comes from `max_tokens_per_microbatch` or memory (`max_memory_per_device_mib`); with
    `async_step="samples"` it trains `per_device_train_batch_size x gradient_accumulation_steps x processes` samples
    normalised by the step's tokens, `token_budget > 0` the tokens one device forwards at once. With
    `dynamic_batching=False` the trainer behaves exactly like TRL's `AsyncGRPOTrainer`. Precedence: `DIFFU_*`
    environment variables over arguments over defaults.

    Parameters:
{config_docstring(TRAINER)}
    """


def async_trainer_config(args, model):
    """The trainer's config: stock's default when ``args`` is None (:class:`DynamicBatchAsyncGRPOConfig` with stock's
    output directory, ``<model>-AsyncGRPO``); a plain ``AsyncGRPOConfig`` gains the plugin's fields (defaults, then the
    ``DIFFU_*`` overrides) and their checks. Raises before any work when DeepSpeed runs without a GPU and
    ``ddp_backend`` is unset (:func:`~hf_dynbsz.configs.shared.default_ddp_backend`)."""
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

"""A config as training builds it: a plain TRL config given the plugin's fields (:func:`ensure_dynamic_batch_fields`),
the trainer's config from its arguments (:func:`trainer_config`), and the config ``hf-dynbsz plan`` builds to reject
what training rejects (:func:`check_as_training`)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

from hf_dynbsz.configs.distillation import DynamicBatchDistillationConfig, refuse_distillation_sequence_parallelism
from hf_dynbsz.configs.dpo import DynamicBatchDPOConfig, refuse_dpo_settings
from hf_dynbsz.configs.grpo import DynamicBatchGRPOConfig, rederive_and_validate
from hf_dynbsz.configs.kto import refuse_kto_settings
from hf_dynbsz.configs.reward import refuse_reward_settings
from hf_dynbsz.configs.shared import default_ddp_backend
from hf_dynbsz.planning.env import apply_env_overrides, with_env_sources
from hf_dynbsz.planning.settings import defaults_of
from hf_dynbsz.planning.validation import validate_dynamic_batch_fields

__all__ = ["check_as_training", "ensure_dynamic_batch_fields", "trainer_config"]

#: The trainers whose steps come from their dataset (no generation round, no GRPO settings), each with what its run
#: refuses of the settings stock accepts (``DynamicBatch{DPO,Reward,KTO}Config``).
DATASET_TRAINER_REFUSALS = {"dpo": refuse_dpo_settings, "reward": refuse_reward_settings, "kto": refuse_kto_settings}


def ensure_dynamic_batch_fields(args, trainer: str = "grpo"):
    """Make a post-initialised ``GRPOConfig`` usable by the dynamic-batching trainer, in place; returns ``args``.

    Sets the dynamic-batching fields to their defaults where missing, applies the ``DIFFU_*`` environment
    overrides and validates. When ``DIFFU_TRAIN_BATCH_SIZE`` changed ``per_device_train_batch_size``, TRL's
    derived ``generation_batch_size`` is stale: it is re-derived as ``per_device_train_batch_size * world_size *
    steps_per_generation`` (keeping ``steps_per_generation``, TRL's default cadence) and checked against
    ``num_generations`` with the same errors as the planner. Idempotent; a no-op on a ``DynamicBatchGRPOConfig``
    (whose ``__post_init__`` already did all this) unless the environment changed since.
    """
    for name, default in defaults_of(trainer).items():
        if not hasattr(args, name):
            setattr(args, name, default)
    previous = args.per_device_train_batch_size
    apply_env_overrides(args)
    try:
        if trainer == "distillation":  # no generation round, no GRPO settings (see DynamicBatchDistillationConfig)
            refuse_distillation_sequence_parallelism(args)
            validate_dynamic_batch_fields(args)
        elif trainer in DATASET_TRAINER_REFUSALS:
            DATASET_TRAINER_REFUSALS[trainer](args)
            validate_dynamic_batch_fields(args)
        else:
            rederive_and_validate(args, previous)
    except ValueError as error:  # name the DIFFU_* variables behind the values
        raise with_env_sources(error, args) from None
    return args


def trainer_config(args, model, config_class: type = DynamicBatchGRPOConfig, algorithm: str = "GRPO"):
    """The trainer's config: stock's default when ``args`` is None (``config_class`` with stock's output directory,
    ``<model>-<algorithm>``), with the dynamic-batching fields in place.

    Raises before any work when DeepSpeed runs without a GPU and ``ddp_backend`` is unset (see
    :func:`default_ddp_backend`).
    """
    if args is None:
        from trl.trainer.utils import get_config_model_id

        name = model if isinstance(model, str) else get_config_model_id(model.config)
        args = config_class(output_dir=f"{name.split('/')[-1]}-{algorithm}")
    ensure_dynamic_batch_fields(args, algorithm.lower())
    if default_ddp_backend(args.ddp_backend) != args.ddp_backend and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "DeepSpeed without a GPU needs ddp_backend='gloo' (ddp_backend=None now): stock TRL then fails with "
            "'train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size'. Use "
            "hf_dynbsz.DynamicBatchGRPOConfig (sets it for you) or pass ddp_backend='gloo'."
        )
    return args


def check_as_training(
    options, generation_batch_size: int, trainer: str = "grpo", config_class: type | None = None
) -> None:
    """Build the config training would build from ``options`` (``hf-dynbsz plan``'s parsed namespace of the user's raw
    values): :class:`DynamicBatchGRPOConfig`, :class:`DynamicBatchDistillationConfig` for ``trainer`` "distillation",
    :class:`DynamicBatchDPOConfig` for "dpo", or ``config_class`` when given
    (``hf_dynbsz.configs.async_grpo.DynamicBatchAsyncGRPOConfig`` for "async_grpo"), so that the planner rejects
    exactly what training rejects, with training's own messages (one validation, not a copy).

    What depends on the machine rather than on the run is neutralised (precision, DeepSpeed, reporters, evaluation:
    checked by the launcher, not here), and GRPO's generation round is ``generation_batch_size``, the one planned for
    the run's processes (the planning process is one process, the run may be many).
    """
    if config_class is None:  # (the asynchronous trainer's config is given by the caller: its import is slow)
        config_class = {"distillation": DynamicBatchDistillationConfig, "dpo": DynamicBatchDPOConfig}.get(
            trainer, DynamicBatchGRPOConfig
        )

    def default(f: dataclasses.Field) -> Any:
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    # The options the user gave (defaults left to the config, so deprecated fields stay quiet).
    values = {
        f.name: getattr(options, f.name)
        for f in dataclasses.fields(config_class)
        if f.init and hasattr(options, f.name) and getattr(options, f.name) != default(f)
    }
    values.update(
        bf16=False, fp16=False, use_cpu=True, deepspeed=None, report_to="none", do_eval=False, eval_strategy="no"
    )
    if trainer not in ("distillation", "async_grpo", *DATASET_TRAINER_REFUSALS):  # (a distillation's round: its step)
        values.update(generation_batch_size=generation_batch_size, steps_per_generation=None)
    with warnings.catch_warnings():  # TRL/transformers deprecation notices are training's business, not the plan's
        warnings.simplefilter("ignore", FutureWarning)
        config_class(**values)

"""``DynamicBatchGRPOConfig``: TRL's ``GRPOConfig`` plus the plugin's settings, and the generation round's fields and
checks it shares with RLOO's config (:class:`GenerationRoundFields`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from trl import GRPOConfig

from hf_dynbsz.configs.shared import DynamicBatchFields, config_doc
from hf_dynbsz.planning.generation_round import USER_BATCH_SETTINGS_ATTR, resolve_generation_round
from hf_dynbsz.planning.validation import validate_dynamic_batch_fields, validate_grpo_fields

__all__ = ["DynamicBatchGRPOConfig", "GenerationRoundFields", "rederive_and_validate", "take_sequence_parallelism"]


@dataclass
class GenerationRoundFields(DynamicBatchFields):
    """The plugin's fields on a config with a generation round (GRPO's, RLOO's): before TRL's ``__post_init__`` the
    user's batch settings recorded, sequence parallelism taken and the generation round resolved with the planner's
    messages; after it the plugin's fields and the GRPO settings TRL checks late."""

    def _dynbsz_before_stock(self) -> None:
        # Record what the user asked for before TRL derives one from the other for this world size; the batch plan
        # needs it to plan another world size (see hf_dynbsz.planning.generation_round).
        setattr(
            self,
            USER_BATCH_SETTINGS_ATTR,
            {"generation_batch_size": self.generation_batch_size, "steps_per_generation": self.steps_per_generation},
        )
        # Sequence parallelism is ours to run (stock's __post_init__ refuses it): see take_sequence_parallelism.
        take_sequence_parallelism(self)
        # The generation round with the planner's messages (named values, valid neighbours), before TRL's.
        resolve_generation_round(
            per_device_train_batch_size=self.per_device_train_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            num_processes=int(os.environ.get("WORLD_SIZE", "1")),
            num_generations=self.num_generations,
            generation_batch_size=self.generation_batch_size,
            steps_per_generation=self.steps_per_generation,
        )

    def _dynbsz_after_stock(self) -> None:
        validate_dynamic_batch_fields(self)
        validate_grpo_fields(self)


@dataclass
class DynamicBatchGRPOConfig(GenerationRoundFields, GRPOConfig):
    __doc__ = config_doc("GRPO")


def take_sequence_parallelism(args) -> None:
    """Move ``parallelism_config.sp_size`` into ``sequence_parallel_size``, in place.

    hf-dynbsz runs DeepSpeed Ulysses on its own packed rows (:mod:`hf_dynbsz.execution.sequence_parallel`): accelerate
    then sees plain data parallelism over all processes (its Ulysses path shards a ``DataLoader``'s token batches, which
    GRPO does not have, and TRL's ``GRPOConfig`` refuses it). Raises for what only accelerate's path would run.
    """
    config = getattr(args, "parallelism_config", None)
    if config is None or (config.sp_size or 1) <= 1:
        if config is not None and (config.cp_size or 1) > 1:
            raise ValueError(
                f"parallelism_config.cp_size={config.cp_size}: context parallelism is not run by GRPO "
                "(stock or hf-dynbsz); use parallelism_config=ParallelismConfig(sp_backend='deepspeed', "
                "sp_size=N) for sequence parallelism (DeepSpeed Ulysses) instead, or cp_size=1."
            )
        return
    if args.sequence_parallel_size not in (1, config.sp_size):
        raise ValueError(
            f"sequence_parallel_size={args.sequence_parallel_size} and parallelism_config.sp_size="
            f"{config.sp_size} disagree: set one of them (or both to the same value)."
        )
    others = {
        name: getattr(config, name)
        for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size")
        if (getattr(config, name) or 1) > 1
    }
    if others:
        raise ValueError(
            f"parallelism_config={others} with sp_size={config.sp_size}: hf-dynbsz's sequence "
            "parallelism combines with DDP and DeepSpeed ZeRO data parallelism (over all processes) "
            "only; leave the other sizes at 1."
        )
    if not args.dynamic_batching:
        raise ValueError(
            f"parallelism_config.sp_size={config.sp_size} needs dynamic_batching=True: sequence "
            "parallelism runs in hf-dynbsz's packed passes (dynamic_batching=False is stock "
            "GRPOTrainer, which has none)."
        )
    args.sequence_parallel_size = config.sp_size
    args.parallelism_config = None


def rederive_and_validate(args, previous_per_device_train_batch_size: int) -> None:
    """A post-initialised config's generation round derived again where ``DIFFU_TRAIN_BATCH_SIZE`` changed
    ``per_device_train_batch_size`` (see :func:`~hf_dynbsz.configs.build.ensure_dynamic_batch_fields`), then checked."""
    if args.per_device_train_batch_size != previous_per_device_train_batch_size:
        steps_per_generation = args.steps_per_generation or args.gradient_accumulation_steps
        generation_batch_size, _, _ = resolve_generation_round(
            per_device_train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            num_processes=args.world_size,
            num_generations=args.num_generations,
            generation_batch_size=None,
            steps_per_generation=steps_per_generation,
        )
        args.generation_batch_size = generation_batch_size
        args.steps_per_generation = steps_per_generation
        recorded = getattr(args, USER_BATCH_SETTINGS_ATTR, None)
        if recorded is not None:
            setattr(
                args,
                USER_BATCH_SETTINGS_ATTR,
                {"generation_batch_size": None, "steps_per_generation": steps_per_generation},
            )
    validate_dynamic_batch_fields(args)
    validate_grpo_fields(args)

"""``DynamicBatchGRPOConfig``, ``DynamicBatchRLOOConfig``, ``DynamicBatchDistillationConfig`` and
``DynamicBatchDPOConfig``: TRL's ``GRPOConfig``, ``RLOOConfig``, ``DistillationConfig`` and ``DPOConfig`` plus the
settings of token-budget micro-batching (one set of fields, :class:`DynamicBatchFields`, from one settings table; a
distillation adds its teacher's budget, :class:`DistillationFields`; a DPO run has no generation round,
:class:`DPOFields`).

Units: *samples* are completions; *tokens* are prompt + completion tokens; *per device* means one process,
*global* means all processes. TRL's ``generation_batch_size`` keeps its meaning: GLOBAL samples per
generation round.

Precedence of every setting: ``DIFFU_*`` environment variables (see :mod:`hf_dynbsz.planning.env`) over arguments over
defaults. The environment is applied before TRL's own ``__post_init__`` so that ``DIFFU_TRAIN_BATCH_SIZE``
feeds TRL's derivation of ``generation_batch_size``.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from trl import DistillationConfig, DPOConfig, GRPOConfig, RLOOConfig

from hf_dynbsz.planning.env import apply_env_overrides, with_env_sources
from hf_dynbsz.planning.generation_round import USER_BATCH_SETTINGS_ATTR, resolve_generation_round
from hf_dynbsz.planning.settings import config_docstring, defaults_of, setting
from hf_dynbsz.planning.validation import validate_dynamic_batch_fields, validate_grpo_fields

__all__ = [
    "DPOFields",
    "DistillationFields",
    "DynamicBatchDPOConfig",
    "DynamicBatchDistillationConfig",
    "DynamicBatchFields",
    "DynamicBatchGRPOConfig",
    "DynamicBatchRLOOConfig",
    "check_as_training",
    "default_ddp_backend",
    "ensure_dynamic_batch_fields",
    "refuse_model_parallelism",
    "refuse_reward_settings",
    "refuse_sequence_parallelism",
    "take_sequence_parallelism",
    "trainer_config",
]


def _field(name: str):
    """A dataclass field whose default and help come from :data:`hf_dynbsz.planning.settings.SETTINGS`."""
    spec = setting(name)
    help_text = spec.help + (f" Environment override: {spec.env}." if spec.env else "")
    metadata = {"help": help_text}
    if spec.choices and spec.kind == "choice":  # (a sharing rule also takes true and false)
        metadata["choices"] = list(spec.choices)
    return field(default=spec.default, metadata=metadata)


@dataclass
class DynamicBatchFields:
    """The plugin's fields and their ``__post_init__``, shared by the configs of both trainers: a dataclass placed
    before TRL's config (``class DynamicBatchGRPOConfig(DynamicBatchFields, GRPOConfig)``), so its fields follow
    TRL's and its ``__post_init__`` runs around TRL's."""

    dynamic_batching: bool = _field("dynamic_batching")
    max_tokens_per_microbatch: int | None = _field("max_tokens_per_microbatch")
    max_tokens_per_microbatch_logprob: int | None = _field("max_tokens_per_microbatch_logprob")
    per_device_generation_batch_size: int | None = _field("per_device_generation_batch_size")
    tensor_batch_size: int | None = _field("tensor_batch_size")
    oversize_policy: str = _field("oversize_policy")
    packing_layout: str = _field("packing_layout")
    balance_across_ranks: bool = _field("balance_across_ranks")
    share_prompt_prefix: str = _field("share_prompt_prefix")  # true, false, "tree" or "groups" (str: one parser type)
    self_check: bool = _field("self_check")
    peak_tflops_per_device: float | None = _field("peak_tflops_per_device")
    max_memory_per_device_mib: int | None = _field("max_memory_per_device_mib")
    max_memory_fraction_per_device: float | None = _field("max_memory_fraction_per_device")
    sequence_parallel_size: int = _field("sequence_parallel_size")

    def __post_init__(self):
        # 1. Environment first: DIFFU_TRAIN_BATCH_SIZE must feed TRL's derivation of generation_batch_size.
        apply_env_overrides(self)
        # DeepSpeed on a machine without an accelerator only agrees with accelerate on the world size over gloo.
        self.ddp_backend = default_ddp_backend(self.ddp_backend)
        try:
            self._dynbsz_check_and_derive()
        except ValueError as error:  # name the DIFFU_* variables behind the values
            raise with_env_sources(error, self) from None

    def _dynbsz_check_and_derive(self) -> None:
        """The checks and derivations after the environment: the generation round, TRL's ``__post_init__`` (the next
        class after this one), the plugin's fields (also converting string values from the command line or YAML)."""
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
        super().__post_init__()  # TRL's checks and derivations (GRPOConfig's or RLOOConfig's)
        validate_dynamic_batch_fields(self)
        validate_grpo_fields(self)


@dataclass
class DynamicBatchGRPOConfig(DynamicBatchFields, GRPOConfig):
    pass


@dataclass
class DynamicBatchRLOOConfig(DynamicBatchFields, RLOOConfig):
    pass


@dataclass
class DistillationFields(DynamicBatchFields):
    """The plugin's fields of a distillation (:class:`DynamicBatchFields` and the teacher's budget) and their checks: a
    distillation has no generation round to derive (one completion per prompt, generated once per optimizer step) and
    no GRPO settings, so after the environment only TRL's own ``DistillationConfig.__post_init__`` and the plugin's
    fields apply."""

    max_tokens_per_microbatch_teacher: int | None = _field("max_tokens_per_microbatch_teacher")

    def _dynbsz_check_and_derive(self) -> None:
        refuse_distillation_sequence_parallelism(self)
        super(DynamicBatchFields, self).__post_init__()  # TRL's DistillationConfig.__post_init__
        validate_dynamic_batch_fields(self)


@dataclass
class DynamicBatchDistillationConfig(DistillationFields, DistillationConfig):
    pass


@dataclass
class DPOFields(DynamicBatchFields):
    """The plugin's fields of a DPO run (:class:`DynamicBatchFields`) and their checks: no generation round and no
    GRPO settings, so after the environment only TRL's own ``DPOConfig.__post_init__`` and the plugin's fields apply;
    ``max_tokens_per_microbatch_logprob`` is the reference's budget."""

    def _dynbsz_check_and_derive(self) -> None:
        refuse_dpo_settings(self)
        super(DynamicBatchFields, self).__post_init__()  # TRL's DPOConfig.__post_init__
        validate_dynamic_batch_fields(self)


@dataclass
class DynamicBatchDPOConfig(DPOFields, DPOConfig):
    pass


def refuse_sequence_parallelism(args, trainer: str, why: str) -> None:
    """``sequence_parallel_size`` > 1 on a trainer that does not run it (``trainer``, for ``why``): refused before any
    work."""
    size = getattr(args, "sequence_parallel_size", 1) or 1
    if int(size) > 1:
        raise ValueError(
            f"sequence_parallel_size={size}: {trainer} does not run sequence parallelism ({why}). Set "
            "sequence_parallel_size=1."
        )


def refuse_dpo_sequence_parallelism(args) -> None:
    """``sequence_parallel_size`` > 1 on a DPO run: refused before any work (a pair's loss is computed in one pass of
    whole rows)."""
    refuse_sequence_parallelism(args, "DynamicBatchDPOTrainer", "a pair's loss is computed from whole rows in one pass")


def refuse_model_parallelism(args, trainer: str) -> None:
    """A ``parallelism_config`` with context, sequence or tensor parallelism on a trainer (``trainer``, its class name)
    that trains as if every process were a data-parallel replica, holding whole rows and whole parameters: refused
    before any work."""
    parallelism = getattr(args, "parallelism_config", None)
    sizes = {name: getattr(parallelism, name, None) or 1 for name in ("cp_size", "sp_size", "tp_size")}
    split = {name: size for name, size in sizes.items() if size > 1}
    if split:
        named = ", ".join(f"{name}={size}" for name, size in split.items())
        stock = {"DynamicBatchDPOTrainer": "trl.DPOTrainer", "DynamicBatchRewardTrainer": "trl.RewardTrainer"}[trainer]
        raise ValueError(
            f"parallelism_config with {named}: {trainer} trains as if every process were a data-parallel "
            "replica holding whole rows and whole parameters, and does not run context, sequence or tensor "
            "parallelism. Set cp_size, sp_size and tp_size to 1 (data parallelism and sharding stay: "
            f"dp_replicate_size, dp_shard_size, DeepSpeed, FSDP), or train with stock {stock}."
        )


def refuse_preference_settings(args, trainer: str) -> None:
    """The refusals of a preference trainer's config (``trainer``: ``"dpo"`` or ``"reward"``), before any work."""
    (refuse_dpo_settings if trainer == "dpo" else refuse_reward_settings)(args)


def refuse_dpo_settings(args) -> None:
    """What ``DynamicBatchDPOTrainer`` does not reproduce of the settings stock accepts, refused before any work:
    ``sequence_parallel_size`` > 1; a ``parallelism_config`` with context, sequence or tensor parallelism
    (:func:`refuse_model_parallelism`); ``hinge`` among the loss types with ``use_weighting`` (stock TRL 1.16 fails in
    its first backward: it scales hinge's relu output in place, which the relu's backward needs; stock's error, raised
    at start)."""
    refuse_dpo_sequence_parallelism(args)
    refuse_model_parallelism(args, "DynamicBatchDPOTrainer")
    loss_types = getattr(args, "loss_type", None) or []
    loss_types = [loss_types] if isinstance(loss_types, str) else list(loss_types)
    if "hinge" in loss_types and getattr(args, "use_weighting", False):
        raise ValueError(
            f"loss_type={loss_types} with use_weighting=True: stock DPOTrainer (TRL 1.16) fails in its first backward "
            "on it (it scales the hinge loss by the WPO weights in place, over the relu output its backward needs), "
            "so DynamicBatchDPOTrainer refuses it before any work. Set use_weighting=False, or take 'hinge' out of "
            "loss_type."
        )


def refuse_reward_settings(args) -> None:
    """What ``DynamicBatchRewardTrainer`` does not run, refused before any work: ``sequence_parallel_size`` > 1 (a
    pair's loss is computed in one pass of whole rows) and a ``parallelism_config`` with context, sequence or tensor
    parallelism."""
    refuse_sequence_parallelism(
        args, "DynamicBatchRewardTrainer", "a pair's loss is computed from whole rows in one pass"
    )
    refuse_model_parallelism(args, "DynamicBatchRewardTrainer")


def refuse_distillation_sequence_parallelism(args) -> None:
    """``sequence_parallel_size`` > 1 on a distillation: refused before any work (the teacher's passes are not
    sharded); stock's own ``parallelism_config`` check (TRL's ``__post_init__``) refuses ``sp_size``."""
    refuse_sequence_parallelism(
        args,
        "DynamicBatchDistillationTrainer",
        "the teacher's passes are not sharded, and stock DistillationTrainer refuses sequence parallelism too",
    )


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


def default_ddp_backend(ddp_backend: str | None, environ=None, accelerator_available: bool | None = None):
    """``"gloo"`` for a DeepSpeed launch (``ACCELERATE_USE_DEEPSPEED=true``) without an accelerator, else unchanged.

    Without it accelerate's ``PartialState`` sees one process while DeepSpeed sees all of them, and DeepSpeed
    fails with "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size". An
    explicit ``ddp_backend`` is never changed.
    """
    if ddp_backend is not None:
        return ddp_backend
    environ = os.environ if environ is None else environ
    if environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return ddp_backend
    if accelerator_available is None:
        import torch

        accelerator_available = torch.accelerator.is_available()
    return ddp_backend if accelerator_available else "gloo"


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
        if trainer == "distillation":  # no generation round, no GRPO settings (see DistillationFields)
            refuse_distillation_sequence_parallelism(args)
            validate_dynamic_batch_fields(args)
        elif trainer in ("dpo", "reward"):  # no generation round, no GRPO settings (see DPOFields, RewardFields)
            refuse_preference_settings(args, trainer)
            validate_dynamic_batch_fields(args)
        else:
            _rederive_and_validate(args, previous)
    except ValueError as error:  # name the DIFFU_* variables behind the values
        raise with_env_sources(error, args) from None
    return args


def _rederive_and_validate(args, previous_per_device_train_batch_size: int) -> None:
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


def _config_doc(trainer: str) -> str:
    return f"""
    Configuration of [`~hf_dynbsz.DynamicBatch{trainer}Trainer`]: every [`~trl.{trainer}Config`] parameter plus the ones
    below (written once, in `hf_dynbsz.planning.settings`). With `dynamic_batching=False` the trainer behaves exactly
    like TRL's `{trainer}Trainer`. Precedence: `DIFFU_*` environment variables over arguments over defaults.

    Parameters:
{config_docstring(trainer.lower())}
    """


DynamicBatchGRPOConfig.__doc__ = _config_doc("GRPO")
DynamicBatchRLOOConfig.__doc__ = _config_doc("RLOO")
DynamicBatchDistillationConfig.__doc__ = _config_doc("Distillation")
DynamicBatchDPOConfig.__doc__ = _config_doc("DPO")


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
    (``hf_dynbsz.async_config.DynamicBatchAsyncGRPOConfig`` for "async_grpo"), so that the planner rejects exactly what
    training rejects, with training's own messages (one validation, not a copy).

    What depends on the machine rather than on the run is neutralised (precision, DeepSpeed, reporters, evaluation:
    checked by the launcher, not here), and GRPO's generation round is ``generation_batch_size``, the one planned for
    the run's processes (the planning process is one process, the run may be many).
    """
    if config_class is None:  # (the asynchronous trainer's config, in hf_dynbsz.async_config, is given by the caller)
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
    if trainer not in ("distillation", "dpo", "reward", "async_grpo"):  # a distillation's round: its step; others none
        values.update(generation_batch_size=generation_batch_size, steps_per_generation=None)
    with warnings.catch_warnings():  # TRL/transformers deprecation notices are training's business, not the plan's
        warnings.simplefilter("ignore", FutureWarning)
        config_class(**values)

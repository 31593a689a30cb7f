"""What every trainer's config shares: the plugin's fields on TRL's config (:class:`DynamicBatchFields`, from one
settings table) and their ``__post_init__`` around TRL's, the refusals and defaults more than one config applies, and
the configs' docstring.

Units: *samples* are completions; *tokens* are prompt + completion tokens; *per device* means one process,
*global* means all processes. TRL's ``generation_batch_size`` keeps its meaning: GLOBAL samples per
generation round.

Precedence of every setting: ``DIFFU_*`` environment variables (see :mod:`hf_dynbsz.planning.env`) over arguments over
defaults. The environment is applied before TRL's own ``__post_init__`` so that ``DIFFU_TRAIN_BATCH_SIZE``
feeds TRL's derivation of ``generation_batch_size``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hf_dynbsz.planning.env import apply_env_overrides, with_env_sources
from hf_dynbsz.planning.settings import config_docstring, setting
from hf_dynbsz.planning.validation import validate_dynamic_batch_fields

__all__ = [
    "DynamicBatchFields",
    "config_doc",
    "default_ddp_backend",
    "plugin_field",
    "refuse_sequence_parallelism",
]


def plugin_field(name: str):
    """A dataclass field whose default and help come from :data:`hf_dynbsz.planning.settings.SETTINGS`."""
    spec = setting(name)
    help_text = spec.help + (f" Environment override: {spec.env}." if spec.env else "")
    metadata = {"help": help_text}
    if spec.choices and spec.kind == "choice":  # (a sharing rule also takes true and false)
        metadata["choices"] = list(spec.choices)
    return field(default=spec.default, metadata=metadata)


@dataclass
class DynamicBatchFields:
    """The plugin's fields and their ``__post_init__``, shared by every trainer's config: a dataclass placed before
    TRL's config (``class DynamicBatchGRPOConfig(GenerationRoundFields, GRPOConfig)``), so its fields follow TRL's and
    its ``__post_init__`` runs around TRL's: the environment, then :meth:`_dynbsz_before_stock` (a trainer's checks
    and derivations that TRL's must see), TRL's ``__post_init__`` (the next class in the MRO), then
    :meth:`_dynbsz_after_stock` (the plugin's fields checked)."""

    dynamic_batching: bool = plugin_field("dynamic_batching")
    max_tokens_per_microbatch: int | None = plugin_field("max_tokens_per_microbatch")
    max_tokens_per_microbatch_logprob: int | None = plugin_field("max_tokens_per_microbatch_logprob")
    per_device_generation_batch_size: int | None = plugin_field("per_device_generation_batch_size")
    tensor_batch_size: int | None = plugin_field("tensor_batch_size")
    oversize_policy: str = plugin_field("oversize_policy")
    packing_layout: str = plugin_field("packing_layout")
    balance_across_ranks: bool = plugin_field("balance_across_ranks")
    share_prompt_prefix: str = plugin_field("share_prompt_prefix")  # true, false, "tree" or "groups" (one parser type)
    self_check: bool = plugin_field("self_check")
    peak_tflops_per_device: float | None = plugin_field("peak_tflops_per_device")
    max_memory_per_device_mib: int | None = plugin_field("max_memory_per_device_mib")
    max_memory_fraction_per_device: float | None = plugin_field("max_memory_fraction_per_device")
    sequence_parallel_size: int = plugin_field("sequence_parallel_size")

    def __post_init__(self):
        # 1. Environment first: DIFFU_TRAIN_BATCH_SIZE must feed TRL's derivation of generation_batch_size.
        apply_env_overrides(self)
        # DeepSpeed on a machine without an accelerator only agrees with accelerate on the world size over gloo.
        self.ddp_backend = default_ddp_backend(self.ddp_backend)
        try:
            self._dynbsz_before_stock()
            super().__post_init__()  # TRL's checks and derivations: the config class after this one
            self._dynbsz_after_stock()
        except ValueError as error:  # name the DIFFU_* variables behind the values
            raise with_env_sources(error, self) from None

    def _dynbsz_before_stock(self) -> None:
        """A trainer's checks and derivations before TRL's ``__post_init__`` (none by default)."""

    def _dynbsz_after_stock(self) -> None:
        """The plugin's fields checked (also converting string values from the command line or YAML)."""
        validate_dynamic_batch_fields(self)


def refuse_sequence_parallelism(args, trainer: str, why: str) -> None:
    """``sequence_parallel_size`` > 1 on a trainer that does not run it (``trainer``, for ``why``): refused before any
    work."""
    size = getattr(args, "sequence_parallel_size", 1) or 1
    if int(size) > 1:
        raise ValueError(
            f"sequence_parallel_size={size}: {trainer} does not run sequence parallelism ({why}). Set "
            "sequence_parallel_size=1."
        )


def refuse_model_parallelism(args, trainer: str) -> None:
    """A ``parallelism_config`` with context, sequence or tensor parallelism on a trainer (``trainer``, its class name)
    that trains as if every process were a data-parallel replica, holding whole rows and whole parameters: refused
    before any work."""
    parallelism = getattr(args, "parallelism_config", None)
    sizes = {name: getattr(parallelism, name, None) or 1 for name in ("cp_size", "sp_size", "tp_size")}
    split = {name: size for name, size in sizes.items() if size > 1}
    if split:
        named = ", ".join(f"{name}={size}" for name, size in split.items())
        stock = trainer.removeprefix("DynamicBatch")  # DynamicBatchDPOTrainer: stock's DPOTrainer
        raise ValueError(
            f"parallelism_config with {named}: {trainer} trains as if every process were a data-parallel "
            "replica holding whole rows and whole parameters, and does not run context, sequence or tensor "
            "parallelism. Set cp_size, sp_size and tp_size to 1 (data parallelism and sharding stay: "
            f"dp_replicate_size, dp_shard_size, DeepSpeed, FSDP), or train with stock trl.{stock}."
        )


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


def config_doc(trainer: str) -> str:
    """The docstring of ``DynamicBatch<trainer>Config``: TRL's parameters plus the plugin's, from the settings table."""
    return f"""
    Configuration of [`~hf_dynbsz.DynamicBatch{trainer}Trainer`]: every [`~trl.{trainer}Config`] parameter plus the ones
    below (written once, in `hf_dynbsz.planning.settings`). With `dynamic_batching=False` the trainer behaves exactly
    like TRL's `{trainer}Trainer`. Precedence: `DIFFU_*` environment variables over arguments over defaults.

    Parameters:
{config_docstring(trainer.lower())}
    """

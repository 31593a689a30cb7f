"""``DynamicBatchGRPOConfig``: TRL's ``GRPOConfig`` plus the settings of token-budget micro-batching.

Units: *samples* are completions; *tokens* are prompt + completion tokens; *per device* means one process,
*global* means all processes. TRL's ``generation_batch_size`` keeps its meaning: GLOBAL samples per
generation round.

Precedence of every setting: ``DIFFU_*`` environment variables (see :mod:`hf_dynbsz.env`) over arguments over
defaults. The environment is applied before TRL's own ``__post_init__`` so that ``DIFFU_TRAIN_BATCH_SIZE``
feeds TRL's derivation of ``generation_batch_size``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from trl import GRPOConfig

from .env import apply_env_overrides
from .plan import (
    DYNAMIC_BATCH_DEFAULTS,
    OVERSIZE_POLICIES,
    PACKING_LAYOUTS,
    TRL_TENSOR_TILE_TOKENS,
    USER_BATCH_SETTINGS_ATTR,
    resolve_generation_round,
    validate_dynamic_batch_fields,
)

__all__ = ["DynamicBatchGRPOConfig", "default_ddp_backend", "ensure_dynamic_batch_fields"]


@dataclass
class DynamicBatchGRPOConfig(GRPOConfig):
    r"""
    Configuration of [`~hf_dynbsz.DynamicBatchGRPOTrainer`]: every [`~trl.GRPOConfig`] parameter plus the ones
    below. With `dynamic_batching=False` the trainer behaves exactly like TRL's `GRPOTrainer`.

    Parameters:
        dynamic_batching (`bool`, *optional*, defaults to `True`):
            Repack each training step's samples into micro-batches by a token budget instead of TRL's fixed
            micro-batches of `per_device_train_batch_size` samples padded to the longest row of the generation
            batch. The loss and gradients are the stock ones. `False` gives stock `GRPOTrainer` behaviour exactly.
        max_tokens_per_microbatch (`int`, *optional*):
            Token budget per device of one training forward/backward pass, counted as the token positions the
            pass computes: the sum of the samples' prompt + completion tokens for padding-free rows, rows x longest
            row for padded micro-batches (no padding to the generation batch's longest row either way; lengths
            are rounded up to GRPOConfig's `pad_to_multiple_of` when that is set). `None` ("auto") uses, per generation batch, the padded token count of stock TRL's
            own micro-batch for the same samples: `per_device_train_batch_size * (longest prompt + longest
            completion in the generation batch)`, so memory is never worse than stock's.
        max_tokens_per_microbatch_logprob (`int`, *optional*):
            Token budget per device, same unit, for the no-grad log-prob passes (old policy, reference model).
            `None` uses 2 x the training budget.
        per_device_generation_batch_size (`int`, *optional*):
            Samples generated at once per device (the chunk size of the transformers `generate` path). Does not
            change the training math. `None` generates the whole per-device share of the generation round at once.
            TRL's `generation_batch_size` keeps its meaning: GLOBAL samples per generation round.
        tensor_batch_size (`int`, *optional*, defaults to `1024`):
            Tokens per tile of vocabulary-sized work (LM head, log-softmax, entropy); a tile is this many tokens x
            8192 vocabulary columns. `None` uses TRL's own tile of 4096 tokens x 32768 columns.
        oversize_policy (`str`, *optional*, defaults to `"warn"`):
            What to do with a single sequence longer than the token budget: `"warn"` gives it a micro-batch of its
            own with a one-time warning; `"error"` raises before the step.
        packing_layout (`str`, *optional*, defaults to `"auto"`):
            `"padding_free"` (packed rows, needs a varlen attention kernel), `"padded"` (micro-batches each padded
            to their own longest row) or `"auto"`: padding-free with flash_attention_2/3, padded otherwise.

    Environment overrides (precedence: environment over arguments over defaults): `DIFFU_TRAIN_BATCH_SIZE` ->
    `per_device_train_batch_size`, `DIFFU_BATCH_SIZE` -> `per_device_generation_batch_size`,
    `DIFFU_TENSOR_BATCH_SIZE` -> `tensor_batch_size`, `DIFFU_MAX_TOKENS` -> `max_tokens_per_microbatch`.
    """

    dynamic_batching: bool = field(
        default=DYNAMIC_BATCH_DEFAULTS["dynamic_batching"],
        metadata={
            "help": "Repack each training step's samples into micro-batches by a token budget (same loss and "
            "gradients as stock). False gives stock GRPOTrainer behaviour exactly."
        },
    )
    max_tokens_per_microbatch: int | None = field(
        default=DYNAMIC_BATCH_DEFAULTS["max_tokens_per_microbatch"],
        metadata={
            "help": "Tokens per device per training forward/backward, counted as the positions the pass computes: "
            "the sum of prompt + completion tokens for padding-free rows, rows x longest row for padded "
            "micro-batches (lengths rounded up to GRPOConfig's pad_to_multiple_of when set). "
            "None ('auto'): per generation batch, the padded token count of stock TRL's micro-batch, i.e. "
            "per_device_train_batch_size * (longest prompt + longest completion in the generation batch), so "
            "memory is never worse than stock. Environment override: DIFFU_MAX_TOKENS."
        },
    )
    max_tokens_per_microbatch_logprob: int | None = field(
        default=DYNAMIC_BATCH_DEFAULTS["max_tokens_per_microbatch_logprob"],
        metadata={
            "help": "Tokens per device per no-grad log-prob pass (old policy, reference model), counted like "
            "max_tokens_per_microbatch. None: 2 x the training budget."
        },
    )
    per_device_generation_batch_size: int | None = field(
        default=DYNAMIC_BATCH_DEFAULTS["per_device_generation_batch_size"],
        metadata={
            "help": "Samples generated at once per device (chunk size of the transformers generate path); does "
            "not change the training math. None: the whole per-device share of the generation round at once. "
            "TRL's generation_batch_size keeps its meaning: GLOBAL samples per generation round. Environment "
            "override: DIFFU_BATCH_SIZE."
        },
    )
    tensor_batch_size: int | None = field(
        default=DYNAMIC_BATCH_DEFAULTS["tensor_batch_size"],
        metadata={
            "help": "Tokens per device per tile of vocabulary-sized work (LM head, log-softmax, entropy), in the "
            "training pass (tiles recomputed in backward) and the no-grad log-prob passes; a tile is this many tokens "
            "x 8192 vocabulary columns. Default 1024, chosen by benchmarks/memory.py. None: TRL's own tile "
            f"({TRL_TENSOR_TILE_TOKENS} tokens x 32768 columns). Environment override: DIFFU_TENSOR_BATCH_SIZE."
        },
    )
    oversize_policy: str = field(
        default=DYNAMIC_BATCH_DEFAULTS["oversize_policy"],
        metadata={
            "help": "A single sequence (prompt + completion tokens) longer than the token budget: 'warn' gives it "
            "a micro-batch of its own with a one-time warning; 'error' raises before the step.",
            "choices": list(OVERSIZE_POLICIES),
        },
    )
    packing_layout: str = field(
        default=DYNAMIC_BATCH_DEFAULTS["packing_layout"],
        metadata={
            "help": "Micro-batch layout: 'padding_free' (packed rows, needs a varlen attention kernel), 'padded' "
            "(each micro-batch padded to its own longest row), or 'auto': padding_free with "
            "flash_attention_2/3-style varlen kernels, padded otherwise.",
            "choices": list(PACKING_LAYOUTS),
        },
    )

    def __post_init__(self):
        # 1. Environment first: DIFFU_TRAIN_BATCH_SIZE must feed TRL's derivation of generation_batch_size.
        apply_env_overrides(self)
        # DeepSpeed on a machine without an accelerator only agrees with accelerate on the world size over gloo.
        self.ddp_backend = default_ddp_backend(self.ddp_backend)
        # 2. Record what the user asked for before TRL derives one from the other for this world size; the batch
        #    plan needs it to plan another world size (see hf_dynbsz.plan).
        setattr(
            self,
            USER_BATCH_SETTINGS_ATTR,
            {"generation_batch_size": self.generation_batch_size, "steps_per_generation": self.steps_per_generation},
        )
        # 3. TRL's checks and derivations.
        super().__post_init__()
        # 4. Ours (also converts string values from the command line or YAML).
        validate_dynamic_batch_fields(self)


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


def ensure_dynamic_batch_fields(args):
    """Make a post-initialised ``GRPOConfig`` usable by the dynamic-batching trainer, in place; returns ``args``.

    Sets the dynamic-batching fields to their defaults where missing, applies the ``DIFFU_*`` environment
    overrides and validates. When ``DIFFU_TRAIN_BATCH_SIZE`` changed ``per_device_train_batch_size``, TRL's
    derived ``generation_batch_size`` is stale: it is re-derived as ``per_device_train_batch_size * world_size *
    steps_per_generation`` (keeping ``steps_per_generation``, TRL's default cadence) and checked against
    ``num_generations`` with the same errors as the planner. Idempotent; a no-op on a ``DynamicBatchGRPOConfig``
    (whose ``__post_init__`` already did all this) unless the environment changed since.
    """
    for name, default in DYNAMIC_BATCH_DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, default)
    previous = args.per_device_train_batch_size
    apply_env_overrides(args)
    if args.per_device_train_batch_size != previous:
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
    return args

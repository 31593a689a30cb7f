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

The parts live beside it: the value checks in :mod:`hf_dynbsz.planning.coerce`, the validation training and the
command line share in :mod:`hf_dynbsz.planning.validation`, TRL's generation round in
:mod:`hf_dynbsz.planning.generation_round` and the table's rows in :mod:`hf_dynbsz.planning.plan_table`.

This module is pure Python (no torch, no TRL): it is importable by the command-line planner on any machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import Any

from hf_dynbsz.planning.coerce import coerce_int, coerce_optional_int, coerce_pad_to_multiple_of
from hf_dynbsz.planning.env import env_sources
from hf_dynbsz.planning.generation_round import resolve_generation_round, user_generation_settings
from hf_dynbsz.planning.plan_table import DATASET_TRAINERS, plan_rows, text_table
from hf_dynbsz.planning.settings import TRL_TENSOR_TILE_TOKENS, SharePrefix, setting
from hf_dynbsz.planning.tokens import ceil_div
from hf_dynbsz.planning.validation import validated_fields

__all__ = [
    "BatchSizePlan",
    "STOCK_TRAINERS",
    "resolve_mixed_precision",
]


def resolve_mixed_precision(args: Any, launcher: str | None = None) -> str:
    """The mixed precision a run trains in: the launcher's (accelerate's ``mixed_precision``) when given, else as TRL
    resolves it: fp16 if set, else bf16 unless ``bf16=False`` (TRL defaults to bf16).

    The plan table and the memory rows of ``hf-dynbsz plan`` both read it here.
    """
    if launcher is not None:
        return launcher
    if getattr(args, "fp16", False) in (True, "true", "True"):
        return "fp16"
    bf16 = getattr(args, "bf16", None)
    if bf16 is None or bf16 in (True, "true", "True"):
        return "bf16"
    return "no"


def _zero_stage(zero_stage: int | None, args: Any) -> int | None:
    """The DeepSpeed ZeRO stage: the launcher's (checked) when given, else that of ``args.deepspeed`` (a dict)."""
    if zero_stage is not None:
        zero_stage = int(zero_stage)
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}.")
        return zero_stage
    deepspeed = getattr(args, "deepspeed", None)
    if isinstance(deepspeed, Mapping):
        stage = deepspeed.get("zero_optimization", {}).get("stage")
        if isinstance(stage, int):
            return stage
    return None


#: The trainers a plan knows: their stock trainer's name (the table says what dynamic_batching=False gives).
STOCK_TRAINERS = {
    "grpo": "GRPOTrainer",
    "rloo": "RLOOTrainer",
    "distillation": "DistillationTrainer",
    "dpo": "DPOTrainer",
    "reward": "RewardTrainer",
    "kto": "KTOTrainer",
    "async_grpo": "AsyncGRPOTrainer",
}


def _batch_settings(args: Any, num_processes: Any, trainer: str = "grpo") -> dict[str, Any]:
    """The batch sizes of ``args`` on ``num_processes`` processes, converted and checked, with the generation round
    derived as TRL derives it (:func:`~hf_dynbsz.planning.generation_round.resolve_generation_round`). A distillation
    generates one completion per prompt, once per optimizer step, for one pass: its round is the optimizer step."""
    if trainer in ("distillation", *DATASET_TRAINERS):  # (a DPO, reward or KTO step's samples: from the dataset)
        return _distillation_settings(args, num_processes)
    if trainer == "async_grpo":
        return _async_settings(args, num_processes)
    settings = _step_settings(args, num_processes) | {
        "num_generations": coerce_int(
            "num_generations",
            getattr(args, "num_generations", 8),
            "an integer >= 2 (completions per prompt; GRPO's advantages compare the completions of one prompt)",
            fix="use 2 or more.",
            minimum=2,
        ),
    }
    num_iterations = coerce_int(
        "num_iterations", getattr(args, "num_iterations", 1), "a positive integer number of passes"
    )
    generation_batch_size, steps_per_generation = user_generation_settings(args)
    generation_batch_size, steps_per_generation, source = resolve_generation_round(
        **settings,
        generation_batch_size=coerce_optional_int(
            "generation_batch_size",
            generation_batch_size,
            "a positive integer number of samples (global, per generation round)",
            "leave it unset to derive it from steps_per_generation.",
        ),
        steps_per_generation=coerce_optional_int(
            "steps_per_generation",
            steps_per_generation,
            "a positive integer number of training steps per generation round",
            "leave it unset to use gradient_accumulation_steps.",
        ),
    )
    return settings | {
        "generation_batch_size": generation_batch_size,
        "steps_per_generation": steps_per_generation,
        "generation_round_source": source,
        "num_iterations": num_iterations,
    }


def _step_settings(args: Any, num_processes: Any) -> dict[str, int]:
    """The processes, samples per device and accumulation steps of ``args``, converted and checked."""
    return {
        "num_processes": coerce_int("num_processes", num_processes, "a positive integer number of processes"),
        "per_device_train_batch_size": coerce_int(
            "per_device_train_batch_size",
            getattr(args, "per_device_train_batch_size", None),
            "a positive integer number of samples per device",
        ),
        "gradient_accumulation_steps": coerce_int(
            "gradient_accumulation_steps",
            getattr(args, "gradient_accumulation_steps", 1),
            "a positive integer number of training steps per optimizer step",
        ),
    }


def _distillation_settings(args: Any, num_processes: Any) -> dict[str, Any]:
    """A distillation's batch sizes (:func:`_batch_settings`): its generation round is the optimizer step."""
    settings = _step_settings(args, num_processes)
    steps = settings["gradient_accumulation_steps"]
    samples = settings["per_device_train_batch_size"] * settings["num_processes"] * steps
    return settings | {
        "num_generations": 1,
        "generation_batch_size": samples,
        "steps_per_generation": steps,
        "generation_round_source": "gradient_accumulation_steps",
        "num_iterations": 1,
    }


def _async_settings(args: Any, num_processes: Any) -> dict[str, Any]:
    """An asynchronous GRPO run's batch sizes (:func:`_batch_settings`): the rollout worker generates continuously,
    and an optimizer step takes ``per_device_train_batch_size x processes x gradient_accumulation_steps`` samples of
    its queue (stock's fixed-count mode); that is the "round" the table shows. ``async_step`` (absent: the samples
    step, as ``hf-dynbsz plan`` plans it) and, for stock's step, stock's ``token_budget`` (0: fixed count; None: the
    server's ``max_model_len``), which then decides the step's samples."""
    settings = _step_settings(args, num_processes)
    steps = settings["gradient_accumulation_steps"]
    step = getattr(args, "async_step", "samples")
    budget = getattr(args, "token_budget", None)
    stock_budget = 0 if step == "samples" else None if budget is None else max(int(budget), 0)
    return settings | {
        "async_step": step,
        "stock_token_budget": stock_budget,
        "num_generations": coerce_int(
            "num_generations", getattr(args, "num_generations", 8), "a positive integer number of completions"
        ),
        "generation_batch_size": settings["per_device_train_batch_size"] * settings["num_processes"] * steps,
        "steps_per_generation": steps,
        "generation_round_source": "gradient_accumulation_steps",
        "num_iterations": 1,
    }


def _sequence_parallel_size(dynamic: Any, num_processes: int) -> int:
    size = int(dynamic.sequence_parallel_size or 1)
    if num_processes % size:
        raise ValueError(
            f"sequence_parallel_size={size} does not divide num_processes={num_processes}: "
            f"{setting('sequence_parallel_size').fix}"
        )
    return size


def _dynamic_settings(args: Any, num_processes: int, layout: str | None) -> dict[str, Any]:
    """The dynamic-batching fields of ``args`` (defaults where absent), checked on a copy: ``args`` is not modified."""
    dynamic = validated_fields(args)
    names = (
        "per_device_generation_batch_size",
        "tensor_batch_size",
        "max_tokens_per_microbatch",
        "max_tokens_per_microbatch_logprob",
        "max_tokens_per_microbatch_teacher",
        "dynamic_batching",
        "oversize_policy",
        "balance_across_ranks",
        "share_prompt_prefix",
        "self_check",
    )
    return {name: getattr(dynamic, name) for name in names} | {
        "pad_to_multiple_of": coerce_pad_to_multiple_of(getattr(args, "pad_to_multiple_of", None)),
        "layout": layout if layout is not None else dynamic.packing_layout,
        "sequence_parallel_size": _sequence_parallel_size(dynamic, num_processes),
    }


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
    share_prompt_prefix: SharePrefix
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
    #: processes sharing each pass's row (DeepSpeed Ulysses, :mod:`hf_dynbsz.execution.sequence_parallel`); 1 = off
    sequence_parallel_size: int = 1
    #: tokens per device per no-grad teacher micro-batch of a distillation; None = the log-prob rule at its size
    max_tokens_per_microbatch_teacher: int | None = None
    #: the trainer planned, a key of :data:`STOCK_TRAINERS`
    trainer: str = "grpo"
    #: asynchronous GRPO's ``async_step`` ("stock" or "samples")
    async_step: str = "samples"
    #: stock's ``token_budget`` that decides an asynchronous step's samples (``async_step="stock"``): 0 = fixed count,
    #: None = the vLLM server's ``max_model_len``
    stock_token_budget: int | None = 0

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
        trainer: str = "grpo",
    ) -> BatchSizePlan:
        """Plan the batch sizes of ``args`` on ``num_processes`` processes.

        ``args`` is a ``GRPOConfig``/``DynamicBatchGRPOConfig`` (post-initialised or not) or any object with the
        same attribute names; the dynamic-batching fields default when absent. ``num_processes`` may differ from
        the world size ``args`` was built for (planning an 8-GPU run on a laptop): the generation round is then
        re-derived from what the user asked for, not from TRL's derived values (see
        :func:`~hf_dynbsz.planning.generation_round.user_generation_settings`): a user-given global
        ``generation_batch_size`` is kept and ``steps_per_generation`` follows from it; otherwise
        ``steps_per_generation`` is kept (defaulting to ``gradient_accumulation_steps``) and ``generation_batch_size
        = per_device_train_batch_size x num_processes x steps_per_generation``, exactly as TRL derives it.

        ``zero_stage`` and ``mixed_precision`` describe the launcher (accelerate/DeepSpeed); when None they are
        read from ``args.deepspeed`` (a dict) and ``args.fp16``/``args.bf16`` (:func:`resolve_mixed_precision`).
        ``layout`` is the concrete packing layout if known; None shows ``args.packing_layout``. ``vision_language``
        (see :func:`hf_dynbsz.planning.model_support.vision_language_mode`) adds a row saying how image steps train,
        and ``router_aux`` ("repacked", or why not) one saying how the MoE router aux loss trains. ``memory_rows``
        (:func:`hf_dynbsz.planning.memory.plan_rows`) show a memory limit's model and budgets. ``trainer``: "grpo",
        "rloo" or "distillation" (:data:`STOCK_TRAINERS`; a distillation's ``args`` is a ``DistillationConfig``: one
        completion per prompt generated once per optimizer step, and a teacher budget).

        Raises :class:`ValueError` with the numbers and the nearest valid values when a divisibility TRL or
        DeepSpeed requires does not hold.
        """
        if trainer not in STOCK_TRAINERS:
            raise ValueError(f"trainer must be one of {', '.join(map(repr, STOCK_TRAINERS))}, got {trainer!r}.")
        batch = _batch_settings(args, num_processes, trainer)
        dynamic = _dynamic_settings(args, batch["num_processes"], layout)
        return cls(
            trainer=trainer,
            **batch,
            **dynamic,
            zero_stage=_zero_stage(zero_stage, args),
            mixed_precision=resolve_mixed_precision(args, mixed_precision),
            env_sources=dict(env_sources(args)),
            vision_language=vision_language,
            router_aux=router_aux,
            memory_rows=tuple(tuple(row) for row in memory_rows),
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

    @property
    def stock_trainer(self) -> str:
        """TRL's trainer this plan's run replaces ("GRPOTrainer", ...)."""
        return STOCK_TRAINERS[self.trainer]

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
        """The table of :meth:`render` as ``(setting, per device, global, meaning)`` rows
        (:data:`hf_dynbsz.planning.plan_table.PLAN_ROWS`)."""
        return plan_rows(self)

    def render(self) -> str:
        """An aligned plain-text table: setting | per device | global | meaning."""
        return "\n".join(text_table(("setting", "per device", "global", "meaning"), self.rows(), "<>>-"))

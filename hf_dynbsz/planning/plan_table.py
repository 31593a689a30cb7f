"""The table of a :class:`~hf_dynbsz.planning.plan.BatchSizePlan`: one declarative row spec per line of the table.

Each :class:`Row` names a setting or quantity, says how to read its per-device and global values off the plan, and
what it means; a row with a predicate (``when``) shows only for the plans it holds for. :func:`plan_rows` turns the
specs into the ``(setting, per device, global, meaning)`` rows that :meth:`BatchSizePlan.render` aligns with
:func:`text_table` (the command line's simulation tables use it too).

Pure Python (no torch, no TRL).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from hf_dynbsz.planning.model_support import images_stay_on_their_process
from hf_dynbsz.planning.settings import SharePrefix, setting

#: The trainers whose steps come from their dataset (nothing generated): a step's samples are its micro-batches'.
DATASET_TRAINERS = ("dpo", "reward", "kto")

__all__ = ["PLAN_ROWS", "Row", "fraction_text", "plan_rows", "text_table"]

#: A :class:`~hf_dynbsz.planning.plan.BatchSizePlan`, read by attribute (that module imports this one, not the
#: reverse: the plan renders its table with these rows).
Plan = Any
#: A cell: fixed text, or a function of the plan giving it.
Cell = str | Callable[[Plan], str]


@dataclass(frozen=True)
class Row:
    """One row of the plan table: ``setting``, the ``per_device`` and ``global_`` values ("-" where the quantity has
    no such value) and the ``meaning``; each cell is fixed text or a function of the plan. ``when``: the row shows
    only for the plans it is true of (None: always)."""

    setting: str
    per_device: Cell
    global_: Cell
    meaning: Cell
    when: Callable[[Plan], bool] | None = None

    def cells(self, plan: Plan) -> tuple[str, str, str, str]:
        def text(cell: Cell) -> str:
            return cell if isinstance(cell, str) else cell(plan)

        return (self.setting, text(self.per_device), text(self.global_), text(self.meaning))


def fraction_text(value: Fraction) -> str:
    """``3`` or ``3/4``."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _attr(name: str) -> Callable[[Plan], str]:
    """The plan's attribute ``name`` as text (fractions as ``n/d``)."""

    def value(plan: Plan) -> str:
        number = getattr(plan, name)
        return fraction_text(number) if isinstance(number, Fraction) else str(number)

    return value


def _on_off(name: str) -> Callable[[Plan], str]:
    return lambda plan: "on" if getattr(plan, name) else "off"


def _none_or(name: str) -> Callable[[Plan], str]:
    return lambda plan: "none" if getattr(plan, name) is None else str(getattr(plan, name))


def _summary_if_on(name: str, off: str) -> Callable[[Plan], str]:
    """The setting's summary when the plan has it on, else ``off``."""
    return lambda plan: setting(name).summary if getattr(plan, name) else off


_ROUND_SOURCE_TEXT = {
    "generation_batch_size": "= generation_batch_size / (per_device_train_batch_size x processes)",
    "steps_per_generation": "set by the user",
    "gradient_accumulation_steps": "defaults to gradient_accumulation_steps",
}


def _chunk(plan: Plan) -> str:
    suffix = " (all)" if plan.per_device_generation_batch_size is None else ""
    return f"{plan.generation_chunk_size}{suffix}"


def _budget(name: str, unset: str) -> Callable[[Plan], str]:
    """A token budget per device (``unset`` when automatic)."""
    return lambda plan: unset if getattr(plan, name) is None else str(getattr(plan, name))


def _budget_all(name: str) -> Callable[[Plan], str]:
    """A token budget over all processes ("-" when automatic)."""
    return lambda plan: "-" if getattr(plan, name) is None else str(getattr(plan, name) * plan.num_processes)


def _budget_decides_samples(plan: Plan) -> bool:
    """An asynchronous run of stock's step with ``token_budget > 0``: stock's token-budget batcher decides the
    samples of a step (not a fixed count)."""
    return plan.trainer == "async_grpo" and plan.async_step == "stock" and plan.stock_token_budget != 0


def _stock_budget_text(plan: Plan) -> str:
    budget = plan.stock_token_budget
    return "the server's max_model_len" if budget is None else str(budget)


def _samples_cell(name: str) -> Callable[[Plan], str]:
    """``name``'s value, or "-" where stock's token budget decides the step's samples."""
    value = _attr(name)
    return lambda plan: "-" if _budget_decides_samples(plan) else value(plan)


def _queue_meaning(plan: Plan) -> str:
    if _budget_decides_samples(plan):
        return (
            f"stock's step: gradient_accumulation_steps micro-batches of as many samples as fit token_budget="
            f"{_stock_budget_text(plan)} tokens per row and process (longer ones dropped), each normalised by its own "
            "trained tokens; the passes are sized apart"
        )
    if plan.async_step == "stock":
        return (
            "samples each optimizer step takes from the rollout queue (stock's fixed-count micro-batches, each "
            "normalised by its own trained tokens, as stock); the budget only cuts them into passes"
        )
    return (
        "samples each optimizer step takes from the rollout queue, as stock's fixed-count mode (token_budget <= 0), "
        "normalised by the step's trained tokens (async_step='samples'); the token budget cuts them into passes and "
        "never changes what the step computes"
    )


def _train_budget_meaning(plan: Plan) -> str:
    if plan.max_tokens_per_microbatch is not None:
        return setting("max_tokens_per_microbatch").summary
    if plan.trainer == "async_grpo":
        row = (
            f"token_budget={_stock_budget_text(plan)}"
            if _budget_decides_samples(plan)
            else f"{plan.per_device_train_batch_size} samples per micro-batch"
        )
        source = "token_budget" if plan.async_step == "samples" else "max_tokens_per_microbatch or memory"
        return f"tokens per training pass ({source}); auto = the prefix trie of stock's row of {row}"
    if _pairs(plan):  # DataCollatorForPreference pads a micro-batch's 2 x B rows to its longest
        return (
            f"tokens per training micro-batch; auto = 2 x {plan.per_device_train_batch_size} rows x the longest "
            "prompt + response of stock's micro-batch"
        )
    return (
        f"tokens per training micro-batch; auto = {plan.per_device_train_batch_size} x (longest prompt + "
        "longest completion) per generation batch"
    )


def _logprob_budget_meaning(plan: Plan) -> str:
    default = "; default 2 x training budget" if plan.max_tokens_per_microbatch_logprob is None else ""
    if plan.trainer == "dpo":
        return "tokens per no-grad reference micro-batch (the reference model's log-probs)" + default
    if plan.trainer == "kto":
        return "tokens per no-grad micro-batch (the KL sequences' policy log-probs, the reference's)" + default
    return setting("max_tokens_per_microbatch_logprob").summary + default


def _balance(plan: Plan) -> str:
    on = plan.balance_across_ranks and not images_stay_on_their_process(plan.vision_language)
    return ("on" if on else "off") + (" (1 process)" if plan.num_processes == 1 else "")


def _balance_meaning(plan: Plan) -> str:
    if plan.num_processes == 1:
        return "no-op on one process"
    if images_stay_on_their_process(plan.vision_language):  # this family's samples are not balanced
        return "this family's image inputs stay on their process"
    return setting("balance_across_ranks").summary


def _images_meaning(plan: Plan) -> str:
    if plan.vision_language == "repacked":
        return (
            "each sample's images move with it (into its micro-batch, to another process); padding-free rows hold a "
            "shared prompt's images once (encoded once per pass)"
        )
    if plan.trainer == "distillation":
        return "image steps run stock DistillationTrainer micro-batches: a teacher's image inputs are not repacked"
    return f"image steps run stock {plan.stock_trainer} micro-batches: this model family is not repacked"


def _router_meaning(plan: Plan) -> str:
    if plan.router_aux == "repacked":
        return "per sample, from one extra no-grad router pass over each optimizer step (log-prob budget)"
    return plan.router_aux


def _grpo_round(plan: Plan) -> bool:
    """Rows of GRPO's and RLOO's generation round (a distillation's round is its optimizer step, n = 1; a DPO run
    generates nothing; an asynchronous GRPO run's rollout worker generates continuously)."""
    return plan.trainer not in ("distillation", "async_grpo", *DATASET_TRAINERS)


def _asynchronous(plan: Plan) -> bool:
    return plan.trainer == "async_grpo"


def _generates_in_trainer(plan: Plan) -> bool:
    """Rows of the trainer's own generation (a DPO run generates nothing, an asynchronous run's server generates)."""
    return plan.trainer not in ("async_grpo", *DATASET_TRAINERS)


def _generates(plan: Plan) -> bool:
    """Rows of generation (a DPO run's pairs and a KTO run's samples come from its dataset)."""
    return plan.trainer not in DATASET_TRAINERS


def _dpo(plan: Plan) -> bool:
    return plan.trainer == "dpo"


def _pairs(plan: Plan) -> bool:
    """Rows of preference pairs (a DPO run's, a reward model's)."""
    return plan.trainer in ("dpo", "reward")


def _logprob_rows(plan: Plan) -> bool:
    """The log-prob budget's row: GRPO's and RLOO's no-grad passes, a DPO run's reference passes, a KTO run's KL and
    reference passes."""
    return _grpo_round(plan) or plan.trainer in ("dpo", "kto")


def _distillation(plan: Plan) -> bool:
    return plan.trainer == "distillation"


def _teacher_budget(plan: Plan) -> str:
    if plan.max_tokens_per_microbatch_teacher is not None:
        return str(plan.max_tokens_per_microbatch_teacher)
    return "2 x training x scale"


def _teacher_budget_meaning(plan: Plan) -> str:
    default = (
        "; default 2 x training budget x the student's no-grad memory per token over the teacher's (about 0.5 for a "
        "teacher twice as wide)"
        if plan.max_tokens_per_microbatch_teacher is None
        else ""
    )
    return setting("max_tokens_per_microbatch_teacher").summary + default


def _sequence_parallel(plan: Plan) -> bool:
    return plan.sequence_parallel_size > 1


def _group_budget(name: str, unset: str) -> Callable[[Plan], str]:
    """The tokens one sequence-parallel group's pass holds: size x the per-device budget."""

    def value(plan: Plan) -> str:
        budget, size = getattr(plan, name), plan.sequence_parallel_size
        return f"{size} x {unset}" if budget is None else str(size * budget)

    return value


def _group_meaning(name: str) -> Callable[[Plan], str]:
    def meaning(plan: Plan) -> str:
        size = plan.sequence_parallel_size
        return (
            f"the longest sequence one {name} pass holds without running oversize: {size} x the per-device budget, "
            f"each process holding 1/{size} of the row"
        )

    return meaning


#: The rows of the plan table, in order (the memory limit's rows follow, see :func:`plan_rows`).
PLAN_ROWS: tuple[Row, ...] = (
    Row("processes", "-", _attr("num_processes"), "data-parallel processes (devices)"),
    Row(
        "per_device_train_batch_size",
        _attr("per_device_train_batch_size"),
        _attr("global_train_batch_size"),
        setting("per_device_train_batch_size").summary,
    ),
    Row("gradient_accumulation_steps", _attr("gradient_accumulation_steps"), "-", "training steps per optimizer step"),
    Row(
        "samples per optimizer step",
        _samples_cell("per_device_samples_per_optimizer_step"),
        _samples_cell("global_samples_per_optimizer_step"),
        lambda plan: (
            f"as many as stock's token budget fits (token_budget={_stock_budget_text(plan)})"
            if _budget_decides_samples(plan)
            else "per_device_train_batch_size x gradient_accumulation_steps (x processes)"
        ),
        when=_generates,
    ),
    Row(
        "pairs per optimizer step",
        _attr("per_device_samples_per_optimizer_step"),
        _attr("global_samples_per_optimizer_step"),
        "preference pairs: per_device_train_batch_size x gradient_accumulation_steps (x processes); a pair's chosen "
        "and rejected sequences run in one pass under one copy of their prompt",
        when=_pairs,
    ),
    Row(
        "prompts per optimizer step",
        "-",
        _attr("prompts_per_optimizer_step"),
        "global samples per optimizer step / num_generations",
        when=_grpo_round,
    ),
    Row("num_generations", "-", _attr("num_generations"), "completions (samples) per prompt", when=_grpo_round),
    Row(
        "generation_batch_size",
        _attr("per_device_generation_share"),
        _attr("generation_batch_size"),
        "samples per generation round (TRL's generation_batch_size is the global one)",
        when=_grpo_round,
    ),
    Row(
        "prompts per generation round",
        "-",
        _attr("prompts_per_generation_round"),
        "generation_batch_size / num_generations",
        when=_grpo_round,
    ),
    Row(
        "steps_per_generation",
        _attr("steps_per_generation"),
        "-",
        lambda plan: f"training steps per generation round; {_ROUND_SOURCE_TEXT[plan.generation_round_source]}",
        when=_grpo_round,
    ),
    Row(
        "optimizer steps per generation round",
        _attr("optimizer_steps_per_generation_round"),
        "-",
        "steps_per_generation / gradient_accumulation_steps",
        when=_grpo_round,
    ),
    Row("num_iterations", _attr("num_iterations"), "-", "passes (mu) over each generation round", when=_grpo_round),
    Row(
        "optimizer steps per round x num_iterations",
        _attr("optimizer_steps_per_generation_round_all_iterations"),
        "-",
        "optimizer steps taken on one generation round",
        when=_grpo_round,
    ),
    Row(
        "generation",
        "-",
        _attr("global_samples_per_optimizer_step"),
        "one completion per prompt, generated once per optimizer step (a distillation's round is its step)",
        when=_distillation,
    ),
    Row(
        "prompts per optimizer step",
        "-",
        _samples_cell("prompts_per_optimizer_step"),
        "global samples per optimizer step / num_generations (whole groups when it divides)",
        when=_asynchronous,
    ),
    Row(
        "rollout queue",
        _samples_cell("per_device_samples_per_optimizer_step"),
        _samples_cell("global_samples_per_optimizer_step"),
        _queue_meaning,
        when=_asynchronous,
    ),
    Row(
        "per_device_generation_batch_size",
        _chunk,
        "-",
        setting("per_device_generation_batch_size").summary,
        when=_generates_in_trainer,
    ),
    Row(
        "generation chunks",
        _attr("generation_chunks_per_device"),
        "-",
        "generate calls per device per generation round",
        when=_generates_in_trainer,
    ),
    Row(
        "tensor_batch_size",
        lambda plan: str(plan.effective_tensor_batch_size) + (" (TRL)" if plan.tensor_batch_size is None else ""),
        "-",
        setting("tensor_batch_size").summary,
    ),
    Row(
        "max_tokens_per_microbatch",
        _budget("max_tokens_per_microbatch", "auto"),
        _budget_all("max_tokens_per_microbatch"),
        _train_budget_meaning,
    ),
    Row(
        "max_tokens_per_microbatch_logprob",
        _budget("effective_max_tokens_per_microbatch_logprob", "2 x auto"),
        _budget_all("effective_max_tokens_per_microbatch_logprob"),
        _logprob_budget_meaning,
        when=_logprob_rows,
    ),
    Row(
        "max_tokens_per_microbatch_teacher",
        _teacher_budget,
        _budget_all("max_tokens_per_microbatch_teacher"),
        _teacher_budget_meaning,
        when=_distillation,
    ),
    Row(
        "pad_to_multiple_of",
        _none_or("pad_to_multiple_of"),
        "-",
        "lengths rounded up to a multiple of this many tokens",
    ),
    Row(
        "dynamic_batching",
        _on_off("dynamic_batching"),
        "-",
        lambda plan: (
            setting("dynamic_batching").summary if plan.dynamic_batching else f"stock {plan.stock_trainer} behaviour"
        ),
    ),
    Row("packing layout", _attr("layout"), "-", setting("packing_layout").summary),
    Row("oversize_policy", _attr("oversize_policy"), "-", setting("oversize_policy").summary),
    Row(
        "share_prompt_prefix",
        lambda plan: str(SharePrefix.of(plan.share_prompt_prefix) or "off"),
        "-",
        _summary_if_on("share_prompt_prefix", "every sample computes its prompt and completion"),
    ),
    Row(
        "self_check",
        _on_off("self_check"),
        "-",
        _summary_if_on("self_check", "the layout read off the model is trusted"),
    ),
    Row("balance_across_ranks", _balance, "-", _balance_meaning),
    Row("DeepSpeed ZeRO stage", _none_or("zero_stage"), "-", "from the launcher"),
    Row("mixed precision", _attr("mixed_precision"), "-", "from the launcher or fp16/bf16"),
    Row(
        "image inputs",
        _attr("vision_language"),
        "-",
        _images_meaning,
        when=lambda plan: plan.vision_language is not None,
    ),
    Row(
        "router aux loss",
        lambda plan: "repacked" if plan.router_aux == "repacked" else "stock math",
        "-",
        _router_meaning,
        when=lambda plan: plan.router_aux is not None,
    ),
    Row(
        "sequence_parallel_size",
        _attr("sequence_parallel_size"),
        lambda plan: f"{max(plan.num_processes // plan.sequence_parallel_size, 1)} group(s)",
        "processes sharing each packed row (DeepSpeed Ulysses); data parallelism across groups",
        when=_sequence_parallel,
    ),
    Row(
        "tokens per training pass (group)",
        _group_budget("max_tokens_per_microbatch", "auto"),
        "-",
        _group_meaning("training"),
        when=_sequence_parallel,
    ),
    Row(
        "tokens per logprob pass (group)",
        _group_budget("effective_max_tokens_per_microbatch_logprob", "2 x auto"),
        "-",
        _group_meaning("logprob"),
        when=_sequence_parallel,
    ),
)


def plan_rows(plan: Plan) -> list[tuple[str, str, str, str]]:
    """The ``(setting, per device, global, meaning)`` rows of ``plan``'s table: :data:`PLAN_ROWS` that apply, then the
    memory limit's rows; a value a ``DIFFU_*`` variable set says so in its meaning, where the user looks for it."""
    rows = [row.cells(plan) for row in PLAN_ROWS if row.when is None or row.when(plan)]
    rows.extend((name, value, "-", meaning) for name, value, meaning in plan.memory_rows)
    return [
        (name, device, total, f"{meaning} [set by {plan.env_sources[name]}]" if name in plan.env_sources else meaning)
        for name, device, total, meaning in rows
    ]


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

"""``hf-dynbsz``: command-line tools (``plan`` here; ``report`` in :mod:`hf_dynbsz.report`).

``hf-dynbsz plan [GRPOConfig options] [--num_processes N] [--config_file ACCELERATE_YAML] [--lengths FILE]``
prints the batch-size plan (:class:`~hf_dynbsz.planning.plan.BatchSizePlan`) of a training command: every
``GRPOConfig``/``DynamicBatchGRPOConfig`` option is accepted by its config name (``--output_dir`` is not
required), ``DIFFU_*`` environment variables are honoured. With ``--lengths`` it also simulates the token-budget
micro-batches of a list of sample lengths and compares them with stock TRL's padded micro-batches.

How the world size is handled: the options are parsed into a namespace of the user's *raw* values (no
``GRPOConfig.__post_init__``, which would derive ``generation_batch_size`` for the world size of this machine and
check that bf16 is supported here). ``BatchSizePlan.from_args`` then derives the generation round exactly like
TRL does, for ``--num_processes`` processes, and :func:`_check_as_training` builds the config training would build
(with that generation round, and what belongs to this machine neutralised), so that every other check is
training's own.

Invalid settings exit with status 2 and the validation message on stderr (no traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hf_dynbsz.planning.coerce import parse_int
from hf_dynbsz.planning.model_support import ModelSupport, router_aux_loss_coef
from hf_dynbsz.planning.partition import token_lower_bound
from hf_dynbsz.planning.plan_table import text_table
from hf_dynbsz.planning.schedule import Scheduler, StepSchedule, simulate_processes, stock_microbatch_tokens

__all__ = ["main", "read_accelerate_config", "read_lengths"]

_PROG = "hf-dynbsz"
_EXIT_USAGE = 2


class UsageError(ValueError):
    """A problem with the user's input (file, setting): reported on stderr with exit status 2."""


# --------------------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------------------


def read_accelerate_config(path: str) -> dict[str, Any]:
    """``num_processes``, ``num_machines``, ``mixed_precision`` and the DeepSpeed ``zero_stage`` of an ``accelerate``
    YAML file.

    Keys absent from the file are absent from the result. ``num_processes`` is accelerate's total over all
    machines. The ZeRO stage comes from ``deepspeed_config.zero_stage``, or from the ``zero_optimization.stage`` of
    the JSON file named by ``deepspeed_config.deepspeed_config_file``.
    """
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except OSError as error:
        raise UsageError(f"cannot read --config_file {path!r}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise UsageError(f"--config_file {path!r} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config_file {path!r} must be a YAML mapping (an accelerate config file).")
    result: dict[str, Any] = {}
    for key in ("num_processes", "num_machines"):
        if data.get(key) is not None:
            result[key] = data[key]
    if data.get("mixed_precision") is not None:
        precision = data["mixed_precision"]
        result["mixed_precision"] = "no" if precision is False else str(precision)  # YAML 1.1 reads `no` as False
    deepspeed = data.get("deepspeed_config") or {}
    if isinstance(deepspeed, dict):
        if deepspeed.get("zero_stage") is not None:
            result["zero_stage"] = deepspeed["zero_stage"]
        elif deepspeed.get("deepspeed_config_file"):
            stage = _zero_stage_from_deepspeed_json(deepspeed["deepspeed_config_file"])
            if stage is not None:
                result["zero_stage"] = stage
    return result


def _zero_stage_from_deepspeed_json(path: str) -> int | None:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as error:
        raise UsageError(f"cannot read DeepSpeed config {path!r}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise UsageError(f"DeepSpeed config {path!r} is not valid JSON: {error}") from None
    stage = (data.get("zero_optimization") or {}).get("stage") if isinstance(data, dict) else None
    return stage if isinstance(stage, int) else None


def read_lengths(path: str) -> list[tuple[int, int | None, int | None]]:
    """Sample lengths in tokens from ``path``, as ``(total, prompt, group)`` (``prompt``/``group`` None when not given).

    Accepted formats: one integer per line (prompt + completion tokens; blank lines and ``#`` comments skipped),
    lines ``PROMPT COMPLETION`` or ``PROMPT COMPLETION GROUP``; or a JSON list of integers, or of ``[prompt,
    completion]`` pairs or ``[prompt, completion, group]`` triples. With separate prompt and completion lengths the
    automatic budget and stock TRL's padding are exact (TRL pads prompts and completions separately); with totals
    only they use the longest total. ``GROUP`` (an integer, equal for samples whose prompts are identical) says
    which samples may share a prompt; without it, each run of ``num_generations`` consecutive samples with equal
    prompt lengths is taken for one prompt's completions.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise UsageError(f"cannot read --lengths {path!r}: {error.strerror or error}") from None

    def as_length(value: Any, where: str) -> int:
        number = parse_int(value)
        if number is None or number < 0:
            raise UsageError(
                f"--lengths {path!r}: {where}: expected a non-negative integer number of tokens, got {value!r}."
            )
        return number

    entries: list[Any] = []
    if text.lstrip().startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise UsageError(f"--lengths {path!r} is not a valid JSON list: {error}") from None
        if not isinstance(data, list):
            raise UsageError(f"--lengths {path!r}: expected a JSON list of integers or [prompt, completion] pairs.")
        for index, item in enumerate(data):
            entries.append((item, f"item {index}"))
    else:
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if line:
                parts = line.replace(",", " ").split()
                entries.append((parts[0] if len(parts) == 1 else parts, f"line {number}"))

    lengths: list[tuple[int, int | None, int | None]] = []
    for item, where in entries:
        if isinstance(item, list | tuple):
            if len(item) not in (2, 3):
                raise UsageError(f"--lengths {path!r}: {where}: expected PROMPT COMPLETION [GROUP], got {item!r}.")
            prompt, completion = as_length(item[0], where), as_length(item[1], where)
            group = as_length(item[2], where) if len(item) == 3 else None
            lengths.append((prompt + completion, prompt, group))
        else:
            lengths.append((as_length(item, where), None, None))
        if lengths[-1][0] < 1:
            raise UsageError(f"--lengths {path!r}: {where}: a sample has at least 1 token, got {lengths[-1][0]}.")
    if not lengths:
        raise UsageError(f"--lengths {path!r} holds no lengths.")
    if len({(prompt is None, group is None) for _, prompt, group in lengths}) > 1:
        raise UsageError(
            f"--lengths {path!r}: mix of formats (totals, PROMPT COMPLETION, PROMPT COMPLETION GROUP); use one."
        )
    return lengths


def _groups(samples: list[tuple[int, int | None, int | None]], num_generations: int) -> list[int] | None:
    """Prompt groups of a step's samples: the file's GROUP column, else runs of ``num_generations`` consecutive samples
    with equal prompt lengths; None with totals only (no prompt to share)."""
    if samples[0][1] is None:
        return None
    if samples[0][2] is not None:
        return [group for _, _, group in samples]
    groups, run = [], -1
    for index, (_, prompt, _) in enumerate(samples):
        if index % num_generations == 0 or prompt != samples[index - 1][1]:
            run += 1
        groups.append(run)
    return groups


def _attn_implementation(namespace: argparse.Namespace) -> str | None:
    if namespace.attn_implementation:
        return namespace.attn_implementation
    kwargs = getattr(namespace, "model_init_kwargs", None)
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError:
            return None
    if isinstance(kwargs, dict):
        return kwargs.get("attn_implementation")
    return None


# --------------------------------------------------------------------------------------------------------------
# Simulation of --lengths
# --------------------------------------------------------------------------------------------------------------


_SIMULATION_HEADER = (
    "step",
    "samples",
    "real tokens",
    "budget",
    "micro-batches",
    "lower bound",
    "utilisation",
    "computed tokens",
    "stock tokens",
    "saved",
)


def _simulation_rows(steps: list[tuple]) -> list[tuple[str, ...]]:
    """The rows of :func:`render_simulation`, one per ``(lengths, schedule, stock tokens, partial)`` step, then the
    totals."""
    rows: list[tuple[str, ...]] = []
    totals = dict.fromkeys(("samples", "real", "capacity", "count", "bound", "dynamic", "stock"), 0)
    for number, (lengths, schedule, stock, partial) in enumerate(steps, start=1):
        count, bound = schedule.passes, token_lower_bound(lengths, schedule.budget)
        dynamic, real = sum(schedule.pass_tokens), sum(lengths)
        # Utilisation is of the micro-batches under the budget: an oversize sequence's pass is over it, by design.
        fitting = [batch for batch in schedule.microbatches if not set(batch) & set(schedule.oversize)]
        fitting_real = sum(lengths[i] for batch in fitting for i in batch)
        capacity = len(fitting) * schedule.budget
        rows.append(
            (
                str(number) + ("*" if partial else ""),
                str(len(lengths)),
                str(real),
                str(schedule.budget),
                str(count),
                str(bound),
                f"{fitting_real / capacity:.1%}" if capacity else "-",
                str(dynamic),
                str(stock),
                f"{1 - dynamic / stock:.1%}" if stock else "-",
            )
        )
        for key, value in (
            ("samples", len(lengths)),
            ("real", fitting_real),
            ("capacity", capacity),
            ("count", count),
            ("bound", bound),
            ("dynamic", dynamic),
            ("stock", stock),
        ):
            totals[key] += value
    rows.append(
        (
            "total",
            str(totals["samples"]),
            str(sum(sum(lengths) for lengths, _, _, _ in steps)),
            "-",
            str(totals["count"]),
            str(totals["bound"]),
            f"{totals['real'] / totals['capacity']:.1%}" if totals["capacity"] else "-",
            str(totals["dynamic"]),
            str(totals["stock"]),
            f"{1 - totals['dynamic'] / totals['stock']:.1%}" if totals["stock"] else "-",
        )
    )
    return rows


def _simulation_notes(plan, scheduler: Scheduler, steps: list[tuple], totals_only: bool, layout_note: str) -> list[str]:
    """The notes above :func:`render_simulation`'s table: what was simulated, what the columns mean, oversize."""
    if plan.max_tokens_per_microbatch:
        budget_text = f"{plan.max_tokens_per_microbatch} tokens"
    elif totals_only:
        budget_text = (
            f"auto = {plan.per_device_train_batch_size} x longest sample of the step (totals only: give PROMPT "
            "COMPLETION pairs for the exact rule, longest prompt + longest completion)"
        )
    else:
        budget_text = f"auto = {plan.per_device_train_batch_size} x (longest prompt + longest completion) of the step"
    samples = sum(len(lengths) for lengths, _, _, _ in steps)
    notes = [
        f"Simulated {samples} samples of one device, {plan.per_device_samples_per_optimizer_step} per optimizer step "
        f"(per_device_train_batch_size {plan.per_device_train_batch_size} x gradient_accumulation_steps "
        f"{plan.gradient_accumulation_steps}); budget: {budget_text}; layout: {scheduler.layout}{layout_note}; "
        f"pad_to_multiple_of: {plan.pad_to_multiple_of or 'none'}.",
        "lower bound = fewest micro-batches the step's tokens allow (each oversize sequence counts one); utilisation "
        "= real tokens / (micro-batches x budget), over the micro-batches within the budget; computed tokens = "
        "tokens the micro-batches compute (padding included); stock tokens = stock "
        "TRL's micro-batches of per_device_train_batch_size samples padded to the step's longest row.",
    ]
    notes = [textwrap.fill(note, width=110, break_on_hyphens=False) for note in notes]
    if any(partial for _, _, _, partial in steps):
        notes.append("* partial optimizer step (fewer samples than a full step).")
    oversize = [lengths[i] for lengths, schedule, _, _ in steps for i in schedule.oversize]
    if oversize:
        budget = max(schedule.budget for _, schedule, _, _ in steps if schedule.oversize)
        notes.append(
            "warning: "
            + scheduler.oversize_warning(len(oversize), max(oversize), budget).split(": ", 1)[1]
            + " (oversize_policy='warn')"
        )
        notes.append(
            "Their passes count in micro-batches and lower bound and are left out of utilisation; "
            "oversize_policy='error' stops training instead."
        )
    return notes


def render_simulation(
    plan, scheduler: Scheduler, rounds: list[SimulatedRound], totals_only: bool, layout_note: str = ""
) -> str:
    """The table of :func:`simulate` on one process: micro-batches vs stock TRL's padded micro-batches, per step."""
    steps = [(step.lengths[0], step.balanced[0], step.stock_tokens, step.partial) for step in rounds]
    notes = _simulation_notes(plan, scheduler, steps, totals_only, layout_note)
    rows = _simulation_rows(steps)
    return "\n".join([*notes, "", *text_table(_SIMULATION_HEADER, rows, ">" * len(_SIMULATION_HEADER))])


@dataclass
class SimulatedRound:
    """One optimizer step of ``--lengths`` over several processes, with and without cross-rank balancing."""

    lengths: list[list[int]]  # per process, prompt + completion tokens per sample
    stock_tokens: int  # token positions stock TRL's padded micro-batches compute, all processes
    balanced: list[StepSchedule]  # per process, balance_across_ranks on
    unbalanced: list[StepSchedule]  # per process, balance_across_ranks off
    partial: bool


def simulate(plan, scheduler: Scheduler, lengths: list[tuple[int, int | None]]) -> list[SimulatedRound]:
    """The schedules of each optimizer step of ``lengths`` (samples in training order), as every process computes
    them: a step takes ``num_processes x per_device_train_batch_size x gradient_accumulation_steps`` samples (the
    last may be partial), process 0's first, and is scheduled by ``scheduler`` exactly as the trainer schedules it,
    with and without cross-rank balancing. With ``max_tokens_per_microbatch`` unset, each process's budget is the
    automatic one, ``per_device_train_batch_size`` rows of stock TRL's padded width. Stock pads to the whole
    generation batch; equal to the optimizer step's when ``steps_per_generation == gradient_accumulation_steps``
    (the default)."""
    per_process, processes = plan.per_device_samples_per_optimizer_step, plan.num_processes
    rounds = []
    for start in range(0, len(lengths), per_process * processes):
        step = lengths[start : start + per_process * processes]
        parts = [step[p * per_process : (p + 1) * per_process] for p in range(processes)]
        parts = [part for part in parts if part]
        totals = [[total for total, _, _ in part] for part in parts]
        prompts = [[prompt or 0 for _, prompt, _ in part] for part in parts]
        groups = [_groups(part, plan.num_generations) for part in parts]
        rows = [
            stock_microbatch_tokens(1, p, [t - q for t, q in zip(ts, p)], plan.pad_to_multiple_of)
            for ts, p in zip(totals, prompts)
        ]
        budgets = [scheduler.budget(plan.per_device_train_batch_size * row) for row in rows]
        schedules = {}
        for balance in (True, False):
            planner = dataclasses.replace(scheduler, balance_across_ranks=balance)
            results = simulate_processes(
                planner, totals, budgets, prompts, groups=None if groups[0] is None else groups
            )
            errors = [result for result in results if isinstance(result, Exception)]
            if errors:
                raise errors[0]
            schedules[balance] = results
        stock = sum(len(ts) * row for ts, row in zip(totals, rows))
        rounds.append(
            SimulatedRound(totals, stock, schedules[True], schedules[False], len(step) < per_process * processes)
        )
    return rounds


def render_processes(plan, scheduler: Scheduler, rounds: list[SimulatedRound]) -> str:
    """The table of :func:`simulate_processes_steps`: passes and rank imbalance without and with balancing."""
    header = (
        "step",
        "samples",
        "real tokens",
        "budget",
        "passes (no balancing)",
        "passes (balanced)",
        "rank imbalance (no balancing)",
        "rank imbalance (balanced)",
        "samples moved",
        "computed tokens",
        "stock tokens",
    )
    rows = []
    for number, step in enumerate(rounds, start=1):
        active = step.balanced if scheduler.balance_across_ranks else step.unbalanced
        balance = step.balanced[0].balance
        computed = sum(sum(s.pass_tokens) for s in active)
        rows.append(
            (
                str(number) + ("*" if step.partial else ""),
                str(sum(map(len, step.lengths))),
                str(sum(map(sum, step.lengths))),
                str(active[0].budget),
                str(step.unbalanced[0].passes),
                str(step.balanced[0].passes),
                f"{balance.imbalance_before:.2f}",
                f"{balance.imbalance_after:.2f}",
                str(step.balanced[0].samples_moved),
                str(computed),
                str(step.stock_tokens),
            )
        )
    note = (
        f"Simulated {sum(sum(map(len, r.lengths)) for r in rounds)} samples over {plan.num_processes} processes, "
        f"{plan.per_device_samples_per_optimizer_step} per process per optimizer step (process 0's first in each "
        f"step); layout: {scheduler.layout}; balance_across_ranks: {'on' if scheduler.balance_across_ranks else 'off'} "
        "(computed tokens follow it). rank imbalance = largest per-process cost over the mean (workload model); "
        "passes = passes every process runs per step (the busiest process's count)."
    )
    notes = [textwrap.fill(note, width=110, break_on_hyphens=False)]
    if any(step.partial for step in rounds):
        notes.append("* partial optimizer step (fewer samples than a full step).")
    return "\n".join([*notes, "", *text_table(header, rows, ">" * len(header))])


def processes_as_dict(rounds: list[SimulatedRound]) -> list[dict[str, Any]]:
    """``--json`` with several processes: per step, each process's micro-batches with and without balancing."""
    return [
        {
            "lengths": step.lengths,
            "budget": step.balanced[0].budget,
            "passes_without_balancing": step.unbalanced[0].passes,
            "passes": step.balanced[0].passes,
            "rank_imbalance_before": step.balanced[0].balance.imbalance_before,
            "rank_imbalance_after": step.balanced[0].balance.imbalance_after,
            "samples_moved": step.balanced[0].samples_moved,
            "processes": [{"lengths": s.lengths, "microbatches": s.microbatches} for s in step.balanced],
            "processes_without_balancing": [
                {"lengths": s.lengths, "microbatches": s.microbatches} for s in step.unbalanced
            ],
            "partial": step.partial,
        }
        for step in rounds
    ]


def simulation_as_dict(rounds: list[SimulatedRound]) -> list[dict[str, Any]]:
    """``--json`` on one process: per optimizer step, the lengths, budget and micro-batches (sample indices within
    the step)."""
    return [
        {
            "lengths": step.lengths[0],
            "budget": step.balanced[0].budget,
            "microbatches": step.balanced[0].microbatches,
            "passes_needed": step.balanced[0].passes_needed,
            "oversize": step.balanced[0].oversize,
            "partial": step.partial,
        }
        for step in rounds
    ]


# --------------------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------------------


def _plan_parser():
    from transformers import HfArgumentParser

    from hf_dynbsz.config import DynamicBatchGRPOConfig

    parser = HfArgumentParser(
        DynamicBatchGRPOConfig,
        prog=f"{_PROG} plan",
        description=(
            "Print the batch-size plan of a GRPO run (per device and global) and check the divisibility rules of "
            "TRL and DeepSpeed. Takes every GRPOConfig / DynamicBatchGRPOConfig option by its config name; "
            "DIFFU_* environment variables override them."
        ),
    )
    group = parser.add_argument_group("planning")
    group.add_argument(
        "--num_processes",
        type=int,
        default=None,
        help="Data-parallel processes (devices) of the run. Default: num_processes of --config_file, else 1.",
    )
    group.add_argument(
        "--config_file",
        default=None,
        help="accelerate config YAML: num_processes, mixed_precision and deepspeed_config.zero_stage are read.",
    )
    group.add_argument(
        "--lengths",
        default=None,
        help="File of sample lengths in tokens (one integer per line, 'PROMPT COMPLETION' per line, or a JSON "
        "list of integers or [prompt, completion] pairs): simulate the micro-batches of one device.",
    )
    group.add_argument(
        "--model_config",
        default=None,
        help="Model directory or config.json: the workload model (FLOPs per token and per attention pair) the "
        "simulation balances micro-batches with, as the trainer does. Default: a generic 7B-class decoder.",
    )
    group.add_argument(
        "--json",
        action="store_true",
        help="Print one JSON document (the plan, and with --lengths each step's budget and micro-batches as "
        "sample indices within the step) instead of the tables.",
    )
    group.add_argument(
        "--held_mib",
        type=float,
        default=None,
        help="With max_memory_per_device_mib: MiB a training process holds before its passes (weights, gradients, "
        "optimizer state, CUDA context). Default: 16 bytes per parameter of --model_config (fp32 weights, gradients "
        "and AdamW moments), ZeRO's shards divided among the processes.",
    )
    group.add_argument(
        "--attn_implementation",
        default=None,
        help="Attention implementation, to resolve packing_layout='auto' (default: model_init_kwargs' "
        "attn_implementation, else sdpa).",
    )
    return parser


def _read_model_config(path: str):
    """The transformers config of a model directory or ``config.json`` file (workload model, layout, images)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise UsageError(f"--model_config {path!r}: not a model directory or config.json file ({error}).") from None


def _num_processes(namespace: argparse.Namespace, launcher: dict[str, Any]) -> int:
    """The world size to plan for: ``--num_processes``, else the accelerate file's (all machines), else 1."""
    if namespace.num_processes is not None:
        value, where = namespace.num_processes, "--num_processes"
    elif launcher.get("num_processes") is not None:
        value, where = launcher["num_processes"], f"num_processes of --config_file {namespace.config_file!r}"
    else:
        return 1
    if parse_int(value, strings=False) is None or value < 1:
        raise UsageError(
            f"{where} must be a positive integer (data-parallel processes over all machines), got "
            f"{value!r}: give the number of devices the run uses, e.g. 8 for one node of 8 GPUs."
        )
    machines = launcher.get("num_machines", 1)
    if namespace.num_processes is None and (not isinstance(machines, int) or machines < 1 or value % machines):
        raise UsageError(
            f"num_processes={value} of --config_file {namespace.config_file!r} is not a multiple of its "
            f"num_machines={machines!r}: accelerate's num_processes counts every process on every "
            "machine (e.g. 2 machines x 8 GPUs = 16)."
        )
    return value


def _check_as_training(namespace: argparse.Namespace, plan) -> None:
    """Build the :class:`~hf_dynbsz.config.DynamicBatchGRPOConfig` training would build from these options, so that
    the planner rejects exactly what training rejects, with training's own messages (one validation, not a copy).

    What depends on the machine rather than on the run is neutralised (precision, DeepSpeed, reporters, evaluation:
    checked by the launcher, not here), and the generation round is the one planned for ``plan.num_processes``
    (this process is one process, the run may be many).
    """
    from hf_dynbsz.config import DynamicBatchGRPOConfig

    def default(f: dataclasses.Field) -> Any:
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default

    # The options the user gave (defaults left to the config, so deprecated fields stay quiet).
    values = {
        f.name: getattr(namespace, f.name)
        for f in dataclasses.fields(DynamicBatchGRPOConfig)
        if f.init and hasattr(namespace, f.name) and getattr(namespace, f.name) != default(f)
    }
    values.update(
        bf16=False,
        fp16=False,
        use_cpu=True,
        deepspeed=None,
        report_to="none",
        do_eval=False,
        eval_strategy="no",
        generation_batch_size=plan.generation_batch_size,
        steps_per_generation=None,
    )
    with warnings.catch_warnings():  # TRL/transformers deprecation notices are training's business, not the plan's
        warnings.simplefilter("ignore", FutureWarning)
        DynamicBatchGRPOConfig(**values)


def _memory_rows(
    namespace: argparse.Namespace,
    model_config,
    attn_implementation: str | None,
    lengths,
    num_processes: int,
    zero_stage: int | None,
    mixed_precision: str | None,
) -> list:
    """With ``max_memory_per_device_mib``: the plan rows answering "what budget fits in N MiB for this model?"
    (:func:`hf_dynbsz.planning.memory.plan_rows`, the trainer's model before any pass is measured)."""
    from hf_dynbsz.planning.cost import GENERIC_DECODER
    from hf_dynbsz.planning.memory import MemoryModel, estimated_held_mib, plan_rows
    from hf_dynbsz.planning.plan import resolve_mixed_precision

    limit = getattr(namespace, "max_memory_per_device_mib", None)
    if limit is None:
        return []
    config = model_config if model_config is not None else GENERIC_DECODER
    # The precision the plan table shows (TRL's default bf16 included): half-precision activations, 2 bytes each.
    half = resolve_mixed_precision(namespace, mixed_precision) in ("bf16", "fp16")
    memory = MemoryModel.from_config(
        config,
        limit,
        activation_bytes=2 if half else 4,
        gradient_checkpointing=bool(getattr(namespace, "gradient_checkpointing", False)),
        tensor_batch_size=namespace.tensor_batch_size,
        attn_implementation=attn_implementation or "sdpa",
    )
    if namespace.held_mib is not None:
        held, source = namespace.held_mib, "--held_mib"
    else:
        held = estimated_held_mib(config, num_processes, zero_stage)
        source = (
            "16 bytes per parameter of "
            + ("--model_config" if model_config is not None else "a generic 7B-class decoder")
            + "; --held_mib to give it"
        )
    if lengths:
        longest = max(total for total, _, _ in lengths)
    else:
        longest = namespace.max_completion_length
    return plan_rows(memory, held, source, longest)


def _planned_layouts(namespace, support: ModelSupport, attn_implementation: str | None):
    """``(layouts, shown)``: the layouts the planned run may use (on its GPUs unless ``--use_cpu``), and the one the
    table shows: None ("auto") unless the attention implementation or an explicit layout decides it."""
    device_type = "cpu" if getattr(namespace, "use_cpu", False) else "cuda"
    layouts, _ = support.layouts(
        namespace.packing_layout, bool(getattr(namespace, "share_prompt_prefix", True)), device_type
    )
    decided = namespace.packing_layout != "auto" or attn_implementation
    return layouts, layouts[0].name if decided else None


def _run_plan(argv: list[str]) -> int:
    parser = _plan_parser()
    namespace = parser.parse_args(argv)  # usage errors exit with status 2

    from hf_dynbsz.planning.env import apply_env_overrides, with_env_sources
    from hf_dynbsz.planning.plan import BatchSizePlan
    from hf_dynbsz.planning.validation import validate_dynamic_batch_fields

    try:
        launcher = read_accelerate_config(namespace.config_file) if namespace.config_file else {}
        num_processes = _num_processes(namespace, launcher)
        zero_stage = launcher.get("zero_stage")
        if zero_stage is None and isinstance(namespace.deepspeed, str) and namespace.deepspeed.endswith(".json"):
            zero_stage = _zero_stage_from_deepspeed_json(namespace.deepspeed)
        for message in apply_env_overrides(namespace):
            print(f"# {message}", file=sys.stderr if namespace.json else sys.stdout)
        validate_dynamic_batch_fields(namespace)
        attn_implementation = _attn_implementation(namespace)
        model_config = _read_model_config(namespace.model_config) if namespace.model_config else None
        support = ModelSupport.of(model_config, attn_implementation=attn_implementation or "sdpa")
        layouts, shown_layout = _planned_layouts(namespace, support, attn_implementation)
        lengths = read_lengths(namespace.lengths) if namespace.lengths else None
        memory_rows = _memory_rows(
            namespace,
            model_config,
            attn_implementation,
            lengths,
            num_processes,
            zero_stage,
            launcher.get("mixed_precision"),
        )
        try:
            plan = BatchSizePlan.from_args(
                namespace,
                num_processes=num_processes,
                zero_stage=zero_stage,
                mixed_precision=launcher.get("mixed_precision"),
                layout=shown_layout,
                vision_language=support.vision_language,
                router_aux=support.router_aux_mode(
                    router_aux_loss_coef(model_config, getattr(namespace, "router_aux_loss_coef", None))
                ),
                memory_rows=memory_rows,
            )
        except ValueError as error:  # name the DIFFU_* variables behind the values, as training does
            raise with_env_sources(error, namespace) from None
        _check_as_training(namespace, plan)
        steps = None
        if lengths is not None:
            namespace.pad_to_multiple_of = plan.pad_to_multiple_of  # "auto" and strings resolved as TRL does
            scheduler = Scheduler.from_args(namespace, support, layout=layouts[0])
            steps = simulate(plan, scheduler, lengths)
        if namespace.json:
            document = {"plan": plan.as_dict(), "env_overrides": dict(plan.env_sources)}
            if plan.memory_rows:
                document["memory"] = {name: value for name, value, _ in plan.memory_rows}
            if steps is not None:
                document["layout"] = scheduler.layout
                multi = plan.num_processes > 1
                document["steps"] = processes_as_dict(steps) if multi else simulation_as_dict(steps)
            print(json.dumps(document, indent=1))
            return 0
        print(plan.render())
        if steps is not None and plan.num_processes > 1:
            print()
            print(render_processes(plan, scheduler, steps))
        elif steps is not None:
            layout_note = ""
            if namespace.packing_layout == "auto":
                layout_note = f" (packing_layout auto, attn_implementation {attn_implementation or 'sdpa (default)'})"
            print()
            print(render_simulation(plan, scheduler, steps, totals_only=lengths[0][1] is None, layout_note=layout_note))
    except ValueError as error:  # includes UsageError and partition's OversizeSequenceError
        print(f"{_PROG} plan: error: {error}", file=sys.stderr)
        return _EXIT_USAGE
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-dynbsz`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(
        prog=_PROG,
        description="Token-budget micro-batching for TRL's GRPOTrainer.",
        epilog=f"Run '{_PROG} plan --help' or '{_PROG} report --help' for a command's options.",
    )
    top.add_argument(
        "command",
        choices=["plan", "report"],
        help="plan: print the batch-size plan of a GRPO run; report: compare runs' dynbsz/ metrics",
    )
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in ("plan", "report"):
        top.parse_args(argv[:1])  # prints help (exit 0) or a usage error (exit 2)
        return _EXIT_USAGE
    if argv[0] == "report":
        from hf_dynbsz.report import main as report

        return report(argv[1:])
    return _run_plan(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

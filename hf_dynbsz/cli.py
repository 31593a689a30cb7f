"""``hf-dynbsz``: command-line tools.

``hf-dynbsz plan [GRPOConfig options] [--num_processes N] [--config_file ACCELERATE_YAML] [--lengths FILE]``
prints the batch-size plan (:class:`~hf_dynbsz.plan.BatchSizePlan`) of a training command: every
``GRPOConfig``/``DynamicBatchGRPOConfig`` option is accepted by its config name (``--output_dir`` is not
required), ``DIFFU_*`` environment variables are honoured. With ``--lengths`` it also simulates the token-budget
micro-batches of a list of sample lengths and compares them with stock TRL's padded micro-batches.

How the world size is handled: the options are parsed into a namespace of the user's *raw* values (no
``GRPOConfig.__post_init__``, which would derive ``generation_batch_size`` for the world size of this machine and
check that bf16 is supported here). ``BatchSizePlan.from_args`` then derives the generation round exactly like
TRL does, for ``--num_processes`` processes.

Invalid settings exit with status 2 and the validation message on stderr (no traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "read_accelerate_config", "read_lengths"]

_PROG = "hf-dynbsz"
_EXIT_USAGE = 2


class UsageError(ValueError):
    """A problem with the user's input (file, setting): reported on stderr with exit status 2."""


# --------------------------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------------------------


def read_accelerate_config(path: str) -> dict[str, Any]:
    """``num_processes``, ``mixed_precision`` and the DeepSpeed ``zero_stage`` of an ``accelerate`` YAML file.

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
    if data.get("num_processes") is not None:
        result["num_processes"] = data["num_processes"]
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


def read_lengths(path: str) -> list[tuple[int, int | None]]:
    """Sample lengths in tokens from ``path``, as ``(total, prompt)`` pairs (``prompt`` None when not given).

    Accepted formats: one integer per line (prompt + completion tokens; blank lines and ``#`` comments skipped),
    or lines ``PROMPT COMPLETION``; or a JSON list of integers, or of ``[prompt, completion]`` pairs. With
    separate prompt and completion lengths the automatic budget and stock TRL's padding are exact (TRL pads
    prompts and completions separately); with totals only they use the longest total.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as error:
        raise UsageError(f"cannot read --lengths {path!r}: {error.strerror or error}") from None

    def as_length(value: Any, where: str) -> int:
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UsageError(
                f"--lengths {path!r}: {where}: expected a non-negative integer number of tokens, got {value!r}."
            )
        return value

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

    lengths: list[tuple[int, int | None]] = []
    for item, where in entries:
        if isinstance(item, list | tuple):
            if len(item) != 2:
                raise UsageError(f"--lengths {path!r}: {where}: expected PROMPT COMPLETION, got {item!r}.")
            prompt, completion = as_length(item[0], where), as_length(item[1], where)
            lengths.append((prompt + completion, prompt))
        else:
            lengths.append((as_length(item, where), None))
        if lengths[-1][0] < 1:
            raise UsageError(f"--lengths {path!r}: {where}: a sample has at least 1 token, got {lengths[-1][0]}.")
    if not lengths:
        raise UsageError(f"--lengths {path!r} holds no lengths.")
    if len({prompt is None for _, prompt in lengths}) > 1:
        raise UsageError(f"--lengths {path!r}: mix of totals and PROMPT COMPLETION pairs; use one format.")
    return lengths


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


def _round_up(value: int, multiple: int | None) -> int:
    if not multiple:
        return value
    return -(-value // multiple) * multiple


def _stock_row_tokens(group: list[tuple[int, int | None]], pad_to_multiple_of: int | None) -> int:
    """Length of one row of stock TRL's padded batch: longest prompt + longest completion, each rounded up."""
    if group[0][1] is None:
        return _round_up(max(total for total, _ in group), pad_to_multiple_of)
    longest_prompt = max(prompt for _, prompt in group)
    longest_completion = max(total - prompt for total, prompt in group)
    return _round_up(longest_prompt, pad_to_multiple_of) + _round_up(longest_completion, pad_to_multiple_of)


def simulate_lengths(
    plan, lengths: list[tuple[int, int | None]], layout: str, attention: str = "varlen", layout_note: str = ""
) -> str:
    """Per optimizer step: micro-batches of the token-budget partition versus stock TRL's padded micro-batches.

    ``lengths`` are one device's samples in training order; they are grouped into optimizer steps of
    ``per_device_train_batch_size x gradient_accumulation_steps`` samples (the last group may be partial). Stock
    TRL cuts a step into micro-batches of ``per_device_train_batch_size`` samples, every row padded to the
    longest row of the step's batch (TRL pads to the whole generation batch; equal to the optimizer step's when
    ``steps_per_generation == gradient_accumulation_steps``). With ``max_tokens_per_microbatch`` unset the budget
    is the automatic one, per step: ``per_device_train_batch_size x`` that padded row length. ``attention``
    ("varlen" or "dense") is the cost model the partitioner balances for padding-free rows.
    """
    from .partition import microbatch_tokens, partition_by_token_budget, token_lower_bound

    partition_layout = "packed" if layout == "padding_free" else "padded"
    pad = plan.pad_to_multiple_of
    step_size = plan.per_device_samples_per_optimizer_step
    header = (
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
    rows: list[tuple[str, ...]] = []
    oversize = 0
    totals = {"samples": 0, "real": 0, "capacity": 0, "count": 0, "bound": 0, "dynamic": 0, "stock": 0}
    for step, start in enumerate(range(0, len(lengths), step_size), start=1):
        group = lengths[start : start + step_size]
        totals_only = [total for total, _ in group]
        row_tokens = _stock_row_tokens(group, pad)
        budget = plan.max_tokens_per_microbatch or plan.per_device_train_batch_size * row_tokens
        microbatches = partition_by_token_budget(
            totals_only,
            budget,
            layout=partition_layout,
            pad_to_multiple_of=pad,
            attention=attention,
            oversize_policy=plan.oversize_policy,
        )
        oversize += sum(1 for total in totals_only if total > budget)
        count = len(microbatches)
        bound = token_lower_bound(totals_only, budget)
        dynamic_tokens = sum(
            microbatch_tokens([totals_only[i] for i in microbatch], partition_layout, pad)
            for microbatch in microbatches
        )
        stock_tokens = len(group) * row_tokens
        real = sum(totals_only)
        capacity = count * budget
        rows.append(
            (
                str(step) + ("*" if len(group) < step_size else ""),
                str(len(group)),
                str(real),
                str(budget),
                str(count),
                str(bound),
                f"{real / capacity:.1%}" if capacity else "-",
                str(dynamic_tokens),
                str(stock_tokens),
                f"{1 - dynamic_tokens / stock_tokens:.1%}" if stock_tokens else "-",
            )
        )
        for key, value in (
            ("samples", len(group)),
            ("real", real),
            ("capacity", capacity),
            ("count", count),
            ("bound", bound),
            ("dynamic", dynamic_tokens),
            ("stock", stock_tokens),
        ):
            totals[key] += value
    rows.append(
        (
            "total",
            str(totals["samples"]),
            str(totals["real"]),
            "-",
            str(totals["count"]),
            str(totals["bound"]),
            f"{totals['real'] / totals['capacity']:.1%}" if totals["capacity"] else "-",
            str(totals["dynamic"]),
            str(totals["stock"]),
            f"{1 - totals['dynamic'] / totals['stock']:.1%}" if totals["stock"] else "-",
        )
    )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))

    if plan.max_tokens_per_microbatch:
        budget_text = f"{plan.max_tokens_per_microbatch} tokens"
    elif lengths[0][1] is None:
        budget_text = (
            f"auto = {plan.per_device_train_batch_size} x longest sample of the step (totals only: give PROMPT "
            "COMPLETION pairs for the exact rule, longest prompt + longest completion)"
        )
    else:
        budget_text = f"auto = {plan.per_device_train_batch_size} x (longest prompt + longest completion) of the step"
    notes = [
        f"Simulated {len(lengths)} samples of one device, {step_size} per optimizer step "
        f"(per_device_train_batch_size {plan.per_device_train_batch_size} x gradient_accumulation_steps "
        f"{plan.gradient_accumulation_steps}); budget: {budget_text}; layout: {layout}{layout_note}; "
        f"pad_to_multiple_of: {pad or 'none'}.",
        "lower bound = fewest micro-batches the step's tokens allow; utilisation = real tokens / (micro-batches x "
        "budget); computed tokens = tokens the micro-batches compute (padding included); stock tokens = stock "
        "TRL's micro-batches of per_device_train_batch_size samples padded to the step's longest row.",
    ]
    notes = [textwrap.fill(note, width=110, break_on_hyphens=False) for note in notes]
    if any(len(lengths[start : start + step_size]) < step_size for start in range(0, len(lengths), step_size)):
        notes.append("* partial optimizer step (fewer samples than a full step).")
    if oversize:
        notes.append(
            f"warning: {oversize} sequence(s) longer than the budget got a micro-batch of their own "
            "(oversize_policy='warn')."
        )
    return "\n".join([*notes, "", line(header), line(["-" * w for w in widths]), *(line(row) for row in rows)])


# --------------------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------------------


def _plan_parser():
    from transformers import HfArgumentParser

    from .config import DynamicBatchGRPOConfig

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
        "--attn_implementation",
        default=None,
        help="Attention implementation, to resolve packing_layout='auto' (default: model_init_kwargs' "
        "attn_implementation, else sdpa).",
    )
    return parser


def _run_plan(argv: list[str]) -> int:
    parser = _plan_parser()
    namespace = parser.parse_args(argv)  # usage errors exit with status 2

    from .env import apply_env_overrides
    from .plan import BatchSizePlan, resolve_packing_layout, validate_dynamic_batch_fields

    try:
        launcher = read_accelerate_config(namespace.config_file) if namespace.config_file else {}
        num_processes = namespace.num_processes or launcher.get("num_processes") or 1
        zero_stage = launcher.get("zero_stage")
        if zero_stage is None and isinstance(namespace.deepspeed, str) and namespace.deepspeed.endswith(".json"):
            zero_stage = _zero_stage_from_deepspeed_json(namespace.deepspeed)
        for message in apply_env_overrides(namespace):
            print(f"# {message}")
        validate_dynamic_batch_fields(namespace)
        attn_implementation = _attn_implementation(namespace)
        layout = (
            resolve_packing_layout(namespace.packing_layout, attn_implementation or "sdpa")
            if namespace.packing_layout != "auto" or attn_implementation
            else None
        )
        plan = BatchSizePlan.from_args(
            namespace,
            num_processes=num_processes,
            zero_stage=zero_stage,
            mixed_precision=launcher.get("mixed_precision"),
            layout=layout,
        )
        lengths = read_lengths(namespace.lengths) if namespace.lengths else None
        print(plan.render())
        if lengths is not None:
            concrete = layout or resolve_packing_layout(namespace.packing_layout, attn_implementation or "sdpa")
            varlen = resolve_packing_layout("auto", attn_implementation) == "padding_free"
            layout_note = ""
            if namespace.packing_layout == "auto":
                layout_note = f" (packing_layout auto, attn_implementation {attn_implementation or 'sdpa (default)'})"
            print()
            print(
                simulate_lengths(
                    plan, lengths, concrete, attention="varlen" if varlen else "dense", layout_note=layout_note
                )
            )
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
        epilog=f"Run '{_PROG} plan --help' for the options of plan.",
    )
    top.add_argument("command", choices=["plan"], help="plan: print the batch-size plan of a GRPO run")
    if not argv or argv[0] in ("-h", "--help") or argv[0] != "plan":
        top.parse_args(argv[:1])  # prints help (exit 0) or a usage error (exit 2)
        return _EXIT_USAGE
    return _run_plan(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

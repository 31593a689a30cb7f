"""``hf-dynbsz``: command-line tools (``plan`` here; ``report`` in :mod:`hf_dynbsz.report`).

``hf-dynbsz plan [--trainer grpo|distillation|dpo] [config options] [--num_processes N] [--config_file ACCELERATE_YAML]
[--lengths FILE]`` prints the batch-size plan (:class:`~hf_dynbsz.planning.plan.BatchSizePlan`) of a training command:
every option of the trainer's config (``GRPOConfig``/``DynamicBatchGRPOConfig``, ``DistillationConfig``/
``DynamicBatchDistillationConfig`` with ``--trainer distillation``, ``DPOConfig``/``DynamicBatchDPOConfig`` with
``--trainer dpo``) is accepted by its config name (``--output_dir``
is not required), ``DIFFU_*`` environment variables are honoured. With ``--lengths`` it also simulates the token-budget
micro-batches of a list of sample lengths and compares them with stock TRL's padded micro-batches.

How the world size is handled: the options are parsed into a namespace of the user's *raw* values (no
``GRPOConfig.__post_init__``, which would derive ``generation_batch_size`` for the world size of this machine and
check that bf16 is supported here). ``BatchSizePlan.from_args`` then derives the generation round exactly like
TRL does, for ``--num_processes`` processes, and :func:`~hf_dynbsz.config.check_as_training` builds the config
training would build (with that generation round, and what belongs to this machine neutralised), so that every
other check is training's own. The simulation of ``--lengths`` and its tables are planning
(:mod:`hf_dynbsz.planning.simulation`, :mod:`hf_dynbsz.planning.simulation_table`).

Invalid settings exit with status 2 and the validation message on stderr (no traceback).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Sequence
from typing import Any

from hf_dynbsz.planning.coerce import parse_int
from hf_dynbsz.planning.model_support import ModelSupport, router_aux_loss_coef
from hf_dynbsz.planning.schedule import Scheduler
from hf_dynbsz.planning.simulation import (
    processes_as_dict,
    read_lengths,
    read_pair_lengths,
    simulate,
    simulation_as_dict,
)
from hf_dynbsz.planning.simulation_table import render_processes, render_simulation

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
# Commands
# --------------------------------------------------------------------------------------------------------------


#: The trainers ``hf-dynbsz plan --trainer`` plans, and their configs' names (options are taken by config name).
PLANNED_TRAINERS = {"grpo": "GRPO", "distillation": "Distillation", "dpo": "DPO"}


def _planned_trainer(argv: list[str]) -> str:
    """The ``--trainer`` of ``argv`` (the config class, and so the options, depend on it), "grpo" by default."""
    scan = argparse.ArgumentParser(add_help=False)
    scan.add_argument("--trainer", choices=list(PLANNED_TRAINERS), default="grpo")
    known, _ = scan.parse_known_args(argv)
    return known.trainer


@functools.cache  # one parser per process and trainer: building it reads every config field's help
def _plan_parser(trainer: str = "grpo"):
    from transformers import HfArgumentParser

    from hf_dynbsz import config

    name = PLANNED_TRAINERS[trainer]
    parser = HfArgumentParser(
        getattr(config, f"DynamicBatch{name}Config"),
        prog=f"{_PROG} plan",
        description=(
            f"Print the batch-size plan of a {name} run (per device and global) and check the divisibility rules of "
            f"TRL and DeepSpeed. Takes every {name}Config / DynamicBatch{name}Config option by its config name; "
            "DIFFU_* environment variables override them."
        ),
    )
    _add_planning_arguments(parser.add_argument_group("planning"))
    return parser


def _add_planning_arguments(group) -> None:
    """The planner's own flags (besides the config's fields), in ``group``."""
    group.add_argument(
        "--trainer",
        choices=list(PLANNED_TRAINERS),
        default="grpo",
        help="The trainer of the run: grpo (DynamicBatchGRPOTrainer, also right for DynamicBatchRLOOTrainer's batch "
        "sizes), distillation (DynamicBatchDistillationTrainer: one completion per prompt, generated once per "
        "optimizer step, and the teacher's budget) or dpo (DynamicBatchDPOTrainer: per_device_train_batch_size "
        "preference pairs per micro-batch; --lengths gives PROMPT CHOSEN REJECTED per pair). Default: grpo.",
    )
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
        "list of integers or [prompt, completion] pairs; with --trainer dpo 'PROMPT CHOSEN REJECTED' per pair): "
        "simulate the micro-batches of one device.",
    )
    group.add_argument(
        "--shared_prefix",
        type=int,
        default=0,
        help="With --lengths and share_prompt_prefix tree: every prompt begins with this many tokens in common (a "
        "tool block, few-shot exemplars), computed once per pass for all of them.",
    )
    group.add_argument(
        "--model_config",
        default=None,
        help="Model directory or config.json: the workload model (FLOPs per token and per attention pair) the "
        "simulation balances micro-batches with, as the trainer does. Default: a generic 7B-class decoder.",
    )
    group.add_argument(
        "--teacher_model_config",
        default=None,
        help="With --trainer distillation: the teacher's model directory or config.json; with "
        "max_memory_per_device_mib the memory rows then model the teacher's passes too.",
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
    teacher = getattr(namespace, "teacher_model_config", None)
    memory = MemoryModel.from_config(
        config,
        limit,
        teacher_config=_read_model_config(teacher) if teacher else None,
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
    layouts, _ = support.layouts(namespace.packing_layout, getattr(namespace, "share_prompt_prefix", True), device_type)
    decided = namespace.packing_layout != "auto" or attn_implementation
    return layouts, layouts[0].name if decided else None


def _shared_prefix(namespace, lengths) -> int:
    """``--shared_prefix``, checked against the lengths: a block of tokens shorter than every prompt given."""
    shared = namespace.shared_prefix
    shortest = min((prompt for _, prompt, _ in lengths if prompt is not None), default=None)
    if shared < 0 or (shared and (shortest is None or shortest < shared)):
        raise UsageError(
            f"--shared_prefix must be a number of tokens every prompt begins with, at most the shortest prompt of "
            f"--lengths ({shortest if shortest is not None else 'none given: use PROMPT COMPLETION lines'}), got "
            f"{shared}."
        )
    return shared


def _lengths(namespace: argparse.Namespace):
    """The samples of ``--lengths`` (a DPO run's: two per pair), or None."""
    if not namespace.lengths:
        return None
    return (read_pair_lengths if namespace.trainer == "dpo" else read_lengths)(namespace.lengths)


def _run_plan(argv: list[str]) -> int:
    parser = _plan_parser(_planned_trainer(argv))
    namespace = parser.parse_args(argv)  # usage errors exit with status 2

    from hf_dynbsz.config import check_as_training
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
        lengths = _lengths(namespace)
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
                trainer=namespace.trainer,
            )
        except ValueError as error:  # name the DIFFU_* variables behind the values, as training does
            raise with_env_sources(error, namespace) from None
        check_as_training(namespace, plan.generation_batch_size, namespace.trainer)
        steps = None
        if lengths is not None:
            namespace.pad_to_multiple_of = plan.pad_to_multiple_of  # "auto" and strings resolved as TRL does
            scheduler = Scheduler.from_args(namespace, support, layout=layouts[0])
            steps = simulate(plan, scheduler, lengths, _shared_prefix(namespace, lengths), namespace.trainer == "dpo")
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

"""``hf-dynbsz``: command-line tools (``plan`` here; ``report`` in :mod:`hf_dynbsz.report`).

``hf-dynbsz plan [--trainer grpo|distillation|dpo|async_grpo] [config options] [--num_processes N]
[--config_file ACCELERATE_YAML] [--lengths FILE]`` prints the batch-size plan
(:class:`~hf_dynbsz.planning.plan.BatchSizePlan`) of a training command: every option of the trainer's config
(``GRPOConfig``/``DynamicBatchGRPOConfig``, ``DistillationConfig``/``DynamicBatchDistillationConfig`` with ``--trainer
distillation``, ``DPOConfig``/``DynamicBatchDPOConfig`` with ``--trainer dpo``,
``AsyncGRPOConfig``/``DynamicBatchAsyncGRPOConfig`` with ``--trainer async_grpo``) is accepted by its config name
(``--output_dir`` is not required), ``DIFFU_*`` environment variables are honoured. With ``--lengths`` it also
simulates the token-budget micro-batches of a list of sample lengths and compares them with stock TRL's padded
micro-batches.

How the world size is handled: the options are parsed into a namespace of the user's *raw* values (no
``GRPOConfig.__post_init__``, which would derive ``generation_batch_size`` for the world size of this machine and
check that bf16 is supported here). ``BatchSizePlan.from_args`` then derives the generation round exactly like
TRL does, for ``--num_processes`` processes, and :func:`~hf_dynbsz.configs.build.check_as_training` builds the config
training would build (with that generation round, and what belongs to this machine neutralised), so that every
other check is training's own. The simulation of ``--lengths`` and its tables are planning
(:mod:`hf_dynbsz.planning.simulation`, :mod:`hf_dynbsz.planning.simulation_table`).

Invalid settings exit with status 2 and the validation message on stderr (no traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Sequence
from typing import Any

from hf_dynbsz.plan_inputs import (
    attn_implementation_of,
    checked_shared_prefix,
    planned_num_processes,
    read_accelerate_config,
    read_model_config,
    zero_stage_from_deepspeed_json,
)
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

__all__ = ["main"]

_PROG = "hf-dynbsz"
_EXIT_USAGE = 2


# --------------------------------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------------------------------


#: The trainers ``hf-dynbsz plan --trainer`` plans, and their configs' names (options are taken by config name).
PLANNED_TRAINERS = {
    "grpo": "GRPO", "distillation": "Distillation", "dpo": "DPO", "reward": "Reward", "kto": "KTO",
    "async_grpo": "AsyncGRPO",
}  # fmt: skip


def _planned_trainer(argv: list[str]) -> str:
    """The ``--trainer`` of ``argv`` (the config class, and so the options, depend on it), "grpo" by default."""
    scan = argparse.ArgumentParser(add_help=False)
    scan.add_argument("--trainer", choices=list(PLANNED_TRAINERS), default="grpo")
    known, _ = scan.parse_known_args(argv)
    return known.trainer


@functools.cache  # one parser per process and trainer: building it reads every config field's help
def _plan_parser(trainer: str = "grpo"):
    from transformers import HfArgumentParser

    name = PLANNED_TRAINERS[trainer]
    parser = HfArgumentParser(
        _config_class(trainer),
        prog=f"{_PROG} plan",
        description=(
            f"Print the batch-size plan of a {name} run (per device and global) and check the divisibility rules of "
            f"TRL and DeepSpeed. Takes every {name}Config / DynamicBatch{name}Config option by its config name; "
            "DIFFU_* environment variables override them."
        ),
    )
    _add_planning_arguments(parser.add_argument_group("planning"))
    return parser


def _config_class(trainer: str) -> type:
    """The plugin's config class of ``trainer`` (each imported on first use: the asynchronous trainer's imports TRL's
    experimental package)."""
    from hf_dynbsz import configs

    return getattr(configs, f"DynamicBatch{PLANNED_TRAINERS[trainer]}Config")


def _add_planning_arguments(group) -> None:
    """The planner's own flags (besides the config's fields), in ``group``."""
    group.add_argument(
        "--trainer",
        choices=list(PLANNED_TRAINERS),
        default="grpo",
        help="The trainer of the run: grpo (DynamicBatchGRPOTrainer, also right for DynamicBatchRLOOTrainer's batch "
        "sizes), distillation (DynamicBatchDistillationTrainer: one completion per prompt, generated once per "
        "optimizer step, and the teacher's budget), dpo (DynamicBatchDPOTrainer: per_device_train_batch_size "
        "preference pairs per micro-batch; --lengths gives PROMPT CHOSEN REJECTED per pair), reward "
        "(DynamicBatchRewardTrainer: the same pairs, no reference), kto (DynamicBatchKTOTrainer: "
        "per_device_train_batch_size unpaired samples per micro-batch, the KL sequences' and the reference's no-grad "
        "budget; --lengths gives PROMPT COMPLETION per sample) or async_grpo "
        "(DynamicBatchAsyncGRPOTrainer: a vLLM server generates continuously; an optimizer step takes "
        "per_device_train_batch_size x gradient_accumulation_steps x processes samples of its queue, token_budget the "
        "tokens per pass). Default: grpo.",
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
        teacher_config=read_model_config(teacher) if teacher else None,
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


@dataclasses.dataclass
class _Planned:
    """What ``hf-dynbsz plan`` prints: the plan, and with ``--lengths`` the scheduler and each simulated step."""

    plan: Any
    scheduler: Scheduler | None
    steps: list | None
    totals_only: bool  # lengths without prompt/completion parts: the simulation shows totals only
    layout_note: str


def _run_plan(argv: list[str]) -> int:
    namespace = _plan_parser(_planned_trainer(argv)).parse_args(argv)  # usage errors exit with status 2
    try:
        planned = _plan(namespace)
    except ValueError as error:  # includes UsageError and partition's OversizeSequenceError
        print(f"{_PROG} plan: error: {error}", file=sys.stderr)
        return _EXIT_USAGE
    print(_as_json(planned) if namespace.json else _as_tables(planned))
    return 0


def _lengths(namespace: argparse.Namespace):
    """The samples of ``--lengths`` (a DPO run's: two per pair), or None."""
    if not namespace.lengths:
        return None
    return (read_pair_lengths if namespace.trainer in ("dpo", "reward") else read_lengths)(namespace.lengths)


def _check_settings(namespace) -> None:
    """The ``DIFFU_*`` overrides applied (each printed), stock's ``token_budget`` taken as the asynchronous trainer's
    training budget, the plugin's fields checked, as training does."""
    from hf_dynbsz.planning.env import apply_env_overrides
    from hf_dynbsz.planning.validation import validate_dynamic_batch_fields

    for message in apply_env_overrides(namespace):
        print(f"# {message}", file=sys.stderr if namespace.json else sys.stdout)
    if namespace.trainer == "async_grpo":
        from hf_dynbsz.configs.async_grpo import take_token_budget

        take_token_budget(namespace)
    validate_dynamic_batch_fields(namespace)


def _plan(namespace: argparse.Namespace) -> _Planned:
    """The plan of ``namespace`` (the user's raw values), checked as training checks it, and the simulated steps."""
    from hf_dynbsz.configs.build import check_as_training
    from hf_dynbsz.planning.env import with_env_sources
    from hf_dynbsz.planning.plan import BatchSizePlan

    launcher = read_accelerate_config(namespace.config_file) if namespace.config_file else {}
    num_processes = planned_num_processes(namespace, launcher)
    zero_stage = launcher.get("zero_stage")
    if zero_stage is None and isinstance(namespace.deepspeed, str) and namespace.deepspeed.endswith(".json"):
        zero_stage = zero_stage_from_deepspeed_json(namespace.deepspeed)
    _check_settings(namespace)
    attn_implementation = attn_implementation_of(namespace)
    model_config = read_model_config(namespace.model_config) if namespace.model_config else None
    support = ModelSupport.of(model_config, attn_implementation=attn_implementation or "sdpa")
    layouts, shown_layout = _planned_layouts(namespace, support, attn_implementation)
    lengths = _lengths(namespace)
    mixed_precision = launcher.get("mixed_precision")
    memory_rows = _memory_rows(
        namespace, model_config, attn_implementation, lengths, num_processes, zero_stage, mixed_precision
    )
    router_aux_coef = router_aux_loss_coef(model_config, getattr(namespace, "router_aux_loss_coef", None))
    try:
        plan = BatchSizePlan.from_args(
            namespace,
            num_processes=num_processes,
            zero_stage=zero_stage,
            mixed_precision=mixed_precision,
            layout=shown_layout,
            vision_language=support.vision_language,
            router_aux=support.router_aux_mode(router_aux_coef),
            memory_rows=memory_rows,
            trainer=namespace.trainer,
        )
    except ValueError as error:  # name the DIFFU_* variables behind the values, as training does
        raise with_env_sources(error, namespace) from None
    check_as_training(namespace, plan.generation_batch_size, namespace.trainer, _config_class(namespace.trainer))
    planned = _Planned(plan, None, None, False, "")
    if lengths is not None:
        namespace.pad_to_multiple_of = plan.pad_to_multiple_of  # "auto" and strings resolved as TRL does
        planned.scheduler = Scheduler.from_args(namespace, support, layout=layouts[0])
        shared = checked_shared_prefix(namespace, lengths)
        planned.steps = simulate(plan, planned.scheduler, lengths, shared, pairs=namespace.trainer in ("dpo", "reward"))
        planned.totals_only = lengths[0][1] is None
        if namespace.packing_layout == "auto":
            implementation = attn_implementation or "sdpa (default)"
            planned.layout_note = f" (packing_layout auto, attn_implementation {implementation})"
    return planned


def _as_json(planned: _Planned) -> str:
    """One JSON document: the plan, the environment's overrides, the memory rows, each simulated step."""
    plan = planned.plan
    document = {"plan": plan.as_dict(), "env_overrides": dict(plan.env_sources)}
    if plan.memory_rows:
        document["memory"] = {name: value for name, value, _ in plan.memory_rows}
    if planned.steps is not None:
        document["layout"] = planned.scheduler.layout
        multi = plan.num_processes > 1
        document["steps"] = processes_as_dict(planned.steps) if multi else simulation_as_dict(planned.steps)
    return json.dumps(document, indent=1)


def _as_tables(planned: _Planned) -> str:
    """The plan table, and the simulation's tables (one process's, or every process's)."""
    plan, scheduler, steps = planned.plan, planned.scheduler, planned.steps
    if steps is None:
        return plan.render()
    if plan.num_processes > 1:
        return f"{plan.render()}\n\n{render_processes(plan, scheduler, steps)}"
    simulation = render_simulation(
        plan, scheduler, steps, totals_only=planned.totals_only, layout_note=planned.layout_note
    )
    return f"{plan.render()}\n\n{simulation}"


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

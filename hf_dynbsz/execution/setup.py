"""Start-up of a run (torch layer): what the trainer holds after TRL's constructor, and the plan it logs.

:func:`build_executor` builds the trainer's loss (a :class:`~hf_dynbsz.execution.step_loss.StepLoss`, the class the
trainer names), reads the run's capabilities off the model and settings
(:class:`~hf_dynbsz.planning.capabilities.Capabilities`), refuses a sequence parallelism the run cannot use before
any work, forms its groups, builds the memory model and returns the
:class:`~hf_dynbsz.execution.executor.PassExecutor`.
:func:`log_batch_size_plan` writes the start-up plan table (:mod:`hf_dynbsz.planning.plan`) from the main process.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from accelerate.utils import DistributedType

from hf_dynbsz.execution.attention import device_facts
from hf_dynbsz.execution.device_memory import MAPPED_BLOCK_BYTES, map_large_blocks, pending_gradient_mib
from hf_dynbsz.execution.executor import PassExecutor
from hf_dynbsz.execution.loss import GRPOLoss
from hf_dynbsz.execution.metrics import StepMeters
from hf_dynbsz.execution.sequence_parallel import NoSequenceParallel, SequenceParallel, sequence_parallel_blocker
from hf_dynbsz.execution.step_loss import StepLoss
from hf_dynbsz.parallel.distributed import ProcessGroup, gathered_calls
from hf_dynbsz.planning.capabilities import Capabilities, support_under
from hf_dynbsz.planning.cost import text_config_of
from hf_dynbsz.planning.memory import (
    INCREMENT_MARGIN,
    RESIDENT_SET_INCREMENT_MARGIN,
    MemoryModel,
    plan_rows,
    teacher_budget_scale,
)
from hf_dynbsz.planning.model_support import ModelSupport, base_model
from hf_dynbsz.planning.plan import BatchSizePlan

logger = logging.getLogger("hf_dynbsz")

__all__ = ["build_executor", "log_batch_size_plan"]


def build_executor(trainer, loss_class: type[StepLoss] = GRPOLoss) -> PassExecutor:
    """The executor of ``trainer`` (a :class:`~hf_dynbsz.trainers.DynamicBatchGRPOTrainer` or
    :class:`~hf_dynbsz.trainers.DynamicBatchRLOOTrainer` after TRL's constructor), with every decision of the run made
    once: its loss (``loss_class`` built from the trainer), capabilities (logged with their reasons), sequence
    parallelism, the memory model, the vision-language policy."""
    loss = loss_class(trainer)
    model, accelerator = base_model(trainer.model), trainer.accelerator
    world = ProcessGroup(accelerator)  # every process (decisions all must agree on)
    device = device_facts(accelerator.device, accelerator.mixed_precision, next(model.parameters()).dtype)
    capabilities = Capabilities.of(
        trainer.args,
        model,
        world,
        aux_loss=getattr(trainer, "aux_loss_enabled", False),  # (a distillation trains no router aux loss)
        external_generation=getattr(trainer, "use_vllm", False)  # (a DPO run generates nothing)
        or getattr(trainer, "use_transformers_continuous_batching", False)
        or hasattr(trainer, "rollout_queue"),  # (an asynchronous trainer: its server generates)
        device_type=device,
        gathered=gathered_calls(accelerator, model),
    )
    teacher = _teacher_model(loss)
    if teacher is not None:  # a distillation: the layouts both models allow, the teacher's budget from its size
        gathered = gathered_calls(accelerator, teacher)
        capabilities = _with_teacher(trainer.args, capabilities, model, teacher, device, gathered)
    for note in capabilities.notes:
        logger.warning("hf_dynbsz: %s.", note)
    parallel = _sequence_parallel(trainer, model, capabilities, loss)
    meters = StepMeters(
        capabilities.support.model_flops,
        accelerator.device,
        str(accelerator.mixed_precision),
        trainer.args.peak_tflops_per_device,
        phases=loss.phases,
    )
    memory = _memory_model(trainer.args, accelerator, model, capabilities.support.attn_implementation, _config(teacher))
    executor = PassExecutor(
        trainer, capabilities=capabilities, parallel=parallel, memory=memory, meters=meters, world=world, loss=loss
    )
    if executor.enabled and executor.media.note:
        logger.warning("hf_dynbsz: %s.", executor.media.note)
    return executor


def _teacher_model(loss: StepLoss):
    """The teacher model under its wrappers (a distillation's loss holds one), or None."""
    teacher = getattr(loss, "teacher", None)
    return None if teacher is None else base_model(teacher.unwrapped)


def _config(model):
    return None if model is None else model.config


def _with_teacher(args, capabilities: Capabilities, model, teacher, device, gathered) -> Capabilities:
    """A distillation pair's capabilities (:meth:`Capabilities.with_teacher`), its scheduler's teacher budget scaled
    by the two models' no-grad memory per token (:func:`~hf_dynbsz.planning.memory.teacher_budget_scale`);
    ``gathered``: :func:`~hf_dynbsz.parallel.distributed.gathered_calls` of the teacher."""
    pair = capabilities.with_teacher(args, support_under(ModelSupport.of(model=teacher), gathered), device)
    scale = teacher_budget_scale(model.config, teacher.config)
    return dataclasses.replace(pair, scheduler=dataclasses.replace(pair.scheduler, teacher_scale=scale))


def _sequence_parallel(trainer, model, capabilities: Capabilities, loss: StepLoss):
    """``sequence_parallel_size`` > 1: check the run allows it (raise before any work), form the groups and plan
    passes between groups (:mod:`hf_dynbsz.execution.sequence_parallel`); size 1: the identity."""
    size = int(getattr(trainer.args, "sequence_parallel_size", 1) or 1)
    if size <= 1:
        return NoSequenceParallel()
    blocker = sequence_parallel_blocker(
        size,
        trainer.accelerator.num_processes,
        layouts=capabilities.layouts if capabilities.enabled else [],
        support=capabilities.support,
        vision_language=capabilities.vision_language,
        router_aux=capabilities.router_aux,
        entropy_bonus=loss.entropy_bonus,
        text_config=text_config_of(model.config),
    )
    if blocker is not None:
        raise ValueError(f"hf_dynbsz: {blocker}.")
    parallel = SequenceParallel.setup(model, size)
    peers = ProcessGroup(trainer.accelerator, parallel.peers)
    capabilities.scheduler = dataclasses.replace(capabilities.scheduler, group=peers)
    return parallel


def _memory_model(args, accelerator, model, attn_implementation, teacher_config=None) -> MemoryModel:
    """The memory model (:mod:`hf_dynbsz.planning.memory`) of a process, with the run's limit (MiB, per device);
    ``teacher_config``: a distillation teacher's, for its passes."""
    limit = args.max_memory_per_device_mib
    if limit is None and args.max_memory_fraction_per_device is not None:
        if accelerator.device.type != "cuda":
            raise ValueError(
                f"max_memory_fraction_per_device={args.max_memory_fraction_per_device} needs a CUDA device, this "
                f"process runs on {accelerator.device}: set max_memory_per_device_mib (MiB per process) instead, or "
                "leave both unset."
            )
        total = torch.cuda.get_device_properties(accelerator.device).total_memory / 2**20
        limit = args.max_memory_fraction_per_device * total
    if limit is not None and map_large_blocks(accelerator.device):
        logger.info(
            "hf_dynbsz: max_memory_per_device_mib on a CPU: blocks of %d KiB or more are mapped on their own "
            "(glibc's M_MMAP_THRESHOLD), so that the resident set the limit bounds is what the tensors hold.",
            MAPPED_BLOCK_BYTES // 1024,
        )
    mixed = str(accelerator.mixed_precision) in ("bf16", "fp16")
    checkpointing = bool(
        getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False)
    )
    return MemoryModel.from_config(
        model.config,
        limit,
        teacher_config=teacher_config,
        increment_margin=INCREMENT_MARGIN if accelerator.device.type == "cuda" else RESIDENT_SET_INCREMENT_MARGIN,
        activation_bytes=2 if mixed else next(model.parameters()).element_size(),
        gradient_checkpointing=checkpointing,
        tensor_batch_size=args.tensor_batch_size,
        attn_implementation=attn_implementation,
    )


def log_batch_size_plan(trainer, executor: PassExecutor) -> None:
    """The start-up plan table, from the main process."""
    accelerator = trainer.accelerator
    if not accelerator.is_main_process:
        return
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    enabled = executor.enabled
    aux_coef = trainer.router_aux_loss_coef if getattr(trainer, "aux_loss_enabled", False) else 0.0
    plan = BatchSizePlan.from_args(
        trainer.args,
        num_processes=accelerator.num_processes,
        zero_stage=plugin.zero_stage if plugin is not None else None,
        mixed_precision=str(accelerator.mixed_precision),
        layout=executor.scheduler.layout if enabled else "stock (dynamic batching off)",
        vision_language=executor.capabilities.vision_language if enabled else None,
        router_aux=executor.capabilities.support.router_aux_mode(aux_coef),
        memory_rows=_memory_rows(trainer, executor),
        trainer=getattr(trainer, "_dynbsz_trainer_name", trainer._dynbsz_algorithm.lower()),
    )
    logger.warning("hf_dynbsz batch-size plan:\n%s", plan.render())


def _memory_rows(trainer, executor: PassExecutor) -> list:
    memory = executor.memory
    if memory.limit_mib is None or not executor.enabled:
        return []
    held = executor.meters.memory.held()  # the gradients are allocated with the first step: counted here
    if trainer.accelerator.distributed_type != DistributedType.DEEPSPEED:
        held += pending_gradient_mib(trainer.model)
    return plan_rows(
        memory,
        held,
        "measured at start (weights, gradients to come, what else the process holds)",
        _longest_sequence(trainer.args),
    )


def _longest_sequence(args) -> int:
    """The longest sequence the plan's memory rows size a budget for: GRPO's and RLOO's ``max_completion_length``, a
    DPO run's ``max_length`` (prompt and response; 4096 where it is unset)."""
    if getattr(args, "max_completion_length", None) is not None:
        return args.max_completion_length
    return getattr(args, "max_length", None) or 4096

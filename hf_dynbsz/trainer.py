"""`DynamicBatchGRPOTrainer`: TRL's GRPOTrainer with token-budget micro-batches and the same math.

An optimizer step consumes exactly stock's samples (stock's ``_prepare_inputs`` still generates, scores,
shuffles and slices them). Instead of one forward/backward per fixed slice, the trainer collects the step's
slices into a :class:`~hf_dynbsz.execution.batch.StepBatch`, asks :mod:`hf_dynbsz.planning.schedule` for its passes (budget,
layout, lockstep), runs them with the packing collator (:mod:`hf_dynbsz.execution.packing`) and the per-sample loss
weights of :mod:`hf_dynbsz.execution.loss`, and logs through :mod:`hf_dynbsz.execution.metrics`. No-grad log-prob passes run by
the same schedule. With ``sequence_parallel_size`` > 1 a group of processes pools its samples and each pass's row is
sharded over the group (:mod:`hf_dynbsz.parallel.sequence_parallel`).

TRL hooks overridden, and why:

* ``training_step``: collect the optimizer step's stock slices; run the scheduled passes on its last call.
* ``_get_per_token_logps_and_entropies``: run no-grad log-prob passes by the schedule (grad calls go to stock).
* ``_generate_single_turn``: generate a device's samples in chunks of ``per_device_generation_batch_size``.

Every other internal name of TRL, transformers or accelerate the trainer touches is listed, with its reason,
in :mod:`hf_dynbsz._trl_compat`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import time
import warnings

import torch
from accelerate.utils import DistributedType
from transformers import TrainerCallback
from trl import GRPOTrainer

from hf_dynbsz._trl_compat import check_trl_version
from hf_dynbsz.config import trainer_config
from hf_dynbsz.execution.attention import ATTENTION_NAME, segment_attention, use_segments
from hf_dynbsz.execution.batch import StepBatch
from hf_dynbsz.execution.device_memory import (
    injected_fault,
    is_out_of_memory,
    pending_gradient_mib,
    release_cached_memory,
)
from hf_dynbsz.execution.loss import EntropyBonus, LossSettings, microbatch_loss, sample_weights
from hf_dynbsz.execution.metrics import StepMeters, StepMetrics
from hf_dynbsz.execution.multimodal import TOKEN_FIELDS, rope_positions, split_media
from hf_dynbsz.execution.packing import SequenceTable, build_microbatch, dummy_microbatch
from hf_dynbsz.execution.router_loss import RouterAuxLoss, captured_router_logits
from hf_dynbsz.execution.self_check import alone_microbatch, run_self_check, tolerance
from hf_dynbsz.execution.tiling import lm_head_tiles
from hf_dynbsz.parallel.distributed import ProcessGroup, destroy_process_group_at_exit
from hf_dynbsz.parallel.sequence_parallel import (
    ULYSSES_ATTENTION_NAME,
    SequenceParallel,
    gather_shards,
    sequence_parallel_blocker,
)
from hf_dynbsz.planning.capabilities import Capabilities
from hf_dynbsz.planning.memory import FailedPass, MemoryModel, OutOfMemoryBudgetError, plan_rows
from hf_dynbsz.planning.model_support import base_model
from hf_dynbsz.planning.partition import text_config_of
from hf_dynbsz.planning.plan import BatchSizePlan, validate_train_dataset_size
from hf_dynbsz.planning.schedule import Scheduler

logger = logging.getLogger("hf_dynbsz")
check_trl_version()

_STOCK_INIT = inspect.signature(GRPOTrainer.__init__)


class DynamicBatchGRPOTrainer(GRPOTrainer):
    """Drop-in replacement for :class:`trl.GRPOTrainer` with token-budget micro-batches.

    Takes exactly stock's constructor arguments. Accepts a :class:`~hf_dynbsz.DynamicBatchGRPOConfig` or a plain
    ``GRPOConfig`` (the new fields then take their defaults and ``DIFFU_*`` environment overrides still apply).
    """

    def __init__(self, *args, **kwargs):
        try:
            bound = _STOCK_INIT.bind(self, *args, **kwargs)
        except TypeError:
            bound = None  # a call stock does not accept: stock's own __init__ raises its TypeError below
        if bound is not None:
            bound.arguments["args"] = trainer_config(bound.arguments.get("args"), bound.arguments["model"])
            if hasattr(bound.arguments.get("train_dataset"), "__len__"):  # a dataset too small trains 0 steps
                validate_train_dataset_size(len(bound.arguments["train_dataset"]), bound.arguments["args"])
            args, kwargs = bound.args[1:], bound.kwargs
        super().__init__(*args, **kwargs)
        self._setup_dynamic_batching()

    __init__.__signature__ = _STOCK_INIT

    def _setup_dynamic_batching(self) -> None:
        model = base_model(self.model)
        self._dynbsz_world = ProcessGroup(self.accelerator)  # every process (decisions all must agree on)
        capabilities = Capabilities.of(
            self.args,
            model,
            self._dynbsz_world,
            aux_loss=self.aux_loss_enabled,
            external_generation=self.use_vllm or self.use_transformers_continuous_batching,
        )
        for note in capabilities.notes:
            logger.warning("hf_dynbsz: %s.", note)
        self._dynbsz_sequence_parallel = self._setup_sequence_parallel(model, capabilities)
        self._dynbsz_enabled = capabilities.enabled
        self._dynbsz_capabilities, self._dynbsz_scheduler = capabilities, capabilities.scheduler
        self._dynbsz_vision = capabilities.vision_language
        if self._dynbsz_enabled and self._dynbsz_vision == "repacked" and self._images_stock_under_zero3:
            logger.warning(
                "hf_dynbsz: image steps run stock GRPOTrainer micro-batches under ZeRO-3 on several "
                "processes: ZeRO-3 gathers the vision tower in every forward that runs it, and repacked "
                "passes differ between processes in how many run it. Text-only steps are repacked."
            )
        self._dynbsz_checked = not self.args.self_check
        self._dynbsz_loss_settings = LossSettings.from_trainer(self)
        self._dynbsz_window: list[dict] = []
        self._dynbsz_meters = StepMeters(
            capabilities.support.model_flops,
            self.accelerator.device,
            str(self.accelerator.mixed_precision),
            self.args.peak_tflops_per_device,
        )
        self._dynbsz_warned: set[str] = set()
        self._setup_memory(model, capabilities)
        self.add_callback(_LogPlanAtTrainBegin(self))
        destroy_process_group_at_exit()  # a script without trainer.end() must exit cleanly (gloo)

    def _setup_sequence_parallel(self, model, capabilities: Capabilities) -> SequenceParallel | None:
        """``sequence_parallel_size`` > 1: check the run allows it (raise before any work), form the groups and plan
        passes between groups (:mod:`hf_dynbsz.parallel.sequence_parallel`)."""
        size = int(getattr(self.args, "sequence_parallel_size", 1) or 1)
        if size <= 1:
            return None
        blocker = sequence_parallel_blocker(
            size,
            self.accelerator.num_processes,
            layouts=capabilities.layouts if capabilities.enabled else [],
            support=capabilities.support,
            vision_language=capabilities.vision_language,
            router_aux=capabilities.router_aux,
            entropy_bonus=bool(self._entropy_bonus_enabled),
            text_config=text_config_of(model.config),
        )
        if blocker is not None:
            raise ValueError(f"hf_dynbsz: {blocker}.")
        parallel = SequenceParallel.setup(model, size)
        capabilities.scheduler = dataclasses.replace(
            capabilities.scheduler, group=ProcessGroup(self.accelerator, parallel.peers)
        )
        return parallel

    def _setup_memory(self, model, capabilities: Capabilities) -> None:
        """The memory model (:mod:`hf_dynbsz.planning.memory`) and whether an out-of-memory pass is recovered here."""
        args, accelerator = self.args, self.accelerator
        limit = args.max_memory_per_device_mib
        if limit is None and args.max_memory_fraction_per_device is not None:
            if accelerator.device.type != "cuda":
                raise ValueError(
                    f"max_memory_fraction_per_device={args.max_memory_fraction_per_device} needs a CUDA "
                    f"device, this process runs on {accelerator.device}: set max_memory_per_device_mib "
                    "(MiB per process) instead, or leave both unset."
                )
            total = torch.cuda.get_device_properties(accelerator.device).total_memory / 2**20
            limit = args.max_memory_fraction_per_device * total
        mixed = str(accelerator.mixed_precision) in ("bf16", "fp16")
        checkpointing = bool(
            getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False)
        )
        self._dynbsz_memory = MemoryModel.from_config(
            model.config,
            limit,
            activation_bytes=2 if mixed else next(model.parameters()).element_size(),
            gradient_checkpointing=checkpointing,
            tensor_batch_size=args.tensor_batch_size,
            attn_implementation=capabilities.support.attn_implementation,
        )
        # Recovery re-plans a step on every process: DDP needs its gradients synchronised apart (after every process
        # agreed that none failed), DeepSpeed's engine keeps accumulated gradients where they cannot be discarded.
        self._dynbsz_recover = (
            accelerator.distributed_type != DistributedType.DEEPSPEED
            and (accelerator.num_processes == 1 or limit is not None)
            and self._dynbsz_sequence_parallel is None
        )
        self._dynbsz_failures_alone = 0

    # ------------------------------------------------------------------ TRL hooks
    def training_step(self, model, inputs, num_items_in_batch):
        # Override: collect the optimizer step's stock slices; run the scheduled passes on its last call.
        if not self._dynbsz_enabled:
            with self._tiles():
                return super().training_step(model, inputs, num_items_in_batch)
        time_before = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        if not self._dynbsz_window:
            self._dynbsz_meters.start()
        with self._dynbsz_meters.clock.phase("generation"):  # TRL's rollout (generation every steps_per_generation)
            self._dynbsz_window.append(self._prepare_inputs(inputs))
        loss = torch.zeros((), device=self.accelerator.device)
        if self.accelerator.sync_gradients:
            window, self._dynbsz_window = self._dynbsz_window, []
            stock, batch = self._media_not_repacked(*window), None
            if not stock:
                batch = StepBatch.from_slices(window, self.accelerator.process_index, self.accelerator.num_processes)
                stock = not self._self_check(model, batch.table)
            loss = self._train_step_stock(model, window) if stock else self._train_step(model, batch)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - time_before
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        pixel_values=None,
        image_grid_thw=None,
        num_images=None,
        pixel_attention_mask=None,
        spatial_shapes=None,
        num_tiles=None,
        image_sizes=None,
        token_type_ids=None,
        mm_token_type_ids=None,
        image_position_ids=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        # Override: run the no-grad log-prob passes (old policy, reference) by the schedule.
        media = dict(
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            num_images=num_images,
            pixel_attention_mask=pixel_attention_mask,
            spatial_shapes=spatial_shapes,
            num_tiles=num_tiles,
            image_sizes=image_sizes,
            image_position_ids=image_position_ids,
        )
        token_fields = {
            name: value
            for name, value in (("token_type_ids", token_type_ids), ("mm_token_type_ids", mm_token_type_ids))
            if value is not None
        }
        stock = (
            not self._dynbsz_enabled
            or torch.is_grad_enabled()
            or compute_aux_loss
            or self._media_not_repacked({**media, **token_fields})
        )  # (the last: the same on every process)
        if not stock:
            prompt_width = input_ids.size(1) - logits_to_keep
            table = SequenceTable.from_padded(
                input_ids[:, :prompt_width],
                attention_mask[:, :prompt_width],
                input_ids[:, prompt_width:],
                attention_mask[:, prompt_width:],
                media=split_media(media, input_ids.size(0)),
                token_fields=token_fields,
            )
            stock = not self._self_check(model, table)
        if stock:
            with self._tiles():
                return super()._get_per_token_logps_and_entropies(
                    model,
                    input_ids,
                    attention_mask,
                    logits_to_keep,
                    batch_size,
                    compute_entropy,
                    compute_aux_loss,
                    **media,
                    **token_fields,
                )
        stock_tokens = (batch_size or input_ids.size(0)) * input_ids.size(1)
        logps, entropies, _ = self._no_grad_passes(model, table, logits_to_keep, compute_entropy, stock_tokens)
        return logps, entropies, None

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # Override: bound generation memory by generating this device's samples in chunks.
        chunk = self.args.per_device_generation_batch_size
        if (
            chunk is None
            or not self.args.dynamic_batching
            or len(prompt_ids) <= chunk
            or self.use_vllm
            or self.use_transformers_continuous_batching
            or images is not None
            or multimodal_fields
        ):
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        completion_ids = []
        for start in range(0, len(prompt_ids), chunk):
            chunk_ids, _ = super()._generate_single_turn(
                prompt_ids[start : start + chunk], None, multimodal_fields, num_generations, has_tool_images
            )
            completion_ids.extend(chunk_ids)
        return completion_ids, None

    # ------------------------------------------------------------------ executing a schedule
    def _train_step(self, model, batch: StepBatch) -> torch.Tensor:
        """The optimizer step's passes: schedule the step's samples, forward/backward each pass, log once."""
        with self._dynbsz_meters.clock.phase("train"):
            device, scheduler = self.accelerator.device, self._dynbsz_scheduler
            ga = self.current_gradient_accumulation_steps
            aux = None
            if self._dynbsz_capabilities.router_aux:  # stock's MoE router aux loss, per sample
                aux = RouterAuxLoss(
                    self.router_aux_loss_coef,
                    *self._dynbsz_capabilities.support.router_aux,
                    len(batch.slice_rows),
                    ga,
                    device,
                )
            if self.top_entropy_quantile < 1.0 or aux is not None:  # one no-grad pass over the step's samples
                _, entropies, counts = self._no_grad_passes(
                    model,
                    batch.table,
                    batch.width,
                    self.top_entropy_quantile < 1.0,
                    batch.stock_microbatch_tokens,
                    router=aux,
                )
                if self.top_entropy_quantile < 1.0:
                    batch.high_entropy = self._high_entropy_mask(batch, entropies)
                if aux is not None:
                    aux.add_counts(batch.slice_ids, counts)
                    aux.agree(self.accelerator)
            batch.policy_weights, batch.entropy_weights = sample_weights(
                self._dynbsz_loss_settings,
                batch.loss_tokens,
                batch.slice_ids,
                batch.slice_rows,
                batch.num_items,
                gradient_accumulation_steps=ga,
                steps_per_generation=self.args.steps_per_generation,
                num_processes=self.accelerator.num_processes,
                entropy_tokens=batch.bonus_mask.sum(dim=1).cpu(),
            )
            if self._sharded:  # the group's samples, each with its stock weights: every process of it runs them all
                batch = self._dynbsz_sequence_parallel.pool_batch(batch)
            own = batch
            while True:  # once, or again with a smaller budget after a pass ran out of memory
                self._allocate_gradients(model)
                budget = self._budget(model, own.table, own.stock_microbatch_tokens, "training")
                schedule = self._plan(own.table, budget, "training")
                self._warn_oversize(schedule, "training")
                # cross-rank balancing: run the samples this process was given
                batch = (
                    own
                    if schedule.exchange is None
                    else scheduler.group.move_batch(own, schedule.exchange, self._moves_media)
                )
                bonus = EntropyBonus(self, len(batch.slice_rows), device) if self._entropy_bonus_enabled else None
                metrics, losses = StepMetrics(), []
                if aux is not None:
                    aux.probabilities.zero_()

                def run_pass(group, last, batch=batch, bonus=bonus, metrics=metrics, losses=losses, schedule=schedule):
                    mb = self._microbatch(batch.table, group, schedule.groups)
                    logps, entropies, router_logits = self._forward(
                        model, mb, True, router=aux is not None, sharded=self._sharded
                    )
                    rows = batch.rows(group, logps.size(1))
                    loss, loss_metrics = microbatch_loss(self._dynbsz_loss_settings, logps, entropies, rows, bonus)
                    if aux is not None:
                        loss = loss + aux.term(router_logits, mb.token_rows, rows.slice_ids)
                    self._backward(model, loss, last)
                    losses.append(loss.detach())
                    metrics.add_pass(mb.real_tokens, mb.computed_tokens, loss_metrics, entropies.detach(), rows.mask)

                with self.compute_loss_context_manager(), self._tiles(), self._segments(model, sharded=self._sharded):
                    failure = self._run_passes(model, schedule, "training", run_pass)
                if failure is None:
                    break
                self._recover(model, failure)
            total_loss = torch.stack(losses).sum() if losses else torch.zeros((), device=device)
            replicas = self._dynbsz_sequence_parallel.size if self._sharded else 1
            total_loss = total_loss / replicas  # a group's processes each hold its whole loss: logged once
            if bonus is not None:
                bonus.finish(self, ga)
            if aux is not None:
                aux.publish(self._metrics["train"], self.accelerator)
        metrics.publish(
            self._metrics["train"],
            self.accelerator,
            loss_type=self.loss_type,
            schedule=schedule,
            stock_computed_tokens=batch.stock_computed_tokens,
            group=scheduler.group,
            meters=self._dynbsz_meters,
            table=batch.table,
            replicas=replicas,
        )
        return total_loss

    @torch.no_grad()
    def _no_grad_passes(
        self,
        model,
        table: SequenceTable,
        width: int,
        compute_entropy: bool,
        stock_tokens: int,
        router: RouterAuxLoss | None = None,
    ):
        """Completion log-probs, entropies (or None) and, for ``router``, the router pass's ``(samples, experts + 1)``
        statistics (expert counts, tokens; or None) of every sample of ``table``, ``(samples, width)``, in table
        order."""
        with self._dynbsz_meters.clock.phase("logprob"):
            scheduler, own = self._dynbsz_scheduler, None
            if self._sharded:  # the group's samples (results: this process's own)
                table, own = self._dynbsz_sequence_parallel.pool_table(table)
            while True:  # once, or again with a smaller budget after a pass ran out of memory
                schedule = self._plan(table, self._budget(model, table, stock_tokens, "logprob"), "logprob")
                self._warn_oversize(schedule, "logprob")
                run = (
                    table
                    if schedule.exchange is None
                    else scheduler.group.move_table(table, schedule.exchange, self._moves_media)
                )
                columns = max([width, *run.completion_lengths.tolist()])
                results = torch.zeros(len(run), 2 if compute_entropy else 1, columns, device=self.accelerator.device)
                statistics = (
                    None
                    if router is None
                    else torch.zeros(len(run), router.width, dtype=torch.float64, device=self.accelerator.device)
                )

                def run_pass(group, last, run=run, results=results, statistics=statistics, schedule=schedule):
                    mb = self._microbatch(run, group, schedule.groups)
                    logps, entropies, router_logits = self._forward(
                        model, mb, compute_entropy, router is not None, sharded=self._sharded
                    )
                    results[group, 0, : logps.size(1)] = logps.float()
                    if compute_entropy:
                        results[group, 1, : entropies.size(1)] = entropies.float()
                    if router is not None:
                        statistics[group] = router.pass_statistics(router_logits, mb.token_rows, len(group))

                with self._tiles(), self._segments(model, sharded=self._sharded):
                    failure = self._run_passes(model, schedule, "logprob", run_pass)
                if failure is None:
                    break
                self._recover(model, failure)
            if schedule.exchange is not None:  # the results go back to the process that owns each sample
                rows = [results[j, :, :c] for j, c in enumerate(run.completion_lengths.tolist())]
                results = scheduler.group.return_rows(rows, schedule.exchange, columns, results.size(1))
                if statistics is not None:
                    statistics = torch.stack(
                        scheduler.group.send_to_owners(
                            list(statistics), schedule.exchange, lambda prompt, completion: router.width
                        )
                    )
            if own is not None:
                results = results[own]
            return results[:, 0, :width], results[:, 1, :width] if compute_entropy else None, statistics

    def _budget(self, model, table: SequenceTable, stock_tokens: int, kind: str) -> int:
        """The token budget of ``kind``'s passes (:meth:`Scheduler.budget`), with a memory limit the largest whose
        predicted peak fits (:meth:`MemoryModel.budget`), agreed by every process."""
        memory, fits = self._dynbsz_memory, None
        if memory.limit_mib is not None:
            fits = memory.budget(kind, self._dynbsz_meters.memory.held(), max(table.lengths.tolist(), default=1))
        return self._dynbsz_scheduler.budget(
            stock_tokens, kind, fits=fits, cap=memory.caps.get(kind), agree=memory.limit_mib is not None
        )

    def _allocate_gradients(self, model) -> None:
        """With a memory limit, the step's gradients exist (as zeros) before it is planned, so that what the process
        holds includes them and every pass starts from the same memory (accumulating into zeros is exact)."""
        if self._dynbsz_memory.limit_mib is None or self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            return
        for parameter in model.parameters():
            if parameter.requires_grad and parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)

    def _run_passes(self, model, schedule, kind: str, run_pass) -> FailedPass | None:
        """Run ``run_pass(group, last)`` for each real pass of ``schedule`` and a dummy pass for each empty one.

        Training passes synchronise gradients on the last, or, where an out-of-memory error is recovered across
        processes, in a dummy pass after every process agreed that none failed. With a memory limit each pass is
        measured and teaches the memory model. Returns None, or the failure (here, or agreed from another process)
        after which the step is re-planned (:meth:`_recover`).
        """
        training, processes = kind == "training", self.accelerator.num_processes
        sync_apart = training and self._dynbsz_recover and processes > 1
        memory, meters, rank = self._dynbsz_memory, self._dynbsz_meters, self.accelerator.process_index
        unwrapped = self.accelerator.unwrap_model(model)
        failure, shapes = None, iter(zip(schedule.pass_tokens, schedule.pass_pairs))
        for position, group in enumerate(schedule.microbatches):
            last = position == schedule.passes - 1 and not sync_apart
            if failure is not None and processes == 1:
                break
            shape = next(shapes) if group else None
            if shape is not None and self._sharded:  # the memory model is per process: each holds 1/size of the row
                shape = tuple(value / self._dynbsz_sequence_parallel.size for value in shape)
            if not group or failure is not None:  # a failed process keeps the others' collectives going
                self._dummy_pass(model, last if training and failure is None else None)
                continue
            held = None
            if memory.limit_mib is not None:
                held = meters.memory.held()
                meters.predicted(memory.peak(kind, *shape, held))
            try:
                with self._no_sync(model, last or not training), injected_fault(unwrapped, kind, rank):
                    run_pass(group, last)
            except Exception as error:  # noqa: BLE001 - only an allocator's out-of-memory error is caught
                if not is_out_of_memory(error):
                    raise
                if not self._dynbsz_recover:
                    error.add_note(self._unrecovered_reason())
                    raise
                longest = max(schedule.lengths[i] for i in group)
                failure = FailedPass(kind, *shape, held, len(group), longest, str(error).splitlines()[0])
                del error
                release_cached_memory(self.accelerator.device)
                continue
            if held is not None:
                memory.measured(kind, *shape, held, meters.memory.pass_peak())
        if self._dynbsz_recover and processes > 1:  # every process learns whether one failed, or gave up
            hopeless = failure is not None and failure.samples == 1 and self._dynbsz_failures_alone >= 1
            agreed = self._dynbsz_scheduler.group.all_reduce_max([2 if hopeless else int(failure is not None)])[0]
            if agreed and failure is None:
                failure = FailedPass(kind, 0, 0, None, 0, 0, "a pass of another process ran out of memory")
            if agreed == 2:
                failure.hopeless = True
        if sync_apart and failure is None:
            self._dummy_pass(model, True)
        if failure is None:
            self._dynbsz_failures_alone = 0
        return failure

    def _unrecovered_reason(self) -> str:
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            why = (
                "under DeepSpeed, whose engine keeps the step's accumulated gradients (and, under ZeRO-3, the other "
                "processes' parameter gathers) where they cannot be discarded: this process stops and the launcher "
                "stops the others"
            )
        else:
            why = (
                "on several processes without max_memory_per_device_mib (recovery needs every process to agree "
                "before gradients synchronise, which a memory limit turns on)"
            )
        return (
            f"hf_dynbsz: this out-of-memory error is not recovered {why}. Set max_memory_per_device_mib so that "
            "budgets are chosen to fit, or lower max_tokens_per_microbatch."
        )

    def _recover(self, model, failure: FailedPass) -> None:
        """After a pass ran out of memory: discard the step's gradients, teach the memory model the failed point,
        and (the caller re-plans the step) or stop when one sequence alone failed again."""
        self._dynbsz_meters.oom_retries += 1
        if failure.kind == "training":
            model.zero_grad(set_to_none=True)  # the step's gradients so far: the step runs again from none
        release_cached_memory(self.accelerator.device)
        memory = self._dynbsz_memory
        if failure.samples:
            memory.record_failure(failure.kind, failure.tokens, failure.pairs, failure.held)
        if failure.samples == 1:
            self._dynbsz_failures_alone += 1
        if failure.hopeless or (self.accelerator.num_processes == 1 and self._dynbsz_failures_alone >= 2):
            raise OutOfMemoryBudgetError(failure.explain(memory))
        logger.warning(
            "hf_dynbsz: %s; the step's passes are re-planned with a smaller budget (%s retry this step).",
            failure.explain(memory),
            self._dynbsz_meters.oom_retries,
        )

    def _plan(self, table: SequenceTable, budget: int, kind: str):
        """The schedule of ``table``'s samples (prompt groups found by prompt ids when prompts may be shared)."""
        groups = table.prompt_groups() if self._dynbsz_scheduler.share_prompts else None
        return self._dynbsz_scheduler.plan(
            table.lengths.tolist(), budget, kind, prompt_lengths=table.prompt_lengths.tolist(), groups=groups
        )

    def _microbatch(self, table: SequenceTable, group: list[int], groups, scheduler: Scheduler | None = None):
        scheduler = scheduler or self._dynbsz_scheduler
        if (
            scheduler.layout == "padding_free"
            and table.positions is None
            and self._dynbsz_capabilities.support.multimodal_rope
        ):  # once per table: each sample's own M-RoPE
            table.positions = rope_positions(
                self.accelerator.unwrap_model(base_model(self.model)), table.tokens, table.token_fields, table.media
            )
        multiple = self.args.pad_to_multiple_of
        if self._sharded:  # a sharded row splits evenly over its group
            multiple = math.lcm(multiple or 1, self._dynbsz_sequence_parallel.size)
        return build_microbatch(
            table,
            group,
            layout=scheduler.layout,
            pad_token_id=self._tokenizer.pad_token_id,
            pad_to_multiple_of=multiple,
            device=self.accelerator.device,
            attention=scheduler.segment_attention,
            groups=groups,
            attention_mask=scheduler.attention_mask,
            position_offset=scheduler.position_offset,
        )

    @property
    def _sharded(self) -> bool:
        """Whether the passes are sharded over sequence-parallel groups (:mod:`hf_dynbsz.parallel.sequence_parallel`)."""
        return self._dynbsz_sequence_parallel is not None

    def _segments(self, model, scheduler: Scheduler | None = None, sharded: bool = False):
        """Segment attention for the passes (forward and backward) when padding-free rows use it; ``sharded``:
        through DeepSpeed Ulysses (each process runs its shard of the row)."""
        enabled = (scheduler or self._dynbsz_scheduler).segment_attention is not None
        return segment_attention(
            self.accelerator.unwrap_model(model), enabled, ULYSSES_ATTENTION_NAME if sharded else ATTENTION_NAME
        )

    def _forward(
        self, model, mb, compute_entropy: bool, router: bool = False, autocast: bool = True, sharded: bool = False
    ):
        """Completion-aligned ``(rows, width)`` log-probs, entropies (or None) and, for ``router``, the router logits
        (per layer; or None) of one micro-batch; under the accelerator's autocast unless ``autocast`` is False.
        ``sharded``: this process runs its shard of the row and the shards' outputs are gathered."""
        use_segments(mb.segments)
        extra = {"output_router_logits": True} if router else {}
        capture = captured_router_logits(self.accelerator.unwrap_model(model)) if router else contextlib.nullcontext()
        precision = self.accelerator.autocast() if autocast else contextlib.nullcontext()
        inputs, labels = mb.model_inputs, mb.shift_labels
        if sharded:
            inputs, labels = self._dynbsz_sequence_parallel.shard(inputs, labels)
        with precision, capture as router_logits:
            outputs = model(**inputs, shift_labels=labels, fused_lm_head=True, **extra)
        log_probs, entropy = outputs.log_probs, outputs.entropy if compute_entropy else None
        if sharded:
            log_probs = gather_shards(log_probs, self._dynbsz_sequence_parallel)
            entropy = gather_shards(entropy, self._dynbsz_sequence_parallel) if compute_entropy else None
        entropies = mb.to_completion_layout(entropy) if compute_entropy else None
        return mb.to_completion_layout(log_probs), entropies, router_logits[-1] if router else None

    def _dummy_pass(self, model, last: bool | None = None) -> None:
        """A one-token pass that keeps this process in lockstep: every parameter takes part, nothing is learned.

        With ``last`` given (a training pass) it also runs a zero backward, synchronising gradients if ``last``.
        """
        scheduler, parallel = self._dynbsz_scheduler, self._dynbsz_sequence_parallel
        mb = dummy_microbatch(
            self._tokenizer.pad_token_id,
            self.accelerator.device,
            scheduler.segment_attention,
            scheduler.attention_mask,
            scheduler.position_offset,
            width=parallel.size if parallel else 2,
        )
        use_segments(mb.segments)
        inputs, labels = (
            (mb.model_inputs, mb.shift_labels) if parallel is None else parallel.shard(mb.model_inputs, mb.shift_labels)
        )
        with self._no_sync(model, last is None or last), self.accelerator.autocast():
            outputs = model(**inputs, shift_labels=labels, fused_lm_head=True)
            if last is not None:
                self._backward(model, outputs.log_probs.sum() * 0.0, last)

    def _no_sync(self, model, last: bool):
        """Around a training pass's forward AND backward (DDP decides in the forward whether the backward
        all-reduces): no gradient synchronisation unless ``last``. DeepSpeed decides at its boundary instead."""
        if last or self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(model)

    def _backward(self, model, loss, last: bool) -> None:
        """One backward of a multi-pass optimizer step (inside :meth:`_no_sync` unless ``last``); gradients sync (and
        DeepSpeed steps) on the last only."""
        is_deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        self.accelerator.gradient_state._set_sync_gradients(last)
        try:
            self.accelerator.backward(loss, **({"scale_wrt_gas": False} if is_deepspeed else {}))
        finally:
            self.accelerator.gradient_state._set_sync_gradients(True)

    def _tiles(self):
        """TRL's fused LM head tiled by ``tensor_batch_size`` (stock's own tile with dynamic_batching off)."""
        return lm_head_tiles(self.args.tensor_batch_size if self.args.dynamic_batching else None)

    def _warn_oversize(self, schedule, kind: str) -> None:
        if schedule.oversize and kind not in self._dynbsz_warned:
            self._dynbsz_warned.add(kind)
            longest = max(schedule.lengths[i] for i in schedule.oversize)
            message = Scheduler.oversize_warning(len(schedule.oversize), longest, schedule.budget, kind)
            memory = self._dynbsz_memory
            if memory.limit_mib is not None:  # the budget came from memory: say what the sequence needs
                message += (
                    f" The budget follows max_memory_per_device_mib={memory.limit_mib:.0f}: a sequence of "
                    f"{longest} tokens alone is predicted to add about "
                    f"{memory.increment(kind, longest, longest * longest):.0f} MiB to what the process holds, "
                    "which may not fit; lower max_completion_length, turn on gradient checkpointing or raise "
                    "the limit."
                )
            warnings.warn(message + " This warning is shown once.", stacklevel=3)

    @torch.no_grad()
    def _self_check(self, model, table: SequenceTable) -> bool:
        """Once per run, before its first pass: keep the fastest layout whose log-probs equal each sample's own
        (:mod:`hf_dynbsz.execution.self_check`); when none does, stock math runs. Returns whether dynamic batching stays on."""
        if self._dynbsz_checked:
            return self._dynbsz_enabled
        self._dynbsz_checked = True
        layouts, group = self._dynbsz_capabilities.layouts, self._dynbsz_scheduler.group
        schedulers = [
            Scheduler.from_args(self.args, self._dynbsz_capabilities.support, group, layout=layout)
            for layout in layouts
        ]

        def run_layout(layout, indices):
            scheduler = schedulers[layouts.index(layout)]
            groups = table.prompt_groups() if scheduler.share_prompts else None
            with self._segments(model, scheduler):
                return self._forward(model, self._microbatch(table, indices, groups, scheduler), False, autocast=False)[
                    0
                ]

        def run_alone(index):
            mb = alone_microbatch(table, index, self._tokenizer.pad_token_id, self.accelerator.device)
            return self._forward(model, mb, False, autocast=False)[0]

        dtype = next(self.accelerator.unwrap_model(model).parameters()).dtype  # the check runs in the weights'
        with self._tiles():
            result = run_self_check(
                layouts,
                table,
                run_layout,
                run_alone,
                tolerance(dtype),
                agree=lambda index: self._dynbsz_world.all_reduce_max([index])[0],
            )
        logger.log(logging.WARNING if result.chosen else logging.INFO, "hf_dynbsz: %s", result.summary(layouts))
        if self._sharded and result.chosen:
            raise RuntimeError(
                f"hf_dynbsz: sequence_parallel_size={self._dynbsz_sequence_parallel.size} shards "
                f"padding-free rows, and the self-check found them not exact for this model "
                f"({result.summary(layouts)}): set sequence_parallel_size=1."
            )
        self._dynbsz_enabled = result.chosen < len(layouts)
        if self._dynbsz_enabled and result.chosen:
            self._dynbsz_scheduler = schedulers[result.chosen]
        return self._dynbsz_enabled

    # ------------------------------------------------------------------ stock features kept exact
    def _high_entropy_mask(self, batch: StepBatch, entropies: torch.Tensor) -> torch.Tensor:
        """``top_entropy_quantile``: stock's per-slice high-entropy mask, from the entropies of one no-grad pass.

        Stock takes the entropy quantile over each fixed slice (gathered across ranks) before its backward, so the
        mask must be known before the first pass: TRL's own ``get_high_entropy_mask`` is applied slice by slice to
        the entropies of a no-grad pass over the step (the same gathers on every rank: one per slice).
        """
        high_entropy = torch.zeros_like(batch.loss_mask)
        slice_ids = batch.slice_ids.to(batch.loss_mask.device)
        for slice_id in batch.slice_rows.nonzero().flatten().tolist():  # this process's slices
            rows = (slice_ids == slice_id).nonzero().flatten()
            selected = self.get_high_entropy_mask(entropies[rows], batch.loss_mask[rows], 1 - self.top_entropy_quantile)
            high_entropy[rows] = selected.to(batch.loss_mask.dtype)
        return high_entropy

    @property
    def _moves_media(self) -> bool:
        """Samples moved between processes carry their image inputs (the same answer on every process)."""
        return self._dynbsz_vision == "repacked"

    def _media_not_repacked(self, *slices: dict) -> bool:
        """Whether ``slices`` carry image inputs (or, for a model not known as vision-language, token-type fields)
        that this run does not repack: those passes run stock's micro-batches. For a vision-language model the answer
        is agreed by every process (one all-reduce): a process taking stock's path while another repacks would split
        their collectives. Image steps of a repacked family run stock's too under ZeRO-3 on several processes
        (:attr:`_images_stock_under_zero3`)."""
        images = any(inputs.get("pixel_values") is not None for inputs in slices)
        if self._dynbsz_vision is None:
            return images or any(inputs.get(name) is not None for inputs in slices for name in TOKEN_FIELDS)
        local = images and (self._dynbsz_vision == "stock" or self._images_stock_under_zero3)
        return bool(self._dynbsz_world.all_reduce_max([int(local)])[0])

    @property
    def _images_stock_under_zero3(self) -> bool:
        """ZeRO-3 gathers the vision tower's parameters in every forward that runs it, so every process must run it
        equally often; repacked passes differ between processes in that (a lockstep pass has no image), so image steps
        keep stock's slices there."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return plugin is not None and plugin.zero_stage == 3 and self.accelerator.num_processes > 1

    def _train_step_stock(self, model, window: list[dict]) -> torch.Tensor:
        """Stock math for a step that cannot be repacked (images of a family not repacked): one pass per stock slice."""
        if "multimodal" not in self._dynbsz_warned:
            self._dynbsz_warned.add("multimodal")
            logger.warning(
                "hf_dynbsz: image inputs of a model family not repacked: its image steps use stock micro-batches."
            )
        total = torch.zeros((), device=self.accelerator.device)
        for position, inputs in enumerate(window):
            with self._no_sync(model, position == len(window) - 1):
                with self.compute_loss_context_manager(), self._tiles():
                    loss = self.compute_loss(model, inputs)
                self._backward(model, loss, position == len(window) - 1)
            total += loss.detach()
        return total

    def _log_batch_size_plan(self) -> None:
        if not self.accelerator.is_main_process:
            return
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        plan = BatchSizePlan.from_args(
            self.args,
            num_processes=self.accelerator.num_processes,
            zero_stage=plugin.zero_stage if plugin is not None else None,
            mixed_precision=str(self.accelerator.mixed_precision),
            layout=self._dynbsz_scheduler.layout if self._dynbsz_enabled else "stock (dynamic batching off)",
            vision_language=self._dynbsz_vision if self._dynbsz_enabled else None,
            router_aux=self._dynbsz_capabilities.support.router_aux_mode(
                self.router_aux_loss_coef if self.aux_loss_enabled else 0.0
            ),
            memory_rows=self._memory_rows(),
        )
        logger.warning("hf_dynbsz batch-size plan:\n%s", plan.render())

    def _memory_rows(self) -> list:
        memory = self._dynbsz_memory
        if memory.limit_mib is None or not self._dynbsz_enabled:
            return []
        held = self._dynbsz_meters.memory.held()  # the gradients are allocated with the first step: counted here
        if self.accelerator.distributed_type != DistributedType.DEEPSPEED:
            held += pending_gradient_mib(self.model)
        return plan_rows(
            memory,
            held,
            "measured at start (weights, gradients to come, what else the process holds)",
            self.args.max_completion_length,
        )


class _LogPlanAtTrainBegin(TrainerCallback):
    """Logs the batch-size plan once, from the main process, when training starts."""

    def __init__(self, trainer: DynamicBatchGRPOTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._log_batch_size_plan()

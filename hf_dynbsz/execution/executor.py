"""The pass executor: every pass of every kind, training and no-grad alike, runs through one loop (torch layer).

For a step's samples (:class:`~hf_dynbsz.execution.batch.StepBatch`) or a no-grad call's
(:class:`~hf_dynbsz.execution.packing.SequenceTable`), :meth:`PassExecutor.run`:

1. chooses the token budget (:meth:`~hf_dynbsz.planning.schedule.Scheduler.budget`; with a memory limit the largest
   whose predicted peak fits, :mod:`hf_dynbsz.planning.memory`);
2. plans the passes (:mod:`hf_dynbsz.planning.schedule`: layout, lockstep, cross-rank balancing);
3. moves samples between processes as the plan's exchange says (:mod:`hf_dynbsz.parallel.distributed`);
4. runs each pass, and a dummy pass wherever another process has a pass and this one has none (lockstep);
5. on an out-of-memory error re-plans the step (:mod:`hf_dynbsz.execution.recovery`).

Steps 1-2 are :class:`~hf_dynbsz.execution.step_planning.StepPlanning`'s, a pass on the device
:class:`~hf_dynbsz.execution.device_pass.DevicePass`'s (the executor's two bases).

Sequence parallelism is an object the executor always holds (:mod:`hf_dynbsz.execution.sequence_parallel`); at size 1
pooling, sharding and gathering are the identity. Vision-language decisions come from
:class:`~hf_dynbsz.execution.multimodal.MediaPolicy`. The trainer (:mod:`hf_dynbsz.trainers`) only calls
:meth:`PassExecutor.train_step`, :meth:`PassExecutor.no_grad_passes`, :meth:`PassExecutor.train_step_stock` and
:meth:`PassExecutor.self_check` from TRL's hooks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from functools import partial

import torch
from torch.profiler import record_function

from hf_dynbsz.execution.batch import StepBatch
from hf_dynbsz.execution.device_memory import injected_fault, release_cached_memory
from hf_dynbsz.execution.device_pass import DevicePass
from hf_dynbsz.execution.layout_timing import NO_LAYOUT_TIMING
from hf_dynbsz.execution.metrics import StepMetrics, StepResult
from hf_dynbsz.execution.multimodal import MediaPolicy
from hf_dynbsz.execution.packing import SequenceTable
from hf_dynbsz.execution.recovery import OutOfMemoryRecovery
from hf_dynbsz.execution.router_loss import RouterAuxLoss
from hf_dynbsz.execution.self_check import check_layouts
from hf_dynbsz.execution.step_planning import StepPlanning
from hf_dynbsz.planning.memory import FailedPass

logger = logging.getLogger("hf_dynbsz")

__all__ = ["PassExecutor"]

#: a pass function: ``run_pass(state, schedule, group, last)`` runs the samples ``group`` of the moved samples
PassFunction = Callable[[object, object, list[int], bool], None]


@dataclasses.dataclass
class _TrainingPasses:
    """A training attempt's samples (after the exchange), the loss's state (GRPO's entropy bonus; see
    :class:`~hf_dynbsz.execution.step_loss.StepLoss`), metrics and per-pass losses."""

    batch: StepBatch
    loss_state: object
    metrics: StepMetrics
    losses: list[torch.Tensor]


@dataclasses.dataclass
class _NoGradPasses:
    """A no-grad attempt's samples (after the exchange) and results: ``(samples, 1 or 2, columns)`` log-probs and
    entropies, and for the router pass ``(samples, experts + 1)`` statistics."""

    table: SequenceTable
    results: torch.Tensor
    statistics: torch.Tensor | None


class PassExecutor(StepPlanning, DevicePass):
    """Runs a step's passes for a :class:`~hf_dynbsz.trainers.DynamicBatchGRPOTrainer` or
    :class:`~hf_dynbsz.trainers.DynamicBatchRLOOTrainer` (``trainer``: TRL's metrics store and hooks) with the trainer's
    loss (``loss``: :class:`~hf_dynbsz.execution.step_loss.StepLoss`). Built at start by
    :func:`hf_dynbsz.execution.setup.build_executor`."""

    def __init__(self, trainer, *, capabilities, parallel, memory, meters, world, loss) -> None:
        self.trainer, self.accelerator, self.args = trainer, trainer.accelerator, trainer.args
        self.capabilities, self.scheduler, self.enabled = capabilities, capabilities.scheduler, capabilities.enabled
        self.parallel, self.memory, self.meters, self.world = parallel, memory, meters, world
        self.media = MediaPolicy.of(capabilities.vision_language, self.accelerator, world)
        self.recovery = OutOfMemoryRecovery(self.accelerator, memory, meters, sequence_parallel_size=parallel.size)
        self.loss = loss  # the trainer's per-sample loss and weights (GRPO's or RLOO's)
        tokenizer = getattr(trainer, "_tokenizer", None) or trainer.processing_class  # (AsyncGRPOTrainer: the latter)
        self.pad_token_id = tokenizer.pad_token_id
        self.checked = not self.args.self_check
        self.self_check_summary: str | None = None  # what the self-check decided and why (its log line)
        self.self_check_seconds: float | None = None  # its wall time, once run (part of the first step's)
        self.warned: set[str] = set()
        self._dummies: dict = {}  # the dummy micro-batch of each layout (lockstep passes)
        self._unwrapped: tuple | None = None  # (model, its unwrapped module): DevicePass.unwrap
        self.layout_timing = NO_LAYOUT_TIMING  # on CUDA with packing_layout "auto": set by the self-check

    # ------------------------------------------------------------------ the one loop
    def run(
        self,
        model,
        kind: str,
        table: SequenceTable,
        stock_tokens: int,
        start,
        run_pass: PassFunction,
        dummy=None,
        reserve: Callable[[object], float] | None = None,
    ):
        """Plan ``table``'s samples for ``kind`` passes and run them; returns ``(schedule, state)``.

        ``start(schedule)`` moves the samples as the schedule's exchange says and returns the attempt's state;
        ``run_pass(state, schedule, group, last)`` runs one pass; ``dummy(model, last)`` a lockstep pass (default:
        :meth:`dummy_pass`); ``reserve(schedule)`` the MiB the passes will hold that the process does not hold when
        they are planned (``schedule`` None before there is one; a distillation teacher's hidden states: see
        :func:`~hf_dynbsz.planning.memory.held_states_mib`). After an out-of-memory error (here or on another
        process) the step is re-planned with a smaller budget and runs again from its start.
        """
        while True:
            self._allocate_gradients(model, kind)
            with record_function("dynbsz/plan"):
                schedule = self._planned(table, stock_tokens, kind, reserve or (lambda schedule: 0.0))
            self._warn_oversize(schedule, kind)
            with record_function("dynbsz/exchange"):
                state = start(schedule)
            timed = self.layout_timing.pass_candidates(schedule, kind, schedule.lengths)  # None: nothing timed
            with self._pass_context(model, kind, segments=timed is None):
                failure = self._run_passes(model, schedule, kind, partial(run_pass, state, schedule), timed, dummy)
            if failure is None:
                return schedule, state
            self.recovery.recover(model, failure)

    def _pass_context(self, model, kind: str, segments: bool = True):
        """Around a step's passes: TRL's loss context, the LM head's tiles, and (``segments``; a measuring step of
        the layout timing enters each pass's own) segment attention."""
        stack = contextlib.ExitStack()
        if kind == "training":
            stack.enter_context(self.trainer.compute_loss_context_manager())
        stack.enter_context(self.tiles())
        if segments:
            stack.enter_context(self.segments(model))
        return stack

    def _run_passes(
        self, model, schedule, kind: str, run_pass, timed: list[int] | None = None, dummy=None
    ) -> FailedPass | None:
        """Run ``run_pass(group, last)`` for each real pass of ``schedule`` and a dummy pass for each empty one.

        Training passes synchronise gradients on the last, or, where an out-of-memory error is recovered across
        processes, in a dummy pass after every process agreed that none failed. Returns None, or the failure (here,
        or agreed from another process) after which the step is re-planned. ``timed``: per pass, the layout
        timing's candidate that runs it (None: every pass in the run's layout). ``dummy``: the lockstep pass (default:
        :meth:`dummy_pass`).
        """
        dummy = dummy or self.dummy_pass
        training, sync_apart = kind == "training", self.recovery.syncs_apart(kind)
        failure, shapes = None, iter(schedule.pass_shapes())
        unwrapped = self.unwrap(model)  # injected faults hook its layers
        for position, group in enumerate(schedule.microbatches):
            last = position == schedule.passes - 1 and not sync_apart
            if failure is not None and self.recovery.processes == 1:
                break
            shape = self.parallel.per_process(next(shapes)) if group else None
            if not group or failure is not None:  # a failed process keeps the others' collectives going
                with self.segments(model) if timed is not None else contextlib.nullcontext():
                    dummy(model, last if training and failure is None else None)
                continue
            candidate = None if timed is None else timed[position]
            failure = self._run_pass(model, unwrapped, kind, run_pass, group, last, shape, schedule, candidate)
        failure = self.recovery.agree(failure, self.scheduler.group, kind)
        if sync_apart and failure is None:
            with self.segments(model) if timed is not None else contextlib.nullcontext():
                dummy(model, True)
        return failure

    def _run_pass(
        self, model, unwrapped, kind: str, run_pass, group, last, shape, schedule, candidate: int | None = None
    ) -> FailedPass | None:
        """One real pass; with a memory limit measured (teaching the memory model); ``candidate``: in that layout
        of the layout timing, timed. Returns its failure, if any."""
        held, (tokens, pairs, path_keys) = None, shape
        if self.memory.limit_mib is not None:
            held = self.meters.memory.held()
            self.meters.predicted(self.memory.peak(kind, tokens, pairs, held, path_keys))
        rank, lengths = self.accelerator.process_index, [schedule.lengths[i] for i in group]
        timed = self.layout_timing.timed(candidate, lengths, partial(self.segments, model))
        try:
            with self.no_sync(model, last or kind != "training"), injected_fault(unwrapped, kind, rank), timed:
                run_pass(group, last)
        except Exception as error:  # noqa: BLE001 - only a recovered out-of-memory error is not raised again
            self.recovery.check(error)
            self.recovery.settle(model)
            longest = max(schedule.lengths[i] for i in group)
            message = str(error).splitlines()[0]
            failure = FailedPass(kind, tokens, pairs, held, len(group), longest, message, path_keys=path_keys)
        else:
            if held is not None:
                self.memory.measured(kind, tokens, pairs, held, self.meters.memory.pass_peak(), path_keys)
            return None
        release_cached_memory(self.accelerator.device)  # after the error (and the frames it held) is gone
        return failure

    # ------------------------------------------------------------------ training passes
    def train_step(self, model, batch: StepBatch) -> StepResult:
        """The optimizer step's passes: statistics, stock loss weights, then forward/backward each pass, log once; the
        step's loss and figures (:class:`~hf_dynbsz.execution.metrics.StepResult`)."""
        trainer, device = self.trainer, self.accelerator.device
        with self.meters.clock.phase("train"):
            ga = trainer.current_gradient_accumulation_steps
            aux, entropies = self._step_statistics(model, batch, ga)
            self.loss.weigh(batch, entropies, gradient_accumulation_steps=ga)
            # what the passes read that other passes compute (a teacher's hidden states, a DPO reference's log-probs)
            self.loss.prepare(self, model, batch, gradient_accumulation_steps=ga)
            pooled = self.parallel.pool_batch(batch)  # sequence parallelism: the group's samples, each with its weights
            start, run_pass = partial(self._start_training, pooled, aux), partial(self._train, model, aux)
            schedule, state = self.run(
                model, "training", pooled.table, pooled.stock_microbatch_tokens, start, run_pass,
                dummy=partial(self.loss.dummy_pass, self),
                reserve=partial(self.loss.reserved_mib, pooled, self.scheduler.group.rank),
            )  # fmt: skip
            self._finish_layout_timing(pooled, schedule)
            losses = state.losses
            total = torch.stack(losses).sum() if losses else torch.zeros((), device=device)
            total = total / self.parallel.size  # a group's processes each hold its whole loss: logged once
            self.loss.finish(state.loss_state, ga)
            if aux is not None:
                aux.publish(trainer._metrics["train"], self.accelerator)
        result = state.metrics.publish(
            trainer._metrics["train"],
            self.accelerator,
            schedule=schedule,
            stock_computed_tokens=state.batch.stock_computed_tokens,
            group=self.scheduler.group,
            meters=self.meters,
            table=state.batch.table,
            replicas=self.parallel.size,
            sharing=self.scheduler.sharing,
        )
        self.layout_timing.publish(trainer._metrics["train"])
        return dataclasses.replace(result, loss=total)

    def _finish_layout_timing(self, batch: StepBatch, schedule) -> None:
        """After a training step's passes: once the layout timing has chosen, the run keeps the chosen layout
        (stock's: dynamic batching off) from the next step on."""
        decided, kept = self.layout_timing.finish_training_step(batch, schedule, self.args.per_device_train_batch_size)
        if decided and kept is None:
            self.enabled = False
        elif decided:
            self.scheduler = kept.scheduler

    def _step_statistics(self, model, batch: StepBatch, ga: int):
        """What the passes need from the whole step before the first, from one no-grad pass over the step's samples:
        per-token entropies where the loss's weights need them (GRPO's ``top_entropy_quantile``) and, for an MoE
        model, every stock micro-batch's expert counts. Returns the step's router aux loss and the entropies (each
        None without one)."""
        trainer = self.trainer
        aux = None
        if self.capabilities.router_aux:  # stock's MoE router aux loss, per sample
            router = self.capabilities.support.router_aux
            divisor, token_weights = self.loss.router_weighting(batch, ga)  # (the async step: 1, shared positions)
            aux = RouterAuxLoss(
                trainer.router_aux_loss_coef, *router, len(batch.slice_rows), divisor, self.accelerator.device,
                token_weights=token_weights,
            )  # fmt: skip
        masked = self.loss.needs_step_entropies
        if not masked and aux is None:
            return None, None
        _, entropies, counts = self.no_grad_passes(
            model, batch.table, batch.width, masked, batch.stock_microbatch_tokens, router=aux
        )
        if aux is not None:
            aux.add_counts(batch.slice_ids, counts)
            aux.agree(self.accelerator)
        return aux, entropies

    def _start_training(self, pooled: StepBatch, aux: RouterAuxLoss | None, schedule) -> _TrainingPasses:
        """A training attempt: cross-rank balancing gives this process the samples it runs."""
        moved = pooled if schedule.exchange is None else self.move(pooled, schedule.exchange)
        moved = moved.weights_on(self.accelerator.device)  # once per step: each pass picks its rows on the device
        if aux is not None:
            aux.probabilities.zero_()
        return _TrainingPasses(moved, self.loss.attempt(moved), self.loss.metrics(moved), [])

    def _train(self, model, aux: RouterAuxLoss | None, state: _TrainingPasses, schedule, group, last: bool) -> None:
        """One training pass: forward, stock-weighted loss, backward (gradients synchronise on ``last``)."""
        with record_function("dynbsz/pack"):
            mb = self.microbatch(state.batch.table, group)
            rows = state.batch.rows(group, mb.gather_index.size(1), mb.sample_index)
        with record_function("dynbsz/forward"):
            values, entropies, router_logits = self.loss.forward(self, model, mb, rows, state.batch, aux is not None)
        with record_function("dynbsz/loss"):
            loss, loss_metrics = self.loss.pass_loss(state.loss_state, values, entropies, rows)
            if aux is not None:
                loss = loss + aux.term(router_logits, mb.token_rows, rows.slice_ids, samples=group)
        with record_function("dynbsz/backward"):
            self.backward(model, loss, last)
        state.losses.append(loss.detach())
        state.metrics.add_pass(
            mb.real_tokens, mb.computed_tokens, loss_metrics, entropies.detach(), rows.mask, rows.slice_ids
        )

    def move(self, samples, exchange):
        """The samples (a step's batch, or a no-grad table) this process runs under a balanced exchange."""
        return samples.moved(self.scheduler.group, exchange, self.media.moves_media)

    # ------------------------------------------------------------------ no-grad passes
    @torch.no_grad()
    def no_grad_passes(
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
        with self.meters.clock.phase("logprob"):
            pooled, own = self.parallel.pool_table(table)  # sequence parallelism: the group's samples
            start = partial(self._start_no_grad, pooled, width, 2 if compute_entropy else 1, router)
            run_pass = partial(self._no_grad, model, compute_entropy, router)
            schedule, state = self.run(model, "logprob", pooled, stock_tokens, start, run_pass)
            results, statistics = state.results, state.statistics
            if schedule.exchange is not None:  # the results go back to the process that owns each sample
                group = self.scheduler.group
                rows = [results[j, :, :c] for j, c in enumerate(state.table.completion_lengths.tolist())]
                results = group.return_rows(rows, schedule.exchange, results.size(2), results.size(1))
                if statistics is not None:
                    statistics = torch.stack(
                        group.send_to_owners(list(statistics), schedule.exchange, lambda p, c: router.width)
                    )
            results = results[own]
            return results[:, 0, :width], results[:, 1, :width] if compute_entropy else None, statistics

    def _start_no_grad(self, pooled: SequenceTable, width: int, channels: int, router, schedule) -> _NoGradPasses:
        run = pooled if schedule.exchange is None else self.move(pooled, schedule.exchange)
        columns = max([width, *run.completion_lengths.tolist()])
        device = self.accelerator.device
        results = torch.zeros(len(run), channels, columns, device=device)
        statistics = None
        if router is not None:
            statistics = torch.zeros(len(run), router.width, dtype=torch.float64, device=device)
        return _NoGradPasses(run, results, statistics)

    def _no_grad(self, model, compute_entropy: bool, router, state: _NoGradPasses, schedule, group, last) -> None:
        with record_function("dynbsz/pack"):
            mb = self.microbatch(state.table, group)
        with record_function("dynbsz/no_grad_forward"):
            logps, entropies, router_logits = self.forward(model, mb, compute_entropy, router is not None)
        index = mb.sample_index  # on the device (a host list as an index would be copied there, and wait)
        state.results[:, 0, : logps.size(1)].index_copy_(0, index, logps.float())
        if compute_entropy:
            state.results[:, 1, : entropies.size(1)].index_copy_(0, index, entropies.float())
        if router is not None:
            statistics = router.pass_statistics(router_logits, mb.token_rows, len(group), samples=group)
            state.statistics.index_copy_(0, index, statistics)

    # ------------------------------------------------------------------ stock's path, and the self-check
    def train_step_stock(self, model, window: list[dict], reason: str | None = None) -> torch.Tensor:
        """Stock math for a step that cannot be repacked: one pass per stock slice. ``reason``: why, logged once per
        reason (None: said elsewhere, as the self-check's log line says why it kept no layout)."""
        if reason is not None and reason not in self.warned:
            self.warned.add(reason)
            logger.warning("hf_dynbsz: %s.", reason)
        total = torch.zeros((), device=self.accelerator.device)
        for position, inputs in enumerate(window):
            last = position == len(window) - 1
            with self.no_sync(model, last):
                with self.trainer.compute_loss_context_manager(), self.tiles():
                    loss = self.trainer.compute_loss(model, inputs)
                loss = self.loss.stock_loss(loss, self.trainer.current_gradient_accumulation_steps)
                self.backward(model, loss, last)
            total += loss.detach()
        return total

    @torch.no_grad()
    def self_check(self, model, table: SequenceTable) -> bool:
        """Once per run, before its first pass: keep the fastest layout whose log-probs and gradients equal each
        sample's own (:func:`~hf_dynbsz.execution.self_check.check_layouts`); when none does, stock math runs.
        Returns whether dynamic batching stays on."""
        if not self.checked:
            self.checked = True
            check_layouts(self, model, table)
        return self.enabled

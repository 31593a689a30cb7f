"""The loss the pass executor trains with: one object per TRL trainer, chosen at setup (torch layer).

Everything the executor does (the budget, the layouts, shared prompts, balancing, sequence parallelism, the memory
budget, out-of-memory recovery, the router aux loss) is the same for every trainer; what differs is each sample's
loss and weight, what a training pass computes, what the step needs before its passes, and the loss metrics stock
logs. :class:`StepLoss` is that part, and the executor holds one:

* :class:`GRPOLoss`: ``GRPOTrainer``'s loss types, entropy bonus and ``top_entropy_quantile``
  (:mod:`hf_dynbsz.execution.loss`);
* :class:`RLOOLoss`: ``RLOOTrainer``'s sequence-level clipped ratio of summed log-probs
  (:mod:`hf_dynbsz.execution.rloo_loss`);
* :class:`AsyncGRPOLoss`: ``AsyncGRPOTrainer``'s clipped token loss, each stock micro-batch normalised by its own
  trained tokens (or the samples-defined step by the step's) (:mod:`hf_dynbsz.execution.async_loss`);
* :class:`DistillationLoss`: ``DistillationTrainer``'s generalized Jensen-Shannon divergence against a teacher, whose
  hidden states its own passes compute before the step's training passes (:mod:`hf_dynbsz.execution.teacher`,
  :mod:`hf_dynbsz.execution.distillation_loss`);
* :class:`DPOLoss`: ``DPOTrainer``'s preference losses, per pair (a pair's chosen and rejected in one pass), the
  reference's log-probs from its own no-grad passes before the step's training passes
  (:mod:`hf_dynbsz.execution.reference`, :mod:`hf_dynbsz.execution.dpo_loss`).

The trainer class names its loss (``DynamicBatchGRPOTrainer`` -> :class:`GRPOLoss`, ``DynamicBatchRLOOTrainer`` ->
:class:`RLOOLoss`, ``DynamicBatchDistillationTrainer`` -> :class:`DistillationLoss`);
:func:`hf_dynbsz.execution.setup.build_executor` builds it from the trainer after TRL's constructor.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hf_dynbsz.execution.async_loss import METRIC_KEYS as ASYNC_METRIC_KEYS
from hf_dynbsz.execution.async_loss import async_loss_settings, async_pass_loss, async_sample_weights, position_shares
from hf_dynbsz.execution.attention import use_segments
from hf_dynbsz.execution.batch import SampleRows, StepBatch
from hf_dynbsz.execution.distillation_loss import (
    DivergenceSettings,
    distillation_pass_loss,
    distillation_sample_weights,
    pass_divergence,
)
from hf_dynbsz.execution.dpo_loss import METRIC_KEYS as DPO_METRIC_KEYS
from hf_dynbsz.execution.dpo_loss import (
    DPOSettings,
    coupled_coefficients,
    dpo_pass_loss,
    pass_outputs,
    sequence_logps,
    sft_coefficients,
)
from hf_dynbsz.execution.loss import EntropyBonus, LossSettings, metric_keys, microbatch_loss, sample_weights
from hf_dynbsz.execution.metrics import StepMetrics
from hf_dynbsz.execution.reference import Reference
from hf_dynbsz.execution.rloo_loss import METRIC_KEYS, RLOOSettings, rloo_pass_loss, rloo_sample_weights
from hf_dynbsz.execution.rope import use_rope_widths
from hf_dynbsz.execution.teacher import Teacher
from hf_dynbsz.parallel.collectives import reduce_sum
from hf_dynbsz.planning.memory import held_states_mib

__all__ = ["AsyncGRPOLoss", "DPOLoss", "DistillationLoss", "GRPOLoss", "RLOOLoss", "StepLoss"]


class StepLoss(Protocol):
    """What the executor asks of a trainer's loss, per optimizer step (``state``: what one training attempt of the
    step carries from pass to pass, e.g. the entropy bonus's sums; None when the loss needs none)."""

    #: the loss has an entropy term (sequence parallelism does not run it)
    entropy_bonus: bool
    #: the step's weights need its per-token entropies, from one no-grad pass before the first training pass
    needs_step_entropies: bool
    #: the phases of a step's time the metrics publish (``dynbsz/<phase>_seconds``)
    phases: tuple[str, ...]

    def weigh(self, batch: StepBatch, entropies: torch.Tensor | None, *, gradient_accumulation_steps: int) -> None:
        """Set ``batch``'s per-sample weights (and masks) to stock's, in place."""

    def prepare(self, executor, model, batch: StepBatch) -> None:
        """What the step's training passes need that other passes compute first (a distillation teacher's hidden
        states), into ``batch``."""

    def attempt(self, batch: StepBatch):
        """The state of one training attempt over ``batch`` (the samples this process runs)."""

    def reserved_mib(self, batch: StepBatch, rank: int, schedule) -> float:
        """MiB the step's training passes over ``batch`` (this process's, ``rank`` in the scheduler's group) will hold
        that the process does not hold when they are planned (``schedule`` None before there is one): the memory
        model keeps room for it (:meth:`~hf_dynbsz.execution.executor.PassExecutor.run`'s ``reserve``)."""

    def metrics(self, batch: StepBatch) -> StepMetrics:
        """The metrics of one training attempt over ``batch``: stock's loss metrics, per stock slice, from the tensors
        :meth:`pass_loss` gives."""

    def forward(self, executor, model, mb, rows: SampleRows, batch: StepBatch, router: bool):
        """One training pass's forward over micro-batch ``mb`` (the samples ``rows`` of ``batch``): ``(values,
        entropies, router logits or None)``, the first two completion-aligned ``(rows, width)``: what
        :meth:`pass_loss` weighs (log-probs; a distillation's per-token divergence)."""

    def pass_loss(
        self, state, per_token_values: torch.Tensor, entropies: torch.Tensor, rows: SampleRows
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One pass's loss (with gradient) and the tensors its metrics read."""

    def finish(self, state, gradient_accumulation_steps: int) -> None:
        """Stock's bookkeeping at the optimizer-step boundary."""

    def stock_loss(self, loss: torch.Tensor, gradient_accumulation_steps: int) -> torch.Tensor:
        """Stock's ``compute_loss`` of one slice as the Trainer backpropagates it (for steps that keep stock's
        slices)."""

    def checked_models(self, model) -> list[tuple[object, bool]]:
        """The models the self-check compares each layout on, each with whether its gradients are compared (the
        trained model; a distillation's teacher too, log-probs only)."""

    def dummy_pass(self, executor, model, last: bool | None = None) -> None:
        """A lockstep training pass that runs what a real pass runs (under ZeRO-3 the same parameter gathers) and
        learns nothing (:meth:`~hf_dynbsz.execution.device_pass.DevicePass.dummy_pass`'s contract)."""

    def router_weighting(self, batch: StepBatch, gradient_accumulation_steps: int):
        """The MoE router aux loss's divisor and per-position weights of ``batch``'s samples
        (:class:`~hf_dynbsz.execution.router_loss.RouterAuxLoss`: None counts a position once per sample holding
        it)."""


class _LogProbLoss:
    """A loss over the policy's completion log-probs (GRPO's and RLOO's): a training pass is the model's fused LM
    head over the pass's row, nothing precedes the passes, the self-check checks the policy."""

    phases = ("train", "logprob", "generation")

    def prepare(self, executor, model, batch: StepBatch) -> None:
        return None

    def reserved_mib(self, batch: StepBatch, rank: int, schedule) -> float:
        return 0.0  # what moved samples bring is a few values per token

    def forward(self, executor, model, mb, rows: SampleRows, batch: StepBatch, router: bool):
        return executor.forward(model, mb, True, router=router)

    def checked_models(self, model) -> list[tuple[object, bool]]:
        return [(model, True)]

    def dummy_pass(self, executor, model, last: bool | None = None) -> None:
        executor.dummy_pass(model, last)

    def router_weighting(self, batch: StepBatch, gradient_accumulation_steps: int):
        return gradient_accumulation_steps, None  # stock's slices: a shared prompt counts for each of its samples


class GRPOLoss(_LogProbLoss):
    """``GRPOTrainer``'s loss: :func:`~hf_dynbsz.execution.loss.sample_weights` for every loss type, the entropy bonus
    (:class:`~hf_dynbsz.execution.loss.EntropyBonus`) and ``top_entropy_quantile``'s per-slice mask."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.settings = LossSettings.from_trainer(trainer)
        self.entropy_bonus = bool(trainer._entropy_bonus_enabled)
        self.needs_step_entropies = trainer.top_entropy_quantile < 1.0

    def weigh(self, batch: StepBatch, entropies: torch.Tensor | None, *, gradient_accumulation_steps: int) -> None:
        if self.needs_step_entropies:
            batch.high_entropy = self._high_entropy_mask(batch, entropies)
        batch.policy_weights, batch.entropy_weights = sample_weights(
            self.settings,
            batch.loss_tokens,
            batch.slice_ids,
            batch.slice_rows,
            batch.num_items,
            gradient_accumulation_steps=gradient_accumulation_steps,
            steps_per_generation=self.trainer.args.steps_per_generation,
            num_processes=self.trainer.accelerator.num_processes,
            entropy_tokens=batch.bonus_mask.sum(dim=1).cpu(),
        )

    def _high_entropy_mask(self, batch: StepBatch, entropies: torch.Tensor) -> torch.Tensor:
        """``top_entropy_quantile``: stock's per-slice high-entropy mask, from the entropies of one no-grad pass.

        Stock takes the entropy quantile over each fixed slice (gathered across ranks) before its backward, so the
        mask must be known before the first pass: TRL's own ``get_high_entropy_mask`` is applied slice by slice to
        the entropies of a no-grad pass over the step (the same gathers on every rank: one per slice).
        """
        high_entropy = torch.zeros_like(batch.loss_mask)
        slice_ids = batch.slice_ids.to(batch.loss_mask.device)
        quantile = 1 - self.trainer.top_entropy_quantile
        for slice_id in batch.slice_rows.nonzero().flatten().tolist():  # this process's slices
            rows = (slice_ids == slice_id).nonzero().flatten()
            selected = self.trainer.get_high_entropy_mask(entropies[rows], batch.loss_mask[rows], quantile)
            high_entropy[rows] = selected.to(batch.loss_mask.dtype)
        return high_entropy

    def attempt(self, batch: StepBatch) -> EntropyBonus | None:
        if not self.entropy_bonus:
            return None
        return EntropyBonus(self.trainer, len(batch.slice_rows), self.trainer.accelerator.device)

    def metrics(self, batch: StepBatch) -> StepMetrics:
        slices = len(batch.slice_rows) // self.trainer.accelerator.num_processes
        return StepMetrics(slices, self.trainer.accelerator.device, metric_keys(self.settings))

    def pass_loss(self, state: EntropyBonus | None, per_token_logps, entropies, rows: SampleRows):
        return microbatch_loss(self.settings, per_token_logps, entropies, rows, state)

    def finish(self, state: EntropyBonus | None, gradient_accumulation_steps: int) -> None:
        if state is not None:
            state.finish(self.trainer, gradient_accumulation_steps)

    def stock_loss(self, loss: torch.Tensor, gradient_accumulation_steps: int) -> torch.Tensor:
        return loss  # GRPOTrainer scales its loss for gradient accumulation itself (loss_is_scaled_for_ga)


class RLOOLoss(_LogProbLoss):
    """``RLOOTrainer``'s loss: each sequence's clipped ratio of summed log-probs, weight ``1 / (B GA)``
    (:mod:`hf_dynbsz.execution.rloo_loss`); its entropy and clip ratios logged per stock slice, as GRPO's loss
    metrics (:class:`~hf_dynbsz.execution.metrics.StepMetrics`). No entropy term."""

    entropy_bonus = False
    needs_step_entropies = False

    def __init__(self, trainer) -> None:
        self.settings = RLOOSettings.from_trainer(trainer)
        self.device = trainer.accelerator.device
        self.num_processes = trainer.accelerator.num_processes

    def weigh(self, batch: StepBatch, entropies: torch.Tensor | None, *, gradient_accumulation_steps: int) -> None:
        batch.policy_weights = rloo_sample_weights(
            batch.slice_ids, batch.slice_rows, gradient_accumulation_steps=gradient_accumulation_steps
        )
        batch.entropy_weights = torch.zeros_like(batch.policy_weights)

    def attempt(self, batch: StepBatch) -> None:
        return None

    def metrics(self, batch: StepBatch) -> StepMetrics:
        return StepMetrics(len(batch.slice_rows) // self.num_processes, self.device, METRIC_KEYS)

    def pass_loss(self, state: None, per_token_logps, entropies, rows: SampleRows):
        return rloo_pass_loss(self.settings, per_token_logps, rows)

    def finish(self, state: None, gradient_accumulation_steps: int) -> None:
        return None

    def stock_loss(self, loss: torch.Tensor, gradient_accumulation_steps: int) -> torch.Tensor:
        return loss / gradient_accumulation_steps  # the Trainer divides RLOO's loss (loss_is_scaled_for_ga False)


class AsyncGRPOLoss(_LogProbLoss):
    """``AsyncGRPOTrainer``'s loss: the clipped token loss against the generator's log-probs, every sample weighted
    ``processes / N / GA`` with ``N`` the trained tokens of its stock slice (:mod:`hf_dynbsz.execution.async_loss`):
    for stock's step (``async_step="stock"``) each micro-batch is a slice, normalised by its own tokens and ``GA``, as
    stock; for the samples-defined step the optimizer step is one slice (``GA`` 1). Its metrics (ratio, kl, entropy,
    clip ratios) logged once per slice, as stock logs them per micro-batch. No entropy term, no reference model."""

    entropy_bonus = False
    needs_step_entropies = False
    phases = ("train", "logprob", "generation")  # generation: waiting for the rollout queue

    def __init__(self, trainer) -> None:
        self.settings = async_loss_settings(trainer)
        self.device = trainer.accelerator.device
        self.num_processes = trainer.accelerator.num_processes
        self.stock_slices = getattr(trainer.args, "async_step", "stock") != "samples"

    def _accumulation(self, gradient_accumulation_steps: int) -> int:
        return gradient_accumulation_steps if self.stock_slices else 1

    def weigh(self, batch: StepBatch, entropies: torch.Tensor | None, *, gradient_accumulation_steps: int) -> None:
        ga = self._accumulation(gradient_accumulation_steps)
        batch.policy_weights = async_sample_weights(self.settings, batch, self.num_processes, ga)
        batch.entropy_weights = torch.zeros_like(batch.policy_weights)

    def attempt(self, batch: StepBatch) -> None:
        return None

    def metrics(self, batch: StepBatch) -> StepMetrics:
        return StepMetrics(len(batch.slice_rows) // self.num_processes, self.device, ASYNC_METRIC_KEYS)

    def pass_loss(self, state: None, per_token_logps, entropies, rows: SampleRows):
        return async_pass_loss(self.settings, per_token_logps, entropies, rows)

    def finish(self, state: None, gradient_accumulation_steps: int) -> None:
        return None

    def stock_loss(self, loss: torch.Tensor, gradient_accumulation_steps: int) -> torch.Tensor:
        return loss  # AsyncGRPOTrainer scales its loss for gradient accumulation itself (loss_is_scaled_for_ga)

    def router_weighting(self, batch: StepBatch, gradient_accumulation_steps: int):
        # each slice is one packed row per process (stock's TreeRow): a position its samples share counts once
        slices = batch.slice_ids if self.stock_slices else None
        return self._accumulation(gradient_accumulation_steps), position_shares(batch.table, slices)


class DistillationLoss:
    """``DistillationTrainer``'s loss: each loss token's divergence from the teacher (its hidden states from the
    teacher's passes before the step, :class:`~hf_dynbsz.execution.teacher.Teacher`) weighted ``P / N``
    (:mod:`hf_dynbsz.execution.distillation_loss`); ``entropy`` logged per stock slice
    (:class:`~hf_dynbsz.execution.metrics.StepMetrics`). No entropy term, no router aux loss (stock runs
    the backbones alone).

    With dynamic batching on, the student and the teacher get TRL's fused LM head (``add_fused_lm_head``, as
    ``GRPOTrainer`` gives its models; a forward without ``fused_lm_head=True`` is the model's own, so generation and
    stock's backbone calls are unchanged): the self-check compares each layout's completion log-probs with each
    sample alone on both models, and a student's lockstep pass runs through it."""

    entropy_bonus = False
    needs_step_entropies = False
    phases = ("train", "logprob", "generation", "teacher")

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.teacher = Teacher(trainer)
        student = trainer.accelerator.unwrap_model(trainer.model)
        self.settings = DivergenceSettings.of(
            trainer.beta, trainer.temperature, student.config, self.teacher.unwrapped.config
        )
        self.num_processes = trainer.accelerator.num_processes
        self.device = trainer.accelerator.device
        if trainer.args.dynamic_batching:
            for model in (student, self.teacher.unwrapped):
                _add_fused_lm_head(model, trainer.temperature)

    def weigh(self, batch: StepBatch, entropies: torch.Tensor | None, *, gradient_accumulation_steps: int) -> None:
        batch.policy_weights = distillation_sample_weights(batch.num_items, self.num_processes)
        batch.entropy_weights = torch.zeros_like(batch.policy_weights)

    def prepare(self, executor, model, batch: StepBatch) -> None:
        self.teacher.hidden_states(executor, batch)

    def reserved_mib(self, batch: StepBatch, rank: int, schedule) -> float:
        """The teacher hidden states that arrive with samples other processes send here (held during the passes
        beside this process's own, which the process holds when they are planned)."""
        exchange = None if schedule is None else schedule.exchange
        bytes_per_value = torch.empty((), dtype=batch.teacher_hidden_dtype).element_size()
        tokens = batch.arriving_hidden_tokens(exchange, rank)
        return held_states_mib(tokens, batch.teacher_hidden_size, bytes_per_value)

    def attempt(self, batch: StepBatch) -> None:
        return None

    def metrics(self, batch: StepBatch) -> StepMetrics:
        return StepMetrics(len(batch.slice_rows) // self.num_processes, self.device)

    def forward(self, executor, model, mb, rows: SampleRows, batch: StepBatch, router: bool):
        """The pass's per-token divergence and entropy, ``(rows, width)``, 0 off the loss tokens: the student's
        backbone and the divergence inside the student's wrapper (``_forward_redirection``, as stock)."""
        valid = rows.mask.bool() & mb.completion_mask.bool()
        completion = mb.completion_mask.bool()
        teacher = torch.cat([batch.teacher_hidden[i] for i in mb.indices])[valid[completion]]
        unwrapped = executor.unwrap(model)
        use_segments(mb.segments)
        use_rope_widths(mb.rope_widths)
        divergence, entropy = self.trainer._forward_redirection(
            model, unwrapped, pass_divergence, self.settings, unwrapped, self.teacher.unwrapped, mb.model_inputs,
            mb.gather_index[valid], teacher,
        )  # fmt: skip
        zeros = torch.zeros(valid.shape, dtype=divergence.dtype, device=divergence.device)
        return zeros.masked_scatter(valid, divergence), zeros.masked_scatter(valid, entropy.detach()), None

    def pass_loss(self, state: None, per_token_divergence, entropies, rows: SampleRows):
        return distillation_pass_loss(per_token_divergence, rows)

    def finish(self, state: None, gradient_accumulation_steps: int) -> None:
        return None

    def stock_loss(self, loss: torch.Tensor, gradient_accumulation_steps: int) -> torch.Tensor:
        return loss  # DistillationTrainer's loss is normalised by num_items_in_batch (loss_is_scaled_for_ga)

    def checked_models(self, model) -> list[tuple[object, bool]]:
        return [(model, True), (self.teacher.model, False)]

    def dummy_pass(self, executor, model, last: bool | None = None) -> None:
        """A real pass's work without a loss token: the student's backbone over a tiny row and the divergence of no
        token, which still gathers both LM heads under ZeRO-3 (forward and backward), as every real pass does."""
        mb = executor.lockstep_microbatch()
        none = mb.gather_index.new_zeros(0)
        teacher = torch.zeros(0, self.teacher.hidden_size, device=executor.accelerator.device)
        unwrapped = executor.unwrap(model)
        use_segments(mb.segments)
        use_rope_widths(mb.rope_widths)
        with executor.no_sync(model, bool(last)):  # (DevicePass.dummy_pass: why not synchronised without last)
            divergence, _ = self.trainer._forward_redirection(
                model, unwrapped, pass_divergence, self.settings, unwrapped, self.teacher.unwrapped, mb.model_inputs,
                none, teacher,
            )  # fmt: skip
            if last is not None:
                executor.backward(model, divergence.sum() * 0.0, last)


class DPOLoss:
    """``DPOTrainer``'s loss: each pair's losses from its chosen and rejected sequence log-probs (one pass holds both),
    weight ``1 / (B GA)``; the sorted losses (``aot``, ``aot_unpaired``) through coefficients from a no-grad policy
    pass, ``sft`` through its token weights (:mod:`hf_dynbsz.execution.dpo_loss`); the reference's log-probs from its
    own passes before the step (:class:`~hf_dynbsz.execution.reference.Reference`). Stock's metrics per stock slice
    (:class:`~hf_dynbsz.execution.metrics.StepMetrics`), ``num_tokens`` summed over processes once per step.

    ``blocker``: why this run cannot repack its steps (the trainer then runs stock's), or None."""

    entropy_bonus = False
    needs_step_entropies = False
    phases = ("train", "logprob")
    checked_model_name = "reference"  # the self-check's log names the second model it checks

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.settings = DPOSettings.from_trainer(trainer)
        self.reference = Reference(trainer)
        self.sft = "sft" in self.settings.loss_types
        self.device = trainer.accelerator.device
        self.num_processes = trainer.accelerator.num_processes
        self.gradient_accumulation_steps = 1
        self.blocker = _dpo_blocker(trainer, self.settings)

    def weigh(self, batch: StepBatch, entropies: torch.Tensor | None, *, gradient_accumulation_steps: int) -> None:
        pairs = batch.slice_rows.double()[batch.slice_ids] / 2
        batch.policy_weights = 1.0 / (pairs * float(gradient_accumulation_steps))
        batch.entropy_weights = torch.zeros_like(batch.policy_weights)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        if self.sft:
            batch.per_token["sft"] = sft_coefficients(self.settings, batch, gradient_accumulation_steps).unsqueeze(1)

    def reserved_mib(self, batch: StepBatch, rank: int, schedule) -> float:
        return 0.0  # the reference's log-probs and a sorted loss's coefficients are a few values per sample

    def prepare(self, executor, model, batch: StepBatch) -> None:
        """The reference's log-probs, then for a sorted loss each sample's coefficient from a no-grad policy pass."""
        self.reference.logps(executor, model, batch, self.settings.ld_alpha)
        if not self.settings.coupled:
            return
        with torch.no_grad():
            per_token, _, _ = executor.no_grad_passes(
                model, batch.table, batch.width, False, batch.stock_microbatch_tokens
            )
            mask = batch.loss_mask.to(per_token.device)
            seq = sequence_logps(
                per_token, mask, batch.per_token["shared"].to(per_token.device), self.settings.ld_alpha
            )
        ref = batch.per_token["ref_logps"].squeeze(1).to(seq)
        coefficient, offset = coupled_coefficients(
            self.settings, seq, ref, batch.slice_ids, self.gradient_accumulation_steps
        )
        device = batch.per_token["coefficient"].device
        batch.per_token["coefficient"] = coefficient.unsqueeze(1).float().to(device)
        batch.per_token["offset"] = offset.unsqueeze(1).float().to(device)

    def attempt(self, batch: StepBatch) -> int:
        return int(batch.table.lengths.sum())  # the real tokens this process runs (stock's attention mask's sum)

    def metrics(self, batch: StepBatch) -> StepMetrics:
        return StepMetrics(len(batch.slice_rows) // self.num_processes, self.device, DPO_METRIC_KEYS)

    def forward(self, executor, model, mb, rows: SampleRows, batch: StepBatch, router: bool):
        values, router_logits = pass_outputs(executor, model, mb, self.settings.outputs, router)
        return values, values["entropy"], router_logits

    def pass_loss(self, state, values, entropies, rows: SampleRows):
        return dpo_pass_loss(self.settings, values, rows, self.sft)

    def finish(self, state: int, gradient_accumulation_steps: int) -> None:
        """Stock's ``num_tokens``: every process's real tokens of the step (each pair's prompt twice), added up."""
        trainer = self.trainer
        tokens = reduce_sum(torch.tensor([float(state)], dtype=torch.float64, device=self.device))
        trainer._total_train_tokens += int(tokens.item()) // trainer._tp_size
        trainer._metrics["train"]["num_tokens"] = [trainer._total_train_tokens]

    def stock_loss(self, loss: torch.Tensor, gradient_accumulation_steps: int) -> torch.Tensor:
        return loss / gradient_accumulation_steps  # the Trainer divides DPO's loss (loss_is_scaled_for_ga False)

    def router_weighting(self, batch: StepBatch, gradient_accumulation_steps: int):
        return gradient_accumulation_steps, None  # stock's micro-batches: each sample's positions its own

    def checked_models(self, model) -> list[tuple[object, bool]]:
        reference = self.reference.model
        return [(model, True)] + (
            [(reference, False)] if reference is not None and not self.reference.precomputed else []
        )

    def dummy_pass(self, executor, model, last: bool | None = None) -> None:
        executor.dummy_pass(model, last)


def _dpo_blocker(trainer, settings: DPOSettings) -> str | None:
    """Why a DPO run trains stock's micro-batches, or None: what the passes do not repack exactly."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    if getattr(trainer, "_is_vision_dataset", False):
        return "vision-language pairs (their image inputs are not repacked for DPO)"
    if not isinstance(trainer.data_collator, DataCollatorForPreference):
        name = type(trainer.data_collator).__name__
        return f"a custom data collator ({name}): the passes read DataCollatorForPreference's rows"
    if settings.use_weighting and "sft" in settings.loss_types:
        return (
            "loss_type 'sft' with use_weighting=True: the WPO weights of a micro-batch's pairs scale its SFT token "
            "mean, which couples its pairs"
        )
    return None


def _add_fused_lm_head(model, temperature: float) -> None:
    """TRL's fused LM head on ``model`` (the base model under PEFT, as ``GRPOTrainer`` adds it), once."""
    from trl.trainer.utils import add_fused_lm_head

    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if not getattr(base, "_dynbsz_fused_lm_head", False):
        add_fused_lm_head(base, temperature=temperature, outputs=("log_probs", "entropy"))
        base._dynbsz_fused_lm_head = True

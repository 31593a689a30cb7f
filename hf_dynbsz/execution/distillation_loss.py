"""The distillation loss per pass with stock's normalisation (torch layer).

TRL 1.16's ``DistillationTrainer`` trains the student on its own completions to match the teacher's next-token
distribution. Per fixed slice of ``B`` samples (``per_device_train_batch_size``), padded to the generation batch's
longest prompt and completion, stock runs the student's backbone, then the teacher's (no grad, both through
``_forward_redirection``), and scores every completion token ``t`` of the loss mask ``m`` (``completion_mask x
tool_mask``) with TRL's ``ChunkedDivergenceFunction`` on the two models' last hidden states and LM heads:

=========================  ====================================================================================
quantity                   stock, per slice
=========================  ====================================================================================
student / teacher logits   ``z = head(h) x logit_scale``, soft-capped, divided by ``temperature`` (each model's own)
divergence of token t      ``D_t``: forward KL(teacher || student) at ``beta`` 0, reverse KL(student || teacher) at
                           1, the generalized JSD with mixture ``(1 - beta) p_s + beta p_t`` between
slice loss                 ``sum_t m_t D_t / (N / P)``; the Trainer does not divide it by GA
                           (``loss_is_scaled_for_ga``)
N                          ``num_items_in_batch``: loss-mask tokens of the whole generation batch (all processes,
                           all GA slices of the optimizer step; one generation per step), at least 1
weight of token t          ``P / N`` (P processes: DDP averages the processes' gradients)
entropy (logged)           per slice, over that slice of every process: ``sum_t m_t H_t / sum_t m_t`` (0 without
                           tokens); ``H_t`` the student's entropy at ``temperature``
=========================  ====================================================================================

A token's divergence depends on its own two hidden states alone, and its weight on the step alone, so any repacking
of the step's samples sums to stock's loss and gradient: :func:`pass_divergence` computes ``D_t`` and ``H_t`` of one
pass's loss tokens (the student's backbone on the pass's row, the teacher's hidden states from its own passes,
:mod:`hf_dynbsz.execution.teacher`) through the same kernel, and :func:`distillation_pass_loss` weighs them.
:class:`hf_dynbsz.execution.metrics.StepMetrics` keeps the entropy's sums per stock slice (as GRPO's and RLOO's loss
metrics), so the logged ``entropy`` is stock's whatever the passes. ``tests/test_distillation_loss.py`` checks this
table against stock's ``_compute_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_dynbsz.execution.attention import use_segments
from hf_dynbsz.execution.batch import SampleRows, StepBatch
from hf_dynbsz.execution.metrics import StepMetrics
from hf_dynbsz.execution.rope import use_rope_widths
from hf_dynbsz.execution.teacher import Teacher, backbone_hidden_states
from hf_dynbsz.planning.cost import text_config_of
from hf_dynbsz.planning.memory import held_states_mib

__all__ = [
    "DistillationLoss",
    "DivergenceSettings",
    "backbone_hidden_states",
    "distillation_pass_loss",
    "distillation_sample_weights",
    "logit_scale",
    "pass_divergence",
]


def logit_scale(config) -> float:
    """The multiplier stock applies to a model's logits before soft-capping (``logit_scale``, ``output_multiplier``,
    ``lm_head_multiplier``, or ``logits_scaling``: a divisor, a multiplier for HyperCLOVA X), 1.0 for none."""
    text = text_config_of(config)
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(text, name, None)
        if value is not None:
            return value
    scaling = getattr(text, "logits_scaling", None)
    if scaling is not None:
        return scaling if text.model_type == "hyperclovax" else 1 / scaling
    return 1.0


@dataclass(frozen=True)
class DivergenceSettings:
    """What the divergence of a token reads besides the two models' hidden states and heads: ``beta``,
    ``temperature``, and each model's logit scale and final soft-capping (None: none)."""

    beta: float
    temperature: float
    student_scale: float = 1.0
    student_softcap: float | None = None
    teacher_scale: float = 1.0
    teacher_softcap: float | None = None

    @classmethod
    def of(cls, beta: float, temperature: float, student_config, teacher_config) -> DivergenceSettings:
        return cls(
            beta=beta,
            temperature=temperature,
            student_scale=logit_scale(student_config),
            student_softcap=getattr(text_config_of(student_config), "final_logit_softcapping", None),
            teacher_scale=logit_scale(teacher_config),
            teacher_softcap=getattr(text_config_of(teacher_config), "final_logit_softcapping", None),
        )


def distillation_sample_weights(num_items: torch.Tensor, num_processes: int) -> torch.Tensor:
    """``(N,)`` float64 weights ``P / max(N, 1)`` of each sample's loss tokens: ``num_items`` (N,) the
    ``num_items_in_batch`` of each sample's generation batch."""
    return float(num_processes) / num_items.double().clamp(min=1.0)


def _full(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """An FSDP2 head's weight (and bias) as plain tensors once, in the hidden states' dtype (as stock does)."""
    if isinstance(weight, torch.distributed.tensor.DTensor):
        weight = weight.full_tensor().to(dtype)
        bias = bias.full_tensor() if bias is not None else None
    return weight, bias


def pass_divergence(
    settings: DivergenceSettings,
    student,
    teacher,
    model_inputs: dict,
    positions: torch.Tensor,
    teacher_hidden: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(D_t, H_t)``, each ``(n,)``: the divergence (with the student's gradient) and the student's entropy of the
    ``n`` loss tokens of one pass. ``student``/``teacher``: the unwrapped models; ``model_inputs``: the pass's rows;
    ``positions``: the flat row position whose next-token prediction is each loss token; ``teacher_hidden``
    ``(n, teacher hidden size)``: the teacher's hidden states there. Called inside the student's wrapper
    (``_forward_redirection``), as stock does, so that DDP, FSDP and ZeRO-3 see a forward."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    hidden = backbone_hidden_states(student, model_inputs)
    hidden = hidden.reshape(-1, hidden.size(-1))[positions]
    student_head, teacher_head = student.get_output_embeddings(), teacher.get_output_embeddings()
    student_weight, student_bias = _full(student_head.weight, student_head.bias, hidden.dtype)
    teacher_weight, teacher_bias = _full(teacher_head.weight, teacher_head.bias, teacher_hidden.dtype)
    hidden = hidden.to(student_weight.device)
    teacher_hidden = teacher_hidden.to(teacher_weight.device)
    return ChunkedDivergenceFunction.apply(
        hidden,
        student_weight,
        student_bias,
        teacher_hidden,
        teacher_weight,
        teacher_bias,
        settings.beta,
        settings.temperature,
        settings.student_scale,
        settings.student_softcap,
        settings.teacher_scale,
        settings.teacher_softcap,
    )


def distillation_pass_loss(per_token_divergence: torch.Tensor, rows: SampleRows):
    """The loss of one pass's samples: ``per_token_divergence`` ``(rows, width)`` (0 off the loss tokens) times each
    sample's weight, summed; and the tensors stock logs besides the entropy (none)."""
    weights = rows.policy_weights.to(per_token_divergence.dtype).unsqueeze(1)
    loss = (per_token_divergence * rows.mask.to(per_token_divergence.dtype) * weights).sum()
    return loss, {}


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

    def prepare(self, executor, model, batch: StepBatch, *, gradient_accumulation_steps: int) -> None:
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


def _add_fused_lm_head(model, temperature: float) -> None:
    """TRL's fused LM head on ``model`` (the base model under PEFT, as ``GRPOTrainer`` adds it), once."""
    from trl.trainer.utils import add_fused_lm_head

    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if not getattr(base, "_dynbsz_fused_lm_head", False):
        add_fused_lm_head(base, temperature=temperature, outputs=("log_probs", "entropy"))
        base._dynbsz_fused_lm_head = True

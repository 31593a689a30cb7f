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
from accelerate.utils import is_peft_model

from hf_dynbsz.execution.batch import SampleRows
from hf_dynbsz.planning.cost import text_config_of

__all__ = [
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


def backbone_hidden_states(unwrapped, model_inputs: dict) -> torch.Tensor:
    """The last hidden states of ``unwrapped`` (a model, or a PEFT model) over one pass's rows, as stock's
    ``_get_last_hidden_state`` runs it: the backbone under the LM head (``base_model``), no KV cache."""
    if is_peft_model(unwrapped):
        unwrapped = unwrapped.base_model.model
    return unwrapped.base_model(**model_inputs, use_cache=False).last_hidden_state


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

"""DPO's loss per preference pair with stock's weights, and what its logged metrics read (torch layer, no trainer
state).

TRL 1.16's ``DPOTrainer._compute_loss`` scores each micro-batch of ``B`` pairs (``per_device_train_batch_size``),
padded by ``DataCollatorForPreference`` as ``[chosen rows ; rejected rows]``, each row ``[prompt | response]``:

=======================  ===========================================================================================
quantity                 stock, per micro-batch (slice)
=======================  ===========================================================================================
sequence log-prob        ``s = sum_t w_t logp_t`` over the response's scored tokens (``completion_mask[1:]``), ``w_t``
                         1, or with ``ld_alpha`` 1 over the first ``min(|chosen|, |rejected|)`` tokens and ``ld_alpha``
                         after (LD-DPO)
log-ratio                ``s - s_ref``, the reference's ``s_ref`` from its no-grad forward (or the dataset's
                         precomputed column); scores: the log-ratio, or its ``f_divergence_type`` transform
pair loss                per ``loss_type``, a function of the pair's two log-ratios / scores (and response lengths for
                         ``ipo`` and ``sigmoid_norm``), times the WPO weights ``exp(mean aligned logp)`` of both
                         responses (``use_weighting``, no gradient)
slice loss               ``sum_k loss_weight_k mean_pairs(loss_k)`` + MoE ``coef aux``; divided by GA by the Trainer
                         (``loss_is_scaled_for_ga`` False)
weight of pair i         ``1 / (B GA)``: a pair's loss depends on its own two sequences alone
=======================  ===========================================================================================

So a training pass holding a pair's chosen and rejected (:attr:`~hf_dynbsz.execution.packing.SequenceTable.together`:
the planner never splits a pair) computes the pair's loss exactly as stock does (:func:`dpo_pass_loss`), whatever
else is in the pass. Three loss types couple a micro-batch's pairs: ``aot`` and ``aot_unpaired`` sort the
micro-batch's log-ratios, and ``sft`` is the token mean of the micro-batch's chosen tokens. ``sft`` is linear in the
token log-probs: each chosen token's weight ``-loss_weight / (N GA)`` (``N`` the slice's chosen tokens) is known
before the passes. The sorted losses keep stock's micro-batch as their unit through a no-grad policy pass before the
training passes: each slice's loss is computed from those log-probs and its derivative ``dL/ds_i`` becomes sample
``i``'s coefficient (:func:`coupled_coefficients`); a training pass adds ``c_i (s_i - stop_grad(s_i))`` (stock's
gradient) plus the slice's loss value spread over its samples (stock's logged loss).

Stock logs its metrics once per micro-batch, over that micro-batch of every process; each pass gives per row the sums
and counts they are made of (:func:`pass_metrics`), kept per stock slice by
:class:`~hf_dynbsz.execution.metrics.StepMetrics`. ``tests/test_dpo_loss.py`` checks this table against stock's
``_compute_loss``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_dynbsz.execution.batch import SampleRows, StepBatch, pair_step_batch
from hf_dynbsz.execution.device_pass import named_pass
from hf_dynbsz.execution.metrics import StepMetrics
from hf_dynbsz.execution.reference import ReferenceLoss, sequence_logps
from hf_dynbsz.execution.router_loss import captured_router_logits
from hf_dynbsz.planning.model_support import rope_width

__all__ = [
    "COUPLED_LOSS_TYPES",
    "DPOLoss",
    "DPOSettings",
    "METRIC_KEYS",
    "PAIR_FIELDS",
    "completion_row_shape",
    "coupled_coefficients",
    "dpo_pass_loss",
    "dpo_step_batch",
    "pair_losses",
    "pass_outputs",
    "sequence_logps",
    "sft_coefficients",
]

#: Loss types whose per-pair loss depends on the other pairs of the micro-batch through a sort.
COUPLED_LOSS_TYPES = ("aot", "aot_unpaired")
#: Every loss type of TRL 1.16's DPOTrainer.
LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)  # fmt: skip
#: The per-sample values that travel with a sample (one per sequence): ``side`` 1 for a chosen response, 0 for a
#: rejected one; ``shared`` the pair's shared response length of LD-DPO; ``response`` the response's tokens of stock's
#: (unshifted) completion mask; ``ref_logps`` the reference's sequence log-prob; ``coefficient`` / ``offset`` a
#: coupled loss's ``dL/ds`` and value share; ``sft`` the weight of each chosen token's log-prob in the SFT term.
PAIR_FIELDS = ("side", "shared", "response", "ref_logps", "coefficient", "offset", "sft")
#: The metrics stock logs besides ``entropy`` (and ``num_tokens``, ``aux_loss``), per slice.
METRIC_KEYS = (
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
    "logits/chosen", "logits/rejected", "mean_token_accuracy",
)  # fmt: skip


@dataclass(frozen=True)
class DPOSettings:
    """What a ``DPOTrainer`` computes its loss with, read once."""

    beta: float
    loss_types: tuple[str, ...]
    loss_weights: tuple[float, ...]
    ld_alpha: float | None
    f_divergence_type: str
    f_alpha_divergence_coef: float
    label_smoothing: float
    use_weighting: bool
    discopop_tau: float

    @classmethod
    def from_trainer(cls, trainer) -> DPOSettings:
        return cls(
            beta=trainer.beta,
            loss_types=tuple(trainer.loss_types),
            loss_weights=tuple(trainer.loss_weights),
            ld_alpha=trainer.ld_alpha,
            f_divergence_type=trainer.f_divergence_type,
            f_alpha_divergence_coef=trainer.f_alpha_divergence_coef,
            label_smoothing=trainer.label_smoothing,
            use_weighting=trainer.use_weighting,
            discopop_tau=trainer.args.discopop_tau,
        )

    @property
    def coupled(self) -> bool:
        """Whether a loss type sorts the micro-batch's pairs (coefficients from a no-grad policy pass)."""
        return any(loss_type in COUPLED_LOSS_TYPES for loss_type in self.loss_types)

    @property
    def outputs(self) -> tuple[str, ...]:
        """The fused LM head's per-token outputs a training pass reads."""
        return ("log_probs", "entropy", "mean_logits", "is_top1") + (
            ("log_sum_sq_probs",) if self.use_weighting else ()
        )


# ---------------------------------------------------------------------------------------------------- the step's pairs
def dpo_step_batch(
    window: list[dict], rank: int = 0, num_processes: int = 1, long_rope: tuple[int, ...] = ()
) -> StepBatch:
    """The pairs of one optimizer step of process ``rank`` (``window``: its stock micro-batches, each
    ``DataCollatorForPreference``'s ``input_ids`` / ``attention_mask`` / ``completion_mask`` of ``[chosen ; rejected]``
    rows, with ``ref_chosen_logps`` / ``ref_rejected_logps`` when precomputed) as a :class:`StepBatch`: each pair's
    chosen then rejected, adjacent, the pair's ``together`` id shared (the planner keeps them in one pass).

    A row's prompt is its tokens before the first scored one (the first response token after position 0), its
    completion the rest (a response with no scored token: all prompt). A row whose completion mask is not ``[0 ... 0
    1 ... 1]`` up to its last real token is not one of ``DataCollatorForPreference``'s: ``ValueError`` (a custom
    collator's steps train stock's micro-batches, decided at start). ``long_rope``: the run's LongRoPE models'
    ``original_max_position_embeddings`` (:attr:`~hf_dynbsz.planning.model_support.ModelSupport.long_rope`): each
    sample takes the rope width of its micro-batch's padded width, as stock's forward picks its factors.
    """
    tokens, prompts, completions, fields = [], [], [], {name: [] for name in PAIR_FIELDS}
    slice_ids, slice_tokens, together, widths = [], [], [], []
    for slice_index, inputs in enumerate(window):
        rows = inputs["input_ids"].size(0)
        pairs = rows // 2
        real = inputs["attention_mask"].sum(1).tolist()
        masks = inputs["completion_mask"].cpu()
        ref = _precomputed(inputs, pairs)
        for j in range(pairs):
            shapes = []
            for row in (j, pairs + j):
                shape = completion_row_shape(masks[row], int(real[row]))
                if shape is None:
                    raise ValueError(
                        f"micro-batch {slice_index}, row {row}: its completion_mask is not one run of response tokens "
                        "to the row's end, as DataCollatorForPreference builds it"
                    )
                shapes.append(shape)
            shared = min(completion for _, completion, _ in shapes)
            for side, (row, (prompt, completion, response)) in enumerate(zip((j, pairs + j), shapes)):
                tokens.append(inputs["input_ids"][row, : prompt + completion])
                prompts.append(prompt)
                completions.append(completion)
                values = (1.0 - side, shared, response, ref[j][side], 0.0, 0.0, 0.0)
                for name, value in zip(PAIR_FIELDS, values):
                    fields[name].append(value)
                slice_ids.append(rank * len(window) + slice_index)
                together.append(len(together) // 2)
                widths.append(rope_width(inputs["input_ids"].size(1), tuple(long_rope)))
        slice_tokens.append(rows * inputs["input_ids"].size(1))
    return pair_step_batch(window, tokens, prompts, completions, fields, slice_ids, slice_tokens, together, widths,
                           rank, num_processes, long_rope)  # fmt: skip


def completion_row_shape(mask: torch.Tensor, real: int) -> tuple[int, int, int] | None:
    """``(prompt, completion, response)`` of a row with ``real`` tokens and completion ``mask``: the tokens before the
    first scored response token, the scored ones (every real token from there), and stock's completion-mask count
    (which counts a response token at position 0, never scored); None when the mask is not one run to the end."""
    mask = mask[:real]
    response = int(mask.sum())
    scored = torch.nonzero(mask[1:]).flatten()
    if not scored.numel():
        return real, 0, response
    first = int(scored[0]) + 1
    if int(mask[first:].sum()) != real - first:
        return None
    return first, real - first, response


def _precomputed(inputs: dict, pairs: int) -> list[tuple[float, float]]:
    """Each pair's precomputed reference log-probs (chosen, rejected), or zeros when the reference's passes give
    them."""
    chosen, rejected = inputs.get("ref_chosen_logps"), inputs.get("ref_rejected_logps")
    if chosen is None or rejected is None:
        return [(0.0, 0.0)] * pairs
    return list(zip(chosen.float().tolist(), rejected.float().tolist()))


# ---------------------------------------------------------------------------------------------------- a pass
def pass_outputs(executor, model, mb, outputs: tuple[str, ...], router: bool = False):
    """The fused LM head's per-token ``outputs`` of one pass of ``model`` over micro-batch ``mb``, each
    completion-aligned ``(rows, width)`` (``is_top1`` as 0/1 floats), and for ``router`` its router logits (or None):
    the forward stock's ``_compute_loss`` runs, on the pass's row."""
    extra = {"output_router_logits": True} if router else {}
    unwrapped = executor.accelerator.unwrap_model(model)
    capture = captured_router_logits(unwrapped) if router else contextlib.nullcontext()
    inputs, labels = named_pass(mb, executor.parallel)  # its segment layout and rope widths, this process's part
    with executor.accelerator.autocast(), capture as router_logits:
        result = model(**inputs, shift_labels=labels, fused_lm_head=True, **extra)
    fields = {}
    for name in outputs:
        value = executor.parallel.gather(getattr(result, name))
        fields[name] = mb.to_completion_layout(value.float() if name == "is_top1" else value)
    return fields, router_logits[-1] if router else None


def _scores(settings: DPOSettings, logratios: torch.Tensor) -> torch.Tensor:
    """The ``f_divergence_type`` transform of log-ratios (stock's chosen/rejected scores)."""
    kind = settings.f_divergence_type
    if kind == "reverse_kl":
        return logratios
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if kind == "alpha_divergence":
        alpha = settings.f_alpha_divergence_coef
        if abs(alpha - 1.0) < 1e-6:
            return logratios
        coefficient = 1.0 / (alpha - 1.0)  # stock multiplies by it (dividing by alpha - 1 rounds differently)
        scaled = (alpha - 1.0) * logratios
        cap = {torch.float16: 11.0, torch.bfloat16: 80.0, torch.float32: 80.0}[scaled.dtype]
        return (torch.exp(torch.clamp(scaled.float(), max=cap)) - 1.0).to(scaled.dtype) * coefficient
    raise ValueError(f"Unknown f_divergence_type: {kind}")


def _smoothed_sigmoid(settings: DPOSettings, delta: torch.Tensor) -> torch.Tensor:
    smoothing, beta = settings.label_smoothing, settings.beta
    return -F.logsigmoid(beta * delta) * (1 - smoothing) - F.logsigmoid(-beta * delta) * smoothing


def _pair_loss(settings: DPOSettings, loss_type: str, pairs: dict) -> torch.Tensor:
    """Stock's per-pair loss of one (not coupled, not SFT) ``loss_type``; ``pairs``: the pairs' tensors."""
    beta, smoothing = settings.beta, settings.label_smoothing
    delta = pairs["delta"]
    chosen, rejected = beta * pairs["chosen_logratios"], beta * pairs["rejected_logratios"]
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type in ("ipo", "sigmoid_norm"):
        normed = (
            pairs["chosen_scores"] / pairs["chosen_response"] - pairs["rejected_scores"] / pairs["rejected_response"]
        )
        return (normed - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * normed)
    if loss_type == "exo_pair":
        epsilon = torch.tensor(smoothing, device=delta.device)
        won = torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - torch.log1p(-epsilon))
        return won + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - torch.log(epsilon))
    if loss_type == "nca_pair":
        return -F.logsigmoid(chosen) - 0.5 * F.logsigmoid(-chosen) - 0.5 * F.logsigmoid(-rejected)
    if loss_type == "robust":
        clean = -(1 - smoothing) * F.logsigmoid(beta * delta)
        return (clean + smoothing * F.logsigmoid(-beta * delta)) / (1 - 2 * smoothing)
    if loss_type == "bco_pair":
        return -F.logsigmoid(chosen) - F.logsigmoid(-rejected)
    if loss_type == "sppo_hard":
        half = 0.5 / beta
        return (pairs["chosen_logratios"] - half) ** 2 + (pairs["rejected_logratios"] + half) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(chosen) + torch.sigmoid(rejected)
    if loss_type == "apo_down":
        return torch.sigmoid(chosen) + 1 - torch.sigmoid(chosen - rejected)
    if loss_type == "discopop":
        logits = beta * delta
        modulation = torch.sigmoid(logits / settings.discopop_tau)
        return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
    raise ValueError(
        f"Unknown loss type: {loss_type}. Should be one of {list(LOSS_TYPES)}"
    )  # (stock raises at its first loss; the config is checked at start)


def _pairs(settings: DPOSettings, seq: torch.Tensor, ref: torch.Tensor, response: torch.Tensor) -> dict:
    """The pairs' tensors the losses read, from ``(pairs, 2)`` sequence log-probs, reference log-probs and response
    lengths (chosen first)."""
    logratios = seq - ref
    scores = _scores(settings, logratios)
    lengths = response.clamp(min=1.0)
    return {
        "chosen_logratios": logratios[:, 0],
        "rejected_logratios": logratios[:, 1],
        "chosen_scores": scores[:, 0],
        "rejected_scores": scores[:, 1],
        "delta": scores[:, 0] - scores[:, 1],
        "chosen_response": lengths[:, 0],
        "rejected_response": lengths[:, 1],
    }


def pair_losses(settings: DPOSettings, seq: torch.Tensor, ref: torch.Tensor, response: torch.Tensor, wpo=None):
    """``(pairs,)``: each pair's ``sum_k loss_weight_k loss_k`` over the loss types that depend on the pair alone (all
    but :data:`COUPLED_LOSS_TYPES` and ``sft``), times the WPO weights ``wpo`` (pairs,) when given; ``seq``, ``ref``,
    ``response``: ``(pairs, 2)``, chosen first."""
    pairs = _pairs(settings, seq, ref, response)
    total = torch.zeros_like(pairs["delta"])
    for loss_type, weight in zip(settings.loss_types, settings.loss_weights):
        if loss_type in COUPLED_LOSS_TYPES or loss_type == "sft":
            continue
        loss = _pair_loss(settings, loss_type, pairs)
        total = total + (loss * wpo if wpo is not None else loss) * weight
    return total


def coupled_losses(settings: DPOSettings, seq: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The scalar ``sum_k loss_weight_k mean(loss_k)`` of one micro-batch's pairs over :data:`COUPLED_LOSS_TYPES`
    (``seq``, ``ref``: its ``(pairs, 2)`` sequence and reference log-probs, chosen first): the sorted losses."""
    total = seq.new_zeros(())
    for loss_type, weight in zip(settings.loss_types, settings.loss_weights):
        if loss_type == "aot":
            policy, reference = seq[:, 0] - seq[:, 1], ref[:, 0] - ref[:, 1]
            delta = torch.sort(policy, dim=0)[0] - torch.sort(reference, dim=0)[0]
        elif loss_type == "aot_unpaired":
            logratios = seq - ref
            delta = torch.sort(logratios[:, 0], dim=0)[0] - torch.sort(logratios[:, 1], dim=0)[0]
        else:
            continue
        total = total + _smoothed_sigmoid(settings, delta).mean() * weight
    return total


def coupled_coefficients(
    settings: DPOSettings, seq: torch.Tensor, ref: torch.Tensor, slice_ids: torch.Tensor, ga: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample, ``(dL/ds, value share)`` of the sorted losses (:func:`coupled_losses`) of its stock slice divided by
    ``ga``: ``seq`` / ``ref`` ``(samples,)`` in pair order (chosen, rejected, ...), from a no-grad pass;
    ``slice_ids`` ``(samples,)``. The value share is the slice's loss over its samples (their sum is the slice's)."""
    coefficient, offset = torch.zeros_like(seq), torch.zeros_like(seq)
    for slice_id in torch.unique(slice_ids).tolist():
        rows = torch.nonzero(slice_ids == slice_id).flatten().to(seq.device)
        leaf = seq[rows].detach().clone().requires_grad_(True)
        with torch.enable_grad():
            loss = coupled_losses(settings, leaf.view(-1, 2), ref[rows].view(-1, 2)) / ga
            (grad,) = torch.autograd.grad(loss, leaf)
        coefficient[rows] = grad
        offset[rows] = loss.detach() / rows.numel()
    return coefficient, offset


def sft_coefficients(settings: DPOSettings, batch: StepBatch, ga: int) -> torch.Tensor:
    """Per sample, the weight of each of its scored tokens' log-probs in the ``sft`` term: ``-loss_weight / (N GA)``
    for a chosen response (``N`` its stock slice's scored chosen tokens: stock's token mean), 0 for a rejected one."""
    weight = sum(w for loss_type, w in zip(settings.loss_types, settings.loss_weights) if loss_type == "sft")
    chosen = batch.per_token["side"].squeeze(1).cpu()
    tokens = batch.loss_mask.sum(1).cpu().double() * chosen.double()
    slices = torch.zeros(len(batch.slice_rows), dtype=torch.float64).index_add_(0, batch.slice_ids, tokens)
    per_sample = -weight / (slices[batch.slice_ids] * ga) * chosen.double()
    return per_sample.float().to(batch.loss_mask.device)


def _wpo_weights(per_token: torch.Tensor, sum_sq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(rows,)`` WPO weights: ``exp`` of the mean over the scored tokens of ``logp - log sum p^2`` (no gradient)."""
    with torch.no_grad():
        aligned = ((per_token - sum_sq) * mask).sum(1)
        return torch.exp(aligned / mask.sum(1).clamp(min=1))


def dpo_pass_loss(settings: DPOSettings, values: dict, rows: SampleRows, sft: bool):
    """The loss of one pass's pairs (``values``: :func:`pass_outputs`' per-token tensors, rows in pair order) with
    stock's weights, and the per-row ``(sums, counts)`` its metrics read (:func:`pass_metrics`).

    Per pair ``1 / (B GA)`` (``rows.policy_weights``) times its own losses; per sample a coupled loss's
    ``c_i (s_i - stop_grad(s_i)) + offset_i``; per chosen token the SFT weight."""
    per_token, mask = values["log_probs"], rows.mask.to(values["log_probs"].dtype)
    fields = {name: rows.per_token[name].squeeze(1) for name in PAIR_FIELDS}
    seq = sequence_logps(per_token, mask, rows.per_token["shared"], settings.ld_alpha)
    ref = fields["ref_logps"].to(seq.dtype)
    wpo = None
    if settings.use_weighting:
        weights = _wpo_weights(per_token, values["log_sum_sq_probs"], mask).view(-1, 2)
        wpo = weights[:, 0] * weights[:, 1]
    losses = pair_losses(settings, seq.view(-1, 2), ref.view(-1, 2), fields["response"].view(-1, 2), wpo)
    pair_weights = rows.policy_weights.view(-1, 2)[:, 0].to(losses.dtype)
    loss = (losses * pair_weights).sum()
    if settings.coupled:
        coefficient, offset = fields["coefficient"].to(seq.dtype), fields["offset"].to(seq.dtype)
        loss = loss + (coefficient * (seq - seq.detach()) + offset).sum()
    if sft:
        loss = loss + (fields["sft"].to(seq.dtype) * (per_token * mask).sum(1)).sum()
    return loss, pass_metrics(settings.beta, values, mask, seq.detach(), ref, fields["side"])


def pass_metrics(beta: float, values: dict, mask: torch.Tensor, seq: torch.Tensor, ref: torch.Tensor, side):
    """Per row ``(sums, counts)`` of stock's metrics (:data:`METRIC_KEYS`): a pair's rewards, accuracy, margin and
    sequence log-probs on its chosen row (counted once), token sums of the mean logits and top-1 hits over a row's
    scored tokens (counted per token) on the rows of their side."""
    chosen = side.to(seq.dtype)
    rejected = 1 - chosen
    rewards = (beta * (seq - ref)).view(-1, 2)
    pair = chosen.view(-1, 2)[:, 0]

    def per_pair(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.stack([values, torch.zeros_like(values)], 1).flatten(), torch.stack([pair, 0 * pair], 1).flatten()

    tokens = mask.sum(1)
    logits = (values["mean_logits"].detach() * mask).sum(1)
    return {
        "rewards/chosen": per_pair(rewards[:, 0]),
        "rewards/rejected": per_pair(rewards[:, 1]),
        "rewards/accuracies": per_pair((rewards[:, 0] > rewards[:, 1]).to(seq.dtype)),
        "rewards/margins": per_pair(rewards[:, 0] - rewards[:, 1]),
        "logps/chosen": per_pair(seq.view(-1, 2)[:, 0]),
        "logps/rejected": per_pair(seq.view(-1, 2)[:, 1]),
        "logits/chosen": (logits * chosen, tokens * chosen),
        "logits/rejected": (logits * rejected, tokens * rejected),
        "mean_token_accuracy": ((values["is_top1"] * mask).sum(1) * chosen, tokens * chosen),
    }


class DPOLoss(ReferenceLoss):
    """``DPOTrainer``'s loss: each pair's losses from its chosen and rejected sequence log-probs (one pass holds both),
    weight ``1 / (B GA)``; the sorted losses (``aot``, ``aot_unpaired``) through coefficients from a no-grad policy
    pass, ``sft`` through its token weights (:mod:`hf_dynbsz.execution.dpo_loss`); the reference's log-probs from its
    own passes before the step (:class:`~hf_dynbsz.execution.reference.Reference`). Stock's metrics per stock slice
    (:class:`~hf_dynbsz.execution.metrics.StepMetrics`), ``num_tokens`` summed over processes once per step.

    ``blocker``: why this run cannot repack its steps (the trainer then runs stock's), or None."""

    def __init__(self, trainer) -> None:
        super().__init__(trainer)
        self.settings = DPOSettings.from_trainer(trainer)
        self.sft = "sft" in self.settings.loss_types
        self.blocker = _dpo_blocker(trainer, self.settings)

    def weigh(self, batch: StepBatch, entropies: torch.Tensor | None, *, gradient_accumulation_steps: int) -> None:
        pairs = batch.slice_rows.double()[batch.slice_ids] / 2
        batch.policy_weights = 1.0 / (pairs * float(gradient_accumulation_steps))
        batch.entropy_weights = torch.zeros_like(batch.policy_weights)
        if self.sft:
            batch.per_token["sft"] = sft_coefficients(self.settings, batch, gradient_accumulation_steps).unsqueeze(1)

    def reserved_mib(self, batch: StepBatch, rank: int, schedule) -> float:
        return 0.0  # the reference's log-probs and a sorted loss's coefficients are a few values per sample

    def prepare(self, executor, model, batch: StepBatch, *, gradient_accumulation_steps: int) -> None:
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
            self.settings, seq, ref, batch.slice_ids, gradient_accumulation_steps
        )
        device = batch.per_token["coefficient"].device
        batch.per_token["coefficient"] = coefficient.unsqueeze(1).float().to(device)
        batch.per_token["offset"] = offset.unsqueeze(1).float().to(device)

    def attempt(self, batch: StepBatch) -> int:
        return int(batch.table.lengths.sum())  # the real tokens this process runs (stock's attention mask's sum)

    def metrics(self, batch: StepBatch) -> StepMetrics:
        return StepMetrics(len(batch.slice_rows) // self.num_processes, self.device, METRIC_KEYS)

    def forward(self, executor, model, mb, rows: SampleRows, batch: StepBatch, router: bool):
        values, router_logits = pass_outputs(executor, model, mb, self.settings.outputs, router)
        return values, values["entropy"], router_logits

    def pass_loss(self, state, values, entropies, rows: SampleRows):
        return dpo_pass_loss(self.settings, values, rows, self.sft)


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

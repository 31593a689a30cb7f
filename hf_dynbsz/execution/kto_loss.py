"""KTO's loss per unpaired sample with stock's weights, its KL estimate per stock micro-batch, and the metrics stock
logs (torch layer, no trainer state).

TRL 1.16's ``KTOTrainer._compute_loss`` scores each micro-batch of ``B`` samples (``per_device_train_batch_size``),
right-padded by ``DataCollatorForUnpairedPreference``: each row ``[prompt | completion]`` with its ``label`` (desirable
or not), and for ``loss_type="kto"`` a second set of rows ``[prompt | another row's completion]`` (the KL sequences,
the completions rotated by one within each batch of ``B`` at dataset preparation):

=======================  ===========================================================================================
quantity                 stock, per micro-batch (slice)
=======================  ===========================================================================================
sequence log-prob        ``s = sum_t logp_t`` over the completion's scored tokens (``completion_mask[1:]``), the
                         policy's with gradient; the reference's ``s_ref`` under no grad (or the dataset's
                         precomputed ``ref_logps``)
KL estimate ``z``        ``kto``: the mean over the slice's KL sequences of the policy's (no grad) minus the
                         reference's sequence log-probs, gathered over processes (``gather_for_metrics``: at the end
                         of the data only the first ``remainder`` values), their mean, clamped at 0, detached;
                         ``apo_zero_unpaired``: 0
sample loss              desirable: ``1 - sigmoid(beta (s - s_ref - z))`` (``apo_zero_unpaired``: without ``z``),
                         times ``desirable_weight``; undesirable: ``1 - sigmoid(beta (z - s + s_ref))``
                         (``apo_zero_unpaired``: ``sigmoid(beta (s - s_ref))``), times ``undesirable_weight``
slice loss               the mean over the slice's samples + MoE ``coef aux``; divided by GA by the Trainer
weight of sample i       ``{desirable,undesirable}_weight / (B GA)``: with ``z`` known, a sample's loss depends on
                         its own sequence alone
=======================  ===========================================================================================

So the step's KL sequences run first, in no-grad passes of their own (the policy's over them; the reference's over
them and the step's samples together, each prompt shared through the prefix tree), ``z`` is computed per stock
micro-batch exactly as stock computes it (:func:`kl_estimates`), and every training pass then computes its samples'
losses as stock does, whatever else is in the pass (:func:`kto_pass_loss`). ``tests/test_kto_trainer.py`` checks the
whole against stock's runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_dynbsz.execution.batch import SampleRows, StepBatch, pair_step_batch
from hf_dynbsz.execution.dpo_loss import completion_row_shape, pass_outputs
from hf_dynbsz.execution.metrics import StepMetrics
from hf_dynbsz.execution.packing import SequenceTable
from hf_dynbsz.execution.reference import ReferenceLoss
from hf_dynbsz.parallel.collectives import gather_rows
from hf_dynbsz.planning.model_support import rope_width

__all__ = [
    "KLSequences",
    "KTOLoss",
    "KTOMetrics",
    "KTOSettings",
    "KTOStepBatch",
    "METRIC_KEYS",
    "SAMPLE_FIELDS",
    "kl_estimates",
    "kto_blocker",
    "kto_pass_loss",
    "kto_step_batch",
]

#: The per-sample values that travel with a sample: ``label`` 1 for a desirable completion, 0 for an undesirable one;
#: ``ref_logps`` the reference's sequence log-prob; ``kl`` its stock micro-batch's KL estimate (set before the passes);
#: ``counted`` 1 where stock's metrics count the sample, 0 where its ``gather_for_metrics`` drops the values of the
#: sample's process (at the end of the data, processes from ``remainder`` on).
SAMPLE_FIELDS = ("label", "ref_logps", "kl", "counted")
#: The metrics stock logs per micro-batch besides ``entropy``, ``num_tokens``, ``rewards/margins`` and ``aux_loss``.
METRIC_KEYS = (
    "kl", "logits/chosen", "logits/rejected", "rewards/chosen", "logps/chosen", "rewards/rejected", "logps/rejected",
)  # fmt: skip
#: The keys of ``DataCollatorForUnpairedPreference``'s micro-batches, all read by the passes (every other key stock
#: passes to the model as an input).
COLLATED_KEYS = frozenset(
    {
        "input_ids", "attention_mask", "completion_mask", "KL_input_ids", "KL_attention_mask", "KL_completion_mask",
        "label", "ref_logps", "ref_KL_logps",
    }
)  # fmt: skip


@dataclass(frozen=True)
class KTOSettings:
    """What a ``KTOTrainer`` computes its loss with, read once."""

    beta: float
    loss_type: str
    desirable_weight: float
    undesirable_weight: float

    @classmethod
    def from_trainer(cls, trainer) -> KTOSettings:
        return cls(
            beta=trainer.beta,
            loss_type=trainer.loss_type,
            desirable_weight=trainer.desirable_weight,
            undesirable_weight=trainer.undesirable_weight,
        )


# ---------------------------------------------------------------------------------------------------- the step's rows
@dataclass
class KLSequences:
    """A step's KL sequences on this process (stock's ``KL_input_ids`` rows): ``table`` their tokens (each its prompt
    and the mismatched completion), ``slice_index`` ``(samples,)`` each one's stock micro-batch within the step (0 to
    the window's length), ``ref_logps`` the dataset's precomputed reference log-probs (None: the reference's passes
    compute them), ``stock_tokens`` the padded tokens of stock's largest KL micro-batch, ``kept_processes`` per
    micro-batch how many processes' estimates stock's gather keeps."""

    table: SequenceTable
    slice_index: torch.Tensor
    ref_logps: torch.Tensor | None
    stock_tokens: int
    kept_processes: list[int]

    @property
    def width(self) -> int:
        return max(int(self.table.completion_lengths.max()), 1) if len(self.table) else 1


@dataclass
class KTOStepBatch(StepBatch):
    """A KTO step's :class:`~hf_dynbsz.execution.batch.StepBatch` (the samples trained) and its KL sequences (None for
    ``apo_zero_unpaired``, which estimates no KL)."""

    kl_sequences: KLSequences | None = None


def _unpadded_rows(inputs: dict, prefix: str, slice_index: int) -> list[tuple[torch.Tensor, int, int]]:
    """Each row of one collated set (``prefix`` "" or "KL_") as ``(tokens, prompt, completion)``: its real tokens, the
    tokens before its first scored completion token, and the scored ones (:func:`completion_row_shape`)."""
    ids, masks = inputs[f"{prefix}input_ids"], inputs[f"{prefix}completion_mask"].cpu()
    rows = []
    for row, real in enumerate(inputs[f"{prefix}attention_mask"].sum(1).tolist()):
        shape = completion_row_shape(masks[row], int(real))
        if shape is None:
            raise ValueError(
                f"micro-batch {slice_index}, {prefix}row {row}: its completion_mask is not one run of completion "
                "tokens to the row's end, as DataCollatorForUnpairedPreference builds it"
            )
        prompt, completion, _ = shape
        rows.append((ids[row, : prompt + completion], prompt, completion))
    return rows


def _kl_sequences(window: list[dict], long_rope: tuple[int, ...], kept_processes: list[int]) -> KLSequences:
    """The KL sequences of ``window``'s micro-batches (:class:`KLSequences`)."""
    tokens, prompts, completions, slice_index, widths, padded = [], [], [], [], [], []
    for k, inputs in enumerate(window):
        for sequence, prompt, completion in _unpadded_rows(inputs, "KL_", k):
            tokens.append(sequence)
            prompts.append(prompt)
            completions.append(completion)
            slice_index.append(k)
            widths.append(rope_width(inputs["KL_input_ids"].size(1), tuple(long_rope)))
        padded.append(inputs["KL_input_ids"].numel())
    table = SequenceTable(tokens, torch.tensor(prompts), torch.tensor(completions))
    table.rope_widths = torch.tensor(widths, dtype=torch.long) if long_rope else None
    precomputed = all("ref_KL_logps" in inputs for inputs in window)
    ref = torch.cat([inputs["ref_KL_logps"].float().cpu() for inputs in window]) if precomputed else None
    return KLSequences(table, torch.tensor(slice_index), ref, max(padded), kept_processes)


def kto_step_batch(
    window: list[dict],
    rank: int = 0,
    num_processes: int = 1,
    long_rope: tuple[int, ...] = (),
    kept_processes: list[int] | None = None,
) -> KTOStepBatch:
    """The samples of one optimizer step of process ``rank`` (``window``: its stock micro-batches, each
    ``DataCollatorForUnpairedPreference``'s rows, with ``KL_*`` rows for ``kto`` and ``ref_logps`` / ``ref_KL_logps``
    when precomputed) as a :class:`KTOStepBatch`. Each sample is its row's real tokens (its prompt: the tokens before
    its first scored completion token); no sample depends on another once the KL estimates are known, so the planner
    may cut the step anywhere. ``long_rope``: the run's LongRoPE models' ``original_max_position_embeddings`` (each
    sample takes the rope width of its micro-batch's padded width); ``kept_processes``: per micro-batch, the processes'
    estimates stock's gather keeps (default: all; stock's metrics count those processes' samples alone)."""
    kept_processes = kept_processes or [num_processes] * len(window)
    tokens, prompts, completions, fields = [], [], [], {name: [] for name in SAMPLE_FIELDS}
    slice_ids, slice_tokens, widths = [], [], []
    for k, inputs in enumerate(window):
        labels = inputs["label"].float().tolist()
        ref = inputs["ref_logps"].float().tolist() if "ref_logps" in inputs else [0.0] * len(labels)
        for row, (sequence, prompt, completion) in enumerate(_unpadded_rows(inputs, "", k)):
            tokens.append(sequence)
            prompts.append(prompt)
            completions.append(completion)
            for name, value in zip(SAMPLE_FIELDS, (labels[row], ref[row], 0.0, float(rank < kept_processes[k]))):
                fields[name].append(value)
            slice_ids.append(rank * len(window) + k)
            widths.append(rope_width(inputs["input_ids"].size(1), tuple(long_rope)))
        slice_tokens.append(inputs["input_ids"].numel())
    batch = pair_step_batch(window, tokens, prompts, completions, fields, slice_ids, slice_tokens, None, widths,
                            rank, num_processes, bool(long_rope))  # fmt: skip
    kl = None
    if all("KL_input_ids" in inputs for inputs in window):
        kl = _kl_sequences(window, long_rope, kept_processes)
    return KTOStepBatch(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(StepBatch)}, kl_sequences=kl)


# ---------------------------------------------------------------------------------------------------- the KL estimate
def completion_sums(per_token: torch.Tensor, completion_lengths: torch.Tensor) -> torch.Tensor:
    """``(samples,)``: each sample's completion-aligned ``per_token`` values summed over its first
    ``completion_lengths`` positions (its scored tokens)."""
    positions = torch.arange(per_token.size(1), device=per_token.device).unsqueeze(0)
    mask = positions < completion_lengths.to(per_token.device).unsqueeze(1)
    return (per_token * mask.to(per_token.dtype)).sum(1)


def kl_estimates(differences: torch.Tensor, slice_index: torch.Tensor, kept_processes: list[int]) -> torch.Tensor:
    """``(slices,)``: stock's KL estimate of each of the step's micro-batches: per micro-batch the mean of this
    process's ``differences`` (policy minus reference sequence log-probs of its KL sequences, fp32), gathered over
    processes, the first ``kept_processes[k]`` values averaged (``gather_for_metrics`` at the end of the data), clamped
    at 0. Every process calls it (one all-gather)."""
    slices = len(kept_processes)
    means = torch.stack(
        [differences[slice_index.to(differences.device) == k].mean() for k in range(slices)]
    ).float()  # as stock: the fp32 mean of the micro-batch's values
    gathered = gather_rows(means)
    return torch.stack([gathered[:kept, k].mean() for k, kept in enumerate(kept_processes)]).clamp(min=0)


# ---------------------------------------------------------------------------------------------------- a pass
def kto_pass_loss(settings: KTOSettings, values: dict, rows: SampleRows):
    """The loss of one pass's samples (``values``: :func:`~hf_dynbsz.execution.dpo_loss.pass_outputs`' per-token
    tensors) with stock's weights, and the per-row ``(sums, counts)`` its metrics read (:class:`KTOMetrics`)."""
    per_token, mask = values["log_probs"], rows.mask.to(values["log_probs"].dtype)
    seq = (per_token * mask).sum(1)
    label, ref, kl, counted = (rows.per_token[name].squeeze(1).to(seq.dtype) for name in SAMPLE_FIELDS)
    logratios = seq - ref
    beta = settings.beta
    if settings.loss_type == "kto":
        desirable, undesirable = 1 - F.sigmoid(beta * (logratios - kl)), 1 - F.sigmoid(beta * (kl - logratios))
    else:  # apo_zero_unpaired
        desirable, undesirable = 1 - F.sigmoid(beta * logratios), F.sigmoid(beta * logratios)
    chosen = label > 0.5
    losses = torch.where(chosen, settings.desirable_weight * desirable, settings.undesirable_weight * undesirable)
    loss = (losses * rows.policy_weights.to(losses.dtype)).sum()
    return loss, pass_metrics(beta, values, mask, seq.detach(), ref, kl, chosen.to(seq.dtype), counted)


def pass_metrics(beta: float, values: dict, mask, seq, ref, kl, chosen, counted) -> dict:
    """Per row ``(sums, counts)`` of stock's metrics (:data:`METRIC_KEYS`): the KL estimate (its micro-batch's, on
    every row), each side's rewards and sequence log-probs (counted per row of the side), and its mean logits over
    the completion tokens (counted per token); rows stock does not count (``counted`` 0) add nothing. ``counted`` is
    passed on for the entropy (:class:`KTOMetrics`)."""
    chosen, rejected = chosen * counted, (1 - chosen) * counted
    mask = mask * counted.unsqueeze(1)
    rewards = beta * (seq - ref)
    tokens = mask.sum(1)
    logits = (values["mean_logits"].detach() * mask).sum(1)
    return {
        "kl": (kl, torch.ones_like(kl)),
        "logits/chosen": (logits * chosen, tokens * chosen),
        "logits/rejected": (logits * rejected, tokens * rejected),
        "rewards/chosen": (rewards * chosen, chosen),
        "logps/chosen": (seq * chosen, chosen),
        "rewards/rejected": (rewards * rejected, rejected),
        "logps/rejected": (seq * rejected, rejected),
        "counted": counted,
    }


class KTOMetrics(StepMetrics):
    """:class:`~hf_dynbsz.execution.metrics.StepMetrics` with stock ``KTOTrainer``'s metrics per stock slice: ``kl``,
    ``entropy`` (0 without completion tokens), and, as stock appends them, ``logits/<side>`` when the slice has
    completion tokens of that side, ``rewards/<side>`` and ``logps/<side>`` when it has samples of that side,
    ``rewards/margins`` when it has both."""

    def __init__(self, slices: int, device) -> None:
        super().__init__(slices, device, METRIC_KEYS)

    def add_pass(self, real_tokens, computed_tokens, loss_metrics, entropies, mask, slice_ids) -> None:
        """The base class's, the entropy over the completion tokens of the rows stock counts alone."""
        metrics = dict(loss_metrics)
        counted = metrics.pop("counted")
        super().add_pass(real_tokens, computed_tokens, metrics, entropies, mask * counted.unsqueeze(1), slice_ids)

    def publish_slices(self, store: dict[str, list], sums=None, maxima=None) -> None:
        sums = self.sums if sums is None else sums
        for slice_sums in sums.tolist():
            figures = {key: (slice_sums[2 * k], slice_sums[2 * k + 1]) for k, key in enumerate(self.keys)}
            total, count = figures["kl"]
            store["kl"].append(total / max(count, 1.0))
            total, count = figures["entropy"]
            store["entropy"].append(total / count if count > 0 else 0.0)
            for side in ("chosen", "rejected"):
                total, count = figures[f"logits/{side}"]
                if count > 0:
                    store[f"logits/{side}"].append(total / count)
            for side in ("chosen", "rejected"):
                total, count = figures[f"rewards/{side}"]
                if count > 0:
                    store[f"rewards/{side}"].append(total / count)
                    store[f"logps/{side}"].append(figures[f"logps/{side}"][0] / count)
            if figures["rewards/chosen"][1] > 0 and figures["rewards/rejected"][1] > 0:
                store["rewards/margins"].append(store["rewards/chosen"][-1] - store["rewards/rejected"][-1])


# ---------------------------------------------------------------------------------------------------- the loss
class KTOLoss(ReferenceLoss):
    """``KTOTrainer``'s loss for the pass executor (:class:`~hf_dynbsz.execution.step_loss.StepLoss`): before the
    passes, the reference's log-probs and each stock micro-batch's KL estimate (:meth:`prepare`); then each sample's
    loss from its own sequence log-prob, weight ``{desirable,undesirable}_weight / (B GA)``; stock's metrics per stock
    slice (:class:`KTOMetrics`), ``num_tokens`` summed over processes once per step.

    ``blocker``: why this run cannot repack its steps (the trainer then runs stock's), or None."""

    outputs = ("log_probs", "entropy", "mean_logits")

    def __init__(self, trainer) -> None:
        super().__init__(trainer)
        self.settings = KTOSettings.from_trainer(trainer)
        self.blocker = kto_blocker(trainer)

    def weigh(self, batch: StepBatch, entropies: torch.Tensor | None, *, gradient_accumulation_steps: int) -> None:
        samples = batch.slice_rows.double()[batch.slice_ids]
        batch.policy_weights = 1.0 / (samples * float(gradient_accumulation_steps))
        batch.entropy_weights = torch.zeros_like(batch.policy_weights)

    def reserved_mib(self, batch: StepBatch, rank: int, schedule) -> float:
        return 0.0  # a sample's label, reference log-prob and KL estimate are three values

    def prepare(self, executor, model, batch: KTOStepBatch, *, gradient_accumulation_steps: int) -> None:
        """The reference's log-probs of the step's samples and, for ``kto``, each stock micro-batch's KL estimate
        from the KL sequences' no-grad passes (the policy's, then the reference's over both sets together)."""
        kl = batch.kl_sequences
        if kl is None:  # apo_zero_unpaired: the reference alone
            self._reference_logps(executor, model, batch, batch.table, batch.width, batch.stock_microbatch_tokens)
            return
        with torch.no_grad():
            policy, _, _ = executor.no_grad_passes(model, kl.table, kl.width, False, kl.stock_tokens)
        policy_kl = completion_sums(policy, kl.table.completion_lengths)
        if self.reference.precomputed:
            reference_kl = kl.ref_logps.to(policy_kl)
        else:  # the reference over the step's samples and its KL sequences together
            both = SequenceTable.concat([batch.table, kl.table])
            stock_tokens = max(batch.stock_microbatch_tokens, kl.stock_tokens)
            sums = self._reference_logps(executor, model, batch, both, max(batch.width, kl.width), stock_tokens)
            reference_kl = sums[len(batch) :].to(policy_kl)
        estimates = kl_estimates(policy_kl - reference_kl, kl.slice_index, kl.kept_processes)
        local = (batch.slice_ids % len(kl.kept_processes)).to(estimates.device)
        batch.per_token["kl"] = estimates[local].float().unsqueeze(1).to(batch.per_token["label"].device)

    def _reference_logps(self, executor, model, batch: StepBatch, table, width: int, stock_tokens: int):
        """The reference's sequence log-probs of ``table`` (whose first samples are ``batch``'s), those of ``batch``'s
        samples into ``batch.per_token["ref_logps"]``; None when the dataset carries them (precomputed)."""
        if self.reference.precomputed:
            return None
        per_token = self.reference.per_token(executor, model, table, width, stock_tokens)
        sums = completion_sums(per_token, table.completion_lengths)
        batch.per_token["ref_logps"] = sums[: len(batch)].float().unsqueeze(1).to(batch.per_token["label"].device)
        return sums

    def attempt(self, batch: StepBatch) -> int:
        """The real tokens of the samples this process runs that stock's ``num_tokens`` counts (its attention mask's
        sum, but for the processes its end-of-data gather drops)."""
        counted = batch.per_token["counted"].squeeze(1).cpu().double()
        return int((batch.table.lengths.double() * counted).sum())

    def metrics(self, batch: StepBatch) -> StepMetrics:
        return KTOMetrics(len(batch.slice_rows) // self.num_processes, self.device)

    def forward(self, executor, model, mb, rows: SampleRows, batch: StepBatch, router: bool):
        values, router_logits = pass_outputs(executor, model, mb, self.outputs, router)
        return values, values["entropy"], router_logits

    def pass_loss(self, state, values, entropies, rows: SampleRows):
        return kto_pass_loss(self.settings, values, rows)


def kto_blocker(trainer) -> str | None:
    """Why a KTO run trains stock's micro-batches, or None: what the passes do not repack exactly."""
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    if getattr(trainer, "_is_vision_dataset", False):
        return "vision-language samples (their image inputs are not repacked for KTO)"
    if not isinstance(trainer.data_collator, DataCollatorForUnpairedPreference):
        name = type(trainer.data_collator).__name__
        return f"a custom data collator ({name}): the passes read DataCollatorForUnpairedPreference's rows"
    return None

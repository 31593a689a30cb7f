"""A reward model's Bradley-Terry loss per preference pair with stock's weights, its passes' scores and the metrics
stock logs (torch layer, no trainer state).

TRL 1.16's ``RewardTrainer.compute_loss`` scores each micro-batch of ``B`` pairs (``per_device_train_batch_size``),
padded on the right by ``DataCollatorForPreference`` as ``[chosen rows ; rejected rows]`` (each row the prompt and its
response, ``chosen_ids`` / ``rejected_ids``), with an ``AutoModelForSequenceClassification`` of one label:

=======================  ===========================================================================================
quantity                 stock, per micro-batch (slice)
=======================  ===========================================================================================
a sequence's reward      the score head on the base model's last hidden state at the row's rightmost token that is
                         not ``pad_token_id`` (transformers' ``GenericForSequenceClassification``; position 0 when
                         every token is); causal attention: it depends on the tokens up to that position alone
pair loss                ``-logsigmoid(r_c - r_r - margin)`` (``margin`` 0 without the column) plus
                         ``center_rewards_coefficient * (r_c + r_r) ** 2``
slice loss               the mean of the pair losses; divided by GA by the Trainer
weight of pair i         ``1 / (B GA)``: a pair's loss depends on its own two sequences alone
metrics                  ``min_reward`` / ``mean_reward`` / ``max_reward`` over the slice's ``2B`` rewards of every
                         process, ``accuracy`` (``r_c > r_r``) and ``margin`` (``r_c - r_r``) means, ``num_tokens``
                         (every process's attention-mask tokens, cumulative)
=======================  ===========================================================================================

So each sequence is cut after the token its reward is read at (:func:`reward_step_batch`: the tokens after it change
nothing), a pair's chosen and rejected share a training pass (the planner never splits a pair), their common prefix
(the prompt) computed once by the pass's prefix tree, and a pass gives every sequence's reward at its own last
position (:func:`pass_rewards`: the model's own forward over the packed row, the score head's output at every
position captured, each sequence's read off). ``tests/test_reward_loss.py`` checks this table against stock's
``compute_loss``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_dynbsz.execution.batch import SampleRows, StepBatch, pair_step_batch
from hf_dynbsz.execution.device_pass import named_pass
from hf_dynbsz.execution.metrics import StepMetrics, count_train_tokens
from hf_dynbsz.planning.model_support import base_model, rope_width

__all__ = [
    "PAIR_FIELDS",
    "RewardLoss",
    "RewardMetrics",
    "RewardSettings",
    "captured_scores",
    "check_rewards",
    "pass_rewards",
    "read_position",
    "read_positions",
    "reward_blocker",
    "reward_pass_loss",
    "reward_step_batch",
]

#: The per-sample values that travel with a sample (one per sequence): ``side`` 1 for a chosen sequence, 0 for a
#: rejected one; ``margin`` the pair's margin (0 without the column); ``tokens`` the row's attention-mask tokens
#: (stock's ``num_tokens`` counts them).
PAIR_FIELDS = ("side", "margin", "tokens")


@dataclass(frozen=True)
class RewardSettings:
    """What a ``RewardTrainer`` computes its loss with, read once."""

    center_rewards_coefficient: float | None

    @classmethod
    def from_trainer(cls, trainer) -> RewardSettings:
        return cls(center_rewards_coefficient=trainer.args.center_rewards_coefficient)


# ---------------------------------------------------------------------------------------------------- the step's pairs
def read_position(ids: torch.Tensor, real: int, pad_token_id: int | None) -> int:
    """The position stock's sequence-classification head reads a row's reward at: its rightmost token that is not
    ``pad_token_id`` among its ``real`` tokens (0 when none is; the last real token without a pad token)."""
    if pad_token_id is None:
        return real - 1
    kept = torch.nonzero(ids[:real] != pad_token_id).flatten()
    return int(kept[-1]) if kept.numel() else 0


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    differ = torch.nonzero(a[:n] != b[:n]).flatten()
    return int(differ[0]) if differ.numel() else n


def reward_step_batch(
    window: list[dict],
    pad_token_id: int | None,
    rank: int = 0,
    num_processes: int = 1,
    long_rope: tuple[int, ...] = (),
) -> StepBatch:
    """The pairs of one optimizer step of process ``rank`` (``window``: its stock micro-batches, each
    ``DataCollatorForPreference``'s ``input_ids`` / ``attention_mask`` of ``[chosen ; rejected]`` rows and an optional
    ``margin``) as a :class:`StepBatch`: each pair's chosen then rejected, adjacent, the pair's ``together`` id shared
    (the planner keeps them in one pass).

    Each sequence is its row's tokens through the one its reward is read at (:func:`read_position`); its "prompt"
    the tokens it shares with the other sequence of its pair (its "completion" the rest: what the prefix-group rule
    shares, the tree rule shares every common prefix whatever). ``long_rope``: the run's LongRoPE models'
    ``original_max_position_embeddings``: each sample takes the rope width of its micro-batch's padded width."""
    tokens, prompts, completions, fields = [], [], [], {name: [] for name in PAIR_FIELDS}
    slice_ids, slice_tokens, together, widths = [], [], [], []
    for slice_index, inputs in enumerate(window):
        rows, width = inputs["input_ids"].shape
        pairs = rows // 2
        ids = inputs["input_ids"].cpu()
        real = inputs["attention_mask"].sum(1).tolist()
        margins = inputs["margin"].float().tolist() if "margin" in inputs else [0.0] * pairs
        for j in range(pairs):
            pair = [ids[row, : read_position(ids[row], int(real[row]), pad_token_id) + 1] for row in (j, pairs + j)]
            shared = _common_prefix(*pair)
            for side, (row, sequence) in enumerate(zip((j, pairs + j), pair)):
                prompt = min(shared, sequence.numel())
                tokens.append(inputs["input_ids"][row, : sequence.numel()])
                prompts.append(prompt)
                completions.append(sequence.numel() - prompt)
                for name, value in zip(PAIR_FIELDS, (1.0 - side, margins[j], float(real[row]))):
                    fields[name].append(value)
                slice_ids.append(rank * len(window) + slice_index)
                together.append(len(together) // 2)
                widths.append(rope_width(width, tuple(long_rope)))
        slice_tokens.append(rows * width)
    return pair_step_batch(window, tokens, prompts, completions, fields, slice_ids, slice_tokens, together, widths,
                       rank, num_processes, bool(long_rope))  # fmt: skip


# ---------------------------------------------------------------------------------------------------- a pass
def read_positions(mb) -> torch.Tensor:
    """``(rows,)``: each row's last position in the pass's flattened output (its sequence's last token: a row's
    positions along its path, the deepest last in row order; in a padded pass its row's last real one)."""
    token_index, row_index = mb.token_rows
    last = torch.full((len(mb.indices),), -1, dtype=torch.long, device=token_index.device)
    return last.scatter_reduce(0, row_index.to(token_index.device), token_index, reduce="amax")


@contextlib.contextmanager
def captured_scores(model):
    """The score head's output at every position of the forwards run inside (appended to the list yielded), from
    ``model``'s own sequence-classification forward (its ``score`` module, under PEFT the wrapper's)."""
    captured: list[torch.Tensor] = []
    handle = base_model(model).score.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        yield captured
    finally:
        handle.remove()


def pass_rewards(executor, model, mb) -> torch.Tensor:
    """``(rows,)``: each sequence's reward from one pass of ``model`` over micro-batch ``mb``: the model's own forward
    (as stock's, under the accelerator's autocast, without a cache) over the pass's row, the score head's output read
    at each sequence's last position."""
    inputs, _ = named_pass(mb, executor.parallel)
    with executor.accelerator.autocast(), captured_scores(executor.unwrap(model)) as captured:
        model(**inputs, use_cache=False)
    return captured[-1].reshape(-1)[read_positions(mb)]


def reward_pass_loss(settings: RewardSettings, rewards: torch.Tensor, rows: SampleRows):
    """The loss of one pass's pairs (``rewards`` (rows,), rows in pair order: chosen then rejected) with stock's
    weights ``1 / (B GA)`` per pair, and the per-row ``(sums, counts)`` its metrics read (:class:`RewardMetrics`)."""
    pairs = rewards.view(-1, 2)
    chosen, rejected = pairs[:, 0], pairs[:, 1]
    margin = rows.per_token["margin"].squeeze(1).view(-1, 2)[:, 0].to(rewards.dtype)
    losses = -F.logsigmoid(chosen - rejected - margin)
    if settings.center_rewards_coefficient is not None:
        losses = losses + settings.center_rewards_coefficient * (chosen + rejected) ** 2
    weights = rows.policy_weights.view(-1, 2)[:, 0].to(losses.dtype)
    return (losses * weights).sum(), pass_metrics(rewards.detach())


def pass_metrics(rewards: torch.Tensor) -> dict:
    """Per row ``(sums, counts)`` of stock's means: each reward (``mean_reward``), and a pair's accuracy and margin on
    its chosen row (counted once); ``rewards`` for the extremes (:class:`RewardMetrics`)."""
    pairs = rewards.view(-1, 2)

    def per_pair(values: torch.Tensor):
        ones = torch.ones_like(values)
        return torch.stack([values, 0 * values], 1).flatten(), torch.stack([ones, 0 * ones], 1).flatten()

    return {
        "rewards": rewards,
        "mean_reward": (rewards, torch.ones_like(rewards)),
        "accuracy": per_pair((pairs[:, 0] > pairs[:, 1]).to(rewards.dtype)),
        "margin": per_pair(pairs[:, 0] - pairs[:, 1]),
    }


class RewardMetrics(StepMetrics):
    """:class:`~hf_dynbsz.execution.metrics.StepMetrics` with stock ``RewardTrainer``'s metrics per stock slice:
    ``min_reward``, ``mean_reward``, ``max_reward`` over the slice's rewards of every process, ``accuracy`` and
    ``margin`` over its pairs (stock's mean of each process's mean: the same with equal micro-batches). No
    ``entropy``."""

    MEANS = ("mean_reward", "accuracy", "margin")

    def __init__(self, slices: int, device) -> None:
        super().__init__(slices, device)
        self.keys = self.MEANS
        self.sums = torch.zeros(slices, 2 * len(self.keys), dtype=torch.float64, device=device)
        self.maxima = torch.full((slices, 2), -math.inf, dtype=torch.float64, device=device)  # -min, max

    def add_pass(self, real_tokens, computed_tokens, loss_metrics, entropies, mask, slice_ids) -> None:
        self.count_pass(real_tokens, computed_tokens)
        figures = torch.stack([part.double() for key in self.keys for part in loss_metrics[key]], dim=1)
        index = slice_ids % self.slices
        self.sums.index_add_(0, index, figures)
        rewards = loss_metrics["rewards"].double()
        extremes = torch.stack([-rewards, rewards], dim=1)
        self.maxima.scatter_reduce_(0, index.unsqueeze(1).expand_as(extremes), extremes, reduce="amax")

    def publish_slices(self, store: dict[str, list], sums=None, maxima=None) -> None:
        sums = self.sums if sums is None else sums
        maxima = self.maxima if maxima is None else maxima
        for slice_sums, (low, high) in zip(sums.tolist(), maxima.tolist()):
            means = {key: slice_sums[2 * k] / max(slice_sums[2 * k + 1], 1.0) for k, key in enumerate(self.keys)}
            store["min_reward"].append(-low)
            store["mean_reward"].append(means["mean_reward"])
            store["max_reward"].append(high)
            store["accuracy"].append(means["accuracy"])
            store["margin"].append(means["margin"])


# ---------------------------------------------------------------------------------------------------- the self-check
#: Pairs the self-check compares (the step's first, repeated where it has fewer: the same forwards on every process).
CHECKED_PAIRS = 2


@torch.no_grad()
def check_rewards(executor, model, batch: StepBatch) -> str | None:
    """The run's self-check for a reward model (the log-prob check does not apply): the rewards of the step's first
    :data:`CHECKED_PAIRS` pairs from one pass in the run's layout against each sequence alone through the model's own
    forward (one unpadded row, the reward at its last token, as stock reads it), within the self-check's tolerance of
    the compute dtype (relative to the largest reward, at least 1), every process agreeing. Returns why the layout
    fails (stock's micro-batches then run), or None. Gradients are not compared."""
    from hf_dynbsz.execution.self_check import compute_dtype, tolerance

    pairs = len(batch) // 2
    group = sorted({i for k in range(CHECKED_PAIRS) for i in (2 * (k % pairs), 2 * (k % pairs) + 1)})
    unwrapped = executor.unwrap(model)
    mb = executor.microbatch(batch.table, group)
    with executor.segments(model), executor.accelerator.autocast():
        packed = pass_rewards(executor, unwrapped, mb).float()
    alone = []
    for i in group:  # the sequence alone: one row of its tokens, no segment layout (stock's forward)
        with executor.accelerator.autocast(), captured_scores(unwrapped) as captured:
            unwrapped(input_ids=batch.table.tokens[i].unsqueeze(0), use_cache=False)
        alone.append(captured[-1].reshape(-1)[-1].float())
    alone = torch.stack(alone)
    error = float((packed - alone).abs().max() / alone.abs().max().clamp(min=1.0))
    limit = tolerance(compute_dtype(executor.accelerator, model))
    failed = executor.world.all_reduce_max([int(error > limit)])[0]
    if not failed:
        return None
    return (
        f"the self-check's rewards in the {executor.scheduler.layout} layout differ from each sequence's own by "
        f"{error:.1e} (> {limit:.0e}) on this or another process"
    )


# ---------------------------------------------------------------------------------------------------- the loss
class RewardLoss:
    """``RewardTrainer``'s loss for the pass executor (:class:`~hf_dynbsz.execution.step_loss.StepLoss`): each pair's
    Bradley-Terry loss (and centering term) from its two rewards (one pass holds both), weight ``1 / (B GA)``; stock's
    metrics per stock slice (:class:`RewardMetrics`), ``num_tokens`` summed over processes once per step. Nothing
    precedes the passes (no reference); no entropy.

    ``blocker``: why this run cannot repack its steps (the trainer then runs stock's), or None."""

    entropy_bonus = False
    needs_step_entropies = False
    phases = ("train",)

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.settings = RewardSettings.from_trainer(trainer)
        self.device = trainer.accelerator.device
        self.num_processes = trainer.accelerator.num_processes
        self.blocker = reward_blocker(trainer)

    def weigh(self, batch: StepBatch, entropies, *, gradient_accumulation_steps: int) -> None:
        pairs = batch.slice_rows.double()[batch.slice_ids] / 2
        batch.policy_weights = 1.0 / (pairs * float(gradient_accumulation_steps))
        batch.entropy_weights = torch.zeros_like(batch.policy_weights)

    def prepare(self, executor, model, batch: StepBatch, *, gradient_accumulation_steps: int) -> None:
        return None

    def reserved_mib(self, batch: StepBatch, rank: int, schedule) -> float:
        return 0.0  # a sample's margin and side are a few values

    def attempt(self, batch: StepBatch) -> float:
        return float(batch.per_token["tokens"].sum())  # the attention-mask tokens of the rows this process runs

    def metrics(self, batch: StepBatch) -> StepMetrics:
        return RewardMetrics(len(batch.slice_rows) // self.num_processes, self.device)

    def forward(self, executor, model, mb, rows: SampleRows, batch: StepBatch, router: bool):
        rewards = pass_rewards(executor, model, mb)
        return rewards, torch.zeros_like(rows.mask, dtype=rewards.dtype), None

    def pass_loss(self, state, rewards, entropies, rows: SampleRows):
        return reward_pass_loss(self.settings, rewards, rows)

    def finish(self, state: float, gradient_accumulation_steps: int) -> None:
        """Stock's ``num_tokens``: every process's attention-mask tokens of the step, added up."""
        count_train_tokens(self.trainer, state, self.device)

    def stock_loss(self, loss: torch.Tensor, gradient_accumulation_steps: int) -> torch.Tensor:
        return loss / gradient_accumulation_steps  # the Trainer divides the reward loss (a micro-batch mean)

    def router_weighting(self, batch: StepBatch, gradient_accumulation_steps: int):
        return gradient_accumulation_steps, None  # stock's micro-batches: each sample's positions its own

    def checked_models(self, model) -> list[tuple[object, bool]]:
        return [(model, True)]

    def dummy_pass(self, executor, model, last: bool | None = None) -> None:
        """A real pass's work on the lockstep row (every parameter takes part, the score head included), learning
        nothing."""
        mb = executor.lockstep_microbatch()
        inputs, _ = named_pass(mb, executor.parallel)
        with executor.no_sync(model, bool(last)), executor.accelerator.autocast():
            outputs = model(**inputs, use_cache=False)
            if last is not None:
                executor.backward(model, outputs.logits.sum() * 0.0, last)


def reward_blocker(trainer) -> str | None:
    """Why a reward model's run trains stock's micro-batches, or None: what the passes do not repack exactly. (TRL
    1.16's RewardTrainer has no vision-language path: its pairs are token ids alone.)"""
    from transformers.modeling_layers import GenericForSequenceClassification
    from trl.trainer.reward_trainer import DataCollatorForPreference

    model = base_model(trainer.accelerator.unwrap_model(trainer.model))
    if not isinstance(trainer.data_collator, DataCollatorForPreference):
        name = type(trainer.data_collator).__name__
        return f"a custom data collator ({name}): the passes read DataCollatorForPreference's rows"
    if not isinstance(model, GenericForSequenceClassification) or not hasattr(model, "score"):
        return (
            f"{type(model).__name__} is not transformers' GenericForSequenceClassification (a causal model's score "
            "head read at the last token that is not padding): the passes read each sequence's score that way"
        )
    return None

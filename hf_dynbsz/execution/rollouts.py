"""An asynchronous GRPO optimizer step's rollout samples as a :class:`~hf_dynbsz.execution.batch.StepBatch` (torch
layer).

TRL's rollout worker hands the trainer whole sequences: ``input_ids`` (prompt, model turns, tool results, a forked
row's rewritten history), ``completion_mask`` (1 on the tokens the loss trains) and ``old_log_probs`` (the
generator's log-probability of each token, 0 off the trained ones), one advantage and group id per sample (the group
id stays with stock's bookkeeping of the groups trained, in the collator). Stock
trains token ``p`` of a sample when ``completion_mask[p]`` is 1 and ``p >= 1`` (its log-probability is read off
position ``p - 1``). Here a sample's *prompt* is everything before its first trained token (at least its first token)
and its *completion* the rest, with the completion mask as the loss mask: tool results and rewritten history inside
the completion are context (loss mask 0), as GRPO's ``tool_mask`` makes them. The plugin's packing, prefix tree and
loss then apply unchanged.

The trainer's collator (:class:`RolloutSliceCollator`) sends each process, per stock micro-batch (a *slice*), the
rows of its samples as :data:`SLICE_KEYS` tensors (padding rows have length 0); :func:`rollout_step_batch` joins an
optimizer step's slices into one :class:`~hf_dynbsz.execution.batch.StepBatch`: for stock's step each micro-batch a
stock slice, for the samples-defined step the whole step one stock slice per process (stock's fixed-count mode with
the step in one micro-batch, :mod:`hf_dynbsz.execution.async_loss`).
"""

from __future__ import annotations

import dataclasses

import torch
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout

from hf_dynbsz.execution.batch import StepBatch
from hf_dynbsz.execution.packing import SequenceTable

__all__ = ["SLICE_KEYS", "RolloutSliceCollator", "rollout_step_batch", "slice_tensors"]

#: Per sample row of a slice: its tokens, completion mask and old log-probs right-padded to the slice's longest
#: sample, its length (0: a padding row), advantage; and per row (the same value on each) the slice's trained
#: tokens over all processes, what stock's packed rows of the slice forward over all processes (their prefix tries'
#: unique tokens) and stock's ``mean_seq_len`` (those tokens per sample, as stock's collator computes it), and the
#: tokens stock's row of this process forwards.
SLICE_KEYS = (
    "input_ids",
    "completion_mask",
    "old_log_probs",
    "lengths",
    "advantages",
    "global_trained_tokens",
    "global_forwarded_tokens",
    "mean_seq_len",
    "stock_row_tokens",
)


def trained_tokens(completion_mask) -> int:
    """The tokens stock's loss trains of a sample: its completion mask from its second token on."""
    return int(completion_mask[1:].sum())


def slice_tensors(rows: list[list[dict]], pad_token_id: int, stock_row_tokens: list[int]) -> dict[str, torch.Tensor]:
    """A micro-batch's samples (``rows``: one list of TRL rollout-sample dicts per process, as stock's planner
    partitions them) as :data:`SLICE_KEYS` tensors of ``processes x k`` rows, process ``p``'s samples in rows
    ``p k`` to ``p k + k - 1`` (``k`` the most any process holds; accelerate's dispatcher gives process ``p`` its
    ``k`` rows). ``stock_row_tokens``: per process, the tokens stock's row forwards (its prefix trie); their sum and
    ``mean_seq_len`` are stock's ``global_n_forward_tokens`` and ``mean_seq_len`` of the micro-batch (its collator's,
    in the default dtype as there), which its step accounting reads."""
    per_process = max(len(samples) for samples in rows)
    width = max(len(sample["input_ids"]) for samples in rows for sample in samples)
    size = per_process * len(rows)
    input_ids = torch.full((size, width), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros(size, width, dtype=torch.long)
    old_log_probs = torch.zeros(size, width, dtype=torch.float32)
    lengths, advantages = torch.zeros(size, dtype=torch.long), torch.zeros(size, dtype=torch.float32)
    total = samples_all = 0
    for process, samples in enumerate(rows):
        for position, sample in enumerate(samples):
            row, length = process * per_process + position, len(sample["input_ids"])
            input_ids[row, :length] = torch.as_tensor(sample["input_ids"])
            completion_mask[row, :length] = torch.as_tensor(sample["completion_mask"])
            old_log_probs[row, :length] = torch.as_tensor(sample["old_log_probs"], dtype=torch.float32)
            lengths[row], advantages[row] = length, float(sample["advantage"])
            total += trained_tokens(completion_mask[row, :length])
            samples_all += 1
    stock = torch.tensor(stock_row_tokens, dtype=torch.float64).repeat_interleave(per_process)
    forwarded = float(sum(stock_row_tokens))
    return {
        "input_ids": input_ids,
        "completion_mask": completion_mask,
        "old_log_probs": old_log_probs,
        "lengths": lengths,
        "advantages": advantages,
        "global_trained_tokens": torch.full((size,), float(total), dtype=torch.float64),
        "global_forwarded_tokens": torch.full((size,), forwarded, dtype=torch.float64),
        "mean_seq_len": torch.full((size,), forwarded / samples_all),  # (the default dtype, as stock's collator)
        "stock_row_tokens": stock,
    }


def _split(ids: torch.Tensor, mask: torch.Tensor) -> int:
    """A sample's prompt length: the tokens before its first trained one (at least one; all without any)."""
    trained = mask[1:].nonzero()
    return 1 + int(trained[0]) if trained.numel() else int(ids.numel())


def rollout_step_batch(window: list[dict], rank: int, num_processes: int, stock_slices: bool = False) -> StepBatch:
    """The optimizer step's samples on process ``rank``: the rows of its slices (``window``: each slice's
    :data:`SLICE_KEYS` tensors as this process received them).

    ``stock_slices`` False (the samples-defined step): the whole step is one stock slice per process (slice ``rank``),
    ``num_items`` the step's trained tokens over all processes. True (stock's step): each micro-batch of ``window`` is
    a stock slice (micro-batch ``s`` of process ``p`` is slice ``p x len(window) + s``, as
    :class:`~hf_dynbsz.execution.batch.StepBatch` numbers them), ``num_items`` its trained tokens over all
    processes."""
    tokens, prompts, masks, old, advantages, stock_rows, slice_ids, num_items = [], [], [], [], [], [], [], []
    slices = len(window) if stock_slices else 1
    slice_rows = torch.zeros(num_processes * slices, dtype=torch.long)
    step_tokens = sum(float(inputs["global_trained_tokens"][0]) for inputs in window)
    for index, inputs in enumerate(window):
        slice_id = rank * slices + (index if stock_slices else 0)
        slice_tokens = float(inputs["global_trained_tokens"][0]) if stock_slices else step_tokens
        stock_rows.append(int(inputs["stock_row_tokens"][0]))
        for row, length in enumerate(inputs["lengths"].tolist()):
            if not length:
                continue
            ids, mask = inputs["input_ids"][row, :length], inputs["completion_mask"][row, :length]
            prompt = _split(ids, mask)
            tokens.append(ids)
            prompts.append(prompt)
            masks.append(mask[prompt:])
            old.append(inputs["old_log_probs"][row, prompt:length])
            advantages.append(inputs["advantages"][row])
            slice_ids.append(slice_id)
            num_items.append(slice_tokens)
            slice_rows[slice_id] += 1
    width = max([mask.numel() for mask in masks] + [1])

    def padded(rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(row, (0, width - row.numel())) for row in rows])

    table = SequenceTable(
        tokens=tokens,
        prompt_lengths=torch.tensor(prompts, dtype=torch.long),
        completion_lengths=torch.tensor([len(ids) - p for ids, p in zip(tokens, prompts)], dtype=torch.long),
    )
    return StepBatch(
        table=table,
        loss_mask=padded(masks),
        advantages=torch.stack(advantages),
        per_token={"old_per_token_logps": padded(old)},
        slice_ids=torch.tensor(slice_ids, dtype=torch.long),
        slice_rows=slice_rows,
        num_items=torch.tensor(num_items, dtype=torch.float64),
        stock_microbatch_tokens=max(stock_rows),
        stock_computed_tokens=sum(stock_rows),
    )


@dataclasses.dataclass
class RolloutSliceCollator(DataCollatorForRollout):
    """Stock's collator with the plugin's output: a micro-batch of stock's planner (one row of samples per process) as
    per-sample rows (:func:`slice_tensors`) with stock's token counts of the micro-batch; stock's bookkeeping kept (the
    prompt groups trained, for the epoch stop, and the micro-batch's sample and packing metrics, ``_log_metrics``, from
    stock's rows: ``batch/pad_frac`` is the padding of stock's packed rows to the longest, as stock logs it)."""

    def torch_call(self, examples):
        (rows,) = examples
        samples = [row.samples for row in rows]
        row_tokens = [len(row.tokens) for row in rows]
        tensors = slice_tensors(samples, self.pad_token_id, row_tokens)
        every = [sample for row in samples for sample in row]
        self.groups_trained.update(sample["group_id"] for sample in every)
        # stock's attention mask of its packed rows, one per process padded to the longest (batch/pad_frac's)
        padded = (torch.arange(max(row_tokens)).unsqueeze(0) < torch.tensor(row_tokens).unsqueeze(1)).long()
        self._log_metrics(rows=rows, all_examples=every, padded=padded)
        return tensors

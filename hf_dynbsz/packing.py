"""Packing collator: turns TRL's padded prompt/completion tensors into token-budget micro-batches.

TRL hands the trainer left-padded ``prompt_ids`` and right-padded ``completion_ids``, both padded to the
longest row of the whole generation batch. This module strips that padding and rebuilds model inputs for
a chosen set of sequences in one of two layouts:

* ``"padding_free"``: every sequence of the micro-batch concatenated into ONE row, ``position_ids``
  restarting at 0 for each sequence, no attention mask. transformers isolates the sequences from each
  other only when ``attention_mask is None`` and no cache is used (flash-attention varlen kernels read the
  boundaries from the restarting ``position_ids``; sdpa/eager build a block-diagonal mask from them).
  The forward must therefore be called with ``use_cache=False`` (TRL's fused LM head forces it).
* ``"padded"``: one row per sequence, right-padded only to the micro-batch's own longest row (rounded up
  to ``pad_to_multiple_of``). Right padding under a causal mask cannot influence real tokens, so no
  attention mask is needed either; ``position_ids`` count from 0 in every row.

In both layouts the labels are pre-shifted (``shift_labels``): position ``t`` carries the next token of
the same sequence when that token is a completion token, ``-100`` otherwise, so a packed row never scores
a token of the following sequence. :class:`MicroBatch.gather_index` maps the model's flat per-position
output back to completion-aligned ``(rows, completion_width)`` tensors in the micro-batch's row order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .partition import LAYOUTS, round_up


@dataclass
class SequenceTable:
    """The samples of one optimizer step on one device, without padding.

    ``tokens[i]`` is prompt + completion of sample ``i`` (1-D, real tokens only); ``prompt_lengths`` and
    ``completion_lengths`` are in tokens. ``completion_lengths`` counts completion tokens that take part
    in attention (``completion_mask``), which may be 0 for a masked truncated completion.
    """

    tokens: list[torch.Tensor]
    prompt_lengths: torch.Tensor  # (N,) long, CPU
    completion_lengths: torch.Tensor  # (N,) long, CPU

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens per sequence (prompt + completion), the unit of the token budget."""
        return self.prompt_lengths + self.completion_lengths

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_padded(cls, prompt_ids, prompt_mask, completion_ids, completion_mask) -> SequenceTable:
        """Strip TRL's padding: prompts are left-padded, completions right-padded (masks are contiguous)."""
        prompt_lengths = prompt_mask.sum(dim=1).long()
        completion_lengths = completion_mask.sum(dim=1).long()
        width = prompt_ids.size(1)
        tokens = []
        p_cpu, c_cpu = prompt_lengths.tolist(), completion_lengths.tolist()
        for row, (p, c) in enumerate(zip(p_cpu, c_cpu)):
            tokens.append(torch.cat([prompt_ids[row, width - p :], completion_ids[row, :c]]))
        return cls(tokens=tokens, prompt_lengths=prompt_lengths.cpu(), completion_lengths=completion_lengths.cpu())

    @classmethod
    def concat(cls, tables: list[SequenceTable]) -> SequenceTable:
        """The samples of ``tables``, one table after the other."""
        return cls(
            tokens=[tokens for table in tables for tokens in table.tokens],
            prompt_lengths=torch.cat([table.prompt_lengths for table in tables]),
            completion_lengths=torch.cat([table.completion_lengths for table in tables]),
        )


@dataclass
class MicroBatch:
    """Model inputs for one forward pass plus the map back to completion-aligned tensors.

    ``indices``: which samples of the :class:`SequenceTable` (in row order). ``model_inputs`` holds
    ``input_ids`` and ``position_ids`` (never an attention mask). ``shift_labels`` has the shape of
    ``input_ids``. ``gather_index`` is ``(rows, completion_width)`` into the flattened per-position
    output; ``completion_mask`` marks the valid entries. ``real_tokens``/``computed_tokens`` count tokens
    without and with padding.
    """

    indices: list[int]
    model_inputs: dict
    shift_labels: torch.Tensor
    gather_index: torch.Tensor
    completion_mask: torch.Tensor
    real_tokens: int
    computed_tokens: int

    def to_completion_layout(self, per_position: torch.Tensor) -> torch.Tensor:
        """(1 or rows, positions) model output -> (rows, completion_width), zero where not a completion token."""
        flat = per_position.reshape(-1)
        out = flat[self.gather_index.reshape(-1)].view(self.gather_index.shape)
        return out * self.completion_mask.to(out.dtype)


def build_microbatch(
    table: SequenceTable,
    indices: list[int],
    *,
    layout: str,
    pad_token_id: int,
    pad_to_multiple_of: int | None = None,
    device: torch.device | str = "cpu",
) -> MicroBatch:
    """Build the inputs of one micro-batch holding the samples ``indices`` of ``table`` (in that order)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if not indices:
        raise ValueError("a micro-batch needs at least one sequence (use dummy_microbatch for an empty one)")
    prompt_lengths = table.prompt_lengths[indices].tolist()
    completion_lengths = table.completion_lengths[indices].tolist()
    seq_lengths = [p + c for p, c in zip(prompt_lengths, completion_lengths)]
    rows = len(indices)
    completion_width = max(max(completion_lengths), 1)
    # Position (in the flattened output) whose next-token prediction is completion token k of row j.
    gather_index = torch.zeros(rows, completion_width, dtype=torch.long)
    completion_mask = torch.zeros(rows, completion_width, dtype=torch.long)

    if layout == "padding_free":
        total = sum(seq_lengths)
        width = round_up(total, pad_to_multiple_of)
        input_ids = torch.full((1, width), pad_token_id, dtype=torch.long)
        position_ids = torch.zeros((1, width), dtype=torch.long)
        shift_labels = torch.full((1, width), -100, dtype=torch.long)
        offset = 0
        for j, i in enumerate(indices):
            seq, p, c, n = table.tokens[i], prompt_lengths[j], completion_lengths[j], seq_lengths[j]
            input_ids[0, offset : offset + n] = seq.cpu()
            position_ids[0, offset : offset + n] = torch.arange(n)
            if c > 0:
                # position offset+p-1+k predicts completion token k (token offset+p+k)
                shift_labels[0, offset + p - 1 : offset + p - 1 + c] = seq[p : p + c].cpu()
                gather_index[j, :c] = torch.arange(offset + p - 1, offset + p - 1 + c)
                completion_mask[j, :c] = 1
            offset += n
        # Trailing rounding padding continues counting positions so it never starts a "new sequence" of
        # length 0 in flash-attention's varlen bookkeeping; its labels are -100.
        if width > total:
            position_ids[0, total:] = torch.arange(width - total)
        computed = width
    else:
        width = round_up(max(seq_lengths), pad_to_multiple_of)
        input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
        position_ids = torch.arange(width, dtype=torch.long).unsqueeze(0).expand(rows, width).clone()
        shift_labels = torch.full((rows, width), -100, dtype=torch.long)
        for j, i in enumerate(indices):
            seq, p, c, n = table.tokens[i], prompt_lengths[j], completion_lengths[j], seq_lengths[j]
            input_ids[j, :n] = seq.cpu()
            if c > 0:
                shift_labels[j, p - 1 : p - 1 + c] = seq[p : p + c].cpu()
                gather_index[j, :c] = torch.arange(j * width + p - 1, j * width + p - 1 + c)
                completion_mask[j, :c] = 1
        computed = rows * width

    return MicroBatch(
        indices=list(indices),
        model_inputs={"input_ids": input_ids.to(device), "position_ids": position_ids.to(device)},
        shift_labels=shift_labels.to(device),
        gather_index=gather_index.to(device),
        completion_mask=completion_mask.to(device),
        real_tokens=sum(seq_lengths),
        computed_tokens=computed,
    )


def dummy_microbatch(pad_token_id: int, device: torch.device | str = "cpu") -> MicroBatch:
    """A one-token micro-batch for zero-weight lockstep passes (a rank with fewer sequences than passes).

    Its forward still runs every layer, so ZeRO-3 gathers and DDP/ZeRO-2 reductions happen on every rank.
    """
    input_ids = torch.full((1, 2), pad_token_id, dtype=torch.long)
    shift_labels = torch.tensor([[pad_token_id, -100]], dtype=torch.long)
    return MicroBatch(
        indices=[],
        model_inputs={"input_ids": input_ids.to(device), "position_ids": torch.arange(2).unsqueeze(0).to(device)},
        shift_labels=shift_labels.to(device),
        gather_index=torch.zeros(0, 1, dtype=torch.long, device=device),
        completion_mask=torch.zeros(0, 1, dtype=torch.long, device=device),
        real_tokens=0,
        computed_tokens=0,
    )


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
  attention mask is needed either; ``position_ids`` count from 0 in every row. With ``attention_mask=True``
  (models whose padding would otherwise reach real tokens, see :mod:`hf_dynbsz.planning.model_support`) the rows carry
  one. Vision-language samples (a table with image inputs or token-aligned fields) get an ``attention_mask``
  instead of ``position_ids``, their image inputs (:func:`hf_dynbsz.execution.multimodal.join_media`) and their token
  fields: these models compute their own (multimodal) positions from the mask, as in stock's forward.

Vision-language samples in a padding-free row carry their image inputs and token fields along the row (a shared
prompt's images once, so the vision tower encodes them once per pass) and, for M-RoPE models, each sample's own
3-D positions (:attr:`SequenceTable.positions`) under a first row of text positions: ``position_ids`` of shape
``(4, 1, width)``, the form Qwen2-VL's text model reads as "packed".

``position_offset`` is added to every position id (RoBERTa-style models number positions from ``padding_idx + 1``).

In both layouts the labels are pre-shifted (``shift_labels``): position ``t`` carries the next token of
the same sequence when that token is a completion token, ``-100`` otherwise, so a packed row never scores
a token of the following sequence. :class:`MicroBatch.gather_index` maps the model's flat per-position
output back to completion-aligned ``(rows, completion_width)`` tensors in the micro-batch's row order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hf_dynbsz.execution.multimodal import join_media, media_digest, media_record, read_media_record
from hf_dynbsz.planning.partition import LAYOUTS, round_up
from hf_dynbsz.planning.schedule import prompt_segments


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
    #: per sample, its image inputs (:func:`hf_dynbsz.execution.multimodal.split_media`); None for text
    media: list[dict[str, torch.Tensor]] | None = None
    #: token-aligned fields (``mm_token_type_ids``...): per field, per sample, one value per token of ``tokens[i]``
    token_fields: dict[str, list[torch.Tensor]] | None = None
    #: per sample, its M-RoPE positions ``(3, len(tokens[i]))`` as the model computes them for the sample alone
    #: (:func:`hf_dynbsz.execution.multimodal.rope_positions`); None for models whose tokens count positions like text, and
    #: until the trainer computes them for a padding-free pass (a new table, moved or concatenated, has none)
    positions: list[torch.Tensor] | None = None
    #: :meth:`prompt_groups`, once computed (it hashes every sample's pixels)
    _groups: list[int] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def multimodal(self) -> bool:
        return self.media is not None or bool(self.token_fields)

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens per sequence (prompt + completion), the unit of the token budget."""
        return self.prompt_lengths + self.completion_lengths

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_padded(
        cls,
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        media=None,
        token_fields: dict[str, torch.Tensor] | None = None,
    ) -> SequenceTable:
        """Strip TRL's padding: prompts are left-padded, completions right-padded (masks are contiguous).

        ``media``: per-sample image inputs; ``token_fields``: ``(samples, prompt width + completion width)`` tensors
        aligned with ``prompt_ids`` then ``completion_ids``, stripped like the token ids.
        """
        prompt_lengths = prompt_mask.sum(dim=1).long()
        completion_lengths = completion_mask.sum(dim=1).long()
        width = prompt_ids.size(1)
        tokens = []
        p_cpu, c_cpu = prompt_lengths.tolist(), completion_lengths.tolist()
        for row, (p, c) in enumerate(zip(p_cpu, c_cpu)):
            tokens.append(torch.cat([prompt_ids[row, width - p :], completion_ids[row, :c]]))
        fields = {
            name: [values[row, width - p : width + c] for row, (p, c) in enumerate(zip(p_cpu, c_cpu))]
            for name, values in (token_fields or {}).items()
        }
        return cls(
            tokens=tokens,
            prompt_lengths=prompt_lengths.cpu(),
            completion_lengths=completion_lengths.cpu(),
            media=media,
            token_fields=fields or None,
        )

    def prompt_groups(self) -> list[int]:
        """One id per sample, shared by the samples whose prompts are identical (numbered by first appearance).

        Compares the unpadded prompt ids and, for vision-language samples, the image inputs (image tokens are one id
        whatever the picture), so duplicate prompts of different dataset rows share an id too. A sample whose last
        prompt token is an image token (a token field not 0 there) is alone: a shared prompt's last token is
        repeated in every completion's block, and an image must be encoded once.
        """
        if self._groups is not None:
            return self._groups
        prompt_lengths = self.prompt_lengths.tolist()
        if not prompt_lengths:
            return []
        flat = torch.cat([tokens[:p] for tokens, p in zip(self.tokens, prompt_lengths)]).cpu().tolist()
        ids: dict[tuple, int] = {}
        groups, offset = [], 0
        for i, p in enumerate(prompt_lengths):
            key: tuple = tuple(flat[offset : offset + p])
            if self.media is not None:
                key += (media_digest(self.media[i]),)
            if any(int(values[i][p - 1]) for values in (self.token_fields or {}).values()):
                key = ("alone", i)
            groups.append(ids.setdefault(key, len(ids)))
            offset += p
        self._groups = groups
        return groups

    def media_records(self) -> list[torch.Tensor]:
        """Per sample, its image inputs and token fields as one float64 record (:func:`~hf_dynbsz.execution.multimodal.
        media_record`): what travels with it to another process."""
        fields = self.token_fields or {}
        return [
            media_record(
                self.media[i] if self.media is not None else None, {name: values[i] for name, values in fields.items()}
            )
            for i in range(len(self))
        ]

    def with_media_records(self, records: list[torch.Tensor]) -> SequenceTable:
        """This table with the image inputs and token fields of ``records`` (one :meth:`media_records` record per
        sample, in table order); a field a sample lacks is zeros, as in :meth:`concat`."""
        read = [read_media_record(record) for record in records]
        media = [piece for piece, _ in read] if any(piece for piece, _ in read) else None
        names = sorted({name for _, fields in read for name in fields})
        fields = {
            name: [
                sample.get(name, torch.zeros(tokens.numel(), dtype=torch.long))
                for (_, sample), tokens in zip(read, self.tokens)
            ]
            for name in names
        }
        return dataclasses.replace(self, media=media, token_fields=fields or None)

    @classmethod
    def concat(cls, tables: list[SequenceTable]) -> SequenceTable:
        """The samples of ``tables``, one table after the other (a table without images gives its samples none)."""
        media = None
        if any(table.media is not None for table in tables):
            media = [piece for table in tables for piece in (table.media or [{}] * len(table))]
        names = {name for table in tables for name in (table.token_fields or {})}
        fields = {
            name: [
                values
                for table in tables
                for values in (table.token_fields or {}).get(
                    name, [torch.zeros_like(tokens) for tokens in table.tokens]
                )
            ]
            for name in sorted(names)
        }
        return cls(
            tokens=[tokens for table in tables for tokens in table.tokens],
            prompt_lengths=torch.cat([table.prompt_lengths for table in tables]),
            completion_lengths=torch.cat([table.completion_lengths for table in tables]),
            media=media,
            token_fields=fields or None,
        )


@dataclass
class MicroBatch:
    """Model inputs for one forward pass plus the map back to completion-aligned tensors.

    ``indices``: which samples of the :class:`SequenceTable` (in row order). ``model_inputs`` holds
    ``input_ids`` and ``position_ids`` (and an ``attention_mask`` for padded rows that need one), or for
    vision-language samples ``input_ids``, ``attention_mask``, their token fields and image inputs. ``segments``:
    the :class:`~hf_dynbsz.execution.attention.SegmentLayout` of a padding-free row run through segment attention (give it to
    :func:`~hf_dynbsz.execution.attention.use_segments` before the forward), else None. ``token_rows``: ``(token_index,
    row_index)`` pairs, each flat token position with every row (sample) it counts for, as stock's attention mask
    counts it: a shared prompt's tokens for each sample sharing it, padding for none (the MoE router aux loss reads
    them). ``shift_labels`` has the shape of
    ``input_ids``. ``gather_index`` is ``(rows, completion_width)`` into the flattened per-position
    output; ``completion_mask`` marks the valid entries. ``real_tokens``/``computed_tokens`` count the positions
    computed without and with padding (a shared prompt counts once).
    """

    indices: list[int]
    model_inputs: dict
    shift_labels: torch.Tensor
    gather_index: torch.Tensor
    completion_mask: torch.Tensor
    real_tokens: int
    computed_tokens: int
    segments: object | None = None
    token_rows: tuple[torch.Tensor, torch.Tensor] | None = None

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
    attention: str | None = None,
    groups: Sequence[int] | None = None,
    attention_mask: bool = False,
    position_offset: int = 0,
) -> MicroBatch:
    """Build the inputs of one micro-batch holding the samples ``indices`` of ``table`` (in that order).

    ``attention``: the base attention implementation when the padding-free row runs through segment attention
    (:mod:`hf_dynbsz.execution.attention`; the inputs then carry its :class:`~hf_dynbsz.execution.attention.SegmentLayout`), None for
    the model's own attention. ``groups`` (one id per sample of ``table``; needs segment attention): samples of this
    micro-batch with the same id have identical prompts and share one copy of it. ``attention_mask``: padded rows
    carry an attention mask. ``position_offset``: added to every position id.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if not indices:
        raise ValueError("a micro-batch needs at least one sequence (use dummy_microbatch for an empty one)")
    if groups is not None and (layout != "padding_free" or attention is None):
        raise ValueError("shared prompts need the padding_free layout and segment attention")
    prompt_lengths = table.prompt_lengths[indices].tolist()
    completion_lengths = table.completion_lengths[indices].tolist()
    seq_lengths = [p + c for p, c in zip(prompt_lengths, completion_lengths)]
    rows = len(indices)
    completion_width = max(max(completion_lengths), 1)
    # Position (in the flattened output) whose next-token prediction is completion token k of row j.
    gather_index = torch.zeros(rows, completion_width, dtype=torch.long)
    completion_mask = torch.zeros(rows, completion_width, dtype=torch.long)
    model_inputs = {}
    segment_layout = None
    token_index: list[torch.Tensor] = []  # flat positions, and the row each counts for
    row_index: list[torch.Tensor] = []

    if layout == "padding_free":
        pieces, positions, labels, segments = [], [], [], []
        shown: list[int] = []  # samples whose prompt (and images) the row holds, in row order
        rope: list[torch.Tensor] = []  # M-RoPE positions along the row (table.positions)
        fields: dict[str, list[torch.Tensor]] = {name: [] for name in table.token_fields or {}}

        def carry(i: int, start: int, end: int | None = None) -> None:
            """Sample ``i``'s token fields and M-RoPE positions for its tokens ``start:end``, appended to the row."""
            for name, values in fields.items():
                values.append(table.token_fields[name][i][start:end].cpu())
            if table.positions is not None:
                rope.append(table.positions[i][:, start:end].cpu())

        offset = 0
        groups_here = None if groups is None else [groups[i] for i in indices]
        for members in prompt_segments(range(len(indices)), prompt_lengths, groups_here):
            first = members[0]
            prefix = prompt_lengths[first] - 1 if len(members) > 1 else 0  # a lone sample is a plain sequence
            if prefix:
                for j in members:
                    token_index.append(torch.arange(offset, offset + prefix))
                    row_index.append(torch.full((prefix,), j))
                pieces.append(table.tokens[indices[first]][:prefix].cpu())
                carry(indices[first], 0, prefix)
                shown.append(indices[first])
                positions.append(torch.arange(prefix))
                labels.append(torch.full((prefix,), -100, dtype=torch.long))
            blocks = []
            start, offset = offset, offset + prefix
            for j in members:
                seq, p, c = table.tokens[indices[j]].cpu(), prompt_lengths[j], completion_lengths[j]
                block = seq[prefix:]  # a plain sequence, or the prompt's last token + the completion
                lead = p - 1 - prefix  # block position whose next token is the first completion token
                pieces.append(block)
                carry(indices[j], prefix)
                if not prefix:
                    shown.append(indices[j])
                token_index.append(torch.arange(offset, offset + block.numel()))
                row_index.append(torch.full((block.numel(),), j))
                positions.append(torch.arange(prefix, prefix + block.numel()))
                label = torch.full((block.numel(),), -100, dtype=torch.long)
                if c > 0:
                    label[lead : lead + c] = seq[p : p + c]
                    gather_index[j, :c] = torch.arange(offset + lead, offset + lead + c)
                    completion_mask[j, :c] = 1
                labels.append(label)
                blocks.append(block.numel())
                offset += block.numel()
            segments.append((start, prefix, tuple(blocks)))
        total = offset
        width = round_up(total, pad_to_multiple_of)
        if width > total:
            # Trailing rounding padding continues counting positions so it never starts a "new sequence" of length
            # 0 in flash-attention's varlen bookkeeping; its labels are -100. With segment attention it is a
            # segment of its own.
            pieces.append(torch.full((width - total,), pad_token_id, dtype=torch.long))
            positions.append(torch.arange(width - total))
            labels.append(torch.full((width - total,), -100, dtype=torch.long))
            segments.append((total, 0, (width - total,)))
            for values in fields.values():
                values.append(torch.zeros(width - total, dtype=values[0].dtype))
            if rope:
                rope.append(torch.arange(width - total).expand(3, -1))
        input_ids = torch.cat(pieces).unsqueeze(0)
        position_ids = torch.cat(positions).unsqueeze(0)
        if rope:  # (4, 1, width): text positions (segment boundaries), then the 3 M-RoPE rows
            position_ids = torch.cat([position_ids, torch.cat(rope, dim=1)]).unsqueeze(1)
        for name, values in fields.items():
            model_inputs[name] = torch.cat(values).unsqueeze(0).to(device)
        if table.media is not None:
            model_inputs.update(
                {key: value.to(device) for key, value in join_media([table.media[i] for i in shown]).items()}
            )
        shift_labels = torch.cat(labels).unsqueeze(0)
        if attention is not None:
            from hf_dynbsz.execution.attention import Segment, SegmentLayout

            segment_layout = SegmentLayout([Segment(*segment) for segment in segments], attention)
        computed, real = width, total
    else:
        width = round_up(max(seq_lengths), pad_to_multiple_of)
        input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
        position_ids = torch.arange(width, dtype=torch.long).unsqueeze(0).expand(rows, width).clone()
        shift_labels = torch.full((rows, width), -100, dtype=torch.long)
        for j, i in enumerate(indices):
            seq, p, c, n = table.tokens[i], prompt_lengths[j], completion_lengths[j], seq_lengths[j]
            input_ids[j, :n] = seq.cpu()
            token_index.append(torch.arange(j * width, j * width + n))
            row_index.append(torch.full((n,), j))
            if c > 0:
                shift_labels[j, p - 1 : p - 1 + c] = seq[p : p + c].cpu()
                gather_index[j, :c] = torch.arange(j * width + p - 1, j * width + p - 1 + c)
                completion_mask[j, :c] = 1
        computed, real = rows * width, sum(seq_lengths)
        if attention_mask or table.multimodal:
            mask = torch.zeros(rows, width, dtype=torch.long)
            for j, n in enumerate(seq_lengths):
                mask[j, :n] = 1
            model_inputs["attention_mask"] = mask.to(device)
        if table.multimodal:  # the model computes its (multimodal) positions from the mask, as in stock's forward
            for name, values in (table.token_fields or {}).items():
                aligned = torch.zeros(rows, width, dtype=values[0].dtype)
                for j, i in enumerate(indices):
                    aligned[j, : seq_lengths[j]] = values[i].cpu()
                model_inputs[name] = aligned.to(device)
            if table.media is not None:
                model_inputs.update(
                    {key: value.to(device) for key, value in join_media([table.media[i] for i in indices]).items()}
                )
            position_ids = None

    model_inputs["input_ids"] = input_ids.to(device)
    if position_ids is not None:
        model_inputs["position_ids"] = (position_ids + position_offset).to(device)
    return MicroBatch(
        indices=list(indices),
        model_inputs=model_inputs,
        shift_labels=shift_labels.to(device),
        gather_index=gather_index.to(device),
        completion_mask=completion_mask.to(device),
        real_tokens=real,
        computed_tokens=computed,
        segments=segment_layout,
        token_rows=(torch.cat(token_index).to(device), torch.cat(row_index).to(device)),
    )


def dummy_microbatch(
    pad_token_id: int,
    device: torch.device | str = "cpu",
    attention: str | None = None,
    attention_mask: bool = False,
    position_offset: int = 0,
    width: int = 2,
) -> MicroBatch:
    """A ``width``-token (at least two) micro-batch for zero-weight lockstep passes (a rank with fewer sequences than
    passes; under sequence parallelism one token per process of the group).

    Its forward still runs every layer, so ZeRO-3 gathers and DDP/ZeRO-2 reductions happen on every rank.
    ``attention``, ``attention_mask`` and ``position_offset`` as in :func:`build_microbatch`.
    """
    input_ids = torch.full((1, width), pad_token_id, dtype=torch.long)
    shift_labels = torch.tensor([[pad_token_id] * (width - 1) + [-100]], dtype=torch.long)
    model_inputs = {
        "input_ids": input_ids.to(device),
        "position_ids": (torch.arange(width) + position_offset).unsqueeze(0).to(device),
    }
    if attention_mask:
        model_inputs["attention_mask"] = torch.ones(1, width, dtype=torch.long, device=device)
    segment_layout = None
    if attention is not None:
        from hf_dynbsz.execution.attention import Segment, SegmentLayout

        segment_layout = SegmentLayout([Segment(0, 0, (width,))], attention)
    return MicroBatch(
        indices=[],
        model_inputs=model_inputs,
        shift_labels=shift_labels.to(device),
        gather_index=torch.zeros(0, 1, dtype=torch.long, device=device),
        completion_mask=torch.zeros(0, 1, dtype=torch.long, device=device),
        real_tokens=0,
        computed_tokens=0,
        segments=segment_layout,
    )

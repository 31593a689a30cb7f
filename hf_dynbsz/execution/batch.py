"""The samples of one optimizer step on one device, as the passes consume them (torch layer).

TRL's ``_prepare_inputs`` hands the trainer one fixed *slice* of ``per_device_train_batch_size`` samples per
accumulation step, every tensor padded to the longest row of the generation batch. :class:`StepBatch` flattens
the ``gradient_accumulation_steps`` slices of an optimizer step into per-sample rows with the padding of the
token ids stripped (:class:`~hf_dynbsz.execution.packing.SequenceTable`, with each sample's image inputs) and everything
that belongs to a sample beside it: its loss mask, advantage, per-token fields (old/reference/sampling
log-probs, importance ratios), the stock slice it came from and, once computed, its loss weights and
``top_entropy_quantile`` mask. Per-token tensors are completion-aligned, ``(samples, width)`` with ``width`` the
widest slice's completion width, or ``(samples, 1)`` for per-sequence values.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import torch

from hf_dynbsz.execution.multimodal import TOKEN_FIELDS, split_media
from hf_dynbsz.execution.packing import SequenceTable
from hf_dynbsz.parallel.distributed import ProcessGroup
from hf_dynbsz.planning.schedule import Exchange

__all__ = ["PER_TOKEN_KEYS", "SampleRows", "StepBatch", "pair_step_batch"]

#: Per-sample fields of TRL's generation output with one value per completion token (or one per sequence), and
#: the value that pads a row past its completion: neutral where TRL sums over all columns (vespo sums the log of
#: the importance ratio over the row, and TRL's own ratio is 1 past the completion mask). ``old_logps`` is
#: RLOOTrainer's: each sequence's summed old-policy log-probs, ``(rows,)``.
PER_TOKEN_KEYS = {
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
    "importance_sampling_ratio": 1.0,
    "old_logps": 0.0,
}


#: Per-sample values after a record's rows (:meth:`StepBatch.records`): slice id, items, policy and entropy weights,
#: rope width (-1: none).
EXTRAS = 5


def _pad_columns(tensor: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    if tensor.size(1) >= width:
        return tensor[:, :width]
    return torch.cat([tensor, tensor.new_full((tensor.size(0), width - tensor.size(1)), value)], dim=1)


def _advantages(inputs: dict, rows: int, width: int) -> torch.Tensor:
    """A slice's advantages, per-token ones padded to ``width``; zeros for a trainer without any (a distillation)."""
    adv = inputs.get("advantages")
    if adv is None:
        return torch.zeros(rows, device=inputs["completion_ids"].device)
    return _pad_columns(adv, width) if adv.dim() == 2 else adv


def _num_items(inputs: dict, rows: int) -> torch.Tensor:
    """``(rows,)``: the generation round's global loss tokens GRPOTrainer hands each slice (``num_items_in_batch``);
    zeros for a trainer whose loss does not read it (RLOOTrainer)."""
    items = inputs.get("num_items_in_batch")
    if items is None:
        return torch.zeros(rows)
    return items.detach().float().cpu().expand(rows)


@dataclass
class SampleRows:
    """The rows of some samples of a :class:`StepBatch`, cropped to a pass's completion width."""

    mask: torch.Tensor  # loss mask
    advantages: torch.Tensor
    per_token: dict[str, torch.Tensor]
    entropy_mask: torch.Tensor | None  # top_entropy_quantile's high-entropy mask (None when off)
    bonus_mask: torch.Tensor  # tokens the entropy bonus acts on: mask x entropy_mask
    policy_weights: torch.Tensor  # (rows,)
    entropy_weights: torch.Tensor  # (rows,)
    slice_ids: torch.Tensor  # (rows,)


@dataclass
class StepBatch:
    """The samples of one optimizer step on one device (stock's slices flattened, in slice order).

    ``loss_mask`` is ``completion_mask x tool_mask``; ``slice_ids`` (samples,) and ``slice_rows`` (slices of all
    processes; other processes' entries are 0) say which stock slice each sample came from and how many rows each
    slice has; ``num_items`` is the
    ``num_items_in_batch`` (global loss tokens of the generation round) each sample's slice saw.
    ``stock_microbatch_tokens`` is the token positions of stock's largest slice (rows x padded width) and
    ``stock_computed_tokens`` those of all slices together. ``policy_weights``/``entropy_weights`` (float64,
    from :func:`hf_dynbsz.execution.loss.sample_weights`) and ``high_entropy`` are filled in before the passes run;
    for a distillation so is ``teacher_hidden``: per sample, the teacher's last hidden states at its completion tokens
    ``(completion tokens, teacher_hidden_size)`` (:mod:`hf_dynbsz.execution.teacher`), moved with the sample.
    """

    table: SequenceTable
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    per_token: dict[str, torch.Tensor]
    slice_ids: torch.Tensor
    slice_rows: torch.Tensor
    num_items: torch.Tensor
    stock_microbatch_tokens: int
    stock_computed_tokens: int
    high_entropy: torch.Tensor | None = None
    policy_weights: torch.Tensor | None = None
    entropy_weights: torch.Tensor | None = None
    teacher_hidden: list[torch.Tensor] | None = None
    teacher_hidden_size: int = 0

    @classmethod
    def from_slices(
        cls, window: list[dict], rank: int = 0, num_processes: int = 1, long_rope: tuple[int, ...] = ()
    ) -> StepBatch:
        """Flatten the stock slices of one optimizer step (the outputs of TRL's ``_prepare_inputs``) of process
        ``rank``.

        Slices are numbered across processes (slice ``s`` of process ``p`` is ``p * slices + s``), so that a sample
        that moves to another process (cross-rank balancing) still says which stock slice it belongs to. ``long_rope``:
        the run's LongRoPE models' ``original_max_position_embeddings``: each sample's rope width is its slice's
        (:meth:`~hf_dynbsz.execution.packing.SequenceTable.from_padded`).
        """
        width = max(inputs["completion_ids"].size(1) for inputs in window)
        keys = [key for key in PER_TOKEN_KEYS if window[0].get(key) is not None]
        tables, masks, advantages, slice_ids, num_items = [], [], [], [], []
        per_token = defaultdict(list)
        slice_tokens = []
        for slice_id, inputs in enumerate(window):
            rows = inputs["completion_ids"].size(0)
            tables.append(
                SequenceTable.from_padded(
                    inputs["prompt_ids"],
                    inputs["prompt_mask"],
                    inputs["completion_ids"],
                    inputs["completion_mask"],
                    media=split_media(inputs, rows),
                    token_fields={key: inputs[key] for key in TOKEN_FIELDS if inputs.get(key) is not None},
                    long_rope=long_rope,
                )
            )
            mask = inputs["completion_mask"]
            if inputs.get("tool_mask") is not None:
                mask = mask * inputs["tool_mask"]
            masks.append(_pad_columns(mask, width, 0))
            advantages.append(_advantages(inputs, rows, width))
            for key in keys:
                values = inputs[key] if inputs[key].dim() == 2 else inputs[key].unsqueeze(1)  # (rows,): per sequence
                per_token[key].append(
                    values if values.size(1) == 1 else _pad_columns(values, width, PER_TOKEN_KEYS[key])
                )
            slice_ids.append(torch.full((rows,), rank * len(window) + slice_id, dtype=torch.long))
            num_items.append(_num_items(inputs, rows))
            slice_tokens.append(rows * (inputs["prompt_ids"].size(1) + inputs["completion_ids"].size(1)))
        slice_rows = torch.zeros(num_processes * len(window), dtype=torch.long)
        slice_rows[rank * len(window) : (rank + 1) * len(window)] = torch.tensor([len(ids) for ids in slice_ids])
        return cls(
            table=SequenceTable.concat(tables),
            loss_mask=torch.cat(masks),
            advantages=torch.cat(advantages),
            per_token={key: torch.cat(values) for key, values in per_token.items()},
            slice_ids=torch.cat(slice_ids),
            slice_rows=slice_rows,
            num_items=torch.cat(num_items),
            stock_microbatch_tokens=max(slice_tokens),
            stock_computed_tokens=sum(slice_tokens),
        )

    def __len__(self) -> int:
        return len(self.table)

    @property
    def width(self) -> int:
        """Completion width of the per-token tensors."""
        return self.loss_mask.size(1)

    @property
    def loss_tokens(self) -> torch.Tensor:
        """(samples,) loss-mask tokens per sample, on CPU."""
        return self.loss_mask.sum(dim=1).cpu()

    @property
    def bonus_mask(self) -> torch.Tensor:
        """Tokens the entropy bonus acts on, as stock's ``effective_mask``: loss mask x high-entropy mask."""
        return self.loss_mask if self.high_entropy is None else self.loss_mask * self.high_entropy

    def rows(self, indices: list[int], width: int, index: torch.Tensor | None = None) -> SampleRows:
        """The rows ``indices`` of the per-sample tensors, per-token ones cropped to ``width`` columns. ``index``:
        ``indices`` already on the device (a pass's :attr:`~hf_dynbsz.execution.packing.MicroBatch.sample_index`:
        no copy here); the weights and slice ids are read where :meth:`weights_on` put them."""
        device = self.loss_mask.device
        index = torch.tensor(indices, device=device) if index is None else index

        def crop(tensor: torch.Tensor) -> torch.Tensor:
            picked = tensor[index]
            return picked[:, :width] if picked.dim() == 2 and picked.size(1) > 1 else picked

        entropy_mask = None if self.high_entropy is None else crop(self.high_entropy)
        return SampleRows(
            mask=crop(self.loss_mask),
            advantages=crop(self.advantages),
            per_token={key: crop(tensor) for key, tensor in self.per_token.items()},
            entropy_mask=entropy_mask,
            bonus_mask=crop(self.bonus_mask),
            policy_weights=self.policy_weights[index],  # (on the device since weights_on)
            entropy_weights=self.entropy_weights[index],
            slice_ids=self.slice_ids[index],
        )

    def weights_on(self, device) -> StepBatch:
        """This batch with its loss weights and slice ids on ``device``, once per step before the passes (each pass
        then picks its rows there)."""
        return dataclasses.replace(
            self,
            policy_weights=self.policy_weights.to(device),
            entropy_weights=self.entropy_weights.to(device),
            slice_ids=self.slice_ids.to(device),
        )

    # ---- moving samples between processes (cross-rank balancing) --------------------------------------------

    def _row_fields(self) -> list[tuple[str, torch.Tensor, bool]]:
        """(name, tensor, per token?) of every per-sample row, in record order (the same on every process)."""
        fields = [("loss_mask", self.loss_mask, True), ("advantages", self.advantages, self.advantages.dim() == 2)]
        fields += [(key, tensor, tensor.size(1) > 1) for key, tensor in self.per_token.items()]
        if self.high_entropy is not None:
            fields.append(("high_entropy", self.high_entropy, True))
        return fields

    def moved(self, group: ProcessGroup, exchange: Exchange, media: bool = False) -> StepBatch:
        """The training samples this process runs under ``exchange``, each with everything that belongs to it (with
        ``media``, the same on every process, their image inputs and token fields too). A distillation's teacher
        hidden states travel apart, in their own dtype, and only those of samples that change process (a sample that
        stays keeps its states, uncopied)."""
        records = group.send_to_runners(self.records(), exchange, self.record_size)
        hidden = None
        if self.teacher_hidden is not None:
            width = self.teacher_hidden_size
            hidden = [
                record.view(-1, width)
                for record in group.send_to_runners(
                    [rows.reshape(-1) for rows in self.teacher_hidden],
                    exchange,
                    lambda prompt, completion: completion * width,
                    dtype=self.teacher_hidden_dtype,
                )
            ]
        moved = self.from_records(records, [exchange.shapes[origin][i] for origin, i in exchange.incoming], hidden)
        if media:
            moved.table = moved.table.with_media_records(group.send_to_runners(self.table.media_records(), exchange))
        return moved

    @property
    def teacher_hidden_dtype(self) -> torch.dtype:
        """The dtype of the teacher hidden states (every process's are the teacher's output dtype; a process owns at
        least one sample)."""
        return self.teacher_hidden[0].dtype if self.teacher_hidden else torch.float32

    def arriving_hidden_tokens(self, exchange: Exchange | None, rank: int) -> int:
        """Completion tokens whose teacher hidden states arrive at process ``rank`` under ``exchange`` (0 without a
        teacher, or nothing moved): states this process will hold during the step's passes besides its own."""
        if self.teacher_hidden is None or exchange is None:
            return 0
        return sum(exchange.shapes[origin][i][1] for origin, i in exchange.incoming if origin != rank)

    def record_size(self, prompt_length: int, completion_length: int) -> int:
        """Values in the record of a sample with these lengths: its tokens, its rows up to its completion
        length, slice id, items, policy and entropy weights, rope width (a distillation's teacher hidden states
        travel apart)."""
        per_token = sum(1 for _, _, is_per_token in self._row_fields() if is_per_token)
        return (
            prompt_length
            + completion_length
            + per_token * completion_length
            + (len(self._row_fields()) - per_token)
            + EXTRAS
        )

    def records(self) -> list[torch.Tensor]:
        """One float64 record per sample (everything that belongs to it but a distillation's teacher hidden states,
        which :meth:`moved` sends in their own dtype), exact for ids, masks, fp32 and fp64."""
        records = []  # (image inputs and token fields travel apart: SequenceTable.media_records)
        for i, tokens in enumerate(self.table.tokens):
            length = int(self.table.completion_lengths[i])
            pieces = [tokens.double()]
            for _, tensor, is_per_token in self._row_fields():
                pieces.append(tensor[i, :length].double() if is_per_token else tensor[i].reshape(1).double())
            widths = self.table.rope_widths
            pieces.append(
                torch.stack(
                    [
                        self.slice_ids[i].double(),
                        self.num_items[i].double(),
                        self.policy_weights[i].double(),
                        self.entropy_weights[i].double(),
                        widths[i].double() if widths is not None else torch.tensor(-1.0, dtype=torch.float64),
                    ]
                ).to(tokens.device)
            )
            records.append(torch.cat([piece.to(tokens.device) for piece in pieces]))
        return records

    def from_records(
        self, records: list[torch.Tensor], shapes: list[tuple[int, int]], hidden: list[torch.Tensor] | None = None
    ) -> StepBatch:
        """A batch of the samples in ``records`` (lengths ``shapes``), laid out like this one (same fields);
        ``hidden``: their teacher hidden states, ``(completion, teacher_hidden_size)`` each (with a teacher)."""
        width = max([completion for _, completion in shapes] + [1])
        fields = self._row_fields()
        rows = {name: [] for name, _, _ in fields}
        tokens, extras = [], []
        for record, (prompt, completion) in zip(records, shapes):
            tokens.append(record[: prompt + completion].long())
            offset = prompt + completion
            for name, tensor, is_per_token in fields:
                size = completion if is_per_token else 1
                value = record[offset : offset + size]
                if is_per_token:
                    pad = PER_TOKEN_KEYS.get(name, 0.0)
                    value = torch.cat([value, value.new_full((width - completion,), pad)])
                rows[name].append(value.to(tensor.dtype))
                offset += size
            extras.append(record[offset : offset + EXTRAS])
        stacked = {name: torch.stack(values) for name, values in rows.items()}
        extras = torch.stack(extras).cpu()
        advantages = stacked["advantages"]
        return StepBatch(
            table=SequenceTable(
                tokens=tokens,
                prompt_lengths=torch.tensor([p for p, _ in shapes]),
                completion_lengths=torch.tensor([c for _, c in shapes]),
                rope_widths=extras[:, 4].long() if self.table.rope_widths is not None else None,
            ),
            loss_mask=stacked["loss_mask"],
            advantages=advantages if self.advantages.dim() == 2 else advantages.squeeze(1),
            per_token={key: stacked[key] for key in self.per_token},
            slice_ids=extras[:, 0].long(),
            slice_rows=self.slice_rows,
            num_items=extras[:, 1].float(),
            stock_microbatch_tokens=self.stock_microbatch_tokens,
            stock_computed_tokens=self.stock_computed_tokens,
            high_entropy=stacked.get("high_entropy"),
            policy_weights=extras[:, 2],
            entropy_weights=extras[:, 3],
            teacher_hidden=None if self.teacher_hidden is None else list(hidden),
            teacher_hidden_size=self.teacher_hidden_size,
        )


def pair_step_batch(window, tokens, prompts, completions, fields, slice_ids, slice_tokens, together, widths, rank,
                    processes, long_rope) -> StepBatch:  # fmt: skip
    """A preference step's :class:`StepBatch` from its rows read off stock's collated micro-batches (``window``: this
    process's, numbered from ``rank * len(window)`` over ``processes``): each row's ``tokens``, prompt and completion
    lengths (tokens), its per-row ``fields`` (one value each), stock slice, pair (``together``) and rope width;
    ``slice_tokens``: each micro-batch's padded positions (rows x width), what stock computes. Every row's loss mask
    covers its completion; DPO's and the reward model's steps are built by it."""
    device = window[0]["input_ids"].device
    loss_mask = torch.zeros(len(tokens), max(completions + [1]), dtype=torch.long, device=device)
    for i, completion in enumerate(completions):
        loss_mask[i, :completion] = 1
    slice_rows = torch.zeros(processes * len(window), dtype=torch.long)
    counts = torch.bincount(torch.tensor(slice_ids, dtype=torch.long) - rank * len(window), minlength=len(window))
    slice_rows[rank * len(window) : (rank + 1) * len(window)] = counts
    table = SequenceTable(tokens, torch.tensor(prompts), torch.tensor(completions), together=together)
    table.rope_widths = torch.tensor(widths, dtype=torch.long) if long_rope else None
    return StepBatch(
        table=table,
        loss_mask=loss_mask,
        advantages=torch.zeros(len(tokens), device=device),
        per_token={
            name: torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)
            for name, values in fields.items()
        },
        slice_ids=torch.tensor(slice_ids, dtype=torch.long),
        slice_rows=slice_rows,
        num_items=torch.zeros(len(tokens)),
        stock_microbatch_tokens=max(slice_tokens),
        stock_computed_tokens=sum(slice_tokens),
    )

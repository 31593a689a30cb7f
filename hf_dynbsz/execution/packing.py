"""Packing collator: turns TRL's padded prompt/completion tensors into token-budget micro-batches.

TRL hands the trainer left-padded ``prompt_ids`` and right-padded ``completion_ids``, both padded to the
longest row of the whole generation batch. This module strips that padding and rebuilds model inputs for
a chosen set of sequences in one of two layouts:

* ``"padding_free"``: the micro-batch's samples in ONE row, no attention mask, laid out as the nodes of their prefix
  tree (:mod:`hf_dynbsz.planning.prefix_tree`, by the sharing rule's position keys): each node's positions once, in
  row order, a node's ``position_ids`` its depths (continuing from its parent's; a root counts from 0). With segment
  attention (:mod:`hf_dynbsz.execution.attention`, whose
  :class:`~hf_dynbsz.execution.attention.SegmentLayout` the inputs carry) each node attends to its root-to-node path:
  a prompt shared by its group, a block shared across prompts, a trunk shared by completions are computed once.
  Without sharing every sample is a root node of its own, a plain sequence whose positions restart at 0; that is
  all a row holds without segment attention, where transformers isolates the sequences only when ``attention_mask is
  None`` and no cache is used (flash-attention varlen kernels read the boundaries from the restarting
  ``position_ids``; sdpa/eager build a block-diagonal mask from them). The forward is called with
  ``use_cache=False`` (TRL's fused LM head forces it).
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

In both layouts the labels are pre-shifted (``shift_labels``): position ``t`` carries its next token when that
token is a completion token of a sample holding ``t`` (samples share a position only when they agree on its next
token), ``-100`` otherwise, so a packed row never scores a token of another sample. :class:`MicroBatch.gather_index`
maps the model's flat per-position output back to completion-aligned ``(rows, completion_width)`` tensors in the
micro-batch's row order: a shared position is read for every sample whose completion it scores, a loss term of each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from hf_dynbsz.execution.multimodal import join_media, media_digest, media_record, read_media_record
from hf_dynbsz.parallel.distributed import ProcessGroup
from hf_dynbsz.planning.model_support import rope_width
from hf_dynbsz.planning.prefix_tree import PrefixTree, group_keys, namespaced, token_keys
from hf_dynbsz.planning.schedule import Exchange
from hf_dynbsz.planning.settings import SharePrefix
from hf_dynbsz.planning.tokens import LAYOUTS, range_positions, round_up

__all__ = ["MicroBatch", "SequenceTable", "build_microbatch", "dummy_microbatch", "to_device_once"]


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
    #: (:func:`hf_dynbsz.execution.multimodal.rope_positions`); None for models whose tokens count positions like
    #: text, and until the trainer computes them for a padding-free pass (a new table, moved or concatenated, has none)
    positions: list[torch.Tensor] | None = None
    #: one id per sample; samples of equal ids always share a training pass (a preference pair's chosen and
    #: rejected, whose loss is one function of both: :meth:`hf_dynbsz.planning.prefix_tree.PrefixTree.units`); None:
    #: no such groups
    together: list[int] | None = None
    #: ``(N,)`` long, CPU: per sample, the width its LongRoPE factors are picked by
    #: (:func:`~hf_dynbsz.planning.model_support.rope_width` of the padded width of stock's micro-batch that holds it;
    #: :mod:`hf_dynbsz.execution.rope`); None for a model without LongRoPE
    rope_widths: torch.Tensor | None = None
    #: :meth:`prompt_groups`, once computed (it hashes every sample's pixels)
    _groups: list[int] | None = field(default=None, init=False, repr=False, compare=False)
    #: :meth:`prefix_keys` and :meth:`prefix_tree` by sharing rule, once computed
    _sharing: dict = field(default_factory=dict, init=False, repr=False, compare=False)

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
        long_rope: tuple[int, ...] = (),
    ) -> SequenceTable:
        """Strip TRL's padding: prompts are left-padded, completions right-padded (masks are contiguous).

        ``media``: per-sample image inputs; ``token_fields``: ``(samples, prompt width + completion width)`` tensors
        aligned with ``prompt_ids`` then ``completion_ids``, stripped like the token ids. ``long_rope``: the
        ``original_max_position_embeddings`` of the run's LongRoPE models
        (:attr:`~hf_dynbsz.planning.model_support.ModelSupport.long_rope`): every sample gets the rope width of these
        tensors' width, the width of stock's forward over them (:attr:`rope_widths`).
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
        rope_widths = None
        if long_rope:
            rope = rope_width(width + completion_ids.size(1), tuple(long_rope))
            rope_widths = torch.full((len(tokens),), rope, dtype=torch.long)
        return cls(
            tokens=tokens,
            prompt_lengths=prompt_lengths.cpu(),
            completion_lengths=completion_lengths.cpu(),
            media=media,
            token_fields=fields or None,
            rope_widths=rope_widths,
        )

    def prompt_groups(self) -> list[int]:
        """One id per sample, shared by the samples whose prompts are identical (numbered by first appearance).

        Compares the unpadded prompt ids, for vision-language samples the image inputs (image tokens are one id
        whatever the picture) and for LongRoPE models the rope widths (:attr:`rope_widths`: other rotary factors), so
        duplicate prompts of different dataset rows share an id too. A sample whose images reach its prompt's last token
        (token fields not 0 from a position at or before it to one at or after it) is alone: a shared prompt's last
        token is repeated in every completion's block, and a sample's images must all be in one node of a row (the
        node that holds its first image brings them: an image encoded once, all of it where its tokens are).
        """
        if self._groups is not None:
            return self._groups
        prompt_lengths = self.prompt_lengths.tolist()
        if not prompt_lengths:
            return []
        flat = torch.cat([tokens[:p] for tokens, p in zip(self.tokens, prompt_lengths)]).cpu().tolist()
        ids: dict[tuple, int] = {}
        groups, offset = [], 0
        spans = zip(self.first_media_positions(), self.media_ends()) if self.token_fields else None
        for i, p in enumerate(prompt_lengths):
            key: tuple = tuple(flat[offset : offset + p])
            if self.media is not None:
                key += (media_digest(self.media[i]),)
            if self.rope_widths is not None:  # other rotary factors: another prompt
                key += (("rope width", int(self.rope_widths[i])),)
            first, end = next(spans) if spans is not None else (None, None)
            if first is not None and end is not None and first <= p - 1 < end:
                key = ("alone", i)
            groups.append(ids.setdefault(key, len(ids)))
            offset += p
        self._groups = groups
        return groups

    def prefix_keys(self, sharing: SharePrefix | str) -> list[np.ndarray]:
        """Per sample, its position keys under the sharing rule ``sharing`` (a
        :class:`~hf_dynbsz.planning.settings.SharePrefix` or its value; :mod:`hf_dynbsz.planning.prefix_tree`):
        ``GROUPS``, each prompt shared in its group (:meth:`prompt_groups`); ``TREE``, every position by its token and
        the next (:func:`~hf_dynbsz.planning.prefix_tree.token_keys`), except that a LongRoPE sample's keys carry its
        rope width (from its first token on: positions are shared only between samples of the same rotary factors) and
        a vision-language sample's keys from the token before its first image token on (its first token, where its
        token fields do not say where its images are) carry its pictures, its rope width and its tokens through the one
        after its last image token (its prompt, where its token fields do not place its images): positions whose
        hidden states its pictures decide are shared only with samples of the same tokens and pictures, and samples
        that share its first image part after its last (all of a sample's images in the node that holds its first, an
        image in a completion after a fork from a sibling included)."""
        if ("keys", sharing) not in self._sharing:
            self._sharing["keys", sharing] = self._keys(sharing)
        return self._sharing["keys", sharing]

    def _keys(self, sharing: SharePrefix | str) -> list[np.ndarray]:
        lengths = self.lengths.tolist()
        if sharing == SharePrefix.GROUPS:
            return group_keys(self.prompt_lengths.tolist(), lengths, self.prompt_groups())
        if sharing != SharePrefix.TREE:
            raise ValueError(f"sharing must be 'tree' or 'groups', got {sharing!r}")
        tokens = [ids.cpu().numpy() for ids in self.tokens]
        base = max((int(ids.max()) for ids in tokens if ids.size), default=0) + 2
        keys = [token_keys(ids, base) for ids in tokens]
        spaces: dict[tuple, int] = {}  # one numbering of the namespaces, so that no two kinds share a key

        def space(name: tuple) -> int:
            return -2 - spaces.setdefault(name, len(spaces))

        for i, width in enumerate(self.rope_widths.tolist() if self.rope_widths is not None else []):
            if width:  # the first key of its own and its width: shared with samples of both alike only
                keys[i] = namespaced(keys[i], 0, space(("rope width", width, int(keys[i][0]))))
        prompts = self.prompt_lengths.tolist()
        for i, (first, end) in enumerate(zip(self.first_media_positions(), self.media_ends())):
            if first is not None:  # its pictures, factors and tokens through the one after its last image token
                start = max(first - 1, 0)
                through = tokens[i][start : end + 1] if end is not None else tokens[i][: prompts[i]]
                pictures = media_digest(self.media[i]) if self.media is not None else None
                width = int(self.rope_widths[i]) if self.rope_widths is not None else 0
                keys[i] = namespaced(keys[i], start, space(("images", pictures, width, tuple(through.tolist()))))
        return keys

    def first_media_positions(self) -> list[int | None]:
        """Per sample, the first position its images decide (its first token with a token field not 0, or 0 for a
        sample with image inputs and no such field), None for a sample without images."""
        if "firsts" not in self._sharing and not self.multimodal:  # text: no images anywhere
            self._sharing["firsts"] = [None] * len(self)
        if "firsts" not in self._sharing:
            firsts = []
            for i in range(len(self)):
                marked = [torch.nonzero(values[i]).flatten() for values in (self.token_fields or {}).values()]
                marked = [int(where[0]) for where in marked if where.numel()]
                media = self.media[i] if self.media is not None else {}
                images = any(value.numel() for value in media.values())
                firsts.append(min(marked) if marked else (0 if images else None))
            self._sharing["firsts"] = firsts
        return self._sharing["firsts"]

    def media_ends(self) -> list[int | None]:
        """Per sample, the position after its last image token (its last token with a token field not 0, plus one);
        None where its token fields mark none (no images, or images its fields do not place)."""
        if "ends" not in self._sharing:
            ends = []
            for i in range(len(self)):
                marked = [torch.nonzero(values[i]).flatten() for values in (self.token_fields or {}).values()]
                marked = [int(where[-1]) + 1 for where in marked if where.numel()]
                ends.append(max(marked) if marked else None)
            self._sharing["ends"] = ends
        return self._sharing["ends"]

    def prefix_tree(self, sharing: SharePrefix | str) -> PrefixTree:
        """The prefix tree of every sample of the table under ``sharing`` (:meth:`prefix_keys`)."""
        if ("tree", sharing) not in self._sharing:
            self._sharing["tree", sharing] = PrefixTree.of_keys(self.prefix_keys(sharing))
        return self._sharing["tree", sharing]

    def group_tree(self) -> PrefixTree:
        """The trie of the prompt-group rule from the samples' lengths and prompt groups alone
        (:meth:`PrefixTree.of_groups`: what the rule computes, without building keys), built once per table."""
        if "group_tree" not in self._sharing:
            prompts, completions = self.prompt_lengths.tolist(), self.completion_lengths.tolist()
            self._sharing["group_tree"] = PrefixTree.of_groups(prompts, completions, self.prompt_groups())
        return self._sharing["group_tree"]

    def moved(self, group: ProcessGroup, exchange: Exchange, media: bool = False) -> SequenceTable:
        """The samples (token ids; with ``media``, their image inputs and token fields too) of a no-grad pass this
        process runs under ``exchange``. ``media`` must be the same on every process (the model is
        vision-language)."""
        widths = self.rope_widths
        sent = [tokens.double() for tokens in self.tokens]
        if widths is not None:  # the rope width travels at the end of the sample's record
            sent = [torch.cat([ids, ids.new_full((1,), float(width))]) for ids, width in zip(sent, widths.tolist())]
        extra = int(widths is not None)
        records = group.send_to_runners(sent, exchange, lambda p, c: p + c + extra)
        shapes = [exchange.shapes[origin][i] for origin, i in exchange.incoming]
        moved = SequenceTable(
            tokens=[record[: p + c].long() for record, (p, c) in zip(records, shapes)],
            prompt_lengths=torch.tensor([p for p, _ in shapes]),
            completion_lengths=torch.tensor([c for _, c in shapes]),
            rope_widths=torch.tensor([int(record[-1]) for record in records]) if extra else None,
        )
        return moved.with_media_records(group.send_to_runners(self.media_records(), exchange)) if media else moved

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
        together = None
        if any(table.together is not None for table in tables):  # each table's groups, numbered apart
            together, offset = [], 0
            for table in tables:
                ids = table.together if table.together is not None else range(len(table))
                together += [offset + int(group) for group in ids]
                offset = max(together, default=-1) + 1
        widths = None
        if any(table.rope_widths is not None for table in tables):
            widths = torch.cat(
                [
                    table.rope_widths if table.rope_widths is not None else torch.zeros(len(table), dtype=torch.long)
                    for table in tables
                ]
            )
        return cls(
            tokens=[tokens for table in tables for tokens in table.tokens],
            prompt_lengths=torch.cat([table.prompt_lengths for table in tables]),
            completion_lengths=torch.cat([table.completion_lengths for table in tables]),
            media=media,
            token_fields=fields or None,
            together=together,
            rope_widths=widths,
        )


@dataclass
class MicroBatch:
    """Model inputs for one forward pass plus the map back to completion-aligned tensors.

    ``indices``: which samples of the :class:`SequenceTable` (in row order). ``model_inputs`` holds
    ``input_ids`` and ``position_ids`` (and an ``attention_mask`` for padded rows that need one), or for
    vision-language samples ``input_ids``, ``attention_mask``, their token fields and image inputs. ``segments``:
    the :class:`~hf_dynbsz.execution.attention.SegmentLayout` of a padding-free row run through segment attention
    (give it to :func:`~hf_dynbsz.execution.attention.use_segments` before the forward), else None. ``token_rows``:
    ``(token_index, row_index)`` pairs, each flat token position with every row (sample) it counts for, as stock's
    attention mask counts it: a shared prompt's tokens for each sample sharing it, padding for none (the MoE router
    aux loss reads them). ``shift_labels`` has the shape of ``input_ids``. ``gather_index`` is ``(rows,
    completion_width)`` into the flattened per-position output; ``completion_mask`` marks the valid entries.
    ``real_tokens``/``computed_tokens`` count the positions computed without and with padding (a shared prompt
    counts once).
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
    #: ``indices`` as a device tensor (rows of per-sample tensors are picked with it, no host list on the device)
    sample_index: torch.Tensor | None = None
    #: each position's rope width (:attr:`SequenceTable.rope_widths` of the sample it holds, 0 on padding), shaped
    #: like ``input_ids``, for :func:`~hf_dynbsz.execution.rope.use_rope_widths`; None for a model without LongRoPE
    rope_widths: torch.Tensor | None = None

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
    keys: Sequence[np.ndarray] | None = None,
    tree: PrefixTree | None = None,
) -> MicroBatch:
    """Build the inputs of one micro-batch holding the samples ``indices`` of ``table`` (in that order).

    ``attention``: the base attention implementation when the padding-free row runs through segment attention
    (:mod:`hf_dynbsz.execution.attention`; the inputs then carry its
    :class:`~hf_dynbsz.execution.attention.SegmentLayout`), None for the model's own attention. ``keys`` (one array
    of position keys per sample of ``table``, :meth:`SequenceTable.prefix_keys`; needs segment attention): the
    micro-batch's samples fold into their prefix tree, each shared position computed once
    (:mod:`hf_dynbsz.planning.prefix_tree`); ``groups`` (one id per sample of ``table``) stands for the keys of the
    prompt-group rule (samples with the same id have identical prompts and share one copy of it). ``tree``: the
    prefix tree of all of ``table``'s samples under ``keys`` (:meth:`SequenceTable.prefix_tree`), whose restriction to
    ``indices`` is the micro-batch's tree (:meth:`PrefixTree.restricted`: the same tree, without inserting the keys
    again). ``attention_mask``: padded rows carry an attention mask. ``position_offset``: added to every position id.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    if not indices:
        raise ValueError("a micro-batch needs at least one sequence (use dummy_microbatch for an empty one)")
    if (groups is not None or keys is not None or tree is not None) and (layout != "padding_free" or attention is None):
        raise ValueError("shared prompts need the padding_free layout and segment attention")
    if keys is None and groups is not None:
        keys = group_keys(table.prompt_lengths.tolist(), table.lengths.tolist(), list(groups))
    samples = _Samples(
        indices, table.prompt_lengths[indices].tolist(), table.completion_lengths[indices].tolist(), device
    )
    if layout == "padding_free":
        if tree is not None:
            tree = tree.restricted(samples.indices)
        elif keys is not None:
            tree = PrefixTree.of_keys([keys[i] for i in samples.indices])
        built = _padding_free_inputs(table, samples, pad_token_id, pad_to_multiple_of, attention, tree)
    else:
        built = _padded_inputs(table, samples, pad_token_id, pad_to_multiple_of, attention_mask)
    moved = _move_with_segments(_host_inputs(built, samples, position_offset), built.segments, device)
    model_inputs = {**built.model_inputs, **{name: moved[name] for name in built.model_inputs}}
    model_inputs["input_ids"] = moved["input_ids"]
    if built.position_ids is not None:
        model_inputs["position_ids"] = moved["position_ids"]
    return MicroBatch(
        indices=list(indices),
        model_inputs=model_inputs,
        shift_labels=moved["shift_labels"],
        gather_index=moved["gather_index"],
        completion_mask=moved["completion_mask"],
        real_tokens=built.real_tokens,
        computed_tokens=built.computed_tokens,
        segments=built.segments,
        token_rows=(moved["token_index"], moved["row_index"]),
        sample_index=moved["sample_index"],
        rope_widths=moved.get("rope_widths"),
    )


def _host_inputs(built: _LayoutInputs, samples: _Samples, position_offset: int) -> dict[str, torch.Tensor]:
    """Every host tensor of a pass (its model inputs, labels, the maps back to the samples), by name."""
    host = {name: value for name, value in built.model_inputs.items() if value.device.type == "cpu"}
    host.update(
        input_ids=built.input_ids,
        shift_labels=built.shift_labels,
        gather_index=samples.gather_index,
        completion_mask=samples.completion_mask,
        token_index=torch.cat(samples.token_index),
        row_index=torch.cat(samples.row_index),
        sample_index=torch.tensor(samples.indices, dtype=torch.long),
    )
    if built.position_ids is not None:
        host["position_ids"] = built.position_ids + position_offset
    if built.rope_widths is not None:
        host["rope_widths"] = built.rope_widths
    return host


def to_device_once(tensors: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """``tensors`` (host tensors of integers or booleans: ids, positions, labels, index arithmetic) on ``device`` in
    ONE host-to-device copy: flattened into one int64 buffer, pinned on CUDA and copied ``non_blocking``, then
    viewed and cast back on the device. A pass's copy never waits for the device (a pageable or blocking copy
    synchronises the host with it). On the CPU the tensors themselves. Floating-point tensors (image inputs) are
    moved by the caller."""
    device = torch.device(device)
    if device.type == "cpu" or not tensors:
        return dict(tensors)
    return _one_copy(tensors, device)


def _one_copy(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """:func:`to_device_once`'s copy (on any device, the CPU too: its test)."""
    names = list(tensors)
    flat = torch.cat([tensors[name].reshape(-1).to(torch.int64) for name in names])
    if device.type == "cuda":
        flat = flat.pin_memory()
    moved = flat.to(device, non_blocking=True)
    out, offset = {}, 0
    for name in names:
        tensor = tensors[name]
        out[name] = moved[offset : offset + tensor.numel()].view(tensor.shape).to(tensor.dtype)
        offset += tensor.numel()
    return out


def _move_with_segments(host: dict[str, torch.Tensor], segments, device) -> dict[str, torch.Tensor]:
    """``host`` and the index tensors of the pass's segment layout (:meth:`SegmentLayout.host_tensors`), moved in one
    copy; the layout adopts its own."""
    if segments is None:
        return to_device_once(host, device)
    own = segments.host_tensors(device)
    moved = to_device_once({**host, **own}, device)
    segments.adopt({name: moved[name] for name in own}, device)
    return moved


class _Samples:
    """The samples of one micro-batch and what both layouts record about them: which flat positions each row
    counts (``token_rows``) and where each completion token's prediction lands (``gather_index``)."""

    def __init__(self, indices: list[int], prompt_lengths: list[int], completion_lengths: list[int], device) -> None:
        self.indices, self.prompt_lengths, self.completion_lengths = indices, prompt_lengths, completion_lengths
        self.seq_lengths = [p + c for p, c in zip(prompt_lengths, completion_lengths)]
        self.device = device
        completion_width = max(max(completion_lengths), 1)
        # Position (in the flattened output) whose next-token prediction is completion token k of row j.
        self.gather_index = torch.zeros(len(indices), completion_width, dtype=torch.long)
        self.completion_mask = torch.zeros(len(indices), completion_width, dtype=torch.long)
        self.token_index: list[torch.Tensor] = []  # flat positions, and the row each counts for
        self.row_index: list[torch.Tensor] = []

    def count(self, row: int, start: int, length: int) -> None:
        """The flat positions ``start:start + length`` count for ``row``."""
        self.count_positions(row, torch.arange(start, start + length))

    def count_positions(self, row: int, positions: torch.Tensor) -> None:
        """The flat ``positions`` count for ``row`` (a shared position for every row that holds it)."""
        self.token_index.append(positions)
        self.row_index.append(torch.full((positions.numel(),), row))

    def count_positions_of_rows(self, positions: torch.Tensor, sizes: list[int]) -> None:
        """The flat ``positions`` count for the rows in order, ``sizes[j]`` of them for row ``j`` (as
        :meth:`count_positions` row after row)."""
        self.token_index.append(positions)
        self.row_index.append(torch.from_numpy(np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)))

    def completions_at(self, rows: list[int], positions: torch.Tensor) -> None:
        """Each of ``rows``' completion tokens is predicted at the flat ``positions``, row after row (as
        :meth:`completion_at_positions` for each)."""
        lengths = [self.completion_lengths[row] for row in rows]
        which = torch.from_numpy(np.repeat(np.asarray(rows, dtype=np.int64), lengths))
        columns = torch.from_numpy(range_positions([range(c) for c in lengths]))
        self.gather_index[which, columns] = positions
        self.completion_mask[which, columns] = 1

    def completion_at(self, row: int, first: int) -> None:
        """``row``'s completion tokens are predicted at the flat positions from ``first`` on."""
        self.completion_at_positions(row, torch.arange(first, first + self.completion_lengths[row]))

    def completion_at_positions(self, row: int, positions: torch.Tensor) -> None:
        """``row``'s completion tokens are predicted at the flat ``positions``, one per token (a position shared by
        several rows is each one's loss term)."""
        c = self.completion_lengths[row]
        self.gather_index[row, :c] = positions
        self.completion_mask[row, :c] = 1

    def media_inputs(self, table: SequenceTable, samples: list[int]) -> dict:
        """The image inputs of ``samples`` of ``table``, joined, on the device."""
        return {key: value.to(self.device) for key, value in join_media([table.media[i] for i in samples]).items()}


@dataclass
class _LayoutInputs:
    """What a layout builder gives :func:`build_microbatch`: the row tensors (on CPU), the other model inputs (on
    the device), the token counts and the segment layout."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    shift_labels: torch.Tensor
    model_inputs: dict
    real_tokens: int
    computed_tokens: int
    segments: object | None = None
    rope_widths: torch.Tensor | None = None


class _PackedRow:
    """The pieces of a padding-free row, appended node by node of the pass's prefix tree: ``tree``, the row's nodes
    back to back in its row order (its trailing padding a root of its own), what segment attention reads."""

    def __init__(self, table: SequenceTable, samples: _Samples) -> None:
        self.table, self.samples = table, samples
        self.pieces: list[torch.Tensor] = []
        self.positions: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []
        self.tree: PrefixTree | None = None
        self.samples_with_images: list[int] = []  # samples whose images the row holds, in row order
        self.rope: list[torch.Tensor] = []  # M-RoPE positions along the row (table.positions)
        self.widths: list[torch.Tensor] = []  # rope widths along the row (table.rope_widths)
        self.fields: dict[str, list[torch.Tensor]] = {name: [] for name in table.token_fields or {}}
        self.offset = 0

    def append_token_fields(self, i: int, start: int, end: int | None = None) -> None:
        """Sample ``i``'s token fields and M-RoPE positions for its tokens ``start:end``, appended to the row."""
        for name, values in self.fields.items():
            values.append(self.table.token_fields[name][i][start:end].cpu())
        if self.table.positions is not None:
            self.rope.append(self.table.positions[i][:, start:end].cpu())

    def add_tree(self, tree: PrefixTree) -> None:
        """The micro-batch's samples as the nodes of their prefix ``tree`` (its samples numbered as the micro-batch's
        rows): each node once, its tokens, positions (depths), token fields and M-RoPE positions its source sample's;
        then each row's positions, loss terms and labels along its path (the index arrays of every row built at once,
        :func:`~hf_dynbsz.planning.tokens.range_positions`)."""
        self.tree, samples, firsts = tree, self.samples, None
        if self.table.media is not None:
            firsts = self.table.first_media_positions()
        starts = []
        for node in range(tree.nodes):
            i = samples.indices[tree.source[node]]
            low, length = tree.start[node], tree.length[node]
            starts.append(self.offset)
            self.pieces.append(self.table.tokens[i][low : low + length].cpu())
            self.append_token_fields(i, low, low + length)
            if self.table.rope_widths is not None:  # a node's samples share its source's (prefix_keys)
                self.widths.append(self.table.rope_widths[i].expand(length))
            if firsts is not None and firsts[i] is not None and low <= firsts[i] < low + length:
                self.samples_with_images.append(i)  # its first image's node holds all its images (prefix_keys)
            self.offset += length
        depths = [range(low, low + length) for low, length in zip(tree.start, tree.length)]
        self.positions.append(torch.from_numpy(range_positions(depths)))
        paths = tree.paths()
        where = range_positions([range(starts[n], starts[n] + tree.length[n]) for path in paths for n in path])
        prompts, completions = samples.prompt_lengths, samples.completion_lengths
        sizes = [p + c for p, c in zip(prompts, completions)]
        samples.count_positions_of_rows(torch.from_numpy(where), sizes)
        first = np.cumsum([0, *sizes[:-1]]).tolist()  # each row's first entry in ``where``
        rows = [j for j, c in enumerate(completions) if c > 0]
        predicted = where[range_positions([range(first[j] + prompts[j] - 1, first[j] + sizes[j] - 1) for j in rows])]
        labels = torch.full((self.offset,), -100, dtype=torch.long)
        if rows:  # a shared position predicts the same next token for every row holding it
            tokens = [self.table.tokens[samples.indices[j]][prompts[j] : sizes[j]].cpu() for j in rows]
            labels[torch.from_numpy(predicted)] = torch.cat(tokens)
        samples.completions_at(rows, torch.from_numpy(predicted))
        self.labels.append(labels)

    def pad(self, length: int, pad_token_id: int) -> None:
        """Trailing rounding padding: it continues counting positions so it never starts a "new sequence" of length
        0 in flash-attention's varlen bookkeeping; its labels are -100. With segment attention it is a node of its
        own."""
        self.pieces.append(torch.full((length,), pad_token_id, dtype=torch.long))
        self.positions.append(torch.arange(length))
        self.labels.append(torch.full((length,), -100, dtype=torch.long))
        self.tree = self.tree.with_padding(length)
        for values in self.fields.values():
            values.append(torch.zeros(length, dtype=values[0].dtype))
        if self.rope:
            self.rope.append(torch.arange(length).expand(3, -1))
        if self.widths:
            self.widths.append(torch.zeros(length, dtype=torch.long))


def _padding_free_inputs(
    table: SequenceTable,
    samples: _Samples,
    pad_token_id: int,
    pad_to_multiple_of: int | None,
    attention: str | None,
    tree: PrefixTree | None,
) -> _LayoutInputs:
    """The ``padding_free`` layout: every sample in one row, as the nodes of the samples' prefix ``tree`` (its samples
    numbered as the micro-batch's rows; None: each sample alone, a plain sequence)."""
    row = _PackedRow(table, samples)
    row.add_tree(PrefixTree.alone(samples.seq_lengths) if tree is None else tree)
    total = row.offset
    width = round_up(total, pad_to_multiple_of)
    if attention == "flex_attention":  # a few row widths, each compiled once
        from hf_dynbsz.execution.attention import flex_row_width

        width = round_up(flex_row_width(width), pad_to_multiple_of)
    if width > total:
        row.pad(width - total, pad_token_id)
    position_ids = torch.cat(row.positions).unsqueeze(0)
    if row.rope:  # (4, 1, width): text positions (segment boundaries), then the 3 M-RoPE rows
        position_ids = torch.cat([position_ids, torch.cat(row.rope, dim=1)]).unsqueeze(1)
    model_inputs = {name: torch.cat(values).unsqueeze(0) for name, values in row.fields.items()}  # (moved later)
    if table.media is not None:
        model_inputs.update(samples.media_inputs(table, row.samples_with_images))
    segment_layout = None
    if attention is not None:
        from hf_dynbsz.execution.attention.layout import SegmentLayout

        segment_layout = SegmentLayout(row.tree, attention)
    return _LayoutInputs(
        input_ids=torch.cat(row.pieces).unsqueeze(0),
        position_ids=position_ids,
        shift_labels=torch.cat(row.labels).unsqueeze(0),
        model_inputs=model_inputs,
        real_tokens=total,
        computed_tokens=width,
        segments=segment_layout,
        rope_widths=torch.cat(row.widths).unsqueeze(0) if row.widths else None,
    )


def _padded_inputs(
    table: SequenceTable, samples: _Samples, pad_token_id: int, pad_to_multiple_of: int | None, attention_mask: bool
) -> _LayoutInputs:
    """The ``padded`` layout: one row per sample, right-padded to the micro-batch's longest (rounded) row."""
    rows, seq_lengths = len(samples.indices), samples.seq_lengths
    width = round_up(max(seq_lengths), pad_to_multiple_of)
    input_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    position_ids = torch.arange(width, dtype=torch.long).unsqueeze(0).expand(rows, width).clone()
    shift_labels = torch.full((rows, width), -100, dtype=torch.long)
    for j, i in enumerate(samples.indices):
        seq, p, c, n = table.tokens[i], samples.prompt_lengths[j], samples.completion_lengths[j], seq_lengths[j]
        input_ids[j, :n] = seq.cpu()
        samples.count(j, j * width, n)
        if c > 0:
            shift_labels[j, p - 1 : p - 1 + c] = seq[p : p + c].cpu()
            samples.completion_at(j, j * width + p - 1)
    model_inputs = {}
    if attention_mask or table.multimodal:
        mask = torch.zeros(rows, width, dtype=torch.long)
        for j, n in enumerate(seq_lengths):
            mask[j, :n] = 1
        model_inputs["attention_mask"] = mask  # (moved with the pass's other inputs)
    if table.multimodal:  # the model computes its (multimodal) positions from the mask, as in stock's forward
        model_inputs.update(_padded_media_inputs(table, samples, width))
        position_ids = None
    rope_widths = None
    if table.rope_widths is not None:  # each row its sample's, over the whole row
        rope_widths = table.rope_widths[samples.indices].unsqueeze(1).expand(rows, width).clone()
    return _LayoutInputs(
        input_ids=input_ids,
        position_ids=position_ids,
        shift_labels=shift_labels,
        model_inputs=model_inputs,
        real_tokens=sum(seq_lengths),
        computed_tokens=rows * width,
        rope_widths=rope_widths,
    )


def _padded_media_inputs(table: SequenceTable, samples: _Samples, width: int) -> dict:
    """Padded rows' token fields (zeros over the padding) and image inputs, on the device."""
    inputs = {}
    for name, values in (table.token_fields or {}).items():
        aligned = torch.zeros(len(samples.indices), width, dtype=values[0].dtype)
        for j, i in enumerate(samples.indices):
            aligned[j, : samples.seq_lengths[j]] = values[i].cpu()
        inputs[name] = aligned  # (moved with the pass's other inputs)
    if table.media is not None:
        inputs.update(samples.media_inputs(table, samples.indices))
    return inputs


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
    if attention == "flex_attention":  # one of the row widths flex_attention compiles for anyway
        from hf_dynbsz.execution.attention import flex_row_width

        width = flex_row_width(width)
    host = {
        "input_ids": torch.full((1, width), pad_token_id, dtype=torch.long),
        "position_ids": (torch.arange(width) + position_offset).unsqueeze(0),
        "shift_labels": torch.tensor([[pad_token_id] * (width - 1) + [-100]], dtype=torch.long),
    }
    if attention_mask:
        host["attention_mask"] = torch.ones(1, width, dtype=torch.long)
    segment_layout = None
    if attention is not None:
        from hf_dynbsz.execution.attention.layout import SegmentLayout

        segment_layout = SegmentLayout(PrefixTree.alone([width]), attention)
    moved = _move_with_segments(host, segment_layout, device)
    labels = moved.pop("shift_labels")
    return MicroBatch(
        indices=[],
        model_inputs=moved,
        shift_labels=labels,
        gather_index=torch.zeros(0, 1, dtype=torch.long, device=device),
        completion_mask=torch.zeros(0, 1, dtype=torch.long, device=device),
        real_tokens=0,
        computed_tokens=0,
        segments=segment_layout,
        sample_index=torch.zeros(0, dtype=torch.long, device=device),
    )

"""Segment attention: padding-free rows and shared prompts through the model's own attention kernel (torch layer).

A padding-free row is cut into *segments*, each attending only to itself:

* a plain sequence (prompt + completion): causal attention over it;
* a prompt shared by several completions of that prompt (GRPO's ``num_generations`` samples):
  ``[prefix | block_1 | ... | block_k]``, where ``prefix`` is the prompt without its last token and ``block_j`` is
  the prompt's last token followed by completion ``j``. Prefix tokens attend causally to the prefix; a block's tokens
  attend to the whole prefix and causally to their own block, never to a sibling. Position ids continue from the
  prefix in every block, so each block computes exactly what its own sequence would (its first token, the prompt's
  last, predicts the completion's first token, as in stock's separate sequence).

:func:`segment_attention_forward` is registered in transformers' ``AttentionInterface`` as :data:`ATTENTION_NAME`;
:func:`segment_attention` switches a model to it, and :func:`use_segments` names the :class:`SegmentLayout` of the
pass about to run. The layout travels beside the forward, not through its keyword arguments, so it reaches the
attention of models whose layers do not pass keyword arguments on (Nemotron), and stays in place for gradient
checkpointing's recomputation in the pass's backward. ``masking_utils`` builds no mask for an implementation it does
not know, so this function owns masking. It is stateless and computes each span with **the base implementation's
own function**, so everything that function does (soft-capping, attention sinks, value heads of another size than
query heads, sliding windows, GQA, dtype handling) is the model's own:

* sdpa / eager: spans of equal shape batched into one call of transformers' ``sdpa_attention_forward`` or the
  model's ``eager_attention_forward``, under the span's mask (causal, and the layer's sliding window, over positions
  within the sequence); a plain causal span without a window takes sdpa's unmasked causal kernel. Shared segments:
  the blocks attend to ``[prefix ; block]`` (a block at least as long as its prefix as one causal call whose prefix
  queries are dropped). The attention work of the separate sequences, never the square of a whole row. Where a
  device caps the calls per layer (:data:`SPAN_CALLS_PER_LAYER`: CUDA, where a call's launches cost more than its
  attention), spans of several shapes share a call, padded to its longest query and key span under a per-span mask;
* flex_attention: one call of transformers' ``flex_attention_forward`` per layer over the whole row, under a block
  mask drawn from the segments (the rule above as a ``mask_mod``, and the layer's sliding window over positions within
  the sequence), built once per pass and window. transformers compiles flex_attention once per process; a new row
  width makes torch recompile once more with dynamic shapes, after which widths reuse the kernel. Its inputs are
  cast to autocast's dtype, as sdpa's are;
* varlen_attn (models on sdpa or eager, on CUDA, where :mod:`hf_dynbsz.planning.model_support` finds nothing against
  it): one call per layer of torch's own FlashAttention-2 varlen kernel (``torch.nn.attention.varlen.varlen_attn``,
  torch >= 2.10; no flash-attn install) over the whole row, with the spans of the flash-attention formulation below
  (each shared prompt's keys and values gathered in front of each of its blocks, causal bottom-right; padding a span
  of its own, so no token follows ``cu_seq[-1]``, pytorch#176793). Partial attentions are never merged through their
  log-sum-exp (the kernel's backward drops the log-sum-exp's gradient). The installed signature is read at run time
  (:func:`varlen_attn_keywords`: ``is_causal`` or ``window_size``, ``scale``, ``enable_gqa``); inputs are cast to
  autocast's dtype, one dtype for query, key and value. CI has no GPU: a reference kernel of the same contract
  (:func:`hf_dynbsz.testing.reference_varlen_attn`) stands in for it on CPU (:data:`VARLEN_ATTN_KERNEL`);
* flash-attention: one varlen call whose query spans are the prefixes and blocks and whose key spans are
  ``[prefix ; own block]`` (keys gathered; causal masks of flash-attention >= 2.1 align bottom-right, and so do
  sliding windows), through transformers' own flash-attention integration. CI has no GPU: the index arithmetic is
  tested on CPU with a reference varlen kernel (:mod:`hf_dynbsz.testing`) standing in for the kernel.

Which models it may run is decided in :mod:`hf_dynbsz.planning.model_support`; the self-check
(:mod:`hf_dynbsz.execution.self_check`) verifies it on the first step's samples.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import inspect
import logging
import sys
from collections import defaultdict
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import numpy as np
import torch
from transformers import AttentionInterface

from hf_dynbsz.planning.cost import text_config_of
from hf_dynbsz.planning.model_support import VARLEN_ATTENTION_PREFIXES, VARLEN_ATTN, DeviceFacts

logger = logging.getLogger("hf_dynbsz")

__all__ = [
    "ATTENTION_NAME",
    "Part",
    "Segment",
    "SegmentLayout",
    "active_segments",
    "device_facts",
    "flex_row_width",
    "segment_attention",
    "segment_attention_forward",
    "use_segments",
    "varlen_attn_keywords",
]

ATTENTION_NAME = "hf_dynbsz_segments"

#: Query and key positions per block of flex_attention's ``BlockMask`` (torch's default).
FLEX_BLOCK_SIZE = 128

#: At most this many sdpa / eager calls per layer over a padding-free row, by device type (absent: one call per span
#: shape, no padding). On a CPU padding costs compute and a call costs little: one call per shape ran a long-tailed
#: step 5.36x faster than stock, 4 padded calls 3.57x (step_time.py, 2 cores). On a GPU a call's launches and gathers
#: cost more than its attention: a call per shape ran a step 6.4x slower than stock (H200, gpu_check.py), hence a few
#: padded calls there (not yet measured on a GPU). On CUDA models on sdpa and eager take torch's varlen_attn instead,
#: where it runs; the span formulation remains for fp32 with packing_layout="padding_free".
SPAN_CALLS_PER_LAYER: dict[str, int] = {"cuda": 4}


@dataclass(frozen=True)
class Segment:
    """One segment of a padding-free row: ``prefix`` shared tokens (0 for a plain sequence), then ``blocks``."""

    start: int
    prefix: int
    blocks: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + self.prefix + sum(self.blocks)

    @property
    def plain(self) -> bool:
        return self.prefix == 0 and len(self.blocks) == 1


@dataclass(frozen=True)
class SpanCall:
    """One batched call of the sdpa / eager formulation: ``rows`` spans, each padded to the call's longest query
    and key span (spans of one shape need no padding).

    ``queries`` / ``keys``: row positions, span after span (``rows x query_length`` / ``rows x key_length``; padding
    entries point at position 0 and are masked out). A span's keys are positions ``0 .. key_length - 1`` of its
    sequence; its queries are the last ``query_length`` of them (a block's queries follow its prefix, which only
    its keys hold). ``kept``: the indices, in the call's flattened
    ``rows x query_length`` outputs, of the outputs that go back to the row (not padding, nor prefix queries
    recomputed by a causal call over ``[prefix ; block]``). ``starts`` / ``lengths``: per span, the key position of
    its first query (key length less query length) and its query length, as tensors beside the others (a mask is
    drawn from them on the device, no host value read there).
    """

    queries: torch.Tensor
    keys: torch.Tensor
    rows: int
    query_lengths: tuple[int, ...]
    key_lengths: tuple[int, ...]
    kept: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor

    TENSORS = ("queries", "keys", "kept", "starts", "lengths")

    def host_tensors(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in self.TENSORS]

    def with_tensors(self, tensors) -> SpanCall:
        """This call with its tensors replaced (moved to a device), in :data:`TENSORS` order."""
        return dataclasses.replace(self, **dict(zip(self.TENSORS, tensors)))

    @property
    def query_length(self) -> int:
        return self.queries.numel() // self.rows

    @property
    def key_length(self) -> int:
        return self.keys.numel() // self.rows

    @property
    def padded(self) -> bool:
        """Whether spans of several shapes share the call (padding to the longest, under a per-span mask)."""
        return len({*self.query_lengths, self.query_length}) > 1 or len({*self.key_lengths, self.key_length}) > 1

    def mask(self, window: int | None, device=None) -> torch.Tensor | None:
        """``(1 or rows, 1, query_length, key_length)`` bool mask (True: may attend), or None for plain causal spans
        of one shape. A padding query attends to its span's first key only (a finite output, dropped). Drawn on the
        device of the call's tensors (``device`` is that device; device operations only)."""
        device = self.starts.device
        if not self.padded:
            if self.query_length == self.key_length and (window is None or window >= self.key_length):
                return None
            starts = self.starts[:1]
        else:  # each span's first query: its key length less its query length
            starts = self.starts
        query_positions = starts.view(-1, 1, 1) + torch.arange(self.query_length, device=device).view(1, -1, 1)
        key_positions = torch.arange(self.key_length, device=device).view(1, 1, -1)
        allowed = key_positions <= query_positions
        if window is not None:
            allowed &= key_positions > query_positions - window
        if self.padded:  # causality keeps a real query off its span's padding keys (they follow its last key)
            real_query = torch.arange(self.query_length, device=device).view(1, -1, 1) < self.lengths.view(-1, 1, 1)
            allowed = (allowed & real_query) | (~real_query & (key_positions == 0))
        return allowed.unsqueeze(1)


class Part(NamedTuple):
    """A part of a padding-free row: a plain sequence, a shared prefix or a block of a shared prompt."""

    own: range  #: its row positions
    shared: range  #: the shared prefix it also attends to (a block's; empty for a prefix or a plain sequence)
    segment: int  #: the index of its segment
    is_prefix: bool  #: a shared prefix, which every block of its segment sees


@dataclass(frozen=True)
class _Span:
    """A span of the sdpa / eager formulation before batching: its query and key row positions (its queries are the
    last of its keys' sequence positions)."""

    queries: tuple[range, ...]
    keys: tuple[range, ...]

    @property
    def shape(self) -> tuple[int, int]:
        """``(queries, keys)``."""
        return sum(map(len, self.queries)), sum(map(len, self.keys))


def _batched_call(spans: list[_Span], skip: int) -> SpanCall:
    """One call over ``spans`` (its tensors on the host), padded to the longest query and key span; ``skip`` leading
    query outputs of each span are dropped."""
    shapes = np.array([span.shape for span in spans], dtype=np.int64).reshape(-1, 2)
    query_length, key_length = int(shapes[:, 0].max()), int(shapes[:, 1].max())
    queries = _padded_positions([span.queries for span in spans], shapes[:, 0], query_length)
    keys = _padded_positions([span.keys for span in spans], shapes[:, 1], key_length)
    columns = np.arange(query_length)
    kept = np.flatnonzero((columns >= skip) & (columns < shapes[:, :1]))
    return SpanCall(
        torch.from_numpy(queries).reshape(-1),
        torch.from_numpy(keys).reshape(-1),
        len(spans),
        tuple(shapes[:, 0].tolist()),
        tuple(shapes[:, 1].tolist()),
        torch.from_numpy(kept),
        torch.from_numpy(shapes[:, 1] - shapes[:, 0]),
        torch.from_numpy(shapes[:, 0].copy()),
    )


def _padded_positions(ranges_of_spans: list[tuple[range, ...]], lengths: np.ndarray, width: int) -> np.ndarray:
    """``(spans, width)`` row positions: each span's ranges, one after another, then 0 (padding) up to ``width``."""
    flat = np.concatenate([np.arange(r.start, r.stop) for ranges in ranges_of_spans for r in ranges])
    rows = np.repeat(np.arange(len(lengths)), lengths)
    columns = np.arange(flat.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out = np.zeros((len(lengths), width), dtype=np.int64)
    out[rows, columns] = flat
    return out


def _padded_partition(shapes: list[tuple[int, int]], parts: int) -> list[int]:
    """Where to cut ``shapes`` (sorted by key length) into at most ``parts`` consecutive calls so that the padded
    attention work, the sum over calls of ``spans x longest query x longest key``, is least: the first index of
    each call after the first (dynamic programming over cut points)."""
    n = len(shapes)
    queries = np.array([s[0] for s in shapes], dtype=np.float64)
    keys = np.array([s[1] for s in shapes], dtype=np.float64)
    best = np.full((parts + 1, n + 1), np.inf)
    cut = np.zeros((parts + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for end in range(1, n + 1):
        longest_query = np.maximum.accumulate(queries[end - 1 :: -1])[::-1]  # over [start, end) for each start
        work = (end - np.arange(end)) * longest_query * keys[end - 1]
        for part in range(1, parts + 1):
            candidates = best[part - 1, :end] + work
            cut[part, end] = int(np.argmin(candidates))
            best[part, end] = candidates[cut[part, end]]
    part = int(np.argmin(best[:, n]))
    cuts, end = [], n
    while part > 0 and end > 0:
        end = int(cut[part, end])
        cuts.append(end)
        part -= 1
    return sorted(c for c in cuts if c > 0)


class SegmentLayout:
    """The segments of one padding-free row and the index tensors the kernels need, built once per pass.

    Every attention layer of the pass (and the recomputation of gradient checkpointing) reuses them.
    """

    def __init__(self, segments: list[Segment], base_implementation: str) -> None:
        self.segments = segments
        self.base_implementation = base_implementation
        self._cache: dict = {}

    # ---- the pass's device tensors, moved once -------------------------------------------------------------------
    def host_tensors(self, device) -> dict[str, torch.Tensor]:
        """The index tensors the layers of a pass on ``device`` will read, built on the host now (when the pass is
        built): the varlen spans (varlen_attn, flash-attention), the position labels and block tables of
        flex_attention without a window, or the span calls of sdpa / eager (as many calls as
        :data:`SPAN_CALLS_PER_LAYER` allows on ``device``). The pass moves them with its inputs in one copy and
        gives them back to :meth:`adopt`; every length and maximum stays a host value."""
        device = torch.device(device)
        if self.varlen or self.flash:
            cu_q, cu_k, key_index, _, _ = self.varlen_spans("cpu")
            return {"varlen/cu_q": cu_q, "varlen/cu_k": cu_k, "varlen/key_index": key_index}
        if self.flex:
            tensors = {f"labels/{name}": values for name, values in self.position_labels("cpu").items()}
            tensors.update(zip(("flex/partial", "flex/partial_index", "flex/full", "flex/full_index"),
                               self.flex_tables(None, "cpu")))  # fmt: skip
            return tensors
        calls, restore = self.span_calls("cpu", SPAN_CALLS_PER_LAYER.get(device.type))
        tensors = {"spans/restore": restore}
        for index, call in enumerate(calls):
            tensors.update({f"spans/{index}/{name}": t for name, t in zip(SpanCall.TENSORS, call.host_tensors())})
        return tensors

    def adopt(self, moved: dict[str, torch.Tensor], device) -> None:
        """Take :meth:`host_tensors`, moved to ``device``, as what the layers read there (no copy in a layer)."""
        device = torch.device(device)
        if self.varlen or self.flash:
            _, _, _, max_q, max_k = self.varlen_spans("cpu")
            key_index = moved["varlen/key_index"]
            self._cache[("varlen", device)] = (moved["varlen/cu_q"], moved["varlen/cu_k"], key_index, max_q, max_k)
        elif self.flex:
            labels = {name.split("/", 1)[1]: t for name, t in moved.items() if name.startswith("labels/")}
            self._cache[("labels", device)] = labels
            tables = ("flex/partial", "flex/partial_index", "flex/full", "flex/full_index")
            self._cache[("flex tables", None, device)] = tuple(moved[name] for name in tables)
        else:
            max_calls = SPAN_CALLS_PER_LAYER.get(device.type)
            calls, _ = self.span_calls("cpu", max_calls)
            calls = [
                call.with_tensors(moved[f"spans/{index}/{name}"] for name in SpanCall.TENSORS)
                for index, call in enumerate(calls)
            ]
            self._cache[("spans", device, max_calls)] = (calls, moved["spans/restore"])

    def cached(self, key, build):
        """``build()``, computed once per layout and ``key``: every layer of the pass, and the recomputation of
        gradient checkpointing, reuse it (segment recurrence keeps its call plans here too)."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    @property
    def flash(self) -> bool:
        """Whether the base implementation is a flash-attention varlen kernel (else: sdpa or eager per span)."""
        return bool(self.base_implementation) and self.base_implementation.startswith(VARLEN_ATTENTION_PREFIXES)

    @property
    def varlen(self) -> bool:
        """Whether the base is torch's own varlen kernel (:data:`~hf_dynbsz.planning.model_support.VARLEN_ATTN`)."""
        return self.base_implementation == VARLEN_ATTN

    @property
    def gathers(self) -> bool:
        """Whether some key span is gathered (a shared prompt's prefix in front of its blocks): without one the key
        spans are the query spans, and the row's keys are used as they are."""
        return any(segment.prefix for segment in self.segments)

    @property
    def flex(self) -> bool:
        """Whether the base implementation is flex_attention (one call per layer under a block mask)."""
        return self.base_implementation == "flex_attention"

    @property
    def width(self) -> int:
        return self.segments[-1].end if self.segments else 0

    def parts(self) -> list[Part]:
        """The row's parts in order: each plain sequence, each shared prefix, each block of a shared prompt."""
        return self.cached("parts", self._build_parts)

    def _build_parts(self) -> list[Part]:
        parts = []
        for index, segment in enumerate(self.segments):
            prefix = range(segment.start, segment.start + segment.prefix)
            if segment.prefix:
                parts.append(Part(prefix, range(0), index, True))
            offset = prefix.stop
            for block in segment.blocks:
                parts.append(Part(range(offset, offset + block), prefix, index, False))
                offset += block
        return parts

    # ---- sdpa / eager formulation --------------------------------------------------------------------------------
    def span_calls(self, device, max_calls: int | None = None) -> tuple[list[SpanCall], torch.Tensor]:
        """``(calls, restore)``: the batched calls of a layer, and the permutation that puts their kept outputs,
        concatenated, back in row order.

        Spans of one shape are batched into one call: plain sequences and shared prefixes of one length (causal),
        and the blocks of shared segments with the same prefix and block length (when the block is at least as long
        as the prefix, as one causal call over ``[prefix ; block]`` whose prefix queries are dropped: the fast
        causal kernel; it recomputes the prefix's own causal attention, at most half a block's; otherwise the
        block's queries alone against ``[prefix ; block]`` under a mask). When that makes more than ``max_calls``
        calls (None: no limit), spans of several shapes share a call instead, padded to its longest query and key
        span under a per-span mask: the spans, sorted by key length, are cut into at most ``max_calls`` calls with
        the least padded attention work.
        """
        device = torch.device(device)
        if device.type == "cpu":
            return self.cached(("spans", device, max_calls), partial(self._build_span_calls, device, max_calls))

        def moved():  # built on the host, then moved (a pass built by the collator has them moved already)
            calls, restore = self.span_calls("cpu", max_calls)
            return [call.with_tensors(t.to(device) for t in call.host_tensors()) for call in calls], restore.to(device)

        return self.cached(("spans", device, max_calls), moved)

    def _build_span_calls(self, device, max_calls: int | None) -> tuple[list[SpanCall], torch.Tensor]:
        """The calls on the host (``device`` is the CPU; checked on the host that they cover the row once)."""
        groups: dict[tuple[int, int], list[_Span]] = defaultdict(list)
        for part in self.parts():
            span = _Span((part.own,), (part.shared, part.own))
            groups[span.shape].append(span)
        if max_calls is None or len(groups) <= max_calls:
            calls = [self._shape_call(members) for members in groups.values()]
        else:
            spans = sorted((s for members in groups.values() for s in members), key=lambda s: s.shape[1::-1])
            cuts = _padded_partition([span.shape for span in spans], max_calls)
            calls = [_batched_call(spans[a:b], 0) for a, b in zip([0, *cuts], [*cuts, len(spans)])]
        order = torch.cat([call.queries.index_select(0, call.kept) for call in calls])
        if order.numel() != self.width or not torch.equal(order.sort().values, torch.arange(self.width)):
            raise ValueError("segments must cover the row exactly (trailing padding included)")
        return calls, torch.argsort(order)

    @staticmethod
    def _shape_call(spans: list[_Span]) -> SpanCall:
        """The call of spans of one shape; blocks at least as long as their prefix as causal calls over
        ``[prefix ; block]`` whose prefix queries are dropped."""
        queries, keys = spans[0].shape
        prefix = keys - queries
        if prefix and queries >= prefix:
            return _batched_call([_Span(span.keys, span.keys) for span in spans], prefix)
        return _batched_call(spans, 0)

    # ---- flex_attention formulation ------------------------------------------------------------------------------
    def position_labels(self, device) -> dict[str, torch.Tensor]:
        """Per row position: ``segment`` (index), ``part`` (a prefix or block's own id), ``shared`` (a prefix token
        every block of its segment sees) and ``position`` (within its sequence: blocks continue from the prefix)."""
        device = torch.device(device)
        if device.type != "cpu":
            return self.cached(
                ("labels", device), lambda: {name: t.to(device) for name, t in self.position_labels("cpu").items()}
            )
        return self.cached(("labels", device), partial(self._build_position_labels, device))

    def _build_position_labels(self, device) -> dict[str, torch.Tensor]:
        parts = self.parts()
        lengths = torch.tensor([len(part.own) for part in parts])
        labels = {
            "segment": torch.tensor([part.segment for part in parts]).repeat_interleave(lengths),
            "part": torch.arange(len(parts)).repeat_interleave(lengths),
            "shared": torch.tensor([part.is_prefix for part in parts], dtype=torch.bool).repeat_interleave(lengths),
            "position": torch.cat(  # a block's positions continue from its prefix's
                [torch.arange(len(part.shared), len(part.shared) + len(part.own)) for part in parts]
            ),
        }
        return {name: values.to(device) for name, values in labels.items()}

    def block_mask(self, window: int | None, device):
        """The flex_attention ``BlockMask`` of the row: a query sees keys of its own segment, at or before it, in its
        own part or in the segment's shared prefix (and within ``window`` positions of its sequence)."""
        return self.cached(("flex", window, device), partial(self._build_block_mask, window, device))

    def _build_block_mask(self, window: int | None, device):
        from torch.nn.attention.flex_attention import BlockMask

        labels = self.position_labels(device)
        segment, part, shared, position = (labels[n] for n in ("segment", "part", "shared", "position"))

        def mask_mod(batch, head, query, key):
            allowed = (segment[query] == segment[key]) & (key <= query)
            allowed = allowed & ((part[query] == part[key]) | shared[key])
            if window is not None:
                allowed = allowed & (position[query] - position[key] < window)
            return allowed

        return BlockMask.from_kv_blocks(
            *self.flex_tables(window, device),
            BLOCK_SIZE=FLEX_BLOCK_SIZE,
            mask_mod=mask_mod,
            seq_lengths=(self.width, self.width),
        )

    def flex_tables(self, window: int | None, device) -> tuple[torch.Tensor, ...]:
        """``(partial counts, partial indices, full counts, full indices)`` of the block mask of ``window`` on
        ``device`` (:meth:`flex_blocks` as ``BlockMask.from_kv_blocks`` takes them)."""
        device = torch.device(device)

        def build():
            partial_blocks, full_blocks = self.flex_blocks(window)
            tables = (*_block_table(partial_blocks), *_block_table(full_blocks))
            return tuple(table.to(device) for table in tables)

        return self.cached(("flex tables", window, device), build)

    def flex_blocks(self, window: int | None) -> tuple[list[list[int]], list[list[int]]]:
        """``(partial, full)``: per query block of :data:`FLEX_BLOCK_SIZE` positions, the key blocks some of whose
        pairs it may attend to (the ``mask_mod`` decides each pair), and those all of whose pairs it may.

        Drawn from the segments' ranges, never from a dense ``width x width`` mask (``create_block_mask`` evaluates
        the mask at every pair: 7 s and 4 GB for a 19,702-token row on a CPU). A query block sees, for each part
        (prefix, block, plain sequence) it holds, the part's own keys up to the block's end and, for a block, its
        segment's prefix. A key block is full when the query block lies in one part and every key of the block
        precedes the query block in that part or lies in its shared prefix (no window: with one, none is full).
        """
        size = FLEX_BLOCK_SIZE
        parts = self.parts()
        starts = [part.own.start for part in parts]
        partial_blocks, full_blocks = [], []
        for query_start in range(0, self.width, size):
            query_end = min(query_start + size, self.width)
            first = bisect.bisect_right(starts, query_start) - 1
            last = bisect.bisect_left(starts, query_end)
            seen, whole = set(), set()
            for part in parts[first:last]:
                own, shared = part.own, part.shared
                seen.update(range(own.start // size, (min(own.stop, query_end) - 1) // size + 1))
                if shared:
                    seen.update(range(shared.start // size, (shared.stop - 1) // size + 1))
                if window is None and last - first == 1:
                    whole.update(range(-(-own.start // size), query_start // size))  # own keys before every query
                    whole.update(range(-(-shared.start // size), shared.stop // size))  # the shared prefix
            full_blocks.append(sorted(whole))
            partial_blocks.append(sorted(seen - whole))
        return partial_blocks, full_blocks

    # ---- varlen (flash) formulation ------------------------------------------------------------------------------
    def varlen_spans(self, device):
        """``(cu_seqlens_q, cu_seqlens_k, key_index, max_q, max_k)`` of the varlen formulation.

        Query spans tile the row in order (so queries need no gathering): each plain sequence, each prefix, each
        block. A span's keys are itself, except a block's: ``[its segment's prefix ; the block]``.
        """
        device = torch.device(device)
        if device.type != "cpu":  # built on the host, then moved (a pass built by the collator has them moved already)
            return self.cached(
                ("varlen", device),
                lambda: tuple(t.to(device) if torch.is_tensor(t) else t for t in self.varlen_spans("cpu")),
            )
        return self.cached(("varlen", device), self._build_varlen_spans)

    def _build_varlen_spans(self):
        parts = self.parts()
        query_lengths = [len(part.own) for part in parts]
        key_lengths = [len(part.shared) + len(part.own) for part in parts]
        key_index = torch.cat([torch.arange(r.start, r.stop) for part in parts for r in (part.shared, part.own)])
        cu_q = torch.tensor([0, *query_lengths]).cumsum(0).to(torch.int32)
        cu_k = torch.tensor([0, *key_lengths]).cumsum(0).to(torch.int32)
        return cu_q, cu_k, key_index, max(query_lengths), max(key_lengths)


def _block_table(blocks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts, indices)`` of a ``BlockMask`` over a square of ``len(blocks)`` blocks, on the host: per query block,
    how many key blocks it lists, and which (first, the rest of its row 0)."""
    counts = torch.tensor([len(row) for row in blocks], dtype=torch.int32)
    indices = torch.zeros(len(blocks), len(blocks), dtype=torch.int32)
    for row, listed in enumerate(blocks):
        indices[row, : len(listed)] = torch.tensor(listed, dtype=torch.int32)
    return counts.view(1, 1, -1), indices.view(1, 1, *indices.shape)


#: The layout of the pass being run (set by :func:`use_segments`, cleared when :func:`segment_attention` exits).
_ACTIVE: list[SegmentLayout | None] = [None]


def use_segments(layout: SegmentLayout | None) -> None:
    """Make ``layout`` the segments of the next forward (and of its backward's recomputation)."""
    _ACTIVE[0] = layout


def active_segments() -> SegmentLayout | None:
    """The layout :func:`use_segments` named for the forward being run (None: no padding-free row)."""
    return _ACTIVE[0]


def _flash_varlen(module, layout, query, key, value, cu_q, cu_k, max_q, max_k, scaling, dropout, **features):
    """transformers' flash-attention integration on varlen spans (the base implementation's kernel): ``query``
    ``(Tq, heads, d)``, ``key``/``value`` ``(Tk, kv_heads, d / d_v)``; ``features``: the layer's ``sliding_window``,
    ``softcap`` and ``s_aux``. Values with another head size than queries (multi-head latent attention) are padded
    to it and the output cropped, as transformers' own integration does."""
    from transformers.integrations.flash_attention import get_target_dtype
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    value_dim = value.size(-1)
    if value_dim != query.size(-1):
        value = torch.nn.functional.pad(value, [0, query.size(-1) - value_dim])
    sinks = features.get("s_aux")
    out = _flash_attention_forward(
        query.unsqueeze(0),
        key.unsqueeze(0),
        value.unsqueeze(0),
        None,
        query_length=query.size(0),
        is_causal=True,
        dropout=dropout,
        softmax_scale=scaling,
        cu_seq_lens_q=cu_q,
        cu_seq_lens_k=cu_k,
        max_length_q=max_q,
        max_length_k=max_k,
        target_dtype=get_target_dtype(query, module),
        sliding_window=features.get("sliding_window"),
        softcap=features.get("softcap"),
        s_aux=sinks.to(query.dtype) if sinks is not None else None,
        attn_implementation=layout.base_implementation,
    ).squeeze(0)
    return out[..., :value_dim]


#: The varlen kernel of the flash formulation; tests replace it with a reference kernel.
VARLEN_KERNEL = _flash_varlen

#: torch's ``varlen_attn`` as segment attention calls it; None: ``torch.nn.attention.varlen.varlen_attn``, looked up
#: at the first call. CPU tests put a reference kernel of the same contract here (torch has no CPU kernel).
VARLEN_ATTN_KERNEL = None


def _varlen_attn_kernel():
    if VARLEN_ATTN_KERNEL is not None:
        return VARLEN_ATTN_KERNEL
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


@functools.lru_cache(maxsize=8)
def varlen_attn_keywords(kernel) -> frozenset[str]:
    """The parameters ``kernel`` (a ``varlen_attn``) takes, read once: torch 2.10's has ``is_causal`` and no
    ``scale``; 2.11 takes ``window_size`` (``(-1, 0)`` is causal) instead of ``is_causal``; 2.12 adds ``enable_gqa``."""
    return frozenset(inspect.signature(kernel).parameters)


def _torch_varlen(query, key, value, cu_q, cu_k, max_q: int, max_k: int, scaling, window: int | None):
    """One ``varlen_attn`` call: ``query`` ``(Tq, heads, d)``, ``key``/``value`` ``(Tk, kv_heads, d)``, causal and
    aligned bottom-right in each span, within ``window`` positions when the layer has one. Keywords the installed
    kernel lacks are made up exactly: no ``enable_gqa``, key and value heads are repeated (as transformers'
    ``repeat_kv``); no ``scale``, the queries are scaled so that the kernel's default scale gives ``scaling``. A
    window without ``window_size`` raises (the planner rules that out: ``ModelSupport.varlen_attn_reason``)."""
    kernel = _varlen_attn_kernel()
    keywords = varlen_attn_keywords(kernel)
    query, key, value = _autocast_inputs(query, key, value)
    key, value = key.to(query.dtype), value.to(query.dtype)  # one dtype for all three
    options = {}
    heads, kv_heads = query.size(1), key.size(1)
    if kv_heads != heads:
        if "enable_gqa" in keywords:
            options["enable_gqa"] = True
        else:
            key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    if window is not None and window < max_k:
        if "window_size" not in keywords:
            raise RuntimeError("this torch's varlen_attn takes no window_size; the layer has a sliding window")
        options["window_size"] = (window - 1, 0)  # the key aligned with the query and window - 1 before it
    elif "window_size" in keywords:
        options["window_size"] = (-1, 0)
    else:
        options["is_causal"] = True
    default_scale = query.size(-1) ** -0.5
    if "scale" in keywords:
        options["scale"] = scaling
    elif scaling is not None and scaling != default_scale:
        query = query * (scaling / default_scale)
    return kernel(query, key, value, cu_q, cu_k, max_q, max_k, **options)


def device_facts(device, mixed_precision: str | None, dtype: torch.dtype) -> DeviceFacts:
    """The :class:`~hf_dynbsz.planning.model_support.DeviceFacts` of ``device`` for a run whose forwards compute in
    ``mixed_precision``'s dtype ("bf16", "fp16") or else ``dtype`` (the weights')."""
    device = torch.device(device)
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    keywords = varlen_attn_keywords(varlen_attn) if varlen_attn is not None else frozenset()
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(mixed_precision), dtype)
    capability = None
    if device.type == "cuda" and torch.cuda.is_available():
        capability = tuple(torch.cuda.get_device_capability(device))
    major, minor = (int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return DeviceFacts(
        type=device.type,
        capability=capability,
        torch_version=(major, minor),
        varlen_attn=varlen_attn is not None,
        varlen_window="window_size" in keywords,
        compute_dtype=str(compute).removeprefix("torch."),
    )


def flex_row_width(tokens: int) -> int:
    """The width of a flex_attention row of ``tokens`` tokens: the least of ``FLEX_BLOCK_SIZE x {1, 2, 3, 4, 6, 8,
    12, ...}`` (two widths per octave, multiples of 128) at least ``tokens``. A row pads to it (the padding a segment
    of its own), so rows of any length take one of a few widths, each compiled once: at most 1.5x the tokens rounded
    up to whole blocks."""
    blocks = max(-(-int(tokens) // FLEX_BLOCK_SIZE), 1)
    power = 1 << (blocks - 1).bit_length()  # the least power of two >= blocks
    return FLEX_BLOCK_SIZE * (power * 3 // 4 if blocks <= power * 3 // 4 else power)


#: Explicit block sizes for flex_attention's Triton kernels when Inductor's autotuning finds no valid choice
#: (``NoValidChoicesError``, pytorch#146260; torchtune#2113 falls back to block sizes of 32 the same way).
FLEX_FALLBACK_OPTIONS = {
    "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 32, "num_stages": 1,
}  # fmt: skip


class _FlexKernel:
    """flex_attention compiled once per process with static shapes (one kernel per row width: :func:`flex_row_width`
    keeps them few), its kernel options (None, or :data:`FLEX_FALLBACK_OPTIONS` once Inductor found no valid choice),
    and the input shapes it has compiled for (``compiles``: one per row width, dtype and head layout)."""

    def __init__(self) -> None:
        self.function = None
        self.options: dict | None = None
        self.compiled: set = set()

    @property
    def compiles(self) -> int:
        return len(self.compiled)

    def __call__(self, query, key, value, block_mask, scale, enable_gqa):
        if self.function is None:
            from torch.nn.attention.flex_attention import flex_attention

            self.function = torch.compile(flex_attention, dynamic=False)
        shape = (tuple(query.shape), tuple(key.shape), tuple(value.shape), query.dtype, enable_gqa)
        if shape not in self.compiled and query.device.type == "cuda":
            self._compile(query, key, value, block_mask, scale, enable_gqa)
            self.compiled.add(shape)
        return self.function(
            query, key, value, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, kernel_options=self.options
        )

    def _compile(self, query, key, value, block_mask, scale, enable_gqa) -> None:
        """Compile forward AND backward for these shapes now, on copies of the inputs (a backward that finds no valid
        kernel would otherwise fail in the pass's backward, past the reach of a fallback), with the fallback options
        when Inductor finds no valid choice."""
        for options in (self.options, FLEX_FALLBACK_OPTIONS):
            try:
                with torch.enable_grad():
                    inputs = [t.detach().requires_grad_() for t in (query, key, value)]
                    out = self.function(
                        *inputs, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, kernel_options=options
                    )
                    out.float().sum().backward()
            except Exception as error:
                if "NoValidChoices" not in f"{type(error).__name__}: {error}" or options is FLEX_FALLBACK_OPTIONS:
                    raise
                first_line = str(error).splitlines()[0][:200]
                logger.warning(
                    "hf_dynbsz: flex_attention found no valid kernel choice; explicit kernel options %s from now on "
                    "(%s).", FLEX_FALLBACK_OPTIONS, first_line,
                )  # fmt: skip
                continue
            self.options = options
            return


#: The process's flex_attention kernel (segment attention's flex formulation).
FLEX_KERNEL = _FlexKernel()


def _flex(module, layout, query, key, value, scaling, dropout, window, **kwargs):
    """One flex_attention call over the whole row under the segments' block mask (built once per pass and window,
    shared by the layers), compiled once per row width (:data:`FLEX_KERNEL`), one dtype for query, key and value
    (autocast's). Soft-capping and sinks go through transformers' integration, which applies them."""
    features = {name: kwargs[name] for name in ("softcap", "s_aux") if kwargs.get(name) is not None}
    query, key, value = _autocast_inputs(query, key, value)
    key, value = key.to(query.dtype), value.to(query.dtype)
    block_mask = layout.block_mask(window, query.device)
    if dropout:
        raise RuntimeError(f"flex_attention has no dropout; {type(module).__name__} passes dropout={dropout}")
    if features or query.size(1) % key.size(1):
        from transformers.integrations.flex_attention import flex_attention_forward

        out, _ = flex_attention_forward(module, query, key, value, block_mask, scaling=scaling, **features)
        return out, None
    out = FLEX_KERNEL(query, key, value, block_mask, scaling, query.size(1) != key.size(1))
    return out.transpose(1, 2).contiguous(), None


def _flash_attention(module, layout, query, key, value, scaling, dropout, window, **kwargs):
    """The whole row in one varlen call of the flash-attention formulation (:data:`VARLEN_KERNEL`)."""
    cu_q, cu_k, key_index, max_q, max_k = layout.varlen_spans(query.device)
    features = {name: kwargs.get(name) for name in ("softcap", "s_aux")}
    out = VARLEN_KERNEL(
        module,
        layout,
        query[0].transpose(0, 1),
        key[0, :, key_index].transpose(0, 1),
        value[0, :, key_index].transpose(0, 1),
        cu_q,
        cu_k,
        max_q,
        max_k,
        scaling,
        dropout,
        sliding_window=window,
        **features,
    )
    return out.unsqueeze(0), None


def _varlen_attention(module, layout, query, key, value, scaling, dropout, window, **kwargs):
    """The whole row in one ``varlen_attn`` call (:func:`_torch_varlen`); each shared prompt's keys and values are
    gathered in front of each of its blocks."""
    unsupported = [name for name in ("softcap", "s_aux") if kwargs.get(name) is not None]
    if unsupported or dropout:
        raise RuntimeError(
            f"{type(module).__name__} passes {', '.join(unsupported) or f'dropout={dropout}'} to its attention, which "
            "torch's varlen_attn does not compute (hf_dynbsz.planning.model_support rules such models out)"
        )
    cu_q, cu_k, key_index, max_q, max_k = layout.varlen_spans(query.device)
    if layout.gathers:
        key, value = key.index_select(2, key_index), value.index_select(2, key_index)
    out = _torch_varlen(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_q, cu_k, max_q, max_k,
        scaling, window,
    )  # fmt: skip
    return out.unsqueeze(0), None


def _autocast_inputs(query, key, value):
    """``query``, ``key``, ``value`` in autocast's dtype where autocast is on for their device, as sdpa receives them.

    Autocast casts sdpa's inputs but not flex_attention's, and a model's rotary or per-head norms can promote queries
    and keys to fp32 while values stay bf16: flex_attention's compiled backward then finds no kernel for the mixed
    dtypes on CUDA (``InductorError: LoweringException: NoValidChoicesError``, pytorch/pytorch#176025), and even
    when dtypes agree it would run in fp32 where stock's sdpa runs in bf16.
    """
    device_type = query.device.type
    if not torch.is_autocast_enabled(device_type):
        return query, key, value
    dtype = torch.get_autocast_dtype(device_type)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _base_function(module, base: str):
    """The attention function the model runs under ``base``: transformers' sdpa, or the model's own eager one."""
    if base == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(
            f"{type(module).__name__} has no eager_attention_forward next to it: {ATTENTION_NAME} "
            "cannot run its eager attention"
        )
    return eager


def _take_rows(tensor: torch.Tensor, positions: torch.Tensor, rows: int) -> torch.Tensor:
    """The ``positions`` of a ``(1, heads, T, d)`` tensor as ``rows`` rows: ``(rows, heads, length, d)``."""
    picked = tensor.index_select(2, positions)  # (1, h, rows * length, d)
    return picked.view(tensor.size(1), rows, positions.numel() // rows, -1).transpose(0, 1)


def segment_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: ``query`` ``(1, heads, T, d)``, ``key``/``value`` ``(1, kv_heads, T, d /
    d_v)``; returns ``((1, T, heads, d_v), None)``. Attends within the segments of the active layout only."""
    with torch.profiler.record_function("dynbsz/attention"):
        return _segment_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)


def _segment_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    layout = _ACTIVE[0]
    if layout is None or query.size(0) != 1:
        raise RuntimeError(
            f"{ATTENTION_NAME} attention runs padding-free rows of hf_dynbsz only (one row with its "
            "segments); this forward carries none."
        )
    if attention_mask is not None:
        raise RuntimeError(
            f"{ATTENTION_NAME} attention got an attention mask (or bias) from "
            f"{type(module).__name__}; it cannot place it on the segments of a padding-free row."
        )
    # The layer's window: what it passes (None on a full-attention layer), else its own attribute.
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    if layout.flash:
        return _flash_attention(module, layout, query, key, value, scaling, dropout, window, **kwargs)
    if layout.varlen:
        return _varlen_attention(module, layout, query, key, value, scaling, dropout, window, **kwargs)
    if layout.flex:
        return _flex(module, layout, query, key, value, scaling, dropout, window, **kwargs)
    max_calls = SPAN_CALLS_PER_LAYER.get(query.device.type)
    calls, restore = layout.span_calls(query.device, max_calls)
    base = _base_function(module, layout.base_implementation)
    kwargs.pop("sliding_window", None)  # the spans' masks draw the window
    kwargs.pop("is_causal", None)
    additive = None if layout.base_implementation == "sdpa" else query.dtype  # eager adds its mask to the scores
    outputs = []
    for index, call in enumerate(calls):
        mask = layout.cached(
            ("span mask", query.device, max_calls, index, window, additive),
            partial(_call_mask, call, window, query.device, additive),
        )
        out, _ = base(
            module,
            _take_rows(query, call.queries, call.rows),
            _take_rows(key, call.keys, call.rows),
            _take_rows(value, call.keys, call.rows),
            mask,
            scaling=scaling,
            dropout=dropout,
            is_causal=True,
            **kwargs,
        )  # (rows, length, h, d_v)
        outputs.append(out.reshape(-1, out.size(2), out.size(3)).index_select(0, call.kept))
    output = torch.cat(outputs).index_select(0, restore)  # (T, heads, d_v) in row order
    return output.unsqueeze(0).contiguous(), None


def _call_mask(call: SpanCall, window: int | None, device, additive: torch.dtype | None) -> torch.Tensor | None:
    """``call``'s mask as its base takes it, built once per pass (every layer reuses it): for sdpa
    (``additive`` None) the bool mask, or None for its causal kernel; for eager an additive mask in ``additive``
    (0 where a query may attend, the dtype's minimum elsewhere), causal where sdpa would get None."""
    mask = call.mask(window, device)
    if additive is None:
        return mask
    if mask is None:
        mask = torch.ones(call.query_length, call.key_length, dtype=torch.bool, device=device).tril()[None, None]
    return torch.zeros(mask.shape, dtype=additive, device=device).masked_fill(~mask, torch.finfo(additive).min)


AttentionInterface.register(ATTENTION_NAME, segment_attention_forward)


@contextlib.contextmanager
def segment_attention(model, enabled: bool = True, name: str = ATTENTION_NAME):
    """Run ``model``'s attention through :func:`segment_attention_forward` inside the context (forward AND backward:
    gradient checkpointing recomputes the forward during backward). The layouts of the passes are given by
    :func:`use_segments`; the active one is cleared on exit. ``name``: the registered implementation to switch to
    (:data:`hf_dynbsz.execution.sequence_parallel.ULYSSES_ATTENTION_NAME` wraps this one for sharded rows)."""
    if not enabled:
        yield
        return
    config = text_config_of(model.config)
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous
        _ACTIVE[0] = None

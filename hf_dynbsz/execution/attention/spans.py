"""Segment attention's span formulation: sdpa and eager, through the model's own attention function (torch layer).

Each node of a padding-free row (a plain sequence, a shared prefix, a block; any node of the row's prefix tree) is a
*span*: its queries against its keys, ``[path ; own]`` (its ancestors' keys, then its own). Spans of one shape are
batched into one call of transformers' ``sdpa_attention_forward`` or the model's ``eager_attention_forward`` under the
span's mask (causal, and the layer's sliding window, over positions within the sequence); a plain causal span without a
window takes sdpa's unmasked causal kernel; a node at least as long as its path is one causal call over ``[path ; own]``
whose path queries are dropped. The attention work of the separate sequences, never the square of a whole row. Where a
device caps the calls per layer (:data:`SPAN_CALLS_PER_LAYER`), spans of several shapes share a call, padded to its
longest query and key span under a per-span mask.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from hf_dynbsz.execution.attention.common import ATTENTION_NAME
from hf_dynbsz.planning.tokens import range_positions

__all__ = ["SPAN_CALLS_PER_LAYER", "SpanCall", "build_span_calls", "span_attention"]

#: At most this many sdpa / eager calls per layer over a padding-free row, by device type (absent: one call per span
#: shape, no padding). On a CPU padding costs compute and a call costs little: one call per shape ran a long-tailed
#: step 5.36x faster than stock, 4 padded calls 3.57x (step_time.py, 2 cores). On a GPU a call's launches and gathers
#: cost more than its attention: a call per shape ran a step 6.4x slower than stock (H200, gpu_check.py), hence a few
#: padded calls there (not yet measured on a GPU). On CUDA models on sdpa and eager take torch's varlen_attn instead,
#: where it runs; the span formulation remains for fp32 with packing_layout="padding_free".
SPAN_CALLS_PER_LAYER: dict[str, int] = {"cuda": 4}


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


def build_span_calls(layout, max_calls: int | None) -> tuple[list[SpanCall], torch.Tensor]:
    """``layout``'s calls on the host (checked there that they cover the row once) and the permutation that puts
    their kept outputs back in row order (see :meth:`~hf_dynbsz.execution.attention.layout.SegmentLayout.
    span_calls`)."""
    groups: dict[tuple[int, int], list[_Span]] = defaultdict(list)
    for part in layout.parts():
        span = _Span((part.own,), (*part.path, part.own))
        groups[span.shape].append(span)
    if max_calls is None or len(groups) <= max_calls:
        calls, order = _shape_calls(list(groups.values()))
    else:
        spans = sorted((s for members in groups.values() for s in members), key=lambda s: s.shape[1::-1])
        cuts = _padded_partition([span.shape for span in spans], max_calls)
        calls = [_batched_call(spans[a:b], 0) for a, b in zip([0, *cuts], [*cuts, len(spans)])]
        order = torch.cat([call.queries.index_select(0, call.kept) for call in calls])
    if order.numel() != layout.width or not torch.equal(order.sort().values, torch.arange(layout.width)):
        raise ValueError("segments must cover the row exactly (trailing padding included)")
    return calls, torch.argsort(order)


def _shape_call(spans: list[_Span]) -> SpanCall:
    """The call of spans of one shape; nodes at least as long as their path as causal calls over ``[path ; own]``
    whose path queries are dropped."""
    return _shape_calls([spans])[0][0]


def _shape_calls(groups: list[list[_Span]]) -> tuple[list[SpanCall], torch.Tensor]:
    """One call per group of spans of one shape (:func:`_shape_call` each, no padding) and the row positions of
    their kept outputs, in call order. The calls' tensors are views of five tensors built at once (a pass holds dozens
    of shapes, and a dozen small array operations per call cost more than its positions): every position range of
    every call is expanded by one vectorised :func:`~hf_dynbsz.planning.tokens.range_positions`."""
    queries, keys, kept, starts, lengths, shapes = [], [], [], [], [], []
    for spans in groups:
        query_length, key_length = spans[0].shape
        prefix, skip, own = key_length - query_length, 0, [span.queries for span in spans]
        if prefix and query_length >= prefix:  # causal over [path ; own], the path's queries dropped
            skip, query_length, own = prefix, key_length, [span.keys for span in spans]
        for ranges in own:
            queries.extend(ranges)
        for span in spans:
            keys.extend(span.keys)
        rows = len(spans)
        kept.extend(range(row * query_length + skip, (row + 1) * query_length) for row in range(rows))
        starts.append((rows, key_length - query_length))
        lengths.append((rows, query_length))
        shapes.append((rows, query_length, key_length, rows * (query_length - skip)))
    flat_queries, flat_keys, flat_kept = range_positions(queries), range_positions(keys), range_positions(kept)
    query_offsets = np.repeat(np.cumsum([0] + [rows * length for rows, length, _, _ in shapes[:-1]]),
                              [count for *_, count in shapes])  # fmt: skip
    returned = flat_queries[flat_kept + query_offsets]
    tensors = [torch.from_numpy(values) for values in (flat_queries, flat_keys, flat_kept)]
    for pairs in (starts, lengths):  # per call (rows, value): the value once per row
        counts, values = np.array(pairs, dtype=np.int64).reshape(-1, 2).T
        tensors.append(torch.from_numpy(np.repeat(values, counts)))
    calls, offsets = [], [0] * 5
    for rows, query_length, key_length, kept_count in shapes:
        sizes = (rows * query_length, rows * key_length, kept_count, rows, rows)
        views = [tensor[offset : offset + size] for tensor, offset, size in zip(tensors, offsets, sizes)]
        offsets = [offset + size for offset, size in zip(offsets, sizes)]
        calls.append(SpanCall(views[0], views[1], rows, (query_length,) * rows, (key_length,) * rows, *views[2:]))
    return calls, torch.from_numpy(returned)


def span_attention(module, layout, query, key, value, scaling, dropout, window, **kwargs):
    """The whole row through the span calls of ``layout`` (:data:`SPAN_CALLS_PER_LAYER` of the query's device), each
    call one of the base implementation's own function: returns ``((1, T, heads, d_v), None)``."""
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

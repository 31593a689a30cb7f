"""The layout of a padding-free row for segment attention: its segments, parts and the kernels' index tensors.

A padding-free row is cut into *segments*, each attending only to itself:

* a plain sequence (prompt + completion): causal attention over it;
* a prompt shared by several completions of that prompt (GRPO's ``num_generations`` samples):
  ``[prefix | block_1 | ... | block_k]``, where ``prefix`` is the prompt without its last token and ``block_j`` is
  the prompt's last token followed by completion ``j``. Prefix tokens attend causally to the prefix; a block's tokens
  attend to the whole prefix and causally to their own block, never to a sibling. Position ids continue from the
  prefix in every block, so each block computes exactly what its own sequence would (its first token, the prompt's
  last, predicts the completion's first token, as in stock's separate sequence).

:class:`SegmentLayout` holds them with the index tensors each kernel reads (built once per pass on the host by the
kernel's own module, moved with the pass's inputs in one copy); :func:`use_segments` names the layout of the pass about
to run (it travels beside the forward, not through its keyword arguments, so it reaches the attention of models whose
layers do not pass keyword arguments on, and stays in place for gradient checkpointing's recomputation).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from hf_dynbsz.execution.attention.flex import (
    build_block_mask,
    build_position_labels,
    flex_blocks,
    flex_tables,
)
from hf_dynbsz.execution.attention.spans import SPAN_CALLS_PER_LAYER, SpanCall, build_span_calls
from hf_dynbsz.execution.attention.varlen import build_varlen_spans
from hf_dynbsz.planning.model_support import VARLEN_ATTENTION_PREFIXES, VARLEN_ATTN

__all__ = ["Part", "Segment", "SegmentLayout", "active_segments", "use_segments"]


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


class Part(NamedTuple):
    """A part of a padding-free row: a plain sequence, a shared prefix or a block of a shared prompt."""

    own: range  #: its row positions
    shared: range  #: the shared prefix it also attends to (a block's; empty for a prefix or a plain sequence)
    segment: int  #: the index of its segment
    is_prefix: bool  #: a shared prefix, which every block of its segment sees


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
        return build_span_calls(self, max_calls)

    # ---- flex_attention formulation ------------------------------------------------------------------------------
    def position_labels(self, device) -> dict[str, torch.Tensor]:
        """Per row position: ``segment`` (index), ``part`` (a prefix or block's own id), ``shared`` (a prefix token
        every block of its segment sees) and ``position`` (within its sequence: blocks continue from the prefix)."""
        device = torch.device(device)
        if device.type != "cpu":
            return self.cached(
                ("labels", device), lambda: {name: t.to(device) for name, t in self.position_labels("cpu").items()}
            )
        return self.cached(("labels", device), partial(build_position_labels, self, device))

    def block_mask(self, window: int | None, device):
        """The flex_attention ``BlockMask`` of the row: a query sees keys of its own segment, at or before it, in its
        own part or in the segment's shared prefix (and within ``window`` positions of its sequence)."""
        return self.cached(("flex", window, device), partial(build_block_mask, self, window, device))

    def flex_tables(self, window: int | None, device) -> tuple[torch.Tensor, ...]:
        """``(partial counts, partial indices, full counts, full indices)`` of the block mask of ``window`` on
        ``device`` (:meth:`flex_blocks` as ``BlockMask.from_kv_blocks`` takes them)."""
        device = torch.device(device)
        return self.cached(("flex tables", window, device), partial(flex_tables, self, window, device))

    def flex_blocks(self, window: int | None) -> tuple[list[list[int]], list[list[int]]]:
        """``(partial, full)`` key blocks per query block
        (:func:`~hf_dynbsz.execution.attention.flex.flex_blocks`)."""
        return flex_blocks(self, window)

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
        return self.cached(("varlen", device), partial(build_varlen_spans, self))


#: The layout of the pass being run (set by :func:`use_segments`, cleared when
#: :func:`~hf_dynbsz.execution.attention.segment_attention` exits).
_ACTIVE: list[SegmentLayout | None] = [None]


def use_segments(layout: SegmentLayout | None) -> None:
    """Make ``layout`` the segments of the next forward (and of its backward's recomputation)."""
    _ACTIVE[0] = layout


def active_segments() -> SegmentLayout | None:
    """The layout :func:`use_segments` named for the forward being run (None: no padding-free row)."""
    return _ACTIVE[0]

"""The layout of a padding-free row for segment attention: its prefix tree, parts and the kernels' index tensors.

A padding-free row holds a pass's samples as their prefix tree, planning's :class:`~hf_dynbsz.planning.prefix_tree.
PrefixTree` (the one model of the tree, from the planner's counts to the kernels' index tensors): each *node* is a
run of positions that one or more samples share, laid out once, in the tree's row order (every node after its
parent, nodes back to back). A node's queries attend to the keys of its root-to-node *path* (its ancestors, all before
it in the row) and causally to its own; never to a sibling's. Position ids are depths (positions within the samples),
so each sample computes exactly what it computes alone. A plain sequence (prompt + completion) is a root without
children; a prompt shared by its completions (GRPO's ``num_generations`` samples) a root (the prompt without its last
token) with a child per completion (the prompt's last token, then the completion); a row's trailing padding a root of
its own (:meth:`~hf_dynbsz.planning.prefix_tree.PrefixTree.with_padding`).

:class:`SegmentLayout` holds the tree with the index tensors each kernel reads (built once per pass on the host by
the kernel's own module, moved with the pass's inputs in one copy); :func:`use_segments` names the layout of the pass
about to run (it travels beside the forward, not through its keyword arguments, so it reaches the attention of
models whose layers do not pass keyword arguments on, and stays in place for gradient checkpointing's recomputation).
"""

from __future__ import annotations

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
from hf_dynbsz.planning.prefix_tree import PrefixTree

__all__ = ["Part", "SegmentLayout", "active_segments", "use_segments"]


class Part(NamedTuple):
    """A node of a padding-free row as the kernels read it."""

    own: range  #: its row positions
    path: tuple[range, ...]  #: its ancestors' row positions, root first (empty for a root)
    node: int  #: its number
    parent: int  #: its parent's number (-1: a root)
    children: int  #: how many nodes continue it

    @property
    def depth(self) -> int:
        """The position (within its samples) of its first token: its path's length."""
        return sum(len(r) for r in self.path)


class SegmentLayout:
    """The nodes of one padding-free row and the index tensors the kernels need, built once per pass.

    ``tree``: the row's prefix tree, its nodes laid out back to back in its row order (a trailing padding node
    included). Every attention layer of the pass (and the recomputation of gradient checkpointing) reuses them.
    """

    def __init__(self, tree: PrefixTree, base_implementation: str) -> None:
        self.tree = tree
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
        """Whether some key span is gathered (a node's path in front of it): without one the key spans are the query
        spans, and the row's keys are used as they are."""
        return any(part.path for part in self.parts())

    @property
    def flex(self) -> bool:
        """Whether the base implementation is flex_attention (one call per layer under a block mask)."""
        return self.base_implementation == "flex_attention"

    @property
    def width(self) -> int:
        """Positions in the row: every node's, back to back."""
        return sum(self.tree.length)

    def parts(self) -> list[Part]:
        """The row's nodes in order, each with its row positions and its path (see :class:`Part`)."""
        return self.cached("parts", self._build_parts)

    def _build_parts(self) -> list[Part]:
        tree, parts, offset = self.tree, [], 0
        for number, (above, length, children) in enumerate(zip(tree.parent, tree.length, tree.children())):
            path = () if above < 0 else (*parts[above].path, parts[above].own)
            parts.append(Part(range(offset, offset + length), path, number, above, len(children)))
            offset += length
        return parts

    def subtree_ends(self) -> list[int]:
        """Per node, one past the number of the last node of its subtree (its descendants follow it in row order)."""

        def build():
            parts = self.parts()
            ends = [number + 1 for number in range(len(parts))]
            for part in reversed(parts):
                if part.parent >= 0:
                    ends[part.parent] = max(ends[part.parent], ends[part.node])
            return ends

        return self.cached("subtree ends", build)

    # ---- sdpa / eager formulation --------------------------------------------------------------------------------
    def span_calls(self, device, max_calls: int | None = None) -> tuple[list[SpanCall], torch.Tensor]:
        """``(calls, restore)``: the batched calls of a layer, and the permutation that puts their kept outputs,
        concatenated, back in row order.

        A node's span is its queries against ``[path ; own]`` keys. Spans of one shape are batched into one call:
        roots of one length (causal), and nodes with the same path and own lengths (when a node is at least as long
        as its path, as one causal call over ``[path ; own]`` whose path queries are dropped: the fast causal kernel;
        it recomputes the path's own causal attention, at most half the node's; otherwise the node's queries alone
        against ``[path ; own]`` under a mask). When that makes more than ``max_calls`` calls (None: no limit),
        spans of several shapes share a call instead, padded to its longest query and key span under a per-span
        mask: the spans, sorted by key length, are cut into at most ``max_calls`` calls with the least padded
        attention work.
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
        """Per row position: ``node`` (its node's number), ``subtree_end`` (one past the last node under that node)
        and ``position`` (its depth: the position within its samples)."""
        device = torch.device(device)
        if device.type != "cpu":
            return self.cached(
                ("labels", device), lambda: {name: t.to(device) for name, t in self.position_labels("cpu").items()}
            )
        return self.cached(("labels", device), partial(build_position_labels, self, device))

    def block_mask(self, window: int | None, device):
        """The flex_attention ``BlockMask`` of the row: a query sees keys at or before it in its own node or on its
        node's path (and within ``window`` positions of its sequence)."""
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

        Query spans tile the row in order (so queries need no gathering): each node. A span's keys are
        ``[its path ; the node]`` (gathered along the row; a root's are itself).
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

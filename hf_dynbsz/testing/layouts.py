"""Padding-free rows written by hand, as planning's prefix tree: what segment attention's and segment recurrence's
tests lay out without a collator.

A row's tree (:class:`~hf_dynbsz.planning.prefix_tree.PrefixTree`) lays its nodes back to back in row order, so a row
written here must too: :func:`segment_tree` builds it from shared prompts' segments, :func:`node_tree` from nodes
``(row start, length, parent)``, and :func:`row_nodes` reads those nodes back off a
:class:`~hf_dynbsz.execution.attention.SegmentLayout`. Pure Python (planning's tree: numpy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hf_dynbsz.planning.prefix_tree import PrefixTree

__all__ = ["Segment", "node_tree", "row_nodes", "segment_tree"]


@dataclass(frozen=True)
class Segment:
    """A shared prompt's segment of a padding-free row, from row position ``start``: ``prefix`` shared tokens (a root;
    0: none), then ``blocks``, each a child of the prefix (or a root of its own without one)."""

    start: int
    prefix: int
    blocks: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.start + self.prefix + sum(self.blocks)

    def nodes(self, first: int) -> list[tuple[int, int, int]]:
        """Its nodes ``(row start, length, parent)``, numbered from ``first``: the prefix, then each block."""
        nodes = [(self.start, self.prefix, -1)] if self.prefix else []
        offset, parent = self.start + self.prefix, first if self.prefix else -1
        for block in self.blocks:
            nodes.append((offset, block, parent))
            offset += block
        return nodes


def node_tree(nodes: Sequence[tuple[int, int, int]]) -> PrefixTree:
    """The tree of a row's ``nodes``, each ``(row start, length, parent)`` in row order (every parent before its
    children, every node starting where the one before it ends)."""
    offset = 0
    for number, (start, length, _) in enumerate(nodes):
        if start != offset:
            raise ValueError(f"node {number} starts at row position {start}, not where the one before it ends")
        offset += length
    return PrefixTree.of_nodes([parent for _, _, parent in nodes], [length for _, length, _ in nodes])


def segment_tree(segments: Sequence[Segment]) -> PrefixTree:
    """The tree of a row of ``segments`` (in row order, back to back)."""
    nodes: list[tuple[int, int, int]] = []
    for segment in segments:
        nodes += segment.nodes(len(nodes))
    return node_tree(nodes)


def row_nodes(layout) -> list[tuple[int, int, int]]:
    """The nodes of ``layout`` (a :class:`~hf_dynbsz.execution.attention.SegmentLayout`), each ``(row start, length,
    parent)``, in row order."""
    return [(part.own.start, len(part.own), part.parent) for part in layout.parts()]

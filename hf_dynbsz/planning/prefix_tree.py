"""Prefix trees: which positions of a pass's samples are computed once, and what a pass of them costs.

Samples that begin alike compute the same hidden states at the positions they share (a causal model sees nothing
after a position). A pass folds its samples into a prefix trie, as TRL's AsyncGRPO does (its ``TreeRow``): a
sample is a sequence of *position keys*, and two samples share position ``i`` when their keys agree at every position
up to ``i``. A position's key is its token and the next one (:func:`token_keys`), so samples share a position only when
they also agree on what follows it: the trie forks one token before they diverge, and every position keeps one
next-token label (the rule the shared prompt follows, ``[prompt without its last token | last token + completion]``).
Other keys restrict the sharing where more than the tokens decides a hidden state (:func:`group_keys`: each prompt
shared by its own group only; :func:`namespaced`: a vision-language sample's images).

:class:`PrefixTree` merges chains of single-child positions into *nodes*, numbered in row order (depth first, children
by first appearance, so that samples with nothing in common keep their order): a node holds ``length`` positions from
depth ``start`` and attends to its root-to-node path. It is the one model of the tree, from the planner's counts to the
kernels' index tensors: the collator (:mod:`hf_dynbsz.execution.packing`) lays a pass's row out from it, its nodes back
to back in row order (:meth:`PrefixTree.with_padding`: the row's trailing padding a root of its own), and segment
attention reads that tree (:class:`~hf_dynbsz.execution.attention.SegmentLayout`); the schedule
(:mod:`hf_dynbsz.planning.schedule`) counts a pass by it: :meth:`PrefixTree.tokens` (unique positions),
:meth:`PrefixTree.pairs` (attention: every position's queries against its path's keys), :meth:`PrefixTree.path_keys`
(the keys gathered in front of the nodes, which the memory model counts) and :meth:`PrefixTree.units` (samples that stay
in one pass: a subtree that fits the budget, else pieces of it, each carrying its path). The per-pass trie of any subset
of a step's samples is a subset of the step's trie, so what the planner counts of a pass is what the collator builds.

Pure Python + numpy: no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PrefixTree", "Unit", "group_keys", "namespaced", "token_keys"]


@dataclass(frozen=True)
class Unit:
    """Samples that always share a pass: one sample, a subtree of the trie, or a piece of one carrying its path.

    ``tokens`` is what the unit computes on its own (shared positions once) and ``pairs`` its attention term (every
    position's path: :meth:`PrefixTree.pairs`, squared sequence lengths for a sample alone).
    """

    samples: tuple[int, ...]
    tokens: int
    pairs: int


def token_keys(tokens: np.ndarray, base: int) -> np.ndarray:
    """The position keys of one sample of ``tokens`` (ids below ``base`` - 1): ``token x base + next token + 1``,
    the last position's next token counted as -1 (no sample extends it with the same key)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    following = np.empty_like(tokens)
    following[:-1] = tokens[1:]
    following[-1:] = -1
    return tokens * base + following + 1


def namespaced(keys: np.ndarray, position: int, namespace: int) -> np.ndarray:
    """``keys`` with position ``position``'s key replaced by ``namespace`` (a negative number: no token key is one),
    so that samples share positions from there on only with samples of the same namespace."""
    keys = np.array(keys, dtype=np.int64)
    keys[position] = namespace
    return keys


def group_keys(prompt_lengths: Sequence[int], lengths: Sequence[int], groups: Sequence[int]) -> list[np.ndarray]:
    """Position keys of the prompt-group rule: the samples of one group (equal ``groups`` ids: identical prompts)
    share their prompt without its last token, when it has at least 2 tokens; nothing else is shared. Keys are not
    tokens: ``-(2 + group)`` first, zeros along the shared prompt, then one key of the sample's own."""
    count = max(groups, default=-1) + 1
    keys = []
    for index, (prompt, length, group) in enumerate(zip(prompt_lengths, lengths, groups)):
        sample = np.zeros(length, dtype=np.int64)
        sample[0] = -(2 + group)
        sample[max(prompt - 1, 0)] = -(2 + count + index)  # from the prompt's last token on: the sample's own
        keys.append(sample)
    return keys


class PrefixTree:
    """The prefix trie of some samples' position keys, single-child chains merged into nodes (see the module).

    Nodes are numbered in row order, every parent before its children: ``parent[n]`` (-1 for a root), ``start[n]``
    (the depth of its first position: positions along its samples), ``length[n]`` (positions), ``source[n]`` (a
    sample it belongs to, whose tokens it holds). ``leaf[s]``: the node sample ``s`` ends on (its path runs from a
    root to it; samples equal in every key end on the same node).
    """

    def __init__(self, parent, start, length, source, leaf) -> None:
        self.parent, self.start, self.length = list(parent), list(start), list(length)
        self.source, self.leaf = list(source), list(leaf)
        self._paths: tuple[tuple[int, ...], ...] | None = None
        self._samples_through: tuple[tuple[int, ...], ...] | None = None
        self._pairs: tuple[int, ...] | None = None  # node_pairs of every node, once counts() asks
        self._shares_nothing: bool | None = None

    def __eq__(self, other) -> bool:
        """Equal structure (nodes, their depths and lengths, each sample's leaf): what :meth:`encode` sends. A node's
        ``source`` is any sample holding it, so trees that differ only there lay out the same positions."""
        return isinstance(other, PrefixTree) and self.encode() == other.encode()

    __hash__ = None  # mutable (cached paths)

    # ------------------------------------------------------------------ building
    @classmethod
    def of_keys(cls, keys: Sequence[np.ndarray]) -> PrefixTree:
        """The trie of the samples whose position keys are ``keys`` (one 1-D integer array each, at least one key)."""
        nodes = _Trie()
        for sample, sample_keys in enumerate(keys):
            nodes.insert(sample, np.asarray(sample_keys, dtype=np.int64), keys)
        return nodes.tree()

    @classmethod
    def alone(cls, lengths: Sequence[int]) -> PrefixTree:
        """Samples of ``lengths`` tokens that share nothing: one root node each."""
        count = len(lengths)
        return cls([-1] * count, [0] * count, [int(n) for n in lengths], range(count), range(count))

    @classmethod
    def of_nodes(cls, parent: Sequence[int], length: Sequence[int]) -> PrefixTree:
        """A tree of nodes given in row order (``parent[n]`` before ``n``, -1 for a root) and their lengths, no sample
        ending on it: a padding-free row's layout as its kernels read it (depths follow from the parents)."""
        start: list[int] = []
        for node, above in enumerate(parent):
            if not -1 <= above < node:
                raise ValueError(f"node {node} of a prefix tree names parent {above}: not a node before it")
            start.append(0 if above < 0 else start[above] + length[above])
        return cls(parent, start, length, [-1] * len(parent), [])

    def with_padding(self, length: int) -> PrefixTree:
        """This tree and, after its nodes, a root of ``length`` positions that no sample holds (a padding-free row's
        trailing padding: a node of its own, attending only to itself)."""
        return PrefixTree([*self.parent, -1], [*self.start, 0], [*self.length, length], [*self.source, -1], self.leaf)

    @classmethod
    def of_groups(
        cls,
        prompt_lengths: Sequence[int],
        completion_lengths: Sequence[int],
        groups: Sequence[int],
        shared: int = 0,
    ) -> PrefixTree:
        """The trie of the prompt-group rule (:func:`group_keys`) from the samples' lengths alone: each group's
        prompt without its last token once, then each sample's last prompt token and completion. ``shared``: every
        prompt begins with the same ``shared`` tokens (a tool block, exemplars): as a prefix tree computes them, all
        but the last once for every sample (the block's last token is keyed on each prompt's next one)."""
        if shared > 1 and min(prompt_lengths, default=shared) < shared:
            raise ValueError(f"every prompt begins with {shared} shared tokens, but a prompt has fewer")
        sizes = Counter(groups)
        parent, start, length, source, leaf, prefixes = [], [], [], [], [], {}
        block = -1
        if shared > 1 and prompt_lengths:
            block = 0
            parent.append(-1), start.append(0), length.append(shared - 1), source.append(0)
        low = shared - 1 if block >= 0 else 0
        for sample, (prompt, completion, group) in enumerate(zip(prompt_lengths, completion_lengths, groups)):
            if group not in prefixes:
                prefixes[group] = block
                if prompt - 1 > low and sizes[group] > 1:
                    prefixes[group] = len(parent)
                    parent.append(block), start.append(low), length.append(prompt - 1 - low), source.append(sample)
            node = prefixes[group]
            offset = low if node == block else prompt - 1
            leaf.append(len(parent))
            parent.append(node)
            start.append(offset), length.append(prompt + completion - offset), source.append(sample)
        return cls._in_row_order(parent, start, length, source, leaf)

    @classmethod
    def _in_row_order(cls, parent, start, length, source, leaf, children=None) -> PrefixTree:
        """The tree of nodes numbered in any order: renumbered depth first (:func:`_depth_first`), ``children``
        (:func:`_children_by`: per node and -1 for the roots, in the order they take; default: by number)."""
        order = _depth_first(_children_by(parent, range(len(parent))) if children is None else children)
        number = {node: index for index, node in enumerate(order)}
        return cls(
            [number[parent[n]] if parent[n] >= 0 else -1 for n in order],
            [start[n] for n in order],
            [length[n] for n in order],
            [source[n] for n in order],
            [number[n] for n in leaf],
        )

    # ------------------------------------------------------------------ reading it
    @property
    def nodes(self) -> int:
        return len(self.parent)

    @property
    def samples(self) -> int:
        return len(self.leaf)

    @property
    def shares_nothing(self) -> bool:
        """Whether every sample is a root node of its own (node ``s`` is sample ``s``, whole): what :meth:`alone`
        builds, and what a step without sharing (padded rows) plans by. Its counts, units, encoding and joins take a
        shortcut that gives what the general walk gives, at a fraction of its cost."""
        if self._shares_nothing is None:
            self._shares_nothing = (
                self.nodes == self.samples
                and self.leaf == list(range(self.samples))
                and all(above < 0 for above in self.parent)
                and not any(self.start)
            )
        return self._shares_nothing

    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Per sample, its nodes from its root to its leaf. Tuples of integers, which Python's garbage collector stops
        tracking (a plan at cluster scale holds a tree per process and step: lists of lists made every full
        collection walk them all)."""
        if self._paths is None:
            paths = []
            for node in self.leaf:
                path = []
                while node >= 0:
                    path.append(node)
                    node = self.parent[node]
                paths.append(tuple(path[::-1]))
            self._paths = tuple(paths)
        return self._paths

    def children(self) -> list[list[int]]:
        """Per node, its children in row order."""
        children = _children_by(self.parent, range(self.nodes))
        return [children.get(node, []) for node in range(self.nodes)]

    def samples_through(self) -> tuple[tuple[int, ...], ...]:
        """Per node, the samples whose path runs through it, ascending (tuples, as :meth:`paths`)."""
        if self._samples_through is None:
            through: list[list[int]] = [[] for _ in self.parent]
            for sample, path in enumerate(self.paths()):
                for node in path:
                    through[node].append(sample)
            self._samples_through = tuple(map(tuple, through))
        return self._samples_through

    def node_pairs(self, node: int) -> int:
        """The attention term of ``node``: its positions' queries against their paths' keys, counted as squared
        lengths count a sequence (``(start + length)^2 - start^2``: a sample alone gives its length squared)."""
        return self.length[node] * (self.length[node] + 2 * self.start[node])

    def tokens(self, samples: Sequence[int] | None = None) -> int:
        """Positions a pass of ``samples`` (default: all) computes: each position once, however many samples hold it."""
        return sum(self.length[node] for node in self._nodes_of(samples))

    def pairs(self, samples: Sequence[int] | None = None) -> int:
        """The attention term of a pass of ``samples`` (default: all): :meth:`node_pairs` over their nodes."""
        return sum(self.node_pairs(node) for node in self._nodes_of(samples))

    def path_keys(self, samples: Sequence[int] | None = None) -> int:
        """The keys a pass of ``samples`` (default: all) gathers in front of its nodes: each node's path (its
        ancestors' positions, ``start`` of them), which attention reads beside the node's own keys in every layer
        (the memory model's path-key term, :mod:`hf_dynbsz.planning.memory`). 0 for samples that share nothing. Of
        a pass of some samples, an upper bound: the collator lays out the pass's own tree, whose nodes are cut only
        where its own samples fork."""
        if self.shares_nothing:
            return 0
        return sum(self.start[node] for node in self._nodes_of(samples))

    def restricted(self, samples: Sequence[int]) -> PrefixTree:
        """The tree of ``samples`` alone, numbered in the order given: what :meth:`of_keys` builds from their keys (the
        same nodes, row order, sources and leaves), read off this tree instead of inserting the keys again (a pass's
        tree from its step's). Its nodes are the chains of this tree's nodes their paths run through, merged where
        none of them forks off or ends."""
        if self.shares_nothing:
            return PrefixTree.alone([self.length[sample] for sample in samples])
        paths, first, ends = self.paths(), {}, {}
        for number, sample in enumerate(samples):
            for node in paths[sample]:
                first.setdefault(node, number)  # the first of them through it: its source, its place among siblings
            ends.setdefault(self.leaf[sample], []).append(number)
        children = _children_by(self.parent, sorted(first, key=first.__getitem__))
        parent, start, length, source, leaf = [], [], [], [], [0] * len(samples)
        merged: dict[int, int] = {}  # per node of this tree, the node of the restricted tree holding it
        for node in _depth_first(children):
            above = self.parent[node]
            if above >= 0 and above not in ends and len(children[above]) == 1:  # a chain: one node with its parent
                merged[node] = merged[above]
                length[merged[node]] += self.length[node]
                continue
            merged[node] = len(parent)
            parent.append(merged[above] if above >= 0 else -1)
            start.append(self.start[node]), length.append(self.length[node]), source.append(first[node])
        for node, numbers in ends.items():
            for number in numbers:
                leaf[number] = merged[node]
        return PrefixTree(parent, start, length, source, leaf)

    def subtrees(self, samples: Sequence[int]) -> list[tuple[int, ...]]:
        """The distinct sets of ``samples`` whose paths run through one node, for every node their paths run through,
        in node order (each set ascending): the pieces a unit of ``samples`` can be cut into along the tree, each then
        computing its path apart (cross-rank balancing, :class:`hf_dynbsz.planning.balance.Divisible`). Samples
        that share a root give their whole set first."""
        paths, through = self.paths(), {}
        for sample in sorted(samples):
            for node in paths[sample]:
                through.setdefault(node, []).append(sample)
        return list(dict.fromkeys(tuple(through[node]) for node in sorted(through)))

    def counts(self, samples: Sequence[int] | None = None) -> tuple[int, int, int]:
        """``(tokens, pairs, path keys)`` of a pass of ``samples`` (default: all): :meth:`tokens`, :meth:`pairs` and
        :meth:`path_keys`, their nodes collected once."""
        nodes = self._nodes_of(samples)
        if self._pairs is None:
            self._pairs = tuple(self.node_pairs(node) for node in range(self.nodes))
        keys = 0 if self.shares_nothing else sum(map(self.start.__getitem__, nodes))
        return sum(map(self.length.__getitem__, nodes)), sum(map(self._pairs.__getitem__, nodes)), keys

    def _nodes_of(self, samples: Sequence[int] | None) -> set[int]:
        chosen = range(self.samples) if samples is None else samples
        if self.shares_nothing:  # node s is sample s
            return set(chosen)
        paths = self.paths()
        return {node for sample in chosen for node in paths[sample]}

    # ------------------------------------------------------------------ units of the partitioner
    def units(self, budget: int, together: Sequence[int] | None = None) -> list[Unit]:
        """The samples that always share a pass, ordered by their first sample: each root's subtree when it fits
        ``budget`` tokens; otherwise its children's subtrees packed first-fit-decreasing into pieces that fit with
        the path they share (each piece carrying it), a subtree too large for a piece split the same way below it,
        and a sample that fits with no other alone (longer than the budget if it must).

        ``together``: one id per sample; samples of equal ids always share a pass (a preference pair's chosen and
        rejected, whose loss is one function of both): units that split such a group are repacked by groups
        (:func:`_together`), a group that fits with no other alone (longer than the budget if it must)."""
        if together is not None and len(together) != self.samples:
            raise ValueError(f"together has {len(together)} ids for {self.samples} samples")
        units = self._units(budget)
        return units if together is None else _together(self, units, together, budget)

    def _units(self, budget: int) -> list[Unit]:
        if self.shares_nothing:  # every root a sample with no children: one unit each, whatever the budget
            return [Unit((sample,), size, size * size) for sample, size in enumerate(self.length)]
        sizes, pairs = self._subtree_sums()
        units: list[Unit] = []
        children, through = self.children(), self.samples_through()
        ends = [[] for _ in self.parent]
        for sample, node in enumerate(self.leaf):
            ends[node].append(sample)
        split = _Split(self, budget, sizes, pairs, children, through, ends, units)
        for root in (node for node, above in enumerate(self.parent) if above < 0):
            split.subtree(root, 0, 0)
        return sorted(units, key=lambda unit: unit.samples[0])

    def _subtree_sums(self) -> tuple[list[int], list[int]]:
        """Per node, the tokens and attention term of its subtree (itself and every node below it)."""
        sizes = list(self.length)
        pairs = [self.node_pairs(node) for node in range(self.nodes)]
        for node in range(self.nodes - 1, -1, -1):  # children follow their parents in row order
            above = self.parent[node]
            if above >= 0:
                sizes[above] += sizes[node]
                pairs[above] += pairs[node]
        return sizes, pairs

    # ------------------------------------------------------------------ across processes
    def encode(self) -> list[int]:
        """The tree as integers (for an all-gather): ``[nodes, samples, *parent, *start, *length, *leaf]``; a tree
        whose samples share nothing (:attr:`shares_nothing`, at least one sample) as ``[-samples, *length]``."""
        if self.shares_nothing and self.samples:
            return [-self.samples, *self.length]
        return [self.nodes, self.samples, *self.parent, *self.start, *self.length, *self.leaf]

    @classmethod
    def decode(cls, values: Sequence[int]) -> tuple[PrefixTree, int]:
        """The tree :meth:`encode` gave at the start of ``values``, and how many values it took (sources are not
        sent: each node's first sample stands for it)."""
        if int(values[0]) < 0:
            samples = -int(values[0])
            return cls.alone(values[1 : 1 + samples]), 1 + samples
        nodes, samples = int(values[0]), int(values[1])
        offset = 2
        parent, start, length = (
            [int(v) for v in values[offset + k * nodes : offset + (k + 1) * nodes]] for k in range(3)
        )
        offset += 3 * nodes
        leaf = [int(v) for v in values[offset : offset + samples]]
        tree = cls(parent, start, length, [0] * nodes, leaf)
        tree.source = [members[0] if members else 0 for members in tree.samples_through()]
        return tree, offset + samples

    @classmethod
    def joined(cls, tree_samples: Sequence[tuple[PrefixTree, int]]) -> PrefixTree:
        """One tree of the samples ``tree_samples`` (``(tree, sample)`` pairs, in the new order): each keeps its path
        in its own tree; samples of different trees share nothing (the planner's view of samples from other
        processes)."""
        alone = all(tree.shares_nothing for tree, _ in tree_samples)
        if alone and len({(id(tree), sample) for tree, sample in tree_samples}) == len(tree_samples):  # distinct
            return cls.alone([tree.length[sample] for tree, sample in tree_samples])
        parent, start, length, source, leaf = [], [], [], [], []
        number: dict[tuple[int, int], int] = {}
        for index, (tree, sample) in enumerate(tree_samples):
            for node in tree.paths()[sample]:
                key = (id(tree), node)
                if key not in number:
                    above = tree.parent[node]
                    number[key] = len(parent)
                    parent.append(number[id(tree), above] if above >= 0 else -1)
                    start.append(tree.start[node]), length.append(tree.length[node]), source.append(index)
            leaf.append(number[id(tree), tree.paths()[sample][-1]])
        return cls._in_row_order(parent, start, length, source, leaf)


def _together(tree: PrefixTree, units: list[Unit], together: Sequence[int], budget: int) -> list[Unit]:
    """``units`` (of ``tree`` under ``budget``) with every group of equal ``together`` ids in one unit: the units
    that hold part of a split group give up their samples, which are repacked group by group, largest first, into
    pieces whose tree tokens fit the budget (first fit); the units that split no group stay as they are."""
    members: dict[int, list[int]] = {}
    for sample, group in enumerate(together):
        members.setdefault(int(group), []).append(sample)
    unit_of = {sample: index for index, unit in enumerate(units) for sample in unit.samples}
    split = {group for group, samples in members.items() if len({unit_of[s] for s in samples}) > 1}
    if not split:
        return units
    broken = {unit_of[s] for group in split for s in members[group]}
    kept = [unit for index, unit in enumerate(units) if index not in broken]
    groups = sorted(
        {int(together[s]) for index in broken for s in units[index].samples},
        key=lambda group: (-tree.tokens(members[group]), members[group][0]),
    )
    pieces: list[list[int]] = []
    for group in groups:
        piece = next((p for p in pieces if tree.tokens(p + members[group]) <= budget), None)
        if piece is None:
            pieces.append(list(members[group]))
        else:
            piece += members[group]
    repacked = [Unit(tuple(sorted(piece)), tree.tokens(piece), tree.pairs(piece)) for piece in pieces]
    return sorted(kept + repacked, key=lambda unit: unit.samples[0])


class _Split:
    """:meth:`PrefixTree.units`'s walk: a subtree with the path above it is one unit when it fits, else pieces."""

    def __init__(self, tree, budget, sizes, pairs, children, samples_through, ends, units) -> None:
        self.tree, self.budget, self.sizes, self.pairs = tree, budget, sizes, pairs
        self.children, self.samples_through, self.ends, self.units = children, samples_through, ends, units

    def subtree(self, node: int, above_tokens: int, above_pairs: int) -> None:
        tree = self.tree
        total = above_tokens + self.sizes[node]
        if total <= self.budget or not self.children[node]:
            self.units.append(Unit(tuple(self.samples_through[node]), total, above_pairs + self.pairs[node]))
            return
        path = above_tokens + tree.length[node]
        path_pairs = above_pairs + tree.node_pairs(node)
        room = self.budget - path
        through = self.samples_through
        items = [(self.sizes[c], through[c][0], c, self.pairs[c], through[c]) for c in self.children[node]]
        items += [(0, sample, -1, 0, [sample]) for sample in self.ends[node]]
        pieces: list[list] = []  # [free room, samples, tokens, pairs]
        for size, _, child, child_pairs, samples in sorted(items, key=lambda item: (-item[0], item[1])):
            if size > room:
                if child >= 0:
                    self.subtree(child, path, path_pairs)
                else:
                    self.units.append(Unit(tuple(samples), path, path_pairs))
                continue
            piece = next((piece for piece in pieces if piece[0] >= size), None)
            if piece is None:
                piece = [room, [], path, path_pairs]
                pieces.append(piece)
            piece[0] -= size
            piece[1] += samples
            piece[2] += size
            piece[3] += child_pairs
        for _, samples, tokens, piece_pairs in pieces:
            self.units.append(Unit(tuple(sorted(samples)), tokens, piece_pairs))


class _Trie:
    """A compressed trie under construction: nodes in creation order, each ``(source sample, first depth, end
    depth)`` with its children by first key (in first-appearance order)."""

    def __init__(self) -> None:
        self.source: list[int] = []
        self.low: list[int] = []
        self.high: list[int] = []
        self.parent: list[int] = []
        self.children: list[dict[int, int]] = []
        self.roots: dict[int, int] = {}
        self.leaf: list[int] = []

    def _add(self, source: int, low: int, high: int, parent: int) -> int:
        self.source.append(source), self.low.append(low), self.high.append(high), self.parent.append(parent)
        self.children.append({})
        return len(self.source) - 1

    def insert(self, sample: int, keys: np.ndarray, every: Sequence[np.ndarray]) -> None:
        """Add ``sample`` (its ``keys``; ``every``: all samples' keys, for the nodes' sources)."""
        if not keys.size:
            raise ValueError(f"sample {sample} has no positions: a prefix tree needs at least one token per sample")
        table, node, depth, end = self.roots, -1, 0, keys.size
        while depth < end:
            child = table.get(int(keys[depth]))
            if child is None:
                new = self._add(sample, depth, end, node)
                table[int(keys[depth])] = new
                self.leaf.append(new)
                return
            high = self.high[child]
            stop = min(high, end)
            theirs = np.asarray(every[self.source[child]], dtype=np.int64)
            differ = np.flatnonzero(keys[depth:stop] != theirs[depth:stop])
            split = depth + int(differ[0]) if differ.size else stop
            if split < high:  # the child's run forks (or this sample ends) inside it: cut it there
                middle = self._add(self.source[child], depth, split, node)
                table[int(keys[depth])] = middle
                self.children[middle][int(theirs[split])] = child
                self.parent[child], self.low[child] = middle, split
                child = middle
            node, table, depth = child, self.children[child], self.high[child]
        self.leaf.append(node)  # it ends where another sample's path continues or ends: that node is its leaf

    def tree(self) -> PrefixTree:
        """The finished trie, renumbered in row order (roots and children in first-appearance order: a node cut
        in two keeps its place among its siblings)."""
        children = {node: list(table.values()) for node, table in enumerate(self.children)}
        children[-1] = list(self.roots.values())
        lengths = [high - low for low, high in zip(self.low, self.high)]
        return PrefixTree._in_row_order(self.parent, self.low, lengths, self.source, self.leaf, children)


def _children_by(parent: Sequence[int], nodes: Iterable[int]) -> dict[int, list[int]]:
    """Per node among ``nodes`` (a node's parent among them too), and per -1 for the roots: its children among
    ``nodes``, in the order ``nodes`` gives them (the order :func:`_depth_first` takes them in)."""
    children: dict[int, list[int]] = {}
    for node in nodes:
        children.setdefault(parent[node], []).append(node)
    return children


def _depth_first(children: dict[int, list[int]]) -> list[int]:
    """The nodes of ``children`` (:func:`_children_by`) in row order: depth first from the roots, each node's
    children in their order."""
    order, stack = [], children.get(-1, [])[::-1]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children.get(node, ())))
    return order

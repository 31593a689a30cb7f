"""Specification of hf_dynbsz.planning.prefix_tree: which positions a pass's samples compute once, and what a pass of
them costs.

A position is identified by the sample's keys up to it (a token and the next); the tree holds each such position
once, in row order, and every count of the planner (unique tokens, attention pairs, the partitioner's units) is the
count a brute-force enumeration of distinct prefixes gives.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_dynbsz.planning.prefix_tree import PrefixTree, group_keys, namespaced, token_keys


def tree_of(sequences, base=10):
    return PrefixTree.of_keys([token_keys(np.array(s), base) for s in sequences])


def distinct_positions(sequences):
    """Brute force: the positions of ``sequences`` keyed by (token, next token), the sample's whole prefix up to the
    next token: a set of tuples, one per position computed once."""
    return {tuple([*s, -1][: i + 2]) for s in sequences for i in range(len(s))}


def brute_pairs(sequences):
    """Each distinct position's queries against its path's keys, counted as squared lengths count: 2 depth + 1."""
    return sum(2 * (len(prefix) - 2) + 1 for prefix in distinct_positions(sequences))


def brute_path_keys(sequences):
    """The keys gathered in front of the nodes: each node's depth (its path's length). A node begins at a position
    whose parent (its tuple less its last entry) continues in two or more ways; a root's depth is 0."""
    positions = distinct_positions(sequences)
    children = {}
    for prefix in positions:
        children[prefix[:-1]] = children.get(prefix[:-1], 0) + 1
    return sum(len(prefix) - 2 for prefix in positions if len(prefix) > 2 and children[prefix[:-1]] >= 2)


sequences = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=8), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(sequences, st.data())
def test_a_pass_computes_each_distinct_position_once(samples, data):
    tree = tree_of(samples)
    assert tree.tokens() == len(distinct_positions(samples))
    assert tree.pairs() == brute_pairs(samples)
    assert tree.path_keys() == brute_path_keys(samples)
    assert tree.counts() == (tree.tokens(), tree.pairs(), tree.path_keys())
    subset = data.draw(st.lists(st.sampled_from(range(len(samples))), min_size=1, unique=True))
    assert tree.tokens(subset) == len(distinct_positions([samples[i] for i in subset]))  # a pass of some of them
    assert tree.pairs(subset) == brute_pairs([samples[i] for i in subset])
    # counted on the step's tree, a pass of some samples gathers at least what the pass's own tree (which the collator
    # lays out) does: the step's nodes are cut where any of its samples fork, the pass's only where its own do
    assert tree.path_keys(subset) >= brute_path_keys([samples[i] for i in subset])


@settings(max_examples=200, deadline=None)
@given(sequences)
def test_nodes_are_in_row_order_and_every_path_spells_its_sample(samples):
    tree = tree_of(samples)
    assert all(parent < node for node, parent in enumerate(tree.parent))  # every parent before its children
    for sample, path in enumerate(tree.paths()):
        depth = 0
        for node in path:
            assert tree.start[node] == depth and tree.length[node] >= 1
            depth += tree.length[node]
            source = samples[tree.source[node]]  # the tokens the row copies are the sample's own
            assert source[tree.start[node] : depth] == samples[sample][tree.start[node] : depth]
        assert depth == len(samples[sample])
    children = tree.children()
    for node, below in enumerate(children):  # a chain of single children is one node (samples may end there)
        ends = tree.leaf.count(node)
        assert len(below) != 1 or ends > 0


def test_the_tree_forks_one_token_before_samples_diverge_and_keeps_their_order():
    #          a  b  c  d          a  b  c  e         f  g        a  b  c  d  (again)
    samples = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [7, 8], [1, 2, 3, 4]]
    tree = tree_of(samples)
    # [a b] once (c is keyed on d or e), then c d for samples 0 and 3, c e f for sample 1; [f g] alone
    assert list(zip(tree.start, tree.length, tree.parent)) == [(0, 2, -1), (2, 2, 0), (2, 3, 0), (0, 2, -1)]
    assert tree.leaf == [1, 2, 3, 1] and tree.source == [0, 0, 1, 2]
    assert tree.tokens() == 9 and tree.tokens([0, 3]) == 4


def test_the_group_rule_shares_each_prompt_in_its_group_only():
    prompts, completions, groups = [4, 4, 3, 4, 1, 1], [2, 0, 5, 3, 2, 2], [0, 0, 1, 0, 2, 2]
    lengths = [p + c for p, c in zip(prompts, completions)]
    keyed = PrefixTree.of_keys(group_keys(prompts, lengths, groups))
    counted = PrefixTree.of_groups(prompts, completions, groups)
    assert (keyed.parent, keyed.start, keyed.length, keyed.leaf) == (
        counted.parent,
        counted.start,
        counted.length,
        counted.leaf,
    )
    # group 0's prompt without its last token once, then each sample's last prompt token and completion; group 1 has
    # one sample (a plain sequence); group 2's prompts of 1 token share nothing
    assert list(zip(counted.start, counted.length, counted.parent)) == [
        (0, 3, -1), (3, 3, 0), (3, 1, 0), (3, 4, 0), (0, 8, -1), (0, 3, -1), (0, 3, -1),
    ]  # fmt: skip
    # brute force on tokens laid out as the rule assumes: a group's prompts identical, every other first token apart
    samples = [[10 * (g + 1) + k for k in range(p)] + [1000 + 10 * s + k for k in range(c)]
               for s, (p, c, g) in enumerate(zip(prompts, completions, groups))]  # fmt: skip
    assert counted.tokens() == len(distinct_positions(samples)) == 3 + (3 + 1 + 4) + 8 + 3 + 3


def test_a_namespace_keeps_positions_from_there_apart():
    same = [1, 2, 3, 4, 5]
    keys = [token_keys(np.array(same), 10), namespaced(token_keys(np.array(same), 10), 2, -7)]
    tree = PrefixTree.of_keys(keys)
    assert list(zip(tree.start, tree.length, tree.parent)) == [(0, 2, -1), (2, 3, 0), (2, 3, 0)]


def test_a_subtree_that_fits_is_one_unit():
    # a shared block of 10, two prompts of their own, two completions each
    samples = [[0] * 10 + [1, 1] + [2, 3], [0] * 10 + [1, 1] + [3, 3], [0] * 10 + [2] + [1], [0] * 10 + [2] + [2, 2]]
    tree = tree_of(samples)
    (unit,) = tree.units(budget=tree.tokens())
    assert unit.samples == (0, 1, 2, 3) and unit.tokens == tree.tokens() and unit.pairs == tree.pairs()


def test_a_subtree_over_the_budget_splits_into_pieces_each_carrying_its_path():
    samples = [[0] * 10 + [1] * 6 + [k] * 3 for k in (2, 3)] + [[0] * 10 + [4] * 6 + [k] * 3 for k in (5, 6)]
    tree = tree_of(samples)
    assert tree.tokens() == 9 + 2 * (6 + 2 * 4)  # the block's first 9 once, each prompt's 6, each completion's 4
    units = tree.units(budget=23)
    assert [unit.samples for unit in units] == [(0, 1), (2, 3)]  # each prompt's subtree with the block's path
    for unit in units:
        assert unit.tokens == tree.tokens(unit.samples) == 23
        assert unit.pairs == tree.pairs(unit.samples)
    assert [unit.samples for unit in tree.units(budget=20)] == [(0,), (1,), (2,), (3,)]  # a prompt's subtree: 23
    (lone,) = tree.units(budget=5)[:1]  # the block alone is over the budget: every sample alone
    assert lone.samples == (0,) and lone.tokens == 19 and lone.pairs == 19 * 19


@settings(max_examples=300, deadline=None)
@given(sequences, st.data())
def test_a_pass_reads_its_tree_off_its_steps_as_its_keys_would_build_it(samples, data):
    """The collator reads a pass's tree off its step's (:meth:`PrefixTree.restricted`, any subset in any order) rather
    than inserting the pass's keys again: the very tree ``of_keys`` builds, nodes, order, sources and leaves."""
    keys = [token_keys(np.array(s), 10) for s in samples]
    chosen = data.draw(st.lists(st.sampled_from(range(len(samples))), min_size=1, unique=True))
    read, built = tree_of(samples).restricted(chosen), PrefixTree.of_keys([keys[i] for i in chosen])
    assert (read.parent, read.start, read.length, read.source, read.leaf) == (
        built.parent, built.start, built.length, built.source, built.leaf,
    )  # fmt: skip
    alone = PrefixTree.alone([len(s) for s in samples]).restricted(chosen)
    assert alone == PrefixTree.alone([len(samples[i]) for i in chosen])


def test_a_rows_nodes_are_a_tree_and_its_trailing_padding_a_root_of_no_sample():
    """Segment attention reads a row as its tree: nodes given in row order by parent and length (a hand-written row)
    take their depths from their parents, a parent must come before its node, and the collator's trailing padding is
    one more root that no sample's path holds (the samples' counts stay the tree's)."""
    row = PrefixTree.of_nodes([-1, 0, 1, 0, -1], [4, 2, 3, 5, 6])
    assert row.start == [0, 4, 6, 4, 0] and row.children() == [[1, 3], [2], [], [], []] and row.samples == 0
    with pytest.raises(ValueError, match="node 1 of a prefix tree names parent 2: not a node before it"):
        PrefixTree.of_nodes([-1, 2, -1], [1, 1, 1])
    tree = tree_of([[1, 2, 3, 4], [1, 2, 5], [6, 7]])
    padded = tree.with_padding(3)
    assert (padded.parent[-1], padded.start[-1], padded.length[-1]) == (-1, 0, 3) and padded.nodes == tree.nodes + 1
    assert padded.paths() == tree.paths() and padded.counts() == tree.counts()


@settings(max_examples=200, deadline=None)
@given(sequences, st.data())
def test_samples_cut_along_the_tree_give_the_samples_below_each_of_their_positions(samples, data):
    """The pieces cross-rank balancing may cut a unit into (:meth:`PrefixTree.subtrees`): for every distinct position
    of the chosen samples, the chosen samples that hold it (brute force over prefixes), each set once; the whole set
    first when they share their first position. A piece computes its own path wherever it runs: its tokens are those
    of its samples alone."""
    tree = tree_of(samples)
    chosen = sorted(data.draw(st.lists(st.sampled_from(range(len(samples))), min_size=1, unique=True)))
    keyed = {sample: [*samples[sample], -1] for sample in chosen}
    expected = {
        tuple(s for s in chosen if tuple(keyed[s][: len(prefix)]) == prefix)
        for prefix in distinct_positions([samples[s] for s in chosen])
    }
    pieces = tree.subtrees(chosen)
    assert len(pieces) == len(set(pieces)) and set(pieces) == expected
    assert all(list(piece) == sorted(piece) for piece in pieces)
    if len({tuple(keyed[s][:2]) for s in chosen}) == 1:
        assert pieces[0] == tuple(chosen)
    for piece in pieces:
        assert tree.tokens(piece) == len(distinct_positions([samples[s] for s in piece]))
    for budget in (1, 4, 9, 30):  # a unit costs what its samples compute: what balancing charges its parts by
        assert all(
            (unit.tokens, unit.pairs) == (tree.tokens(unit.samples), tree.pairs(unit.samples))
            for unit in tree.units(budget)
        )


#: Group 0 (samples 0, 1, 2, 4: prompts of 6) shares 5 prompt tokens; its blocks (the prompt's last token and the
#: completion) are 10, 3, 5 and 2 tokens: 25 in all. Sample 3 is alone in group 1: 10 tokens. A unit's attention term
#: is its positions' path lengths, 2 depth + 1 each: (5 + block)^2 - 25 per block, 25 for the shared prompt.
GROUP_UNITS = {
    # the group fits: one unit (25 + 200 + 39 + 75 + 24 pairs)
    40: [((0, 1, 2, 4), 25, 363), ((3,), 10, 100)],
    # 15 tokens: pieces of 10 block tokens beside the prompt, first-fit-decreasing: [10] and [5, 3, 2]; sample 0 alone
    15: [((0,), 15, 225), ((1, 2, 4), 15, 25 + 39 + 75 + 24), ((3,), 10, 100)],
    # 8 and 3 tokens: no two blocks fit beside the prompt, every sample alone
    8: [((0,), 15, 225), ((1,), 8, 64), ((2,), 10, 100), ((3,), 10, 100), ((4,), 7, 49)],
    3: [((0,), 15, 225), ((1,), 8, 64), ((2,), 10, 100), ((3,), 10, 100), ((4,), 7, 49)],
}


@pytest.mark.parametrize("budget", list(GROUP_UNITS))
def test_the_group_rule_units_share_a_group_that_fits_and_pack_its_blocks_beside_the_prompt(budget):
    prompts, completions, groups = [6, 6, 6, 3, 6], [9, 2, 4, 7, 1], [0, 0, 0, 1, 0]
    tree = PrefixTree.of_groups(prompts, completions, groups)
    assert [(unit.samples, unit.tokens, unit.pairs) for unit in tree.units(budget)] == GROUP_UNITS[budget]


def test_a_tree_travels_as_integers_and_trees_join_as_a_forest():
    tree = tree_of([[1, 2, 3], [1, 2, 4], [5]])
    decoded, used = PrefixTree.decode([*tree.encode(), 99])
    assert used == len(tree.encode())
    assert (decoded.parent, decoded.start, decoded.length, decoded.leaf) == (
        tree.parent,
        tree.start,
        tree.length,
        tree.leaf,
    )
    other = tree_of([[1, 2, 3]])
    joined = PrefixTree.joined([(tree, 1), (other, 0), (tree, 0)])
    # samples of different trees share nothing; those of one tree keep their shared path
    assert joined.tokens() == tree.tokens([0, 1]) + other.tokens()
    assert joined.paths()[0][0] == joined.paths()[2][0] != joined.paths()[1][0]


def walked(tree):
    """``tree`` with the shortcut of samples sharing nothing turned off: what the general walk computes."""
    general = PrefixTree(tree.parent, tree.start, tree.length, tree.source, tree.leaf)
    general._shares_nothing = False
    return general


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(1, 60), st.data())
def test_samples_that_share_nothing_travel_as_their_lengths_and_count_as_the_general_walk_counts(lengths, budget, data):
    """A step without sharing (padded rows) plans by such a tree on every process at every step: its encoding is its
    lengths, and its units, counts and joins are the general walk's."""
    groups = list(range(len(lengths)))  # one prompt per sample: nothing in common
    prompts = [data.draw(st.integers(0, n)) for n in lengths]
    built = [
        PrefixTree.alone(lengths),
        PrefixTree.of_groups(prompts, [n - p for n, p in zip(lengths, prompts)], groups),
        tree_of([[index, *([0] * (n - 1))] for index, n in enumerate(lengths)], base=len(lengths) + 2),
    ]
    for tree in built:
        assert tree.shares_nothing and tree == PrefixTree.alone(lengths)
        assert tree.encode() == [-len(lengths), *lengths]
        decoded, used = PrefixTree.decode([*tree.encode(), 7, 7])
        assert used == 1 + len(lengths)
        assert (decoded.parent, decoded.start, decoded.length, decoded.leaf, decoded.source) == (
            tree.parent,
            tree.start,
            tree.length,
            tree.leaf,
            list(range(len(lengths))),
        )
        general = walked(tree)
        assert tree.units(budget) == general.units(budget)
        chosen = data.draw(st.lists(st.sampled_from(range(len(lengths))), unique=True))
        assert (tree.tokens(chosen), tree.pairs(chosen)) == (general.tokens(chosen), general.pairs(chosen))
        assert tree.counts(chosen) == general.counts(chosen) == (tree.tokens(chosen), tree.pairs(chosen), 0)
    first, second = built[0], built[1]
    tree_samples = [(second, len(lengths) - 1), (first, 0), (second, 0)][: 3 if len(lengths) > 1 else 2]  # distinct
    general = {id(first): walked(first), id(second): walked(second)}
    joined = PrefixTree.joined(tree_samples)
    assert joined == PrefixTree.joined([(general[id(tree)], sample) for tree, sample in tree_samples])
    assert joined.length == [lengths[-1], lengths[0], lengths[0]][: len(tree_samples)]


def test_a_tree_that_shares_a_position_takes_the_general_walk():
    assert not tree_of([[1, 2, 3], [1, 2, 4]]).shares_nothing
    assert not PrefixTree.of_groups([4, 4], [2, 3], [0, 0]).shares_nothing
    assert PrefixTree.of_groups([4, 1, 1], [2, 3, 1], [0, 1, 1]).shares_nothing  # a 1-token prompt: nothing shared
    picked = PrefixTree.joined([(PrefixTree.alone([5]), 0), (PrefixTree.alone([5]), 0)])
    assert picked.shares_nothing and picked.length == [5, 5]  # two trees' samples: distinct however equal


# ---- groups that always share a pass (a preference pair's chosen and rejected) -----------------------------------
def pairs_tree(prompts, responses):
    """Preference pairs: prompt ``prompts[k]`` (a list of tokens) with its two responses ``responses[k]``; samples in
    pair order (chosen, rejected, ...) and each pair's ``together`` id."""
    samples = [prompt + response for prompt, pair in zip(prompts, responses) for response in pair]
    return tree_of(samples), [k for k in range(len(prompts)) for _ in range(2)]


def test_together_keeps_units_that_split_no_group():
    tree, together = pairs_tree([[0] * 6, [1] * 6], [([2] * 3, [3] * 4), ([2] * 2, [3] * 2)])
    for budget in (5, 13, 100):
        plain = tree.units(budget)
        grouped = tree.units(budget, together)
        whole = [unit for unit in plain if all(s ^ 1 in unit.samples for s in unit.samples)]
        assert all(unit in grouped for unit in whole)  # a unit holding whole pairs stays as it is


def test_pairs_sharing_a_prompt_are_repacked_whole_when_the_prompts_subtree_is_cut():
    # one prompt of 10 with four pairs; every chosen response opens with 5, every rejected one with 6, so the plain cut
    # of the prompt's subtree (9 + 2 x (1 + 4 x 6) = 59 tokens) takes the chosen ones apart from the rejected ones
    responses = [([5, k] + [1] * 4, [6, k] + [1] * 4) for k in range(4)]
    tree, together = pairs_tree([[0] * 10] * 4, responses)
    assert tree.tokens() == 59 and tree.units(59, together) == tree.units(59)  # it fits: one unit
    plain = [unit.samples for unit in tree.units(40)]
    assert any(len(unit) % 2 or any(s ^ 1 not in unit for s in unit) for unit in plain)  # the plain cut splits pairs
    units = tree.units(40, together)
    assert sorted(s for unit in units for s in unit.samples) == list(range(8))
    for unit in units:
        assert all(s ^ 1 in unit.samples for s in unit.samples)  # whole pairs
        assert unit.tokens == tree.tokens(unit.samples) <= 40 and unit.pairs == tree.pairs(unit.samples)
    assert [unit.tokens for unit in units] == [35, 35]  # two pairs a piece: 9 + 2 x (1 + 2 x 6)


def test_a_pair_over_the_budget_is_one_unit_over_the_budget():
    tree, together = pairs_tree([[0] * 10], [([1] * 8, [2] * 8)])
    (unit,) = tree.units(12, together)
    assert unit.samples == (0, 1) and unit.tokens == tree.tokens() == 9 + 2 * 9


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=2, max_size=12), st.data())
def test_every_group_runs_in_exactly_one_unit(samples, data):
    tree = tree_of(samples)
    together = data.draw(st.lists(st.integers(0, 3), min_size=len(samples), max_size=len(samples)))
    budget = data.draw(st.integers(1, 40))
    units = tree.units(budget, together)
    assert sorted(s for unit in units for s in unit.samples) == list(range(len(samples)))
    where = {s: index for index, unit in enumerate(units) for s in unit.samples}
    for group in set(together):
        assert len({where[s] for s, g in enumerate(together) if g == group}) == 1
    plain = tree.units(budget)
    for unit in units:  # a unit the plain cut made, or a repacked one: whole groups within the budget, or one group
        assert unit in plain or unit.tokens == tree.tokens(unit.samples)
        assert unit in plain or unit.tokens <= budget or len({together[s] for s in unit.samples}) == 1

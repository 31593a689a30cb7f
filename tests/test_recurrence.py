"""Specification of hf_dynbsz.execution.recurrence: padding-free rows and shared prompts through the sequence mixers of
hybrid and state-space models give each sample's own log-probs and gradients.

Each family is built tiny from its config (random weights, fp32, transformers' torch fallbacks of its kernels): Gated
DeltaNet (Qwen3.5), the Mamba-2 SSM with no attention at all (Mamba-2), short convolutions (LFM2), RecurrentGemma's
RG-LRU and convolution, and MiniMax's lightning attention. A row is built by the packing collator (shared prompts
where a prompt has several completions) and run through segment attention and segment recurrence; every sample's
log-probs must equal the sample run alone through the model (what generation computed). Two controls show the
reference can fail: without segment recurrence a sequence starts from the previous one's state, and blocks run
without their prefix start from a zero state; both differ by far more than the tolerance.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head

from hf_dynbsz.execution import recurrence
from hf_dynbsz.execution.attention import SegmentLayout, use_segments
from hf_dynbsz.execution.check_passes import gradient_table
from hf_dynbsz.execution.packing import SequenceTable, build_microbatch
from hf_dynbsz.execution.recurrence import (
    SHORTEST_BUCKET,
    bucket_length,
    chained_states,
    continuation_calls,
    continuation_runs,
    prefix_states,
    recurrence_calls,
    segment_recurrence,
    state_argument,
)
from hf_dynbsz.execution.self_check import gradient_error
from hf_dynbsz.planning.model_support import ModelSupport
from hf_dynbsz.planning.prefix_tree import PrefixTree
from hf_dynbsz.testing import (
    Segment,
    bare_check_passes,
    grpo_batch,
    logps_alone,
    node_tree,
    packed_logps,
    prefix_batch,
    segment_tree,
    stock_logps,
)
from hf_dynbsz.testing.zoo import SEGMENT_RECURRENCE_FAMILIES, build_tiny_causal_lm_of_type, causal_lm_types

TOLERANCE = 2e-6  # fp32: the runs differ from each sample alone by 5e-7 at most
LEAK = 2e-5  # a sequence started from another's state differs by more than this (10x the tolerance)

# prompts of 9, 4 and 13 tokens, 3 + 2 + 1 completions (one empty)
PROMPTS, REPEATS = [9, 4, 13], [3, 2, 1]
COMPLETIONS = [6, 11, 3, 8, 0, 5]
FAMILIES = ["qwen3_5_text", "mamba2", "lfm2", "recurrent_gemma", "minimax"]


@pytest.fixture(params=FAMILIES)
def model(request):  # one per test: a mixer decides at its first shared row whether prefixes run once (prefix_states)
    model = build_tiny_causal_lm_of_type(request.param, seed=1)
    for module in model.modules():  # tiny random convolutions carry little: scaled up, a leak shows above LEAK
        if isinstance(module, torch.nn.Conv1d):
            module.weight.data.mul_(4)
    model.eval()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def mixers(model) -> tuple[str, ...]:
    return ModelSupport.of(model=model).sequence_mixers


def alone(model, batch) -> list[torch.Tensor]:
    """Each sample's completion log-probs, the sample run alone (no padding)."""
    table = SequenceTable.from_padded(*batch)
    return [logps_alone(model, table, sample) for sample in range(len(table.tokens))]


def packed(model, batch, order, shared: bool, with_recurrence: bool = True, pad_to_multiple_of=None):
    table = SequenceTable.from_padded(*batch)
    groups = table.prompt_groups() if shared else None
    attention = model.config._attn_implementation
    recurrent = mixers(model) if with_recurrence else ()
    _, logps, _ = packed_logps(model, table, order, groups, attention, pad_to_multiple_of, mixers=recurrent)
    return logps


def largest_error(model, order, shared, **options) -> float:
    batch = grpo_batch(PROMPTS, COMPLETIONS, REPEATS, seed=2, token_high=40)
    with torch.no_grad():
        expected = alone(model, batch)
        logps = packed(model, batch, order, shared, **options)
    return max(
        (logps[row, : COMPLETIONS[sample]] - expected[sample]).abs().max().item()
        for row, sample in enumerate(order)
        if COMPLETIONS[sample]
    )


def test_the_family_has_sequence_mixers_and_trains_padding_free(model):
    support = ModelSupport.of(model=model)
    assert support.sequence_mixers and support.padding_free_blocker is None
    layout = support.layouts()[0][0]
    assert layout.name == "padding_free" and layout.sharing and layout.segment_recurrence


@pytest.mark.parametrize("pad_to_multiple_of", [None, 16])
def test_shared_prompts_give_each_samples_own_logprobs(model, pad_to_multiple_of):
    order = [4, 0, 5, 2, 3, 1]  # groups interleaved: the collator gathers each group's segment
    assert largest_error(model, order, shared=True, pad_to_multiple_of=pad_to_multiple_of) <= TOLERANCE


def tree_error(model) -> float:
    """The largest difference from each sample alone of a tree row: a block every prompt begins with, completions
    sharing a trunk and one of two branches (inner nodes two levels deep, nodes shorter than a convolution's kernel)."""
    batch = prefix_batch(
        [5, 2, 9], [6, 0, 3, 9, 1, 5, 4, 2], [3, 3, 2], shared=7, trunk=4, branches=2, branch=3, seed=3
    )
    table = SequenceTable.from_padded(*batch)
    completions = table.completion_lengths.tolist()
    with torch.no_grad():
        _, logps, _ = packed_logps(model, table, list(range(8)), None, model.config._attn_implementation,
                                   mixers=mixers(model), sharing="tree")  # fmt: skip
        return max(
            (logps[j, :c] - logps_alone(model, table, j)).abs().max().item() for j, c in enumerate(completions) if c
        )


def test_a_tree_row_gives_each_samples_own_logprobs(model):
    """Each node starts from its parent's final states (copied for every child), inner nodes level by level; the
    first row decides, per mixer, whether states are handed on (blocks of roots, and down chains of inner nodes)."""
    assert tree_error(model) <= TOLERANCE  # the mixers decide here, and recompute
    assert tree_error(model) <= TOLERANCE  # then hand states on where they decided so
    chains = {chained_states(m) for m in model.modules() if type(m).__name__ in mixers(model)}
    assert chains == {model.config.model_type not in ("recurrent_gemma", "minimax")}


def test_states_go_down_chains_of_inner_nodes_only_where_a_chain_was_checked(monkeypatch):
    """A cache whose state, once a run started from one, stays the state it started from: shared prompts' blocks
    (children of roots, which start from zero) are still right, chains of inner nodes are not. Decided on a row of
    shared prompts, the check of the row cut in halves sees it, and tree rows recompute their paths: still exact.
    Handing states down chains anyway leaks."""
    model = build_tiny_causal_lm_of_type("qwen3_5_text", seed=1)
    add_fused_lm_head(model.eval(), outputs=("log_probs", "entropy"))

    def stale(self, recurrent_states, layer_idx, state_idx=0, **kwargs):
        return self.recurrent.setdefault(state_idx, recurrent_states)

    monkeypatch.setattr(recurrence.RunStates, "update_recurrent_state", stale)
    assert largest_error(model, list(range(len(COMPLETIONS))), shared=True) <= TOLERANCE  # decides on shared prompts
    deciding = [m for m in model.modules() if type(m).__name__ in mixers(model)]
    assert {prefix_states(m) for m in deciding} == {True} and {chained_states(m) for m in deciding} == {False}
    assert tree_error(model) <= TOLERANCE
    for module in deciding:
        recurrence._CHAINED_STATES[module] = True
    assert tree_error(model) > LEAK


def test_a_sequence_never_starts_from_the_previous_sequences_state(model):
    order = list(range(len(COMPLETIONS)))
    assert largest_error(model, order, shared=False) <= TOLERANCE
    # the control: the mixers run over the whole row carry state from one sequence into the next
    assert largest_error(model, order, shared=False, with_recurrence=False) > LEAK


def test_a_block_starts_from_its_prefixs_state(model, monkeypatch):
    order = list(range(len(COMPLETIONS)))
    assert largest_error(model, order, shared=True) <= TOLERANCE

    # the control: blocks run from a zero state, each prefix alone (recomputed prefixes), or from the bank's zero row
    def without_prefix_state(layout, device):  # every node a root of its own
        split = PrefixTree.alone([len(part.own) for part in layout.parts()])
        return recomputed(SegmentLayout(split, layout.base_implementation), device)

    def from_zero_state(layout, device):
        levels, calls, positions = continued(layout, device)
        zero_row = sum(call.gather.shape[0] for level in levels for call in level)
        calls = [dataclasses.replace(call, state_rows=torch.full_like(call.state_rows, zero_row)) for call in calls]
        return levels, calls, positions

    recomputed, continued = recurrence_calls, continuation_calls
    monkeypatch.setattr(recurrence, "recurrence_calls", without_prefix_state)
    monkeypatch.setattr(recurrence, "continuation_calls", from_zero_state)
    assert largest_error(model, order, shared=True) > LEAK


#: The families whose mixers recompute each shared prefix (their blocks cannot start from the prefix's final states:
#: Mamba's and Jamba's full-sequence scans start from zero whatever the cache holds, Falcon-Mamba's likewise,
#: RecurrentGemma's block reads no cache, MiniMax's lightning attention reads one with methods of its own).
#: Every other family of SEGMENT_RECURRENCE_FAMILIES hands states on, and down chains of inner nodes, as it did
#: under transformers 5.24: a release that loses that fails here, per family.
RECOMPUTES_PREFIXES = frozenset({"falcon_mamba", "jamba", "mamba", "minimax", "recurrent_gemma"})
#: The families of FAMILIES whose mixers read their states through transformers' cache (5.21 to 5.25 alike), and the
#: keyword they take it under: all but those of RECOMPUTES_PREFIXES (above).
READS_STATES_FROM_CACHE = {family: "cache" for family in FAMILIES if family not in RECOMPUTES_PREFIXES}


def test_a_mixer_that_reads_its_states_from_the_cache_runs_each_prefix_once(model, caplog):
    """Qwen3.5's Gated DeltaNet, Mamba-2 and LFM2's convolution read their states through transformers' cache: their
    blocks start from the prefix's final states (after one check on the first shared row). RecurrentGemma's block and
    MiniMax's lightning attention do not: their prefixes are recomputed in front of each block, with the reason
    logged."""
    recurrence._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="hf_dynbsz"):
        largest_error(model, [4, 0, 5, 2, 3, 1], shared=True)
    expected = READS_STATES_FROM_CACHE.get(model.config.model_type)
    for module in model.modules():
        if type(module).__name__ in mixers(model):
            assert prefix_states(module) is (expected is not None), type(module).__name__
            assert state_argument(module) == expected, type(module).__name__
            assert (f"{type(module).__name__} recomputes each shared prefix" in caplog.text) is (expected is None)


def test_gradients_equal_those_of_each_sample_alone():
    model = build_tiny_causal_lm_of_type("qwen3_5_text", seed=3)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    batch = grpo_batch(PROMPTS, COMPLETIONS, REPEATS, seed=4, token_high=40)
    weights = torch.linspace(0.5, 2.0, len(COMPLETIONS))

    def gradients(loss):
        model.zero_grad()
        loss().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    def each_alone():
        return sum(weights[i] * logps.sum() for i, logps in enumerate(alone(model, batch)))

    def shared_row():
        logps = packed(model, batch, list(range(len(COMPLETIONS))), shared=True)
        return (logps * weights.unsqueeze(1)).sum()

    with torch.no_grad():
        shared_row()  # the first shared row decides that the Gated DeltaNet starts blocks from prefix states
    assert all(prefix_states(m) for m in model.modules() if type(m).__name__ in mixers(model))
    expected, got = gradients(each_alone), gradients(shared_row)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=1e-5, rtol=1e-4), name


def test_runs_of_a_bucket_share_a_call_and_every_token_is_kept_once():
    # a plain sequence of 5, a shared prompt of prefix 4 with blocks 3, 1 and 3, a plain sequence of 7, one of 20
    segments = [Segment(0, 0, (5,)), Segment(5, 4, (3, 1, 3)), Segment(16, 0, (7,)), Segment(23, 0, (20,))]
    layout = SegmentLayout(segment_tree(segments), "sdpa")
    calls, positions = recurrence_calls(layout, "cpu")
    assert [tuple(call.gather.shape) for call in calls] == [(5, 16), (1, 24)]  # runs of 5, 7, 5, 7, 7 | 20
    assert sorted(positions.tolist()) == list(range(layout.width))
    first = calls[0]
    # each block runs after its prefix; the first block keeps the prefix's outputs, the others only their own
    assert first.gather[1, :8].tolist() == [5, 6, 7, 8, 9, 10, 11, 11]  # prefix, block 1, then padding
    assert first.keep[1].tolist() == [True] * 7 + [False] * 9
    assert first.gather[2, :6].tolist() == [5, 6, 7, 8, 12, 12]
    assert first.keep[2].tolist() == [False] * 4 + [True] + [False] * 11


def test_with_prefix_states_each_prefix_runs_once_and_its_blocks_start_from_its_final_state():
    segments = [Segment(0, 0, (5,)), Segment(5, 4, (3, 1, 3)), Segment(16, 0, (7,)), Segment(23, 2, (4, 6))]
    layout = SegmentLayout(segment_tree(segments), "sdpa")
    (prefix_calls,), calls, positions = continuation_calls(layout, "cpu")  # one level of inner nodes: the prefixes
    # prefixes unpadded (their final states are read), by length: [23, 24] then [5..8]; bank rows 0, 1; zero row 2
    assert [call.gather.tolist() for call in prefix_calls] == [[[23, 24]], [[5, 6, 7, 8]]]
    assert all(call.state_rows is None for call in prefix_calls)  # roots start from zero
    assert sorted(positions.tolist()) == list(range(layout.width))
    (call,) = calls  # every block and plain sequence fits the shortest bucket
    starts = {
        tuple(row[keep].tolist()): int(state) for row, keep, state in zip(call.gather, call.keep, call.state_rows)
    }
    assert starts == {
        (0, 1, 2, 3, 4): 2,  # a plain sequence: the zero row
        (9, 10, 11): 1,
        (12,): 1,
        (13, 14, 15): 1,  # the blocks of the prefix [5..8]
        (16, 17, 18, 19, 20, 21, 22): 2,
        (25, 26, 27, 28): 0,
        (29, 30, 31, 32, 33, 34): 0,  # the blocks of the prefix [23, 24]
    }


def test_a_bucket_holds_its_run_with_less_than_half_as_many_tokens_again():
    for tokens in range(1, 5000):
        length = bucket_length(tokens)
        assert tokens <= length and (length == SHORTEST_BUCKET or 2 * length < 3 * tokens)
    # 16, 24, 32, 48, ..., 768, 1024: few call shapes per layer
    assert len({bucket_length(tokens) for tokens in range(1, 1025)}) == 13


def test_passes_without_a_layout_run_the_mixers_untouched(model):
    batch = grpo_batch([6], [4], [1], seed=5, token_high=40)
    use_segments(None)
    with torch.no_grad():
        plain = stock_logps(model, *batch)[0]
        with segment_recurrence(model, mixers(model)):
            wrapped = stock_logps(model, *batch)[0]
    assert torch.equal(plain, wrapped)
    wrapped_classes = mixers(model)
    assert not any("forward" in vars(m) for m in model.modules() if type(m).__name__ in wrapped_classes)  # gone


#: The families from their defaults' layer patterns that also run by default (the others with ``-m zoo``): a Jamba
#: (four Mamba layers in a row, MoE between them), Qwen3.5's Gated DeltaNet, Mamba (no attention), LFM2 and Mamba-2
#: (the Mamba-2 mixer of Bamba, Falcon-H1, Nemotron-H, Zamba and Zamba2).
DEFAULT_PATTERN_SUBSET = ("jamba", "qwen3_5_text", "mamba", "lfm2", "mamba2")

#: The rows of the training passes from the defaults' layer patterns: (sharing, prompt lengths, prefix structure of
#: :func:`~hf_dynbsz.testing.prefix_batch`). Prompt groups only; or a prefix tree over prompts of equal or of different
#: lengths that begin with a block shared across groups (then a prompt's completions share a trunk of 2 tokens, and
#: pairs of them one more token), or that share nothing beyond their group (pairs of a prompt's completions begin with
#: the same token): both make inner nodes of one token below a root, which a Mamba-2 mixer ran through its decoding
#: path from its parent's state, updating it in place (the backward raised; under checkpointing gradients were off).
ROWS = {
    "groups": ("groups", PROMPTS, None),
    "tree-across-equal": ("tree", [5, 5, 5], dict(shared=7, trunk=2, branches=2, branch=1)),
    "tree-across-varied": ("tree", [5, 2, 9], dict(shared=7, trunk=2, branches=2, branch=1)),
    "tree-within-equal": ("tree", [5, 5, 5], dict(branches=2, branch=1)),
    "tree-within-varied": ("tree", [5, 2, 9], dict(branches=2, branch=1)),
}
#: The passes of each family: (rows of :data:`ROWS`, gradient checkpointing), each structure of a tree's rows once,
#: with and without checkpointing (the backward raised without it; with it, gradients were silently off).
PASSES = (
    ("groups", False),
    ("groups", True),
    ("tree-across-equal", True),
    ("tree-across-varied", False),
    ("tree-within-equal", False),
    ("tree-within-varied", True),
)
#: The passes of :data:`PASSES` the default run takes for :data:`DEFAULT_PATTERN_SUBSET`.
DEFAULT_PASSES = {("groups", False), ("groups", True), ("tree-across-equal", True), ("tree-within-equal", False)}


def _default_pattern_params():
    installed = set(causal_lm_types())
    for family in SEGMENT_RECURRENCE_FAMILIES:
        for rows, checkpointing in PASSES:
            marks = [pytest.mark.zoo]
            if family in DEFAULT_PATTERN_SUBSET and (rows, checkpointing) in DEFAULT_PASSES:
                marks.append(pytest.mark.representative)
            if family not in installed:
                marks.append(pytest.mark.skip(reason=f"{family} is not in the installed transformers"))
            checkpoint = "-checkpointing" if checkpointing else ""
            yield pytest.param(family, rows, checkpointing, marks=marks, id=f"{family}-{rows}{checkpoint}")


def _rows_batch(rows: str):
    """The generation batch of :data:`ROWS`' ``rows``: ``(sharing, batch)``."""
    sharing, prompts, structure = ROWS[rows]
    if structure is None:
        return sharing, grpo_batch(prompts, COMPLETIONS, REPEATS, seed=2, token_high=40)
    return sharing, prefix_batch(prompts, [6, 0, 3, 9, 1, 5, 4, 7, 2, 8, 3, 1], [4, 4, 4], seed=3, **structure)


@pytest.mark.parametrize(("family", "rows", "checkpointing"), list(_default_pattern_params()))
def test_a_training_pass_from_the_defaults_layer_pattern_has_each_samples_own_gradients(family, rows, checkpointing):
    """Each segment-recurrence family built from its config's defaults, reduced in size only (its real layer pattern:
    several recurrent layers in a row, MoE between them where the family has MoE): one training pass of a row with
    shared prompts gives every sample's own log-probs and the gradients of the samples run alone, with and without
    gradient checkpointing (whose recomputation must take the forward's path); and so does a prefix tree's row
    (:data:`ROWS`: prompts of equal and of different lengths, sharing a block across groups or nothing beyond their
    group). A Jamba's blocks started from their prefix's states, which its Mamba scan ignores, and its gradients were
    1e-2 off (its log-probs 5e-7); a Mamba-2 mixer's one-token inner nodes raised in the backward."""
    model = build_tiny_causal_lm_of_type(family, seed=1, layer_pattern="default")
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # dropout is off; checkpointing runs in training mode only
    sharing, batch = _rows_batch(rows)
    layout = ModelSupport.of(model=model).layouts(share_prompt_prefix=sharing)[0][0]
    assert layout.sharing == sharing and layout.segment_recurrence
    table = SequenceTable.from_padded(*batch)
    completions = table.completion_lengths.tolist()
    run_layout, run_alone = bare_check_passes(model, table)
    every = list(range(len(table)))
    alone_probes = [run_alone(sample) for sample in every]
    run_layout(layout, every, False)  # as in a run: the mixers decide on prefix states without gradients
    hands_on = family not in RECOMPUTES_PREFIXES
    for module in model.modules():
        if type(module).__name__ in mixers(model):
            assert (prefix_states(module), chained_states(module)) == (hands_on, hands_on), type(module).__name__
    probe = run_layout(layout, every, True)
    for row, sample in enumerate(every):
        if completions[sample]:
            assert (probe.logps[row, : completions[sample]] - alone_probes[sample].logps[0]).abs().max() <= TOLERANCE
    expected = {name: sum(p.gradients[name] for p in alone_probes) for name in probe.gradients}
    error, name = gradient_error(probe.gradients, expected)
    assert error <= 1e-5, (error, name)
    assert sharing == "groups" or one_token_inner_nodes(gradient_table(table)), "the tree row has no one-token fork"


def one_token_inner_nodes(table) -> int:
    """How many inner nodes of one token below a root the prefix tree's row of all of ``table``'s samples holds."""
    mb = build_microbatch(table, list(range(len(table))), layout="padding_free", pad_token_id=0, attention="sdpa",
                          keys=table.prefix_keys("tree"))  # fmt: skip
    return sum(1 for part in mb.segments.parts() if part.children and part.parent >= 0 and len(part.own) == 1)


def test_an_inner_node_of_one_token_below_a_root_runs_in_front_of_its_children():
    """A mixer run on one token from a state takes its decoding path, which updates the state in place (Mamba-2's):
    no run from a state is one token long. Such a node's token runs in front of each child's own tokens, from its
    parent's states, the first child keeping its output; every position is kept once."""
    nodes = [
        (0, 4, -1),  # 0: a root of 4 tokens
        (4, 1, 0),  # 1: one token below it, with children 2 and 3 (leaves)
        (5, 3, 1),
        (8, 2, 1),
        (10, 1, 0),  # 4: one token, whose only child 5 is one token too, with leaves 6 and 7
        (11, 1, 4),
        (12, 2, 5),
        (14, 1, 5),
        (15, 1, -1),  # 8: a root of one token (from a zero state: runs alone), with leaves 9 and 10
        (16, 2, 8),
        (18, 3, 8),
    ]
    layout = SegmentLayout(node_tree(nodes), "sdpa")
    runs = continuation_runs(layout)
    assert runs == {
        0: ([0, 1, 2, 3], 0, -1),
        2: ([4, 5, 6, 7], 0, 0),  # node 1's token in front, kept here
        3: ([4, 8, 9], 1, 0),
        5: ([10, 11], 0, 0),  # node 4's token in front: two tokens, an inner node that runs
        6: ([12, 13], 0, 5),
        7: ([14], 0, 5),
        8: ([15], 0, -1),
        9: ([16, 17], 0, 8),
        10: ([18, 19, 20], 0, 8),
    }
    levels, calls, positions = continuation_calls(layout, "cpu")
    assert sorted(positions.tolist()) == list(range(layout.width))
    for call in [call for level in levels for call in level] + calls:
        assert call.state_rows is None or call.gather.shape[1] > 1
    assert [[call.gather.tolist() for call in level] for level in levels] == [[[[15]], [[0, 1, 2, 3]]], [[[10, 11]]]]


@pytest.mark.parametrize(("family", "continues"), [("mamba", False), ("qwen3_5_text", True)])
@pytest.mark.parametrize("precision", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_whether_blocks_start_from_prefix_states_is_decided_in_fp32_whatever_the_precision(
    family, continues, precision
):
    """Mamba's torch scan ignores the recurrent state its cache hands it: its prefixes must be recomputed. Under bf16
    autocast the difference hid in bf16's rounding and Mamba's blocks started from their prefix's states (gradients
    0.37 off); the decision runs the mixer in fp32 whatever the run's precision. Qwen3.5's Gated DeltaNet takes the
    states, in both."""
    model = build_tiny_causal_lm_of_type(family, seed=1, layer_pattern="default")
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    batch = grpo_batch(PROMPTS, COMPLETIONS, REPEATS, seed=2, token_high=40)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision != torch.float32):
        packed(model, batch, list(range(len(COMPLETIONS))), shared=True)
    decided = {prefix_states(m) for m in model.modules() if type(m).__name__ in mixers(model)}
    assert decided == {continues}

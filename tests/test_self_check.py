"""Specification of hf_dynbsz.execution.self_check: the layouts a run may use are checked against each sample alone at
start, and a layout that differs (or fails) is left for the next, on every process alike."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head

from hf_dynbsz.execution.check_passes import Probe, checked_parameters, gradient_table
from hf_dynbsz.execution.packing import SequenceTable
from hf_dynbsz.execution.self_check import (
    FAILED,
    OUT_OF_MEMORY,
    PASSED,
    compute_dtype,
    gradient_error,
    gradient_samples,
    gradient_tolerance,
    pick_samples,
    run_self_check,
    tolerance,
    tree_probe,
    tree_samples,
)
from hf_dynbsz.planning.model_support import Layout
from hf_dynbsz.planning.settings import SharePrefix
from hf_dynbsz.testing import (
    bare_check_passes,
    build_char_tokenizer,
    build_tiny_causal_lm,
    build_tiny_hybrid_lm,
    grpo_batch,
    prefix_batch,
)

TREE = Layout("padding_free", SharePrefix.TREE, "sdpa", attention="varlen")
SHARED = Layout("padding_free", SharePrefix.GROUPS, "sdpa", attention="varlen")
PLAIN = Layout("padding_free", segment_attention="sdpa", attention="varlen")
PADDED = Layout("padded")
MASKED = Layout("padded", attention_mask=True)


def table_of(prompt_lengths, completion_lengths, repeats, seed=0):
    return SequenceTable.from_padded(*grpo_batch(prompt_lengths, completion_lengths, repeats, seed=seed))


def runners(model, table, gradients=True):
    """The trainer's two callables, for a bare model: a pass in a layout, and one sample alone."""
    return bare_check_passes(model, table, gradients)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def with_fused_head(model):
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model.eval()


def test_the_samples_checked_hold_siblings_and_different_lengths():
    table = table_of([5, 1, 8], [3, 9, 1, 12, 4, 6], [3, 1, 2])
    chosen = pick_samples(table)
    assert len(chosen) == 4
    groups = table.prompt_groups()
    distinct = sorted(set(chosen))
    assert any(groups[i] == groups[j] for i in distinct for j in distinct if i < j)  # shared prompts exercised
    assert len({int(table.lengths[i]) for i in distinct}) >= 3  # padded rows get padding
    assert pick_samples(table_of([4], [2], [1])) == [0, 0, 0, 0]  # the same forwards on a process with one sample


def test_the_gradients_compared_are_the_siblings_and_the_shortest_other_sample():
    """Completions 3, 9 and 1 share a prompt of 5 tokens: the siblings checked are the shortest with at least 4 tokens
    (1: 9 tokens), then the shortest (2: 1 token). The longest other sample (5, 14 tokens) has its log-probs checked,
    and the shortest other (0, 3 completion tokens) its gradients too."""
    table = table_of([5, 1, 8], [3, 9, 1, 12, 4, 6], [3, 1, 2])
    distinct = sorted(set(pick_samples(table)))
    assert distinct == [0, 1, 2, 5]
    assert gradient_samples(table, distinct) == [0, 1, 2]


def test_the_gradient_passes_keep_each_completions_first_tokens_and_the_whole_prompt():
    """The passes with gradients run each sample's prompt and its first GRADIENT_COMPLETION completion tokens (here
    3): a block of a few tokens already takes its prefix's state or keys; token fields and positions are cut alike."""
    table = table_of([5, 1, 8], [3, 9, 1, 12, 4, 6], [3, 1, 2])
    table.token_fields = {"mm_token_type_ids": [torch.arange(len(tokens)) for tokens in table.tokens]}
    table.positions = [torch.arange(len(tokens)).expand(3, -1) for tokens in table.tokens]
    cut = gradient_table(table, 3)
    assert cut.prompt_lengths.tolist() == [5, 5, 5, 1, 8, 8]
    assert cut.completion_lengths.tolist() == [3, 3, 1, 3, 3, 3]
    assert cut.prompt_groups() == table.prompt_groups()
    for i, tokens in enumerate(cut.tokens):
        assert torch.equal(tokens, table.tokens[i][: len(tokens)]) and len(tokens) == int(cut.lengths[i])
        assert torch.equal(cut.token_fields["mm_token_type_ids"][i], torch.arange(len(tokens)))
        assert torch.equal(cut.positions[i], torch.arange(len(tokens)).expand(3, -1))


def counting(run_layout):
    """``run_layout`` that records the layouts it ran."""
    ran = []

    def run(layout, indices, gradients):
        ran.append((layout, gradients))
        return run_layout(layout, indices, gradients)

    return run, ran


def test_a_model_the_layouts_suit_keeps_the_fastest_and_runs_no_other(tokenizer):
    model = with_fused_head(build_tiny_causal_lm(tokenizer, hidden_size=32))
    table = table_of([6, 3, 9], [4, 11, 2, 7, 1, 5], [3, 1, 2])
    run_layout, run_alone = runners(model, table)
    run_layout, ran = counting(run_layout)
    with torch.no_grad():
        result = run_self_check([SHARED, PLAIN, PADDED, MASKED], table, run_layout, run_alone, limit=1e-4)
    assert result.chosen == 0 and result.reasons == [] and result.errors[0] < 1e-5
    assert ran == [(SHARED, False), (SHARED, True)] and len(result.errors) == 1  # the slower layouts cost nothing


@pytest.mark.parametrize("layout", [SHARED, PLAIN, PADDED, MASKED], ids=lambda layout: layout.describe())
def test_each_layout_equals_the_samples_alone(tokenizer, layout):
    model = with_fused_head(build_tiny_causal_lm(tokenizer, hidden_size=32))
    table = table_of([6, 3, 9], [4, 11, 2, 7, 1, 5], [3, 1, 2])
    with torch.no_grad():
        result = run_self_check([layout], table, *runners(model, table), limit=1e-4)
    assert result.chosen == 0 and result.errors[0] < 1e-5


def tree_table():
    """Samples beyond prompt groups: a 6-token block every prompt begins with, completions sharing a 3-token trunk."""
    batch = prefix_batch([5, 2, 9], [4, 11, 2, 7, 1, 5], [3, 1, 2], shared=6, trunk=3)
    return SequenceTable.from_padded(*batch)


def test_the_samples_checked_share_prefixes_across_prompts_and_completions(tokenizer):
    """The check's rows exercise what a prefix tree shares: the picked samples (siblings and others) hold nodes
    two levels under a root, and its gradient passes (completions cut to their first tokens) keep a shared trunk."""
    model = with_fused_head(build_tiny_causal_lm(tokenizer, hidden_size=32))
    table = tree_table()
    distinct = sorted(set(pick_samples(table)))
    paths = table.prefix_tree("tree").paths()
    assert max(len(paths[i]) for i in distinct) >= 3 and len({paths[i][0] for i in distinct}) == 1
    run_layout, ran = counting(runners(model, table)[0])
    with torch.no_grad():
        result = run_self_check([TREE, SHARED], table, run_layout, runners(model, table)[1], limit=1e-4)
    assert result.chosen == 0 and result.errors[0] < 1e-5 and result.gradient_errors[0] < 1e-5
    assert ran == [(TREE, False), (TREE, True)]  # log-probs and gradients, on the tree's rows


def test_a_prefix_tree_that_differs_steps_down_to_prompt_groups(tokenizer, monkeypatch):
    """Nodes that see their parent's keys and not their grandparent's: a shared prompt's row (one level) is right, a
    tree's row (a block shared across prompts, then each prompt, then its completions) is not. The check leaves the
    tree with its reason and keeps prompt groups."""
    from hf_dynbsz.execution.attention.layout import SegmentLayout

    build = SegmentLayout._build_parts

    def parent_only(layout):
        return [part._replace(path=part.path[-1:]) for part in build(layout)]

    monkeypatch.setattr(SegmentLayout, "_build_parts", parent_only)
    model = with_fused_head(build_tiny_causal_lm(tokenizer, hidden_size=32))
    table = tree_table()
    with torch.no_grad():
        result = run_self_check([TREE, SHARED, PLAIN], table, *runners(model, table), limit=1e-4)
    assert result.chosen == 1 and result.errors[0] > 1e-3 and result.errors[1] < 1e-5
    assert result.reasons[0].startswith("padding_free, prefix tree, segment attention (sdpa): log-probs differ")


def shared_positions(a, b) -> int:
    """Positions two samples compute once between them, from their tokens: a position is its sample's tokens up to
    and including the next one (-1 after the last), so they share position i when they agree on tokens 0..i+1."""
    a, b = [*a, -1], [*b, -1]
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return max(n - 1, 0)


def three_levels(table, samples) -> bool:
    """Whether three samples make a prefix tree of three levels, from their tokens: two of them share more positions
    than either shares with the third, which shares at least one with both, and the two part (each has a position of
    its own)."""
    tokens = [table.tokens[i].tolist() for i in samples]
    for pair, third in (((0, 1), 2), ((0, 2), 1), ((1, 2), 0)):
        a, b, c = tokens[pair[0]], tokens[pair[1]], tokens[third]
        trunk, root = shared_positions(a, b), shared_positions(a, c)
        if trunk > root >= 1 and shared_positions(b, c) == root and trunk < min(len(a), len(b)):
            return True
    return False


def test_a_prefix_tree_is_probed_on_three_levels_of_the_steps_own_samples():
    """A block every prompt begins with, then each prompt, then its completions' trunk: the tree's check picks two
    completions of one prompt and a sample of another prompt, and the probe table is the step's own."""
    table = tree_table()
    picked = tree_samples(table)
    assert picked is not None and three_levels(table, picked)
    assert set(picked) <= set(pick_samples(table, tree=True)) and len(pick_samples(table, tree=True)) == 4
    assert tree_probe(table, [TREE, SHARED]) == (table, "")


def test_without_three_levels_in_the_step_the_tree_is_probed_on_cut_copies_of_a_sample(tokenizer, monkeypatch):
    """Prompt groups and completions that part at once (the step of a run without shared blocks or trunks): the
    probe adds two copies of the shortest sample of 3 completion tokens or more, cut inside its completion, so that
    the tree's check runs three levels. The bug of a node that sees its parent's keys but not its grandparent's,
    invisible on shared prompts alone, is caught there."""
    table = table_of([6, 3, 9], [4, 11, 2, 7, 1, 5], [3, 1, 2])
    assert tree_samples(table) is None  # shared prompts only: two levels
    probe, note = tree_probe(table, [TREE, SHARED])
    assert "probed on two copies of one of them cut short" in note
    assert len(probe) == len(table) + 2 and probe.completion_lengths.tolist()[-2:] == [1, 2]  # sample 0's 4, cut
    for copy in (6, 7):
        assert probe.tokens[copy].tolist() == table.tokens[0].tolist()[: int(probe.lengths[copy])]
    picked = sorted(set(pick_samples(probe, tree=True)))
    assert {0, 6, 7} <= set(picked) and three_levels(probe, [0, 6, 7])
    assert three_levels(gradient_table(probe), [0, 6, 7])  # the gradient passes keep the three levels
    assert tree_probe(table, [SHARED, PLAIN]) == (table, "")  # no tree to check: the step's samples as they are
    model = with_fused_head(build_tiny_causal_lm(tokenizer, hidden_size=32))
    with torch.no_grad():
        result = run_self_check([TREE, SHARED], probe, *runners(model, probe), limit=1e-4)
    assert result.chosen == 0 and result.gradient_errors[0] < 1e-5
    from hf_dynbsz.execution.attention.layout import SegmentLayout

    build = SegmentLayout._build_parts
    monkeypatch.setattr(SegmentLayout, "_build_parts", lambda layout: [
        part._replace(path=part.path[-1:]) for part in build(layout)])  # fmt: skip
    for checked, caught in ((table, False), (probe, True)):
        with torch.no_grad():
            result = run_self_check([TREE, SHARED], checked, *runners(model, checked), limit=1e-4)
        assert (result.chosen == 1) == caught, result


def test_a_run_whose_first_step_shares_only_prompts_still_checks_the_tree_and_leaves_it_when_wrong(
    tmp_path, monkeypatch
):
    """The trainer's self-check on a first step of prompt groups whose completions part at once (no tree beyond them):
    the probe's cut copies make the tree three levels deep, and a tree whose nodes miss their grandparent's keys (right
    for shared prompts, wrong deeper) is left for prompt groups at start, with the probe named in the log."""
    from hf_dynbsz import DynamicBatchGRPOConfig
    from hf_dynbsz.execution.attention.layout import SegmentLayout
    from hf_dynbsz.testing import RecordingReward, ScriptedRollout, base_config_kwargs, build_trainer, prompt_dataset

    build = SegmentLayout._build_parts
    monkeypatch.setattr(SegmentLayout, "_build_parts", lambda layout: [
        part._replace(path=part.path[-1:]) for part in build(layout)])  # fmt: skip
    tokenizer = build_char_tokenizer()
    args = DynamicBatchGRPOConfig(**base_config_kwargs(str(tmp_path), max_steps=1, share_prompt_prefix="tree"))
    lengths, prompt_length = (lambda rng, n, rank: rng.integers(4, 12, n)), (lambda rng: rng.integers(3, 12))
    scripted = ScriptedRollout(lengths, prompt_length, max_completion_length=16, seed=0, token_high=40)

    def rollout(prompts, trainer):  # a prompt's completions begin with tokens of their own: they part at once
        out = scripted(prompts, trainer)
        for k, ids in enumerate(out["completion_ids"]):
            ids[0] = 3 + k
        return out

    model = build_tiny_causal_lm(tokenizer)
    trainer = build_trainer(args, model, tokenizer, dataset=prompt_dataset(), reward=RecordingReward(), rollout=rollout)
    trainer.train()
    executor = trainer._dynbsz
    assert executor.enabled and executor.scheduler.sharing is SharePrefix.GROUPS, executor.self_check_summary
    assert "padding_free, prefix tree, segment attention (sdpa): log-probs differ" in executor.self_check_summary
    assert "the prefix tree was probed on two copies of one of them cut short" in executor.self_check_summary


def test_a_step_that_cannot_make_three_levels_says_the_tree_was_not_probed():
    table = table_of([6, 3], [2, 1, 2, 0], [2, 2])  # completions of 2 tokens at most: no cut copy parts from another
    probe, note = tree_probe(table, [TREE, SHARED])
    assert probe is table and note.startswith(" The prefix tree was not probed")


def test_a_layout_that_mixes_sequences_is_left_with_its_reason(tokenizer):
    """A linear-attention layer carries state from one sequence of a padding-free row into the next: the decision
    module rules that out from the config, and the self-check finds it on the samples when asked to try."""
    model = with_fused_head(build_tiny_hybrid_lm(tokenizer))
    table = table_of([6, 3, 9], [4, 11, 2, 7, 1, 5], [3, 1, 2])
    with torch.no_grad():
        result = run_self_check(
            [Layout("padding_free", attention="dense"), PADDED, MASKED], table, *runners(model, table), limit=1e-4
        )
    assert result.chosen == 1
    assert result.errors[0] > 5e-4 and result.errors[1] < 1e-5  # the state leak is small on a tiny model
    assert "padding_free: log-probs differ from each sample's own by" in result.reasons[0]


def test_a_layout_whose_pass_raises_is_left_not_raised(tokenizer):
    model = with_fused_head(build_tiny_causal_lm(tokenizer, hidden_size=32))
    table = table_of([6, 3], [4, 11, 2, 7], [2, 2])
    run_layout, run_alone = runners(model, table)

    def failing_first(layout, indices, gradients):
        if layout is SHARED:
            raise RuntimeError("the attention got an attention mask\nsecond line")
        return run_layout(layout, indices, gradients)

    with torch.no_grad():
        result = run_self_check([SHARED, PADDED], table, failing_first, run_alone, limit=1e-4)
    assert result.chosen == 1 and math.isinf(result.errors[0])
    assert result.reasons == [
        "padding_free, shared prompts, segment attention (sdpa): RuntimeError: the attention got an attention mask"
    ]


def test_a_pass_out_of_memory_stops_the_check_on_every_process_with_no_verdict(tokenizer):
    """A sample alone running out of memory (raised inside the model) leaves no layout judged: this process votes
    out-of-memory at the first layout without running it, and the result says so; another process's out-of-memory
    vote stops this one at the layout it is on. Any other error of a sample alone is raised."""
    model = with_fused_head(build_tiny_causal_lm(tokenizer, hidden_size=32))
    table = table_of([6, 3], [4, 11, 2, 7], [2, 2])
    run_layout, run_alone = runners(model, table)
    run_layout, ran = counting(run_layout)
    votes = []

    def alone_out_of_memory(index, gradients):
        if gradients:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        return run_alone(index, gradients)

    def agree(vote):
        votes.append(vote)
        return vote

    with torch.no_grad():
        result = run_self_check([SHARED, PADDED], table, run_layout, alone_out_of_memory, 1e-4, agree)
    assert votes == [OUT_OF_MEMORY] and ran == [] and result.chosen == 2
    assert result.out_of_memory == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    with torch.no_grad():
        result = run_self_check(
            [SHARED, PADDED], table, run_layout, run_alone, 1e-4, agree=lambda vote: max(vote, OUT_OF_MEMORY)
        )
    assert result.chosen == 2 and result.out_of_memory == "a pass of another process's self-check ran out of memory"
    assert [layout for layout, gradients in ran] == [SHARED, SHARED]  # it ran the first layout only

    def alone_broken(index, gradients):
        raise ValueError("not a memory error")

    with pytest.raises(ValueError, match="not a memory error"), torch.no_grad():
        run_self_check([SHARED], table, run_layout, alone_broken, 1e-4)


def test_every_process_takes_the_first_layout_every_process_passed(tokenizer):
    model = with_fused_head(build_tiny_causal_lm(tokenizer, hidden_size=32))
    table = table_of([6, 3], [4, 11, 2, 7], [2, 2])
    run_layout, run_alone = runners(model, table)
    run_layout, ran = counting(run_layout)
    passed_here = []

    def another_process_needs_padded_rows(vote):  # the all-reduce: the other process fails the first two
        passed_here.append(vote == PASSED)
        return PASSED if vote == PASSED and len(passed_here) > 2 else FAILED

    with torch.no_grad():
        result = run_self_check(
            [SHARED, PLAIN, PADDED, MASKED], table, run_layout, run_alone, limit=1e-4,
            agree=another_process_needs_padded_rows,
        )  # fmt: skip
    assert passed_here == [True, True, True]  # one all-reduce per layout tried
    assert [layout for layout, gradients in ran if not gradients] == [SHARED, PLAIN, PADDED]
    assert result.chosen == 2
    assert result.reasons[0] == f"{SHARED.describe()}: another process found it inexact"


def test_a_layout_is_kept_only_when_this_process_passed_it_too(tokenizer):
    """Another process fails the first layout and passes the second; this one fails the second: neither is kept,
    though each passed a layout the other did not."""
    model = with_fused_head(build_tiny_causal_lm(tokenizer, hidden_size=32))
    table = table_of([6, 3], [4, 11, 2, 7], [2, 2])
    run_layout, run_alone = runners(model, table)

    def plain_rows_wrong_here(layout, indices, gradients):
        probe = run_layout(layout, indices, gradients)
        return Probe(probe.logps + 1.0, probe.gradients) if layout is PLAIN else probe

    tried = iter([SHARED, PLAIN, PADDED])

    def agree(vote):  # the all-reduce, with the other process passing the plain and padded rows only
        return max(vote, PASSED if next(tried) in (PLAIN, PADDED) else FAILED)

    with torch.no_grad():
        result = run_self_check([SHARED, PLAIN, PADDED], table, plain_rows_wrong_here, run_alone, 1e-4, agree)
    assert result.chosen == 2 and len(result.reasons) == 2
    assert "log-probs differ from each sample's own by 1.00e+00" in result.reasons[1]


def test_none_within_tolerance_means_stock_math(tokenizer):
    model = with_fused_head(build_tiny_causal_lm(tokenizer, hidden_size=32))
    table = table_of([6, 3], [4, 11, 2, 7], [2, 2])
    with torch.no_grad():
        result = run_self_check([PADDED], table, *runners(model, table), limit=-1.0)
    assert result.chosen == 1 and len(result.reasons) == 1


def test_a_layout_whose_gradients_differ_is_left_naming_the_parameter(tokenizer):
    """Log-probs equal each sample's own, gradients not (a backward that loses a path): the layout is left as one
    whose log-probs differ, and the reason names the parameter whose gradients differ most."""
    model = with_fused_head(build_tiny_causal_lm(tokenizer, hidden_size=32))
    table = table_of([6, 3, 9], [4, 11, 2, 7, 1, 5], [3, 1, 2])
    run_layout, run_alone = runners(model, table)
    name = "model.layers.0.mlp.up_proj.weight"

    def backward_loses_half(layout, indices, gradients):
        probe = run_layout(layout, indices, gradients)
        if layout is not SHARED or not gradients:
            return probe
        return Probe(probe.logps, {**probe.gradients, name: probe.gradients[name] * 0.5})

    with torch.no_grad():
        result = run_self_check(
            [SHARED, PADDED], table, backward_loses_half, run_alone, limit=1e-4, gradient_limit=1e-3
        )
    assert result.chosen == 1 and math.isinf(result.errors[0])
    assert result.reasons[0].startswith(f"{SHARED.describe()}: gradients differ from each sample's own by 5.00e-01")
    assert result.reasons[0].endswith(f"at {name} (tolerance 0.001)")
    assert result.gradient_errors[1] < 1e-6  # the padded rows' gradients equal each sample's own


def test_the_gradients_checked_cover_every_kind_of_parameter_in_its_first_and_last_layer():
    """Jamba from its defaults: four Mamba layers, MoE on layers 1 and 3, attention on layer 4. Every kind of
    parameter is checked (mixers, their A_log, attention, MLP, experts, router, norms, embeddings, head), each in the
    first and the last layer that has it, and no layer in between."""
    import re

    from hf_dynbsz.testing.zoo import build_tiny_causal_lm_of_type

    model = build_tiny_causal_lm_of_type("jamba", layer_pattern="default")
    names = [name for name, _ in model.named_parameters()]
    checked = [name for name, _ in checked_parameters(model)]
    kinds = {re.sub(r"\.\d+\.", ".*.", name) for name in names}
    assert {re.sub(r"\.\d+\.", ".*.", name) for name in checked} == kinds
    assert {"model.layers.0.mamba.A_log", "model.layers.3.mamba.A_log"} <= set(checked)
    assert "model.layers.2.mamba.A_log" not in checked  # between the first and the last Mamba layer
    assert {"model.layers.1.feed_forward.router.weight", "model.layers.3.feed_forward.router.weight"} <= set(checked)
    assert "model.layers.4.self_attn.q_proj.weight" in checked and "lm_head.weight" in checked


def test_the_gradient_error_is_a_parameters_own_relative_difference_with_a_floor():
    reference = {"large": torch.full((4,), 10.0), "small": torch.full((4,), 1e-6), "unused": torch.zeros(3)}
    same = {name: g.clone() for name, g in reference.items()}
    assert gradient_error(same, reference) == (0.0, "large")
    off = {**same, "large": reference["large"] * 1.1}
    error, name = gradient_error(off, reference)
    assert name == "large" and error == pytest.approx(0.1)
    # a parameter that hardly learns is measured against 1e-3 of the largest norm (20), not against its own (2e-6)
    noisy = {**same, "small": reference["small"] * 2}
    assert gradient_error(noisy, reference)[0] == pytest.approx(2e-6 / 2e-2)
    assert gradient_error({**same, "unused": torch.full((3,), float("nan"))}, reference) == (math.inf, "unused")


def test_a_detached_prefix_state_is_caught_at_start(tmp_path, monkeypatch, caplog):
    """Qwen3.5's Gated DeltaNet starts each block from its prefix's final states. Detached, those states give the
    same forward (the log-probs agree) and lose the blocks' gradients through the prefix: the self-check's gradients
    refuse the layout, the run trains the next (padding-free rows without shared prompts) and equals stock. The
    control: with gradients not compared, the same run keeps the layout and leaves stock."""
    from hf_dynbsz.execution import recurrence, self_check

    def detached_bank(states, kernel):
        return {index: bank.detach() for index, bank in bank_of(states, kernel).items()}

    bank_of = recurrence._bank
    monkeypatch.setattr(recurrence, "_bank", detached_bank)
    stock = _train_hybrid(tmp_path / "stock", stock=True)
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        checked = _train_hybrid(tmp_path / "checked")
    scheduler = checked._dynbsz.scheduler
    assert scheduler.layout == "padding_free" and not scheduler.sharing and scheduler.segment_recurrence
    assert "gradients differ from each sample's own" in caplog.text and "linear_attn" in caplog.text
    assert _difference(checked, stock) <= 1e-5
    monkeypatch.setattr(self_check, "gradient_tolerance", lambda dtype: math.inf)
    unchecked = _train_hybrid(tmp_path / "unchecked")
    assert unchecked._dynbsz.scheduler.sharing  # the forward alone cannot tell
    assert _difference(unchecked, stock) > 1e-4


def _train_hybrid(directory, stock=False):
    """Two steps of a tiny Qwen3.5 (Gated DeltaNet and attention layers) on prompts of equal length, each prompt with
    several completions."""
    from trl import GRPOConfig

    from hf_dynbsz import DynamicBatchGRPOConfig
    from hf_dynbsz.testing import RecordingReward, ScriptedRollout, base_config_kwargs, build_trainer, prompt_dataset
    from hf_dynbsz.testing.zoo import build_tiny_causal_lm_of_type

    config_cls = GRPOConfig if stock else DynamicBatchGRPOConfig
    args = config_cls(**base_config_kwargs(str(directory), router_aux_loss_coef=0.0))
    model = build_tiny_causal_lm_of_type("qwen3_5_text", seed=0, layer_pattern="default")
    lengths = lambda rng, n, rank: rng.integers(4, 16, n)  # noqa: E731
    rollout = ScriptedRollout(lengths, lambda rng: 8, max_completion_length=24, seed=0, token_high=60)
    reward = RecordingReward()
    trainer = build_trainer(
        args, model, build_char_tokenizer(), dataset=prompt_dataset(), reward=reward, rollout=rollout
    )
    trainer.train()
    return trainer


def _difference(trainer, other) -> float:
    from hf_dynbsz.testing import relative_difference

    return relative_difference(dict(trainer.model.named_parameters()), dict(other.model.named_parameters()))


@pytest.mark.parametrize("model_type", ["mistral", "deepseek_v3"])  # a sliding window; narrower value heads
def test_flex_attentions_padding_free_rows_pass_the_check(model_type, monkeypatch):
    """flex_attention's layouts are checked like the others: its padding-free rows with shared prompts (one flex
    call per layer) equal each sample alone, so the run keeps them."""
    from hf_dynbsz.testing.zoo import build_tiny_causal_lm_of_type

    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # flex uncompiled: a CPU compile of each kernel takes about 26 s
    model = with_fused_head(build_tiny_causal_lm_of_type(model_type, attn_implementation="flex_attention"))
    flex_shared = Layout("padding_free", SharePrefix.GROUPS, "flex_attention", attention="varlen")
    table = SequenceTable.from_padded(*grpo_batch([6, 3, 9], [4, 11, 2, 7, 1, 5], [3, 1, 2], token_high=60))
    with torch.no_grad():  # log-probs only: flex_attention has no backward on CPU (the GPU check trains it)
        result = run_self_check([flex_shared, PADDED, MASKED], table, *runners(model, table, False), limit=1e-4)
    assert result.chosen == 0 and result.reasons == [] and result.errors[0] < 1e-5


def test_tolerance_follows_the_precision():
    assert tolerance(torch.float32) == 1e-4 and tolerance(torch.bfloat16) == tolerance(torch.float16) == 5e-2


def test_the_trainer_checks_once_and_logs_a_step_down(tmp_path, caplog):
    """End to end, on a linear-attention model whose layout list is made to start with padding-free rows (as if the
    decision module had missed its recurrent layers): the check finds them inexact, the run trains the next layout
    (padding-free rows through segment recurrence) with one warning and equals stock; with self_check=False the
    layout is used as given."""
    from trl import GRPOConfig, GRPOTrainer

    from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
    from hf_dynbsz.planning.schedule import Scheduler
    from hf_dynbsz.testing import (
        RecordingReward,
        ScriptedRollout,
        base_config_kwargs,
        build_trainer,
        prompt_dataset,
        relative_difference,
    )

    def train(trainer_cls, config_cls, **settings):
        lengths, prompt_length = (lambda rng, n, rank: rng.geometric(0.1, n)), (lambda rng: rng.integers(3, 12))
        rollout = ScriptedRollout(lengths, prompt_length, max_completion_length=24, seed=0, token_high=40)
        model = build_tiny_hybrid_lm(build_char_tokenizer())
        args = config_cls(
            **base_config_kwargs(str(tmp_path / str(len(settings))), router_aux_loss_coef=0.0, **settings)
        )
        dataset, reward = prompt_dataset(), RecordingReward()
        trainer = build_trainer(
            args,
            model,
            build_char_tokenizer(),
            dataset=dataset,
            reward=reward,
            rollout=rollout,
            trainer_cls=trainer_cls,
        )
        if trainer_cls is DynamicBatchGRPOTrainer:
            capabilities = trainer._dynbsz.capabilities
            mixing = Layout("padding_free", attention="dense")  # the linear attention's state crosses sequences
            capabilities.layouts.insert(0, mixing)
            trainer._dynbsz.scheduler = Scheduler.from_args(args, capabilities.support, layout=mixing)
        trainer.train()
        return trainer

    stock = train(GRPOTrainer, GRPOConfig)
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        checked = train(DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig, self_check=True)
    scheduler = checked._dynbsz.scheduler  # the next rung: padding-free rows through segment recurrence
    assert scheduler.layout == "padding_free" and scheduler.segment_recurrence
    assert caplog.text.count("self-check") == 1 and "differ from each sample's own" in caplog.text
    assert checked._dynbsz.self_check_seconds > 0 and "It took" in caplog.text  # its share of the first step
    params = {name: p for name, p in checked.model.named_parameters()}
    assert relative_difference(params, dict(stock.model.named_parameters())) <= 1e-5
    unchecked = train(DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig, self_check=False, seed=0)
    scheduler = unchecked._dynbsz.scheduler
    assert scheduler.layout == "padding_free" and not scheduler.segment_recurrence  # trusted, not checked: not stock's
    params = {name: p for name, p in unchecked.model.named_parameters()}
    assert relative_difference(params, dict(stock.model.named_parameters())) > 1e-5


def test_under_bf16_mixed_precision_the_check_uses_bf16s_tolerances(tmp_path):
    """accelerate runs a prepared model's forward under autocast whatever the caller's context, so fp32 weights trained
    in bf16 mixed precision compute the check's log-probs and gradients in bf16: a fp32 tolerance turned that noise
    into stock math (found on an H200: 8e-3 on every layout, against 1e-4). How far bf16 rounds depends on the CPU's
    bf16 kernels, so this reads the tolerances the check applied, not the noise it met (see the next test for the
    tolerances' effect)."""
    from hf_dynbsz import DynamicBatchGRPOConfig
    from hf_dynbsz.testing import (
        RecordingReward,
        ScriptedRollout,
        base_config_kwargs,
        build_char_tokenizer,
        build_tiny_causal_lm,
        build_trainer,
        prompt_dataset,
    )

    tokenizer = build_char_tokenizer()
    args = DynamicBatchGRPOConfig(**base_config_kwargs(str(tmp_path), bf16=True, max_steps=1, self_check=True))
    lengths, prompt_length = (lambda rng, n, rank: rng.integers(20, 60, n)), (lambda rng: rng.integers(3, 12))
    rollout = ScriptedRollout(lengths, prompt_length, max_completion_length=64, seed=0, token_high=40)
    model, reward = build_tiny_causal_lm(tokenizer), RecordingReward()
    trainer = build_trainer(args, model, tokenizer, dataset=prompt_dataset(), reward=reward, rollout=rollout)
    executor = trainer._dynbsz
    assert compute_dtype(executor.accelerator, trainer.model) == torch.bfloat16  # fp32 weights, bf16 autocast
    trainer.train()
    summary = executor.self_check_summary
    assert executor.enabled and summary.startswith("self-check passed"), summary
    assert f"of {tolerance(torch.bfloat16):g}, gradients" in summary, summary
    assert f"of {gradient_tolerance(torch.bfloat16):g})." in summary, summary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_difference_between_fp32s_and_bf16s_tolerance_fails_only_in_fp32(tokenizer, dtype):
    """A layout that moves every log-prob by 1e-3 and one parameter's gradients by 3e-2 (relative): beyond fp32's
    tolerances, within bf16's (the noise bf16 autocast gives packing, whatever the CPU)."""
    model = with_fused_head(build_tiny_causal_lm(tokenizer, hidden_size=32))
    table = table_of([6, 3], [4, 11, 2, 7], [2, 2])
    run_layout, run_alone = runners(model, table)

    def moved(layout, indices):
        probe = run_layout(layout, indices)
        gradients = dict(probe.gradients)
        gradients["lm_head.weight"] = gradients["lm_head.weight"] * 1.03
        return Probe(probe.logps + 1e-3, gradients) if layout is SHARED else probe

    for shift in ("logps", "gradients"):

        def one_moved(layout, indices, shift=shift):
            probe, exact = moved(layout, indices), run_layout(layout, indices)
            return Probe(probe.logps, exact.gradients) if shift == "logps" else Probe(exact.logps, probe.gradients)

        with torch.no_grad():
            result = run_self_check(
                [SHARED, PADDED],
                table,
                one_moved,
                run_alone,
                tolerance(dtype),
                gradient_limit=gradient_tolerance(dtype),
            )
        assert result.chosen == (1 if dtype == torch.float32 else 0), (shift, result.reasons)


def test_stock_math_chosen_in_the_first_steps_reference_pass_trains_every_slice_as_stock(
    model_dir, tmp_path, monkeypatch
):
    """With ``beta > 0`` the check runs in the reference pass of an optimizer step's first training call, when that
    call has already begun collecting the step's slices; a check that keeps no layout ends that step on stock's slices
    (before, the step's next call saw stock math and ran stock's ``training_step`` on its own slice alone: the first
    slice was never trained) and the run equals stock."""
    from trl import GRPOConfig, GRPOTrainer

    from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
    from hf_dynbsz.execution import self_check
    from hf_dynbsz.testing import relative_difference, run_training

    monkeypatch.setattr(self_check, "tolerance", lambda dtype: -1.0)  # no layout passes
    settings = dict(beta=0.1, max_steps=2)
    _, stock, stock_completions, _ = run_training(GRPOTrainer, GRPOConfig, model_dir, str(tmp_path / "s"), **settings)
    _, params, completions, _ = run_training(
        DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig, model_dir, str(tmp_path / "o"), **settings
    )
    assert completions == stock_completions
    assert relative_difference(params, stock) <= 1e-5

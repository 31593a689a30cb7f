"""Specification of hf_dynbsz.execution.attention: shared prompts and padding-free rows give stock's log-probs, on
every kernel.

Each padding-free row is built by the packing collator (with prompt groups where prompts are shared) and run
through segment attention; the log-probs, entropies and gradients must equal those of stock TRL's padded forward of
the same samples as separate sequences (fp32), on sdpa and eager, and on the flash-attention formulation with a
reference varlen kernel standing in for the GPU kernel (its index arithmetic is what runs on a GPU).
"""

from __future__ import annotations

import contextlib
import itertools
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl.trainer.utils import add_fused_lm_head

from hf_dynbsz.execution import attention
from hf_dynbsz.execution.attention import (
    ATTENTION_NAME,
    SegmentLayout,
    device_facts,
    segment_attention,
    segment_attention_forward,
    use_segments,
)
from hf_dynbsz.execution.packing import SequenceTable, build_microbatch
from hf_dynbsz.planning.model_support import VARLEN_ATTN
from hf_dynbsz.planning.schedule import row_tokens
from hf_dynbsz.testing import (
    Segment,
    build_char_tokenizer,
    build_tiny_causal_lm,
    grpo_batch,
    node_tree,
    packed_logps,
    prefix_batch,
    reference_varlen_attention,
    reference_varlen_attn,
    row_nodes,
    segment_mask,
    segment_tree,
    stock_logps,
    tree_mask,
)


@pytest.fixture(scope="module", params=["sdpa", "eager", "flex_attention"])
def model(request):
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, attn_implementation=request.param, hidden_size=64, num_hidden_layers=2)
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    with eager_flex_attention():
        yield model


@contextlib.contextmanager
def eager_flex_attention():
    """flex_attention as torch's reference (uncompiled) implementation, stock's and ours alike: transformers compiles
    it, which on a CPU costs a C++ build of each kernel (about 26 s); the GPU check runs it compiled."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHDYNAMO_DISABLE", "1")  # read when transformers first compiles flex_attention
        yield


@pytest.fixture
def flash_formulation(monkeypatch):
    """Segment layouts take the flash-attention path, with the reference varlen kernel instead of the GPU one."""
    calls = []

    def kernel(
        module, layout, query, key, value, cu_q, cu_k, max_q, max_k, scaling, dropout, sliding_window=None, **features
    ):
        calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k))
        assert int(cu_q[-1]) == query.size(0) and int(cu_k[-1]) == key.size(0)
        assert not any(value is not None for value in features.values()), "softcap / sinks: not in the reference"
        return reference_varlen_attention(query, key, value, cu_q, cu_k, scaling, dropout, sliding_window)

    monkeypatch.setattr(attention, "VARLEN_KERNEL", kernel)
    monkeypatch.setattr(SegmentLayout, "flash", property(lambda self: True))
    return calls


# prompts of 9, 4 and 13 tokens (left-padded to 13 in TRL's batch), 4 + 3 + 1 completions; one empty completion
PROMPTS, REPEATS = [9, 4, 13], [4, 3, 1]
COMPLETIONS = [6, 1, 11, 3, 8, 0, 5, 7]


@pytest.mark.parametrize("kernel", ["native", "flash"])
@pytest.mark.parametrize("pad_to_multiple_of", [None, 8])
def test_shared_prompts_give_stocks_logprobs_and_entropies(model, request, kernel, pad_to_multiple_of):
    if kernel == "flash" and model.config._attn_implementation == "flex_attention":
        pytest.skip("the flash formulation replaces the base kernel: its run on sdpa and eager covers it")
    calls = request.getfixturevalue("flash_formulation") if kernel == "flash" else None
    batch = grpo_batch(PROMPTS, COMPLETIONS, REPEATS)
    table = SequenceTable.from_padded(*batch)
    groups = table.prompt_groups()
    assert groups == [0, 0, 0, 0, 1, 1, 1, 2]
    base = model.config._attn_implementation
    with torch.no_grad():
        expected, expected_entropy = stock_logps(model, *batch)
        order = [5, 0, 7, 2, 4, 1, 6, 3]  # groups interleaved: the collator gathers each group's segment
        mb, logps, entropy = packed_logps(model, table, order, groups, base, pad_to_multiple_of)
    for row, sample in enumerate(order):
        n = COMPLETIONS[sample]
        assert torch.allclose(logps[row, :n], expected[sample, :n], atol=2e-6, rtol=0), (row, sample)
        assert torch.allclose(entropy[row, :n], expected_entropy[sample, :n], atol=2e-6, rtol=0)
    if calls is not None:
        assert len(calls) == model.config.num_hidden_layers  # every layer took the varlen formulation
    # each prompt computed once: 8 + 3 (prefixes of the shared prompts) + 13 (the lone sample, a plain sequence)
    real = 8 + sum(COMPLETIONS[:4]) + 4 + 3 + sum(COMPLETIONS[4:7]) + 3 + 13 + COMPLETIONS[7]
    assert (
        mb.real_tokens
        == real
        == row_tokens(order, table.prompt_lengths.tolist(), table.completion_lengths.tolist(), groups)
    )


def test_groups_split_across_passes_and_duplicate_prompts_of_other_groups(model):
    # two dataset rows with the same prompt (ids equal): one group; the group split over two micro-batches
    completion_lengths = (4, 9, 2, 7, 1, 5)
    batch = grpo_batch([11], completion_lengths, [6], seed=3)
    table = SequenceTable.from_padded(*batch)
    assert table.prompt_groups() == [0] * 6
    with torch.no_grad():
        expected, _ = stock_logps(model, *batch)
        for part in ([0, 2, 4], [1, 3, 5]):
            _, logps, _ = packed_logps(model, table, part, table.prompt_groups(), model.config._attn_implementation)
            for row, sample in enumerate(part):
                n = completion_lengths[sample]
                assert torch.allclose(logps[row, :n], expected[sample, :n], atol=2e-6, rtol=0)


def weighted_samples():
    """The gradient tests' samples: stock's padded batch, its table, a loss weight per sample (0.5 to 2)."""
    batch = grpo_batch(PROMPTS, COMPLETIONS, REPEATS, seed=5)
    return batch, SequenceTable.from_padded(*batch), torch.linspace(0.5, 2.0, len(COMPLETIONS)).unsqueeze(1)


def gradients(model, compute) -> dict:
    """The gradients (by parameter name) of the scalar ``compute()`` returns."""
    model.zero_grad()
    compute().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_gradients_equal_those_of_separate_sequences(model):
    if model.config._attn_implementation == "flex_attention":
        pytest.skip("flex_attention has no backward on CPU (torch raises NotImplementedError); the GPU check trains it")
    batch, table, weights = weighted_samples()

    def stock():
        logps, _ = stock_logps(model, *batch)
        return (logps * batch[3] * weights).sum()

    def ours():
        order = list(range(len(COMPLETIONS)))
        _, logps, _ = packed_logps(model, table, order, table.prompt_groups(), model.config._attn_implementation)
        return (logps * weights).sum()

    expected, got = gradients(model, stock), gradients(model, ours)
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=1e-5, rtol=1e-4), name


def test_a_sibling_never_sees_another_siblings_tokens(model):
    batch = grpo_batch([10], [5, 6, 7], [3], seed=7)
    table = SequenceTable.from_padded(*batch)
    base = model.config._attn_implementation
    with torch.no_grad():
        _, before, _ = packed_logps(model, table, [0, 1, 2], table.prompt_groups(), base)
        changed = SequenceTable(
            tokens=[t.clone() for t in table.tokens],
            prompt_lengths=table.prompt_lengths,
            completion_lengths=table.completion_lengths,
        )
        changed.tokens[2][10:] = (changed.tokens[2][10:] + 1) % 37 + 3  # another completion for sibling 2
        _, after, _ = packed_logps(model, changed, [0, 1, 2], changed.prompt_groups(), base)
        assert torch.equal(after[:2], before[:2])  # siblings 0 and 1 are untouched, bit for bit
        assert not torch.allclose(after[2], before[2])
        prompt_changed = SequenceTable(
            tokens=[t.clone() for t in table.tokens],
            prompt_lengths=table.prompt_lengths,
            completion_lengths=table.completion_lengths,
        )
        for tokens in prompt_changed.tokens:
            tokens[2] = (tokens[2] + 1) % 37 + 3  # the shared prompt does reach every sibling
        _, moved, _ = packed_logps(model, prompt_changed, [0, 1, 2], prompt_changed.prompt_groups(), base)
        assert all(not torch.allclose(moved[j], before[j]) for j in range(3))


def test_varlen_spans_of_the_flash_formulation():
    layout = SegmentLayout(
        segment_tree([Segment(0, 3, (2, 4)), Segment(9, 0, (5,)), Segment(14, 0, (2,))]), "flash_attention_2"
    )
    cu_q, cu_k, key_index, max_q, max_k = layout.varlen_spans("cpu")
    # query spans: prefix (3), block (2), block (4), plain (5), trailing padding (2); tiling the row in order
    assert cu_q.tolist() == [0, 3, 5, 9, 14, 16]
    # key spans: prefix, prefix + block 1, prefix + block 2, the plain sequence, the padding
    assert cu_k.tolist() == [0, 3, 8, 15, 20, 22]
    assert key_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, *range(9, 14), 14, 15]
    assert (max_q, max_k) == (5, 7) and cu_q.dtype == torch.int32


def test_segments_must_cover_the_row():
    """The span calls are checked on the host to cover the row once: here the calls of a row whose second node is
    left out of its parts."""
    layout = SegmentLayout(segment_tree([Segment(0, 0, (3,)), Segment(3, 0, (2,))]), "sdpa")
    layout._cache["parts"] = layout.parts()[:1]  # positions 3-4 in no span
    with pytest.raises(ValueError, match="cover the row"):
        layout.span_calls("cpu")


#: What segment attention needs of an attention module (transformers' sdpa reads these).
MODULE = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)


def test_the_attention_function_refuses_a_forward_without_segments_or_with_a_mask():
    query = torch.zeros(1, 2, 3, 4)
    use_segments(None)
    with pytest.raises(RuntimeError, match="padding-free rows of hf_dynbsz only"):
        segment_attention_forward(MODULE, query, query, query, None)
    use_segments(SegmentLayout(segment_tree([Segment(0, 0, (3,))]), "sdpa"))
    try:  # a model that hands its attention a bias of its own (Doge's dynamic mask) cannot be placed on segments
        with pytest.raises(RuntimeError, match="got an attention mask"):
            segment_attention_forward(MODULE, query, query, query, torch.zeros(1, 1, 3, 3))
    finally:
        use_segments(None)


def test_the_context_switches_the_implementation_and_restores_it(model):
    base = model.config._attn_implementation
    with segment_attention(model):
        assert model.config._attn_implementation == ATTENTION_NAME
        use_segments(SegmentLayout(segment_tree([Segment(0, 0, (3,))]), "sdpa"))
    assert model.config._attn_implementation == base
    assert attention._ACTIVE[0] is None  # no layout outlives its passes
    with pytest.raises(KeyError), segment_attention(model):
        raise KeyError("restored even after an error")
    assert model.config._attn_implementation == base


def segment_attention_of(layout, query, key, value, module=MODULE, **kwargs):
    use_segments(layout)
    try:
        return segment_attention_forward(module, query, key, value, None, **kwargs)[0]
    finally:
        use_segments(None)


def dense_reference(segments, query, key, value, scale, window=None):
    """Each segment under its dense mask (segment_mask, and the window over positions in the sequence)."""
    expected = torch.zeros(1, query.size(2), query.size(1), value.size(3))
    for segment in segments:
        span = slice(segment.start, segment.end)
        mask = segment_mask(segment.prefix, segment.blocks)
        if window is not None:
            position = torch.cat(
                [torch.arange(segment.prefix)]
                + [torch.arange(segment.prefix, segment.prefix + block) for block in segment.blocks]
            )
            mask &= position.unsqueeze(0) > position.unsqueeze(1) - window
        dense = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, span], key[:, :, span], value[:, :, span], attn_mask=mask, scale=scale, enable_gqa=True
        )
        expected[:, span] = dense.transpose(1, 2)
    return expected


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("value_dim", [8, 5])  # 5: multi-head latent attention's value heads, smaller than queries
def test_flex_formulation_equals_dense_segment_masks(window, value_dim):
    """One flex_attention call over the whole row under the segments' block mask, against the rule written as dense
    masks: shared prefixes, plain sequences, trailing padding, a sliding window over positions within the sequence."""
    torch.manual_seed(0)
    segments = [Segment(0, 5, (3, 1, 4)), Segment(13, 0, (6,)), Segment(19, 5, (3, 2)), Segment(29, 0, (8,))]
    layout = SegmentLayout(segment_tree(segments), "flex_attention")
    width = layout.width
    query, key, value = torch.randn(1, 4, width, 8), torch.randn(1, 2, width, 8), torch.randn(1, 2, width, value_dim)
    with eager_flex_attention():
        out = segment_attention_of(layout, query, key, value, scaling=0.3, sliding_window=window)
    assert torch.allclose(out, dense_reference(segments, query, key, value, 0.3, window), atol=1e-6)
    labels = layout.position_labels("cpu")
    assert labels["position"][19:29].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 5, 6]  # blocks continue from the prefix
    assert labels["node"][19:29].unique().numel() == 3  # the prefix and two blocks


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("value_dim", [8, 5])  # 5: multi-head latent attention's value heads, smaller than queries
def test_sdpa_formulation_equals_dense_segment_masks(window, value_dim):
    """Against the rule written as dense masks (segment_mask): every call of the sdpa formulation, batched or not,
    with a sliding window (over positions within the sequence) and with value heads of another size."""
    torch.manual_seed(0)
    segments = [
        Segment(0, 5, (3, 1, 4)),
        Segment(13, 0, (6,)),
        Segment(19, 5, (3, 2)),
        Segment(29, 0, (6,)),
        Segment(35, 0, (2,)),
    ]
    layout = SegmentLayout(segment_tree(segments), "sdpa")
    width = layout.width
    query, key, value = torch.randn(1, 4, width, 8), torch.randn(1, 2, width, 8), torch.randn(1, 2, width, value_dim)
    out = segment_attention_of(layout, query, key, value, scaling=0.3, sliding_window=window)
    assert torch.allclose(out, dense_reference(segments, query, key, value, 0.3, window), atol=1e-6)
    calls, _ = layout.span_calls("cpu")
    # (queries per span, keys per span, spans, dropped queries): causal prefixes of 5 (x2), plain 6 (x2), plain 2;
    # blocks shorter than their prefix of 5 under a mask: 3 (x2), 1, 4, 2
    assert sorted((c.query_length, c.key_length, c.rows, dropped(c)) for c in calls) == sorted(
        [(5, 5, 2, 0), (6, 6, 2, 0), (2, 2, 1, 0), (3, 8, 2, 0), (1, 6, 1, 0), (4, 9, 1, 0), (2, 7, 1, 0)]
    )
    # blocks at least as long as their prefix: one causal call over [prefix ; block], prefix queries dropped
    long = [Segment(0, 2, (3, 3, 2))]
    long_blocks = SegmentLayout(segment_tree(long), "sdpa")
    query, key, value = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, value_dim)
    out = segment_attention_of(long_blocks, query, key, value, scaling=0.3, sliding_window=window)
    assert torch.allclose(out, dense_reference(long, query, key, value, 0.3, window), atol=1e-6)
    calls, _ = long_blocks.span_calls("cpu")
    assert sorted((c.query_length, c.rows, dropped(c), c.mask(None, "cpu") is None) for c in calls) == [
        (2, 1, 0, True),
        (4, 1, 2, True),
        (5, 2, 4, True),
    ]


def dropped(call):
    """Query outputs a call computes but does not keep (prefix queries recomputed, padding)."""
    return call.rows * call.query_length - call.kept.numel()


def test_eager_formulation_runs_the_models_own_eager_function():
    """Base "eager": the model's eager_attention_forward (found next to its attention module) runs every span, with
    an additive mask; here a module whose eager function soft-caps the scores, as Gemma-2's does."""
    from transformers.models.gemma2 import modeling_gemma2

    torch.manual_seed(1)
    module = modeling_gemma2.Gemma2Attention.__new__(modeling_gemma2.Gemma2Attention)
    module.__dict__.update(num_key_value_groups=2, is_causal=True, training=False, head_dim=8)
    segments = [Segment(0, 4, (3, 5)), Segment(12, 0, (7,))]
    query, key, value = torch.randn(1, 4, 19, 8), torch.randn(1, 2, 19, 8), torch.randn(1, 2, 19, 8)
    out = segment_attention_of(
        SegmentLayout(segment_tree(segments), "eager"), query, key, value, module=module, scaling=0.3, softcap=2.0
    )
    expected = torch.zeros(1, 19, 4, 8)
    for segment in segments:
        span = slice(segment.start, segment.end)
        mask = torch.zeros(segment.end - segment.start, segment.end - segment.start).masked_fill(
            ~segment_mask(segment.prefix, segment.blocks), torch.finfo(torch.float32).min
        )
        dense, _ = modeling_gemma2.eager_attention_forward(
            module, query[:, :, span], key[:, :, span], value[:, :, span], mask[None, None], scaling=0.3, softcap=2.0
        )
        expected[:, span] = dense
    assert torch.allclose(out, expected, atol=1e-6)
    without_cap = segment_attention_of(
        SegmentLayout(segment_tree(segments), "eager"), query, key, value, module=module, scaling=0.3
    )
    assert not torch.allclose(without_cap, expected, atol=1e-3)  # the soft-cap was applied, not dropped


# (GPT-OSS's sinks only natively: the reference varlen kernel has no sinks; flash-attention's s_aux is reviewed)
@pytest.mark.parametrize(
    ("model_type", "kernel"),
    [
        (model_type, kernel)
        for model_type in ("mistral", "gemma3_text", "deepseek_v3", "gpt_oss", "nemotron")
        for kernel in ("native", "flash")
        if (model_type, kernel) != ("gpt_oss", "flash")
    ],
)
def test_families_of_the_zoo_keep_each_sequence_its_own(model_type, kernel, request):
    """Sliding windows of 8 (Mistral; Gemma-3's mixed layers), value heads narrower than query heads (DeepSeek-V3's
    latent attention), sinks on the model's own eager attention (GPT-OSS), a decoder layer that passes no keyword
    arguments to its attention (Nemotron): shared-prompt rows equal stock's padded forward, natively and through the
    flash formulation (the reference varlen kernel draws the window as flash-attention does; sinks have no
    reference kernel)."""
    from hf_dynbsz.testing.zoo import build_tiny_causal_lm_of_type

    if kernel == "flash":
        request.getfixturevalue("flash_formulation")
    model = build_tiny_causal_lm_of_type(model_type).eval()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    prompt_lengths, completions, repeats = [9, 4, 13], [6, 1, 19, 3, 8, 0, 25, 7], [4, 3, 1]  # longer than windows
    batch = grpo_batch(prompt_lengths, completions, repeats)
    table = SequenceTable.from_padded(*batch)
    with torch.no_grad():
        expected, _ = stock_logps(model, *batch)
        order = [5, 0, 7, 2, 4, 1, 6, 3]
        _, logps, _ = packed_logps(model, table, order, table.prompt_groups(), model.config._attn_implementation)
    for row, sample in enumerate(order):
        n = completions[sample]
        assert torch.allclose(logps[row, :n], expected[sample, :n], atol=1e-5, rtol=0), (row, sample)


def test_flex_formulation_runs_in_autocasts_dtype_as_sdpa_does(monkeypatch):
    """Under bf16 autocast, rotary embeddings leave queries and keys in fp32 and values in bf16. sdpa gets all three
    in bf16 from autocast; flex_attention gets no cast, and its compiled CUDA backward finds no kernel for mixed dtypes
    (pytorch/pytorch#176025). The flex formulation casts them as autocast casts sdpa's, and computes what the sdpa
    formulation computes under the same autocast."""
    seen = []
    original = attention.FLEX_KERNEL

    def recording(query, key, value, *args, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype))
        return original(query, key, value, *args, **kwargs)

    monkeypatch.setattr(attention, "FLEX_KERNEL", recording)
    torch.manual_seed(2)
    segments = [Segment(0, 5, (3, 1, 4)), Segment(13, 0, (6,))]
    width = segments[-1].end
    query, key = torch.randn(1, 4, width, 8), torch.randn(1, 2, width, 8)
    value = torch.randn(1, 2, width, 8).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), eager_flex_attention():
        flex = segment_attention_of(
            SegmentLayout(segment_tree(segments), "flex_attention"), query, key, value, scaling=0.3
        )
        sdpa = segment_attention_of(SegmentLayout(segment_tree(segments), "sdpa"), query, key, value, scaling=0.3)
    assert seen == [(torch.bfloat16,) * 3]
    assert flex.dtype == sdpa.dtype == torch.bfloat16
    assert torch.allclose(flex.float(), sdpa.float(), atol=2e-2)


@pytest.mark.parametrize("max_calls", [1, 2, 3])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("value_dim", [8, 5])
def test_spans_of_several_shapes_share_a_padded_call_with_the_same_outputs_and_gradients(
    monkeypatch, max_calls, window, value_dim
):
    """With at most ``max_calls`` calls a layer, spans of several shapes share a call, padded to its longest query
    and key span under a per-span mask: outputs and gradients of the queries, keys and values equal the dense rule's
    (a padding query attends to one real key and its output is dropped, so it adds exactly nothing)."""
    monkeypatch.setitem(attention.SPAN_CALLS_PER_LAYER, "cpu", max_calls)
    torch.manual_seed(3)
    segments = [
        Segment(0, 5, (3, 1, 4)),
        Segment(13, 0, (6,)),
        Segment(19, 2, (3, 2, 7)),
        Segment(33, 0, (9,)),
        Segment(42, 0, (1,)),
    ]
    layout = SegmentLayout(segment_tree(segments), "sdpa")
    width = layout.width
    inputs = [torch.randn(1, 4, width, 8), torch.randn(1, 2, width, 8), torch.randn(1, 2, width, value_dim)]
    ours_inputs = [t.clone().requires_grad_() for t in inputs]
    dense_inputs = [t.clone().requires_grad_() for t in inputs]
    out = segment_attention_of(layout, *ours_inputs, scaling=0.3, sliding_window=window)
    expected = dense_reference(segments, *dense_inputs, 0.3, window)
    assert torch.allclose(out, expected, atol=1e-6)
    weights = torch.randn(expected.shape)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    for ours, dense in zip(ours_inputs, dense_inputs):
        assert torch.allclose(ours.grad, dense.grad, atol=1e-5)
    calls, _ = layout.span_calls("cpu", max_calls)
    assert len(calls) <= max_calls and any(call.padded for call in calls)
    assert sum(call.kept.numel() for call in calls) == width  # each position's output kept once
    for call in filter(lambda call: call.padded, calls):
        mask = call.mask(window, "cpu")[:, 0]
        assert mask.any(-1).all()  # every query, padding included, sees a key: no row of NaNs on any kernel
        for row, (queries, keys) in enumerate(zip(call.query_lengths, call.key_lengths)):
            assert not mask[row, :queries, keys:].any()  # no real query sees its span's padding keys


def test_eager_padded_calls_equal_the_dense_rule(monkeypatch):
    """The eager formulation takes the padded calls' masks as additive masks."""
    from transformers.models.qwen2 import modeling_qwen2

    monkeypatch.setitem(attention.SPAN_CALLS_PER_LAYER, "cpu", 2)
    torch.manual_seed(4)
    segments = [Segment(0, 4, (2, 5)), Segment(11, 0, (3,)), Segment(14, 0, (8,))]
    layout = SegmentLayout(segment_tree(segments), "eager")
    width = layout.width
    query, key, value = torch.randn(1, 4, width, 8), torch.randn(1, 2, width, 8), torch.randn(1, 2, width, 8)
    module = modeling_qwen2.Qwen2Attention(modeling_qwen2.Qwen2Config(hidden_size=32, num_attention_heads=4,
                                                                      num_key_value_heads=2), 0).eval()  # fmt: skip
    out = segment_attention_of(layout, query, key, value, module=module, scaling=0.3)
    assert torch.allclose(out, dense_reference(segments, query, key, value, 0.3), atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), min_size=1, max_size=9),
    st.integers(1, 4),
)
def test_the_padded_partition_cuts_where_the_padded_work_is_least(spans, parts):
    """Against every way of cutting the spans (sorted by key length) into at most ``parts`` consecutive calls."""
    shapes = sorted(((q, q + extra) for q, extra in spans), key=lambda shape: (shape[1], shape[0]))

    def work(cuts):
        bounds = zip([0, *cuts], [*cuts, len(shapes)])
        return sum((b - a) * max(s[0] for s in shapes[a:b]) * shapes[b - 1][1] for a, b in bounds)

    cuts = attention._padded_partition(shapes, parts)
    assert len(cuts) < parts and cuts == sorted(set(cuts)) and all(0 < c < len(shapes) for c in cuts)
    every = [
        list(chosen)
        for count in range(min(parts, len(shapes)))
        for chosen in itertools.combinations(range(1, len(shapes)), count)
    ]
    assert work(cuts) == min(work(c) for c in every)


@pytest.mark.parametrize("window", [None, 150])
def test_flex_block_mask_is_drawn_from_the_segments_as_torch_would_draw_it(window):
    """The flex formulation's BlockMask comes from the segments' ranges (no dense width x width mask): over rows of
    several 128-position blocks, its key blocks per query block are those ``create_block_mask`` finds by evaluating
    every pair (without a window; with one, a superset the mask_mod narrows), its full blocks are full, and the
    attention equals the dense rule."""
    from torch.nn.attention.flex_attention import create_block_mask

    torch.manual_seed(5)
    segments = [
        Segment(0, 150, (40, 300, 7)),
        Segment(497, 0, (260,)),
        Segment(757, 60, (129, 128, 1)),
        Segment(1075, 0, (5,)),
    ]
    layout = SegmentLayout(segment_tree(segments), "flex_attention")
    ours = layout.block_mask(window, "cpu")
    labels = layout.position_labels("cpu")
    node, subtree_end, position = (labels[n] for n in ("node", "subtree_end", "position"))

    def rule(batch, head, query, key):
        allowed = (key <= query) & (node[key] <= node[query]) & (node[query] < subtree_end[key])
        return allowed & (position[query] - position[key] < window) if window is not None else allowed

    torch_mask = create_block_mask(rule, None, None, layout.width, layout.width, device="cpu")
    listed, torch_listed = ours.to_dense()[0, 0].bool(), torch_mask.to_dense()[0, 0].bool()
    assert listed.shape == torch_listed.shape == (9, 9)
    assert torch.equal(listed, torch_listed) if window is None else bool((listed >= torch_listed).all())
    dense = rule(0, 0, torch.arange(layout.width).view(-1, 1), torch.arange(layout.width).view(1, -1))
    for query_block, full_blocks in enumerate(layout.flex_blocks(window)[1]):
        for key_block in full_blocks:
            rows, columns = (
                slice(query_block * 128, (query_block + 1) * 128),
                slice(key_block * 128, (key_block + 1) * 128),
            )
            assert dense[rows, columns].all()
    assert any(layout.flex_blocks(None)[1])  # the prefix of 150 and the long blocks do make full blocks
    query, key, value = (
        torch.randn(1, 4, layout.width, 8),
        torch.randn(1, 2, layout.width, 8),
        torch.randn(1, 2, layout.width, 8),
    )
    with eager_flex_attention():
        out = segment_attention_of(layout, query, key, value, scaling=0.3, sliding_window=window)
    assert torch.allclose(out, dense_reference(segments, query, key, value, 0.3, window), atol=1e-6)


#: Families of the zoo with flex_attention in transformers, covering what the flex formulation must carry: sliding
#: windows (mistral, gemma2/3, cohere2, exaone4, all with a window of 8 in the tiny configs), soft-capping (gemma2),
#: value heads narrower than query heads (deepseek_v3), per-head norms (qwen3, olmo2). gpt_oss's attention sinks
#: cannot run flex on a CPU (transformers refuses, for stock too); the GPU check covers the rest.
FLEX_FAMILIES = (
    "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "deepseek_v3", "cohere2", "olmo2",
    "granite", "starcoder2", "exaone4", "smollm3",
)  # fmt: skip


@pytest.mark.parametrize("model_type", FLEX_FAMILIES)
def test_flex_formulation_gives_stocks_logprobs_across_families(model_type):
    """Shared prompts in one flex_attention call per layer against stock's own flex forward of the separate
    sequences (uncompiled on a CPU; forward only: torch has no flex backward on a CPU)."""
    from hf_dynbsz.testing.zoo import build_tiny_causal_lm_of_type

    model = build_tiny_causal_lm_of_type(model_type, attn_implementation="flex_attention").eval()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    batch = grpo_batch(PROMPTS, COMPLETIONS, REPEATS, token_high=60)
    table = SequenceTable.from_padded(*batch)
    order = [5, 0, 7, 2, 4, 1, 6, 3]
    with torch.no_grad(), eager_flex_attention():
        expected, expected_entropy = stock_logps(model, *batch)
        _, logps, entropy = packed_logps(model, table, order, table.prompt_groups(), "flex_attention")
    for row, sample in enumerate(order):
        n = COMPLETIONS[sample]
        assert torch.allclose(logps[row, :n], expected[sample, :n], atol=2e-6, rtol=0), (row, sample)
        assert torch.allclose(entropy[row, :n], expected_entropy[sample, :n], atol=2e-6, rtol=0)


# ---- torch's varlen_attn: one call per layer, a reference kernel of the same contract standing in on a CPU ----------
@pytest.fixture
def varlen_attn_kernel(monkeypatch):
    """torch's varlen_attn replaced by the reference kernel of its contract (torch has no CPU kernel); returns the
    calls, each ``(cu_seq_q, cu_seq_k, max_q, max_k, keyword names)``."""
    calls = []

    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False):  # fmt: skip
        calls.append((cu_seq_q.tolist(), cu_seq_k.tolist(), max_q, max_k, window_size, enable_gqa))
        return reference_varlen_attn(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux, scale=scale,
            window_size=window_size, enable_gqa=enable_gqa,
        )  # fmt: skip

    monkeypatch.setattr(attention, "VARLEN_ATTN_KERNEL", kernel)
    return calls


@pytest.mark.parametrize("pad_to_multiple_of", [None, 8])
def test_varlen_attn_rows_give_stocks_logprobs_in_one_call_per_layer(model, varlen_attn_kernel, pad_to_multiple_of):
    """Shared prompts and plain sequences in one varlen_attn call per layer: each block's keys are its prompt's
    gathered in front of it (causal bottom-right); trailing padding is a span of its own, so the spans end at the
    row's last token (the reference refuses anything else, as pytorch#176793 requires)."""
    if model.config._attn_implementation == "flex_attention":
        pytest.skip("varlen_attn replaces sdpa and eager only: a model on flex_attention keeps its own kernel")
    batch = grpo_batch(PROMPTS, COMPLETIONS, REPEATS)
    table = SequenceTable.from_padded(*batch)
    order = [5, 0, 7, 2, 4, 1, 6, 3]
    with torch.no_grad():
        expected, expected_entropy = stock_logps(model, *batch)
        mb, logps, entropy = packed_logps(model, table, order, table.prompt_groups(), VARLEN_ATTN, pad_to_multiple_of)
    for row, sample in enumerate(order):
        n = COMPLETIONS[sample]
        assert torch.allclose(logps[row, :n], expected[sample, :n], atol=2e-6, rtol=0), (row, sample)
        assert torch.allclose(entropy[row, :n], expected_entropy[sample, :n], atol=2e-6, rtol=0)
    assert len(varlen_attn_kernel) == model.config.num_hidden_layers  # one call per layer over the whole row
    cu_q, cu_k, max_q, max_k, window, gqa = varlen_attn_kernel[0]
    assert cu_q[-1] == mb.computed_tokens and window == (-1, 0) and gqa  # 4 query heads on 2 key/value heads
    assert len(cu_q) == len(cu_k) and cu_k[-1] > cu_q[-1]  # the gathered prefixes: more keys than queries


def test_varlen_attn_gradients_equal_those_of_separate_sequences(model, varlen_attn_kernel):
    if model.config._attn_implementation == "flex_attention":
        pytest.skip("varlen_attn replaces sdpa and eager only: a model on flex_attention keeps its own kernel")
    batch, table, weights = weighted_samples()

    def ours():
        _, logps, _ = packed_logps(model, table, list(range(len(COMPLETIONS))), table.prompt_groups(), VARLEN_ATTN, 8)
        return (logps * weights).sum()

    expected = gradients(model, lambda: (stock_logps(model, *batch)[0] * batch[3] * weights).sum())
    got = gradients(model, ours)
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text", "qwen3", "llama"])
def test_varlen_attn_keeps_each_sequence_its_own_across_families(model_type, varlen_attn_kernel):
    """Sliding windows of 8 (Mistral; Gemma-3's mixed layers, with its own query scaling), per-head norms (Qwen3):
    rows longer than the windows equal stock's padded forward."""
    from hf_dynbsz.testing.zoo import build_tiny_causal_lm_of_type

    model = build_tiny_causal_lm_of_type(model_type).eval()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    prompt_lengths, completions, repeats = [9, 4, 13], [6, 1, 19, 3, 8, 0, 25, 7], [4, 3, 1]
    batch = grpo_batch(prompt_lengths, completions, repeats)
    table = SequenceTable.from_padded(*batch)
    order = [5, 0, 7, 2, 4, 1, 6, 3]
    with torch.no_grad():
        expected, _ = stock_logps(model, *batch)
        _, logps, _ = packed_logps(model, table, order, table.prompt_groups(), VARLEN_ATTN)
    for row, sample in enumerate(order):
        n = completions[sample]
        assert torch.allclose(logps[row, :n], expected[sample, :n], atol=1e-5, rtol=0), (row, sample)
    windows = {call[4] for call in varlen_attn_kernel}
    assert ((7, 0) in windows) == (model_type in ("mistral", "gemma3_text"))  # a window of 8: 7 keys before


def older_varlen_attn(version: str):
    """A varlen_attn with an older torch's signature over the reference kernel: 2.10 (``is_causal``, no ``scale``,
    no ``enable_gqa``: equal heads only) or 2.11 (``window_size`` and ``scale``, no ``enable_gqa``)."""
    calls = []

    def torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        calls.append({"is_causal": is_causal})
        window = (-1, 0) if is_causal else (-1, -1)
        return reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window)

    def torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1)):  # fmt: skip
        calls.append({"window_size": window_size, "scale": scale})
        return reference_varlen_attn(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size
        )

    return {"2.10": torch_2_10, "2.11": torch_2_11}[version], calls


@pytest.mark.parametrize("version", ["2.10", "2.11"])
@pytest.mark.parametrize("window", [None, 3])
def test_the_installed_signature_is_read_at_run_time(monkeypatch, version, window):
    """Older torch releases' varlen_attn: what their signature lacks is made up exactly (key/value heads repeated
    without enable_gqa, queries scaled without scale); a window without window_size is refused."""
    kernel, calls = older_varlen_attn(version)
    monkeypatch.setattr(attention, "VARLEN_ATTN_KERNEL", kernel)
    torch.manual_seed(6)
    segments = [Segment(0, 5, (3, 1, 4)), Segment(13, 0, (6,)), Segment(19, 0, (2,))]
    layout = SegmentLayout(segment_tree(segments), VARLEN_ATTN)
    query, key, value = torch.randn(1, 4, 21, 8), torch.randn(1, 2, 21, 8), torch.randn(1, 2, 21, 8)
    if window is not None and version == "2.10":
        with pytest.raises(RuntimeError, match="takes no window_size"):
            segment_attention_of(layout, query, key, value, scaling=0.3, sliding_window=window)
        return
    out = segment_attention_of(layout, query, key, value, scaling=0.3, sliding_window=window)
    assert torch.allclose(out, dense_reference(segments, query, key, value, 0.3, window), atol=1e-6)
    assert calls == [{"is_causal": True}] if version == "2.10" else calls[0]["scale"] == 0.3


def test_varlen_attn_refuses_what_it_cannot_compute(varlen_attn_kernel):
    layout = SegmentLayout(segment_tree([Segment(0, 0, (3,))]), VARLEN_ATTN)
    query = torch.zeros(1, 2, 3, 4)
    for features in ({"softcap": 30.0}, {"s_aux": torch.zeros(2)}, {"dropout": 0.1}):
        with pytest.raises(RuntimeError, match="does not compute"):
            segment_attention_of(layout, query, query, query, **features)
    assert not varlen_attn_kernel


def test_the_installed_varlen_attn_takes_every_keyword_a_call_passes():
    """torch 2.12 to 2.15 (checked: 2.13.0+cpu and 2.15.0) take ``scale``, ``window_size`` and ``enable_gqa``: the call
    passes all three and makes up none. A release that renames one fails here, not in a GPU run."""
    from torch.nn.attention.varlen import varlen_attn

    from hf_dynbsz.execution.attention.varlen import varlen_attn_keywords

    assert {"scale", "window_size", "enable_gqa"} <= varlen_attn_keywords(varlen_attn)
    assert {"cu_seq_q", "cu_seq_k", "max_q", "max_k"} <= varlen_attn_keywords(varlen_attn)


def test_device_facts_read_this_machine():
    facts = device_facts("cpu", "no", torch.float32)
    assert (facts.type, facts.capability, facts.compute_dtype) == ("cpu", None, "float32")
    assert facts.varlen_attn and facts.varlen_window  # torch 2.13 has varlen_attn (no CPU kernel) with window_size
    assert device_facts("cpu", "bf16", torch.float32).compute_dtype == "bfloat16"
    assert facts.torch_version >= (2, 13)


# ---- flex_attention: a few row widths, each compiled once; explicit kernel options where Inductor finds none --------
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 100_000))
def test_flex_rows_take_a_few_widths_of_whole_blocks(tokens):
    width, blocks = attention.flex_row_width(tokens), -(-tokens // 128)
    assert width % attention.FLEX_BLOCK_SIZE == 0 and tokens <= width <= 1.5 * 128 * blocks
    assert width // 128 in {2**k for k in range(20)} | {3 * 2**k for k in range(20)}


def test_flex_row_widths_are_two_per_octave():
    widths = sorted({attention.flex_row_width(tokens) for tokens in range(1, 8193)})
    assert widths == [128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]


def test_a_flex_row_pads_to_its_width_with_a_segment_of_its_own(model):
    if model.config._attn_implementation != "flex_attention":
        pytest.skip("row widths in whole 128-position blocks apply only to models on flex_attention")
    batch = grpo_batch(PROMPTS, COMPLETIONS, REPEATS)
    table = SequenceTable.from_padded(*batch)
    with torch.no_grad():
        expected, _ = stock_logps(model, *batch)
        mb, logps, _ = packed_logps(model, table, list(range(8)), table.prompt_groups(), "flex_attention")
    assert mb.computed_tokens == 128 > mb.real_tokens and mb.segments.width == 128
    assert row_nodes(mb.segments)[-1] == (mb.real_tokens, 128 - mb.real_tokens, -1)  # the padding: a root alone
    for row in range(8):
        n = COMPLETIONS[row]
        assert torch.allclose(logps[row, :n], expected[row, :n], atol=2e-6, rtol=0)


def test_flex_kernel_falls_back_to_explicit_options_when_inductor_finds_no_valid_choice(caplog):
    """The first call of a shape compiles forward and backward on copies; a NoValidChoicesError there switches the
    process to FLEX_FALLBACK_OPTIONS (logged once); any other error is the caller's."""
    calls = []

    def compiled(query, key, value, block_mask=None, scale=None, enable_gqa=False, kernel_options=None):
        calls.append(kernel_options)
        if kernel_options is None:
            raise RuntimeError("InductorError: LoweringException: NoValidChoicesError: No choices to select")
        return query * 2

    kernel = attention._FlexKernel()
    kernel.function = compiled
    query = torch.ones(1, 2, 128, 4)
    kernel._compile(query, query, query, None, 0.5, False)
    assert kernel.options is attention.FLEX_FALLBACK_OPTIONS and calls == [None, attention.FLEX_FALLBACK_OPTIONS]
    assert "no valid kernel choice" in caplog.text

    def broken(*args, **kwargs):
        raise ValueError("something else")

    kernel = attention._FlexKernel()
    kernel.function = broken
    with pytest.raises(ValueError, match="something else"):
        kernel._compile(query, query, query, None, 0.5, False)


# ---- prefix trees: any shared run of tokens once, each node attending to its root-to-node path ---------------------
#: A tree row: root A (5) with children B (3; its children D (4) and E (2)) and C (6; its child F (1)), a plain
#: sequence G (7) and trailing padding P (2), in row order (start, length, parent).
TREE = [(0, 5, -1), (5, 3, 0), (8, 4, 1), (12, 2, 1), (14, 6, 0), (20, 1, 4), (21, 7, -1), (28, 2, -1)]


def tree_reference(nodes, query, key, value, scale, window=None):
    """The whole row under the tree's dense mask (:func:`hf_dynbsz.testing.tree_mask`: parent links, depths)."""
    mask = tree_mask(nodes, window)
    dense = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=True
    )
    return dense.transpose(1, 2)


def tree_layout(base):
    return SegmentLayout(node_tree(TREE), base)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("kernel", ["sdpa", "sdpa in 2 calls", "eager", "flex_attention", VARLEN_ATTN, "flash"])
def test_a_tree_row_attends_along_each_nodes_path_on_every_kernel(kernel, window, monkeypatch, request):
    """Each node's queries see its ancestors' keys and causally its own, never a sibling's or a cousin's (a window
    counts depths): outputs, and gradients of queries, keys and values where the kernel has a backward on a CPU,
    equal the tree's dense rule. The varlen kernels run the reference kernels of their contracts."""
    base = {"sdpa in 2 calls": "sdpa", "flash": "flash_attention_2"}.get(kernel, kernel)
    if kernel == "sdpa in 2 calls":
        monkeypatch.setitem(attention.SPAN_CALLS_PER_LAYER, "cpu", 2)
    if kernel == "flash":
        request.getfixturevalue("flash_formulation")
    if kernel == VARLEN_ATTN:
        request.getfixturevalue("varlen_attn_kernel")
    torch.manual_seed(9)
    layout = tree_layout(base)
    width = layout.width
    inputs = [torch.randn(1, 4, width, 8), torch.randn(1, 2, width, 8), torch.randn(1, 2, width, 8)]
    backward = kernel != "flex_attention"  # flex_attention has no backward on a CPU
    ours_inputs = [t.clone().requires_grad_(backward) for t in inputs]
    dense_inputs = [t.clone().requires_grad_(backward) for t in inputs]
    module = MODULE
    if kernel == "eager":  # the model's own eager function, found next to its attention module
        from transformers.models.qwen2 import modeling_qwen2

        config = modeling_qwen2.Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
        module = modeling_qwen2.Qwen2Attention(config, 0).eval()
    with eager_flex_attention() if kernel == "flex_attention" else contextlib.nullcontext():
        out = segment_attention_of(layout, *ours_inputs, module=module, scaling=0.3, sliding_window=window)
    expected = tree_reference(TREE, *dense_inputs, 0.3, window)
    assert torch.allclose(out, expected, atol=1e-6)
    if not backward:
        return
    weights = torch.randn(expected.shape)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    for ours, dense in zip(ours_inputs, dense_inputs):
        assert torch.allclose(ours.grad, dense.grad, atol=1e-5)


def test_a_tree_rows_index_tensors():
    layout = tree_layout("sdpa")
    parts = layout.parts()
    assert [part.depth for part in parts] == [0, 5, 8, 8, 5, 11, 0, 0]  # positions continue along the path
    assert parts[3].path == (range(0, 5), range(5, 8)) and parts[5].path == (range(0, 5), range(14, 20))
    assert layout.subtree_ends() == [6, 4, 3, 4, 6, 6, 7, 8] and layout.gathers
    cu_q, cu_k, key_index, max_q, max_k = layout.varlen_spans("cpu")
    assert cu_q.tolist() == [0, 5, 8, 12, 14, 20, 21, 28, 30]  # every node a query span, in row order
    assert cu_k.tolist() == [0, 5, 13, 25, 35, 46, 58, 65, 67]  # [path ; own]
    assert key_index[35:46].tolist() == [*range(0, 5), *range(14, 20)]  # C: A's keys, then its own
    assert (max_q, max_k) == (7, 12)
    labels = layout.position_labels("cpu")
    assert labels["position"][20].item() == 11 and labels["node"][20].item() == 5


@pytest.fixture
def tree_batch():
    """A generation batch with sharing beyond prompt groups: a 7-token block every prompt begins with, three prompts
    of their own (5, 2 and 9 tokens; 3, 3 and 2 completions) whose completions share a 4-token trunk, then one of two
    3-token branches, then a leaf (one empty)."""
    leaves = [6, 0, 3, 9, 1, 5, 4, 2]
    batch = prefix_batch([5, 2, 9], leaves, [3, 3, 2], shared=7, trunk=4, branches=2, branch=3, seed=3)
    return batch, SequenceTable.from_padded(*batch)


def test_a_tree_row_computes_each_shared_position_once(tree_batch):
    batch, table = tree_batch
    tree = table.prefix_tree("tree")
    mb = build_microbatch(table, list(range(8)), layout="padding_free", pad_token_id=0, attention="sdpa",
                          keys=table.prefix_keys("tree"))  # fmt: skip
    assert mb.real_tokens == tree.tokens() < table.lengths.sum() and mb.segments.gathers
    # the block's first 6 tokens once (the 7th forks: it is keyed on the prompts' first own tokens), then per prompt
    assert tree.length[0] == 6 and tree.parent.count(-1) == 1
    # every sample's positions are counted for it (the router aux loss), and each completion token is one loss term
    token_index, row_index = mb.token_rows
    assert torch.bincount(row_index).tolist() == table.lengths.tolist()
    assert mb.completion_mask.sum() == table.completion_lengths.sum()
    assert len(set(mb.gather_index[mb.completion_mask.bool()].tolist())) < table.completion_lengths.sum()  # shared
    groups = build_microbatch(table, list(range(8)), layout="padding_free", pad_token_id=0, attention="sdpa",
                              keys=table.prefix_keys("groups"))  # fmt: skip
    assert (
        groups.real_tokens
        == row_tokens(
            list(range(8)), table.prompt_lengths.tolist(), table.completion_lengths.tolist(), table.prompt_groups()
        )
        > mb.real_tokens
    )


@pytest.mark.parametrize("kernel", ["native", VARLEN_ATTN, "flash"])
def test_tree_rows_give_stocks_logprobs_and_entropies(model, tree_batch, kernel, request):
    """A shared block across prompts and tree-rollout completions (trunks and branches are completion tokens: their
    positions are loss terms of every sample holding them): each sample's log-probs and entropies are stock's."""
    base = model.config._attn_implementation
    if kernel != "native" and base == "flex_attention":
        pytest.skip("the varlen formulations replace sdpa and eager; a model on flex_attention keeps its own kernel")
    if kernel != "native":
        request.getfixturevalue({"flash": "flash_formulation"}.get(kernel, "varlen_attn_kernel"))
        base = VARLEN_ATTN if kernel == VARLEN_ATTN else base
    batch, table = tree_batch
    order = [7, 0, 4, 2, 1, 6, 3, 5]
    with torch.no_grad():
        expected, expected_entropy = stock_logps(model, *batch)
        mb, logps, entropy = packed_logps(model, table, order, None, base, 8, sharing="tree")
    for row, sample in enumerate(order):
        n = int(table.completion_lengths[sample])
        assert torch.allclose(logps[row, :n], expected[sample, :n], atol=2e-6, rtol=0), (row, sample)
        assert torch.allclose(entropy[row, :n], expected_entropy[sample, :n], atol=2e-6, rtol=0)
    assert mb.real_tokens == table.prefix_tree("tree").tokens()


@pytest.mark.parametrize("kernel", ["native", VARLEN_ATTN])
def test_tree_gradients_equal_those_of_separate_sequences(model, tree_batch, kernel, request):
    """The gradient of a shared position is the sum of its samples' loss terms' gradients, as stock's separate
    sequences give it: each sample weighted differently, the gradients of every parameter equal stock's."""
    base = model.config._attn_implementation
    if base == "flex_attention":
        pytest.skip("flex_attention has no backward on CPU (torch raises NotImplementedError); the GPU check trains it")
    if kernel == VARLEN_ATTN:
        request.getfixturevalue("varlen_attn_kernel")
        base = VARLEN_ATTN
    batch, table = tree_batch
    weights = torch.linspace(-1.0, 2.0, 8).unsqueeze(1)

    def stock():
        return (stock_logps(model, *batch)[0] * batch[3] * weights).sum()

    def ours():
        _, logps, _ = packed_logps(model, table, list(range(8)), None, base, sharing="tree")
        return (logps * weights).sum()

    expected, got = gradients(model, stock), gradients(model, ours)
    for name in expected:
        assert torch.allclose(got[name], expected[name], atol=1e-5, rtol=1e-4), name


def test_a_tree_row_without_sharing_beyond_groups_is_the_groups_row(model):
    """Distinct prompts whose completions differ from their first token: the tree shares what prompt groups share,
    and lays the row out as the groups rule does, node for node."""
    batch = grpo_batch(PROMPTS, COMPLETIONS, REPEATS, seed=11, token_high=200)
    table = SequenceTable.from_padded(*batch)
    first = [int(t[p]) for t, p, c in zip(table.tokens, table.prompt_lengths, table.completion_lengths) if c]
    prompts = [t[:p].tolist() for t, p in zip(table.tokens, table.prompt_lengths)]
    assert len(set(first)) == len(first) and len({p[0] for p in prompts}) == 3  # nothing more to share
    order = [5, 0, 7, 2, 4, 1, 6, 3]
    rows = [
        build_microbatch(table, order, layout="padding_free", pad_token_id=0, attention="sdpa", keys=keys)
        for keys in (table.prefix_keys("tree"), table.prefix_keys("groups"))
    ]
    assert row_nodes(rows[0].segments) == row_nodes(rows[1].segments)
    assert torch.equal(rows[0].model_inputs["input_ids"], rows[1].model_inputs["input_ids"])
    assert torch.equal(rows[0].gather_index, rows[1].gather_index)

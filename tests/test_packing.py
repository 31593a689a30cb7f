"""Packing collator: both layouts give the log-probs of stock TRL's padded forward, with no leakage."""

from __future__ import annotations

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head, pad

from hf_dynbsz.execution.packing import SequenceTable, build_microbatch, dummy_microbatch
from hf_dynbsz.testing import build_char_tokenizer, build_tiny_causal_lm, stock_logps

PAD = 0


def trl_style_batch(prompt_lengths, completion_lengths, seed=0):
    """Left-padded prompts and right-padded completions, like TRL's generation output."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 50, (n,), generator=generator) for n in prompt_lengths]
    completions = [torch.randint(3, 50, (n,), generator=generator) for n in completion_lengths]
    prompt_ids = pad(prompts, padding_value=PAD, padding_side="left")
    prompt_mask = pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left")
    completion_ids = pad(completions, padding_value=PAD, padding_side="right")
    completion_mask = pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right")
    return prompt_ids, prompt_mask, completion_ids, completion_mask


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request):
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, attn_implementation=request.param, hidden_size=64)
    model.eval()
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


PROMPTS = [5, 17, 3, 9, 12]
COMPLETIONS = [11, 2, 20, 0, 7]  # includes an empty (masked truncated) completion


@pytest.mark.parametrize("layout", ["padding_free", "padded"])
@pytest.mark.parametrize("pad_to_multiple_of", [None, 8])
def test_layouts_match_stock_padded_logprobs(model, layout, pad_to_multiple_of):
    batch = trl_style_batch(PROMPTS, COMPLETIONS)
    with torch.no_grad():
        expected_logps, expected_entropy = stock_logps(model, *batch)
        table = SequenceTable.from_padded(*batch)
        order = [3, 1, 4, 0, 2]  # any order: results are mapped back per sample
        mb = build_microbatch(table, order, layout=layout, pad_token_id=PAD, pad_to_multiple_of=pad_to_multiple_of)
        out = model(**mb.model_inputs, shift_labels=mb.shift_labels, fused_lm_head=True)
        logps = mb.to_completion_layout(out.log_probs)
        entropy = mb.to_completion_layout(out.entropy)
    mask = batch[3].bool()
    for row, sample in enumerate(order):
        n = COMPLETIONS[sample]
        assert torch.allclose(logps[row, :n], expected_logps[sample, :n], atol=1e-5, rtol=0)
        assert torch.allclose(entropy[row, :n], expected_entropy[sample, :n], atol=1e-5, rtol=0)
        assert torch.all(logps[row, n:] == 0)
    assert mask.sum() == mb.completion_mask.sum()


def test_padding_free_row_is_one_row_without_attention_mask():
    table = SequenceTable.from_padded(*trl_style_batch(PROMPTS, COMPLETIONS))
    mb = build_microbatch(table, [0, 1, 2], layout="padding_free", pad_token_id=PAD)
    assert mb.model_inputs["input_ids"].shape == (1, sum(PROMPTS[:3]) + sum(COMPLETIONS[:3]))
    assert "attention_mask" not in mb.model_inputs
    # positions restart at every sequence boundary
    starts = (mb.model_inputs["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert starts == [0, 16, 16 + 19]
    assert mb.real_tokens == mb.computed_tokens == 16 + 19 + 23


def test_padded_layout_pads_only_to_its_own_longest_row():
    table = SequenceTable.from_padded(*trl_style_batch(PROMPTS, COMPLETIONS))
    mb = build_microbatch(table, [0, 4], layout="padded", pad_token_id=PAD, pad_to_multiple_of=8)
    assert mb.model_inputs["input_ids"].shape == (2, 24)  # longest 19 -> 24, not the batch's 23 + 20
    assert mb.real_tokens == 16 + 19 and mb.computed_tokens == 48


def test_packed_sequences_cannot_see_each_other(model):
    """Changing sequence A must not move sequence B's log-probs; a dense mask or a cache would leak."""
    base = trl_style_batch([6, 6], [8, 8], seed=1)
    changed = [t.clone() for t in base]
    changed[0][0] = torch.randint(3, 50, changed[0][0].shape)  # new prompt for sequence 0 only
    changed[2][0] = torch.randint(3, 50, changed[2][0].shape)
    with torch.no_grad():
        results = []
        for batch in (base, changed):
            mb = build_microbatch(SequenceTable.from_padded(*batch), [0, 1], layout="padding_free", pad_token_id=PAD)
            out = model(**mb.model_inputs, shift_labels=mb.shift_labels, fused_lm_head=True)
            results.append(mb.to_completion_layout(out.log_probs))
        assert torch.equal(results[0][1], results[1][1])
        assert not torch.allclose(results[0][0], results[1][0])

        # Sensitivity check: the same packed row with an all-ones attention mask (what `use_cache` or a
        # collator that adds a mask would do) lets sequence 1 see sequence 0.
        leaky = []
        for batch in (base, changed):
            mb = build_microbatch(SequenceTable.from_padded(*batch), [0, 1], layout="padding_free", pad_token_id=PAD)
            ids = mb.model_inputs["input_ids"]
            out = model(
                **mb.model_inputs, attention_mask=torch.ones_like(ids), shift_labels=mb.shift_labels, fused_lm_head=True
            )
            leaky.append(mb.to_completion_layout(out.log_probs))
        assert not torch.allclose(leaky[0][1], leaky[1][1], atol=1e-6)


def test_dummy_microbatch_touches_every_parameter():
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer)
    add_fused_lm_head(model)
    mb = dummy_microbatch(PAD)
    out = model(**mb.model_inputs, shift_labels=mb.shift_labels, fused_lm_head=True)
    (out.log_probs.sum() * 0.0).backward()
    assert all(p.grad is not None and torch.all(p.grad == 0) for p in model.parameters())

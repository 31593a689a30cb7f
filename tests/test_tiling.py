"""tensor_batch_size tiling of TRL's fused LM head: same values and gradients as untiled, for any tile."""

from __future__ import annotations

import pytest
import torch
import trl.kernels.chunked_logprob as kernel
import trl.trainer.utils as trl_utils
from trl.trainer.utils import add_fused_lm_head

from hf_dynbsz.execution.tiling import VOCAB_COLUMNS_PER_TILE, lm_head_tiles
from hf_dynbsz.testing import build_char_tokenizer, build_tiny_causal_lm

ROWS, WIDTH = 4, 25  # 4 x 24 = 96 scored positions after the shift


def make_model(temperature=1.0, softcap=None, logit_scale=None):
    tokenizer = build_char_tokenizer()
    model = build_tiny_causal_lm(tokenizer, hidden_size=16, num_hidden_layers=1, vocab_size=1000, seed=3)
    if softcap is not None:
        model.config.final_logit_softcapping = softcap
    if logit_scale is not None:
        model.config.logit_scale = logit_scale
    add_fused_lm_head(model, temperature=temperature, outputs=("log_probs", "entropy"))
    return model


def run(model, tokens_per_tile, vocab_columns=VOCAB_COLUMNS_PER_TILE):
    """Log-probs, entropies and parameter gradients of a loss mixing both, under the given tile."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 1000, (ROWS, WIDTH), generator=generator)
    weights = torch.randn(ROWS, WIDTH - 1, generator=generator)
    model.zero_grad()
    with lm_head_tiles(tokens_per_tile, vocab_columns):
        out = model(input_ids=input_ids, labels=input_ids, fused_lm_head=True)
        loss = (out.log_probs * weights).sum() + 0.3 * out.entropy.sum()
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return out.log_probs.detach(), out.entropy.detach(), grads, input_ids


def assert_same(a, b, atol=1e-5):
    for x, y in zip(a[:2], b[:2]):
        assert torch.allclose(x, y, atol=atol, rtol=1e-5), (x - y).abs().max()
    for name in a[2]:
        scale = b[2][name].abs().max().clamp(min=1e-6)
        assert torch.allclose(a[2][name], b[2][name], atol=1e-5 * float(scale), rtol=1e-4), name


@pytest.mark.parametrize("tokens_per_tile", [1, 7, 32, 96, 5000])  # 1; not dividing 96; dividing; =N; > N
def test_tiled_equals_untiled_values_and_gradients(tokens_per_tile):
    model = make_model()
    untiled = run(model, None)  # TRL's own tile (4096 x 32768) holds the whole input: no tiling at all
    assert_same(run(model, tokens_per_tile), untiled)


@pytest.mark.parametrize("vocab_columns", [1, 333, 1000, 4096])
def test_vocabulary_width_of_a_tile_does_not_change_results(vocab_columns):
    model = make_model()
    assert_same(run(model, 16, vocab_columns), run(model, None))


@pytest.mark.parametrize("temperature, softcap, logit_scale", [(0.7, None, None), (1.0, 3.0, None), (1.3, 2.0, 0.5)])
def test_temperature_softcapping_and_scaling_match_the_explicit_formula(temperature, softcap, logit_scale):
    model = make_model(temperature, softcap, logit_scale)
    logps, entropy, _, input_ids = run(model, 5)
    with torch.no_grad():
        hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]
        logits = model.lm_head(hidden) * (logit_scale or 1.0)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        log_softmax = torch.log_softmax(logits / temperature, dim=-1)
    expected = log_softmax.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    expected_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    assert torch.allclose(logps, expected, atol=1e-5)
    assert torch.allclose(entropy, expected_entropy, atol=1e-5)


def test_constants_are_restored_even_after_an_error():
    before = kernel.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
    with pytest.raises(RuntimeError, match="boom"):
        with lm_head_tiles(3):
            assert (kernel.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE) == (3, VOCAB_COLUMNS_PER_TILE)
            raise RuntimeError("boom")
    assert (kernel.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE) == before


def test_none_leaves_trl_tiles_untouched():
    before = kernel.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
    with lm_head_tiles(None):
        assert (kernel.TOKEN_CHUNK_SIZE, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE) == before


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_distillation_divergence_tiled_equals_untiled(beta):
    """TRL's distillation kernel reads the same tile constants' siblings (its own TOKEN_CHUNK_SIZE and
    VOCAB_CHUNK_SIZE): tiled by tensor_batch_size, its divergence, entropy and gradients are the untiled ones."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    generator = torch.Generator().manual_seed(0)
    student_weight = torch.randn(1000, 16, generator=generator).requires_grad_()
    teacher_weight, teacher = torch.randn(1000, 24, generator=generator), 0.3 * torch.randn(50, 24, generator=generator)
    hidden = (0.3 * torch.randn(50, 16, generator=generator)).requires_grad_()  # logits of a few units

    def run(tokens_per_tile, vocab_columns=VOCAB_COLUMNS_PER_TILE):
        with lm_head_tiles(tokens_per_tile, vocab_columns):
            divergence, entropy = ChunkedDivergenceFunction.apply(
                hidden, student_weight, None, teacher, teacher_weight, None, beta, 0.8, 1.0, None, 1.0, None
            )
            grads = torch.autograd.grad((divergence * torch.arange(50.0)).sum(), [hidden, student_weight])
        return divergence.detach(), entropy, grads

    untiled = run(None)
    for tiled in (run(7, 333), run(50, 1000)):
        for a, b in zip([*tiled[:2], *tiled[2]], [*untiled[:2], *untiled[2]]):  # (fp32 sums over 1000 columns)
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max())), (a - b).abs().max()

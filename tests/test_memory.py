"""Specification of hf_dynbsz.planning.memory: the model of a pass's memory and the largest token budget that fits."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_dynbsz.planning.memory import (
    FAILURE_SHRINK,
    KINDS,
    Coefficients,
    MemoryModel,
    plan_rows,
    prior_coefficients,
    teacher_budget_scale,
)

CONFIG = types.SimpleNamespace(
    hidden_size=512, num_hidden_layers=4, intermediate_size=1376, num_attention_heads=8, vocab_size=4000
)


def model(limit=None, fixed=50.0, per_token=0.25, per_pair=0.0):
    coefficients = Coefficients(fixed, per_token, per_pair)
    return MemoryModel({kind: coefficients for kind in KINDS}, limit)


def test_prior_grows_with_the_model_and_shrinks_with_checkpointing_and_no_grad():
    wide = types.SimpleNamespace(**dict(vars(CONFIG), hidden_size=1024, intermediate_size=2752))
    base = prior_coefficients(CONFIG, "training")
    assert prior_coefficients(wide, "training").per_token > 1.9 * base.per_token
    assert prior_coefficients(CONFIG, "training", gradient_checkpointing=True).per_token < 0.6 * base.per_token
    assert prior_coefficients(CONFIG, "logprob").per_token < base.per_token / 2
    assert prior_coefficients(CONFIG, "training", activation_bytes=2).per_token < base.per_token


def test_prior_reads_per_layer_sizes_and_unreadable_ones():
    # Gemma-3n lists intermediate_size per layer: the prior takes the largest; a size that is no number falls back.
    per_layer = types.SimpleNamespace(**dict(vars(CONFIG), intermediate_size=[1376, 688, 1376, 688]))
    assert prior_coefficients(per_layer, "training") == prior_coefficients(CONFIG, "training")
    unreadable = types.SimpleNamespace(**dict(vars(CONFIG), intermediate_size="auto", vocab_size=None))
    assert prior_coefficients(unreadable, "training").per_token > 0


def test_prior_counts_attention_pairs_only_for_eager_kernels():
    assert prior_coefficients(CONFIG, "training", attn_implementation="eager").per_pair > 0
    assert prior_coefficients(CONFIG, "training", attn_implementation="sdpa").per_pair == 0
    with pytest.raises(ValueError, match="kind must be one of"):
        prior_coefficients(CONFIG, "generation")


def test_without_a_limit_nothing_is_chosen():
    assert model().budget("training", held_mib=100.0, longest=64) is None
    assert model().room(100.0) is None


def test_few_measurements_keep_the_priors_fixed_term_and_scale_its_load():
    memory = model()
    memory.observe("training", 1000, 0, 600.0)  # the prior says 300
    assert memory.coefficients("training") == Coefficients(50.0, 0.55, 0.0)
    assert memory.coefficients("logprob") == Coefficients(50.0, 0.25, 0.0)  # kinds learn apart
    for tokens in (500, 2000, 4000, 8000):  # five, of all sizes: still too few for a full fit
        memory.observe("training", tokens, 0, 50.0 + 0.55 * tokens)
    assert memory.coefficients("training") == Coefficients(50.0, pytest.approx(0.55), 0.0)


def test_measured_passes_refit_the_coefficients():
    memory = model(per_pair=1e-6)
    truth = Coefficients(120.0, 0.3, 2e-6)
    for tokens, pairs in [
        (500, 10_000),
        (1000, 400_000),
        (2000, 90_000),
        (4000, 2_000_000),
        (3000, 50_000),
        (800, 600_000),
    ]:
        memory.observe("training", tokens, pairs, truth.increment(tokens, pairs))
    fitted = memory.coefficients("training")
    assert fitted.fixed == pytest.approx(120.0, rel=1e-6)
    assert fitted.per_token == pytest.approx(0.3, rel=1e-6)
    assert fitted.per_pair == pytest.approx(2e-6, rel=1e-6)


def test_a_fit_never_goes_negative():
    memory = model()
    for tokens in (1000, 1500, 2000, 2500, 3000, 3500):  # a line through -200 MiB at 0
        increment = 0.3 * tokens - 200.0
        memory.observe("training", tokens, 0, increment)
    assert memory.coefficients("training").fixed == 0.0
    assert memory.coefficients("training").per_token > 0


def test_budget_is_the_largest_that_fits_the_room():
    memory = model(limit=2000.0)
    room = 2000.0 * (1 - memory.headroom) - 500.0
    budget = memory.budget("training", held_mib=500.0, longest=100)
    margin = 1 + memory.increment_margin
    assert (
        margin * memory.increment("training", budget, 0) <= room < margin * memory.increment("training", budget + 1, 0)
    )


@settings(max_examples=200, deadline=None)
@given(
    limit=st.floats(100, 100_000),
    held=st.floats(0, 50_000),
    fixed=st.floats(0, 500),
    per_token=st.floats(1e-4, 2.0),
    per_pair=st.floats(0, 1e-3),
    longest=st.integers(1, 100_000),
)
def test_budget_fits_with_its_longest_sequence(limit, held, fixed, per_token, per_pair, longest):
    memory = model(limit, fixed, per_token, per_pair)
    budget = memory.budget("training", held, longest)
    room = memory.room(held)
    assert budget >= 1

    def worst(tokens):  # a pass of `tokens` whose sequences are at most `longest` long, with the model's margin
        return (1 + memory.increment_margin) * memory.increment("training", tokens, tokens * min(tokens, longest))

    if budget > 1:
        assert worst(budget) <= room * (1 + 1e-9)
    assert worst(budget + 1) > room * (1 - 1e-9)


def test_a_failed_pass_caps_the_budget_and_teaches_the_fit():
    memory = model(limit=2000.0)
    before = memory.budget("training", held_mib=0.0, longest=10)
    memory.record_failure("training", tokens=4000, pairs=0, held_mib=0.0)
    assert memory.caps["training"] == int(4000 * FAILURE_SHRINK)
    assert memory.budget("training", held_mib=0.0, longest=10) <= int(4000 * FAILURE_SHRINK) < before
    assert memory.budget("logprob", held_mib=0.0, longest=10) == before
    # the fit now predicts that 4000 tokens need the whole limit
    assert memory.increment("training", 4000, 0) == pytest.approx(2000.0)


def test_describe_names_whether_the_coefficients_are_fitted():
    memory = model()
    assert memory.describe("training").endswith("(prior)")
    memory.observe("training", 1000, 0, 300.0)
    assert memory.describe("training").endswith("(fitted)")


def test_plan_rows_answer_what_budget_fits():
    from hf_dynbsz.planning.memory import plan_rows

    rows = dict((name, value) for name, value, _ in plan_rows(model(limit=2000.0), 500.0, "given", longest=100))
    assert rows["max_memory_per_device_mib"] == "2000"
    assert rows["budget that fits, training"] == str(model(limit=2000.0).budget("training", 500.0, 100))
    full = dict((name, value) for name, value, _ in plan_rows(model(limit=2000.0), 1950.0, "given", longest=100))
    assert full["budget that fits, training"] == "none"


def test_held_estimate_shards_with_zero():
    from hf_dynbsz.planning.memory import estimated_held_mib

    alone = estimated_held_mib(CONFIG)
    assert estimated_held_mib(CONFIG, num_processes=8, zero_stage=3) == pytest.approx(alone / 8)
    assert alone / 8 < estimated_held_mib(CONFIG, num_processes=8, zero_stage=2) < alone


def test_a_teachers_passes_have_a_model_of_their_own_from_the_teachers_config():
    """A distillation's teacher: its no-grad passes' prior is a log-prob pass's, of the teacher's config; the plan
    shows its rows; its budget scale is the student's no-grad memory per token over the teacher's."""
    teacher = types.SimpleNamespace(**dict(vars(CONFIG), hidden_size=1024, intermediate_size=2752))
    memory = MemoryModel.from_config(CONFIG, 4000, teacher_config=teacher)
    assert memory.priors["teacher"] == prior_coefficients(teacher, "logprob")
    assert memory.priors["logprob"] == prior_coefficients(CONFIG, "logprob")
    assert MemoryModel.from_config(CONFIG).priors["teacher"] == prior_coefficients(CONFIG, "logprob")
    names = [row[0] for row in plan_rows(memory, 100.0, "measured", 64)]
    assert "memory of a teacher pass" in names and "budget that fits, teacher" in names
    assert "memory of a teacher pass" not in [
        row[0] for row in plan_rows(MemoryModel.from_config(CONFIG, 4000), 1, "", 1)
    ]
    scale = teacher_budget_scale(CONFIG, teacher)
    assert scale == pytest.approx(prior_coefficients(CONFIG, "logprob").per_token / memory.priors["teacher"].per_token)
    assert 0.45 < scale < 0.55 and teacher_budget_scale(CONFIG, CONFIG) == 1.0

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


def test_a_tree_rows_path_keys_are_a_term_of_their_own():
    """A prefix tree's node gathers its path's keys and values (and, in the sdpa / eager spans, queries) in front of
    its own, in every layer: the prior counts them per path key, more without gradient checkpointing (every layer's
    copies kept for backward) than with it, and none under flex_attention (its block mask reads the row in place)."""
    sdpa = prior_coefficients(CONFIG, "training", attn_implementation="sdpa", gradient_checkpointing=True)
    assert sdpa.per_path_key > 0
    assert prior_coefficients(CONFIG, "training", attn_implementation="sdpa").per_path_key > 2 * sdpa.per_path_key
    assert prior_coefficients(CONFIG, "logprob", attn_implementation="eager").per_path_key > 0
    assert 0 < prior_coefficients(CONFIG, "logprob", attn_implementation="flash_attention_2").per_path_key
    assert prior_coefficients(CONFIG, "training", attn_implementation="flex_attention").per_path_key == 0
    # a pass of the same tokens grows with the keys its row gathers, and so does its predicted peak
    memory = MemoryModel({kind: sdpa for kind in KINDS}, 4000.0)
    increments = [memory.increment("training", 2000, 0, path_keys) for path_keys in (0, 1000, 4000)]
    assert increments[0] < increments[1] < increments[2]
    assert increments[2] - increments[0] == pytest.approx(4000 * sdpa.per_path_key)
    assert memory.peak("training", 2000, 0, 100.0, 1000) == pytest.approx(100.0 + increments[1])
    # fewer tokens fit a pass whose rows gather more keys per token
    budgets = [memory.budget("training", 500.0, 64, path_keys_per_token=ratio) for ratio in (0.0, 1.0, 3.0)]
    assert budgets[0] > budgets[1] > budgets[2] >= 1


def test_measured_passes_refit_the_path_key_term():
    """Passes of many shapes (path keys apart from tokens) fit the path-key term; passes whose path keys are always
    the same share of their tokens cannot tell it apart from the per-token term: it keeps the prior's share."""
    memory = model(per_pair=0.0)
    memory.priors = {kind: Coefficients(50.0, 0.25, 0.0, 0.02) for kind in KINDS}
    truth = Coefficients(120.0, 0.3, 0.0, 0.05)
    shapes = [(500, 0), (1000, 3000), (2000, 200), (4000, 9000), (3000, 1000), (800, 2400), (1500, 6000)]
    for tokens, path_keys in shapes:
        memory.observe("training", tokens, 0, truth.increment(tokens, 0, path_keys), path_keys)
    fitted = memory.coefficients("training")
    assert (fitted.fixed, fitted.per_token, fitted.per_path_key) == pytest.approx((120.0, 0.3, 0.05), rel=1e-6)
    alike = model()
    alike.priors = {kind: Coefficients(50.0, 0.25, 0.0, 0.02) for kind in KINDS}
    for tokens in (500, 1000, 2000, 4000, 3000, 800):
        alike.observe("training", tokens, 0, truth.increment(tokens, 0, tokens // 2), tokens // 2)
    fitted = alike.coefficients("training")
    assert fitted.per_path_key == pytest.approx(0.02 * fitted.per_token / 0.25)
    assert fitted.increment(1000, 0, 500) == pytest.approx(truth.increment(1000, 0, 500), rel=1e-6)


def test_a_planned_pass_that_does_not_fit_cuts_the_budget():
    """The budget counts the step's path keys per token; a pass gathering more (short leaves under a long trunk) may
    not fit: :meth:`fitting_budget` cuts the budget by its overshoot, until every pass of several samples fits. A pass
    of one sample cannot be split and does not cut it."""
    memory = MemoryModel({kind: Coefficients(20.0, 0.1, 0.0, 0.05) for kind in KINDS}, 1000.0)
    held = 400.0
    budget = memory.budget("training", held, 64, path_keys_per_token=0.5)
    room = memory.room(held)
    margin = 1 + memory.increment_margin
    fitting = (budget, 0, budget // 2, 4)  # the step's share of path keys: fits
    assert memory.fitting_budget("training", held, budget, [fitting, (budget // 3, 0, 0, 2)]) == budget
    heavy = (budget, 0, 3 * budget, 5)  # three path keys per token
    assert margin * memory.increment("training", budget, 0, 3 * budget) > room
    smaller = memory.fitting_budget("training", held, budget, [fitting, heavy])
    assert 1 <= smaller < budget
    # the same share of keys at the smaller budget fits
    assert margin * memory.increment("training", smaller, 0, 3 * smaller) <= room * (1 + 1e-9)
    alone = (budget, 0, 3 * budget, 1)
    assert memory.fitting_budget("training", held, budget, [fitting, alone]) == budget
    assert (
        MemoryModel({kind: Coefficients(20.0, 0.1, 0.0) for kind in KINDS}).fitting_budget(
            "training", held, budget, [heavy]
        )
        == budget
    )  # without a limit, nothing to fit


def test_held_states_are_reserved_from_the_room():
    """A distillation teacher's last hidden states the passes will hold (``tokens x width`` values): the budget is the
    one that fits as if the process held them already."""
    from hf_dynbsz.planning.memory import held_states_mib

    assert held_states_mib(1000, 1024, 2) == pytest.approx(1000 * 1024 * 2 / 2**20)
    assert held_states_mib(0, 1024, 4) == 0.0
    memory = model(limit=2000.0)
    states = held_states_mib(20_000, 4096, 4)
    assert memory.budget("teacher", 500.0, 100, reserved_mib=states) == memory.budget("teacher", 500.0 + states, 100)
    assert memory.budget("teacher", 500.0, 100, reserved_mib=states) < memory.budget("teacher", 500.0, 100)
    passes = [(5000, 0, 0, 3)]
    assert memory.fitting_budget("teacher", 500.0, 5000, passes, reserved_mib=states) == memory.fitting_budget(
        "teacher", 500.0 + states, 5000, passes
    )

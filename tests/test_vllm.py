"""TRL's vLLM path (``use_vllm=True``), tested without vLLM: the stand-in of :mod:`hf_dynbsz.testing.vllm_standin`
behind TRL's own ``VLLMGeneration``, single process (2-process DDP: ``tests/test_distributed.py``).

The stand-in first: what ``generate`` returns in server and colocate mode (TRL's shapes; completions sampled from the
engine's weights; each token's log-probability after temperature plus fixed noise), that weight syncs are real (the
engine holds the weights of the last sync, and a run without syncs samples other completions) and that server mode's
``get_server_info`` is read. Then the trainers: stock ``GRPOTrainer`` and ``DynamicBatchGRPOTrainer``, each built and
trained in a stand-in of its own, across the four ``vllm_importance_sampling_mode`` values, the loss types (each treats
TRL's ratio its own way), server and colocate mode and one or two iterations: the same completions, parameters within
1e-5 of stock's (and their updates within 1e-3), and every metric TRL logs (the importance-sampling ratio's min, mean
and max, the sampling log-prob difference and the loss metrics among them) within 1e-5. RLOOTrainer the same way (it
asks vLLM for no log-probs and has no importance-sampling correction). A probe shows that the old log-probs TRL builds
the ratio from are the plugin's packed no-grad passes, and that the probe sees stock's pass when the plugin falls back
to it.

By default one combination of mode and iterations per (loss type, sampling mode) pair, a Latin square over them, so
every pair and every combination runs; ``-m long`` runs all of them.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from trl.generation.vllm_generation import VLLMGeneration

from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer, DynamicBatchRLOOConfig, DynamicBatchRLOOTrainer
from hf_dynbsz.execution.executor import PassExecutor
from hf_dynbsz.testing import (
    RecordingReward,
    base_config_kwargs,
    construction_error,
    logged_metrics,
    metric_mismatches,
    prompt_dataset,
    relative_difference,
    run_training,
    saved_model_trainer,
    update_difference,
    vllm_standin,
)

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "vespo", "sapo", "luspo")
#: (vllm_mode, num_iterations): server and colocate mode, old log-probs computed for the correction alone (1) or
#: reused by a second iteration whose ratio moves off 1 (2).
RUNS = (("server", 1), ("colocate", 2), ("colocate", 1), ("server", 2))
#: Clip bounds both sides of 1, so that truncation and masking act on the stand-in's noisy ratios.
IS_BOUNDS = dict(vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0)
#: Per loss type, what its run needs: luspo is meant with sequence-level ratios and, summing over tokens, is chaotic
#: at the common learning rate (tests/test_trainer.py's CHAOS_FREE_LEARNING_RATE).
LOSS_FIELDS = {"luspo": dict(importance_sampling_level="sequence", learning_rate=0.1)}
SMALL_BUDGET = 40  # tokens per pass: prompts are 3-18 tokens, so stock's slices of 4 rows are cut up
PARAM_TOLERANCE, UPDATE_TOLERANCE = 1e-5, 1e-3
#: Relative, every logged metric. A later step's metrics are computed on parameters that agree to PARAM_TOLERANCE
#: (at a learning rate of 0.5), so they cannot be held tighter: vespo's third loss, colocate, 2 iterations, differed
#: by 1.1e-5 of 0.0988 (its first two, before any update, by none).
METRIC_TOLERANCE = 2 * PARAM_TOLERANCE
IS_METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


def vllm_fields(vllm_mode: str, num_iterations: int = 1, **fields) -> dict:
    """A run on TRL's vLLM path: ``vllm_mode``, ``num_iterations``, two rounds of generation (two weight syncs)."""
    rounds = dict(num_iterations=num_iterations, max_steps=1 + num_iterations)
    return dict(use_vllm=True, vllm_mode=vllm_mode, **rounds, **fields)


# ---- the stand-in ---------------------------------------------------------------------------------------------------


def stock_trainer(model_dir, tmp_path, **fields):
    """Stock GRPOTrainer on the saved model with the comparison runs' config and ``fields`` (build it in a stand-in)."""
    return saved_model_trainer(GRPOConfig(**base_config_kwargs(str(tmp_path), **fields)), model_dir)


def model_logps(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """The model's own log-probability of each completion token after ``temperature``, the sequence alone."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)


def test_the_stand_in_replaces_trls_name_only_inside_its_context():
    import trl.generation.vllm_generation as vllm_generation
    import trl.trainer.grpo_trainer as grpo_module
    import trl.trainer.rloo_trainer as rloo_module

    with vllm_standin():
        assert issubclass(grpo_module.VLLMGeneration, VLLMGeneration)
        assert rloo_module.VLLMGeneration is grpo_module.VLLMGeneration is not VLLMGeneration
        assert hasattr(vllm_generation, "SamplingParams")
    assert grpo_module.VLLMGeneration is rloo_module.VLLMGeneration is VLLMGeneration
    assert not hasattr(vllm_generation, "SamplingParams")  # vLLM's, absent without vLLM


def generated(model_dir, tmp_path, vllm_mode: str, prompts, temperature: float):
    """``(generate's return, the trainer, the stand-in)`` of TRL's ``VLLMGeneration`` in ``vllm_mode``, 4 generations
    per prompt, after a weight sync."""
    with vllm_standin() as standin:
        trainer = stock_trainer(model_dir, tmp_path / vllm_mode, temperature=temperature, **vllm_fields(vllm_mode))
        trainer.vllm_generation.sync_weights()
        repeated = [prompt for prompt in prompts for _ in range(4)]
        result = trainer.vllm_generation.generate(prompts=repeated, images=None, num_generations=4)
    return result, trainer, standin


def test_generate_returns_trls_shapes_sampled_from_the_model_with_fixed_noise(model_dir, tmp_path):
    prompts, temperature = [[3, 4, 5, 6], [6, 5]], 0.7
    server, trainer, standin = generated(model_dir, tmp_path, "server", prompts, temperature)
    colocate, _, _ = generated(model_dir, tmp_path, "colocate", prompts, temperature)
    assert colocate == server  # one request per prompt (colocate) or n per request (server): the same draws
    prompt_ids, completion_ids, logprobs, logprob_token_ids = server
    assert prompt_ids == [prompt for prompt in prompts for _ in range(4)]
    eos, cap = trainer.processing_class.eos_token_id, trainer.max_completion_length
    assert all(ids[-1] == eos or len(ids) == cap for ids in completion_ids)
    assert all(eos not in ids[:-1] for ids in completion_ids)
    assert len(set(map(tuple, completion_ids))) > 4  # sampled, not greedy
    assert logprob_token_ids == [[[token] for token in ids] for ids in completion_ids]
    noise = []
    for prompt, ids, lps in zip(prompt_ids, completion_ids, logprobs):
        assert [len(lp) for lp in lps] == [1] * len(ids)
        own = model_logps(trainer.model, prompt, ids, temperature)
        noise += (torch.tensor([lp[0] for lp in lps]) - own).tolist()
    noise = torch.tensor(noise)
    assert abs(noise.mean()) < 0.15 and 0.2 < noise.std() < 0.4  # normal noise of 0.3 nats: vLLM's other kernels
    assert standin.engines[0].syncs == 1 and standin.engines[0].sequences == 8


def test_server_mode_reads_the_servers_logprobs_mode(model_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING), vllm_standin(logprobs_mode="raw_logprobs"):
        stock_trainer(model_dir, tmp_path, **vllm_fields("server"))
    assert "runs with `--logprobs-mode raw_logprobs`" in caplog.text


def trained_completions(model_dir, tmp_path, monkeypatch=None):
    """The completions of a 2-step stock run on the vLLM path (server mode), the trainer and its engine; with
    ``monkeypatch``, TRL's weight sync does nothing."""
    if monkeypatch is not None:
        monkeypatch.setattr(VLLMGeneration, "sync_weights", lambda self: None)
    with vllm_standin() as standin:
        trainer = stock_trainer(model_dir, tmp_path, **vllm_fields("server"))
        trainer.train()
    return trainer.reward_funcs[0].completions, trainer, standin.engines[0]


def test_weight_syncs_are_real(model_dir, tmp_path, monkeypatch):
    completions, trainer, engine = trained_completions(model_dir, tmp_path / "synced")
    assert engine.syncs == engine.requests == 2  # a sync before each round of generation
    trained = dict(trainer.model.named_parameters())
    assert any(not torch.equal(engine.parameters[name], p) for name, p in trained.items())  # the last step's update
    trainer.vllm_generation.sync_weights()
    assert engine.syncs == 3
    assert all(torch.equal(engine.parameters[name], p) for name, p in trained.items())
    # without syncs the engine samples from the initial weights: the first round's completions, then others
    unsynced, _, stale_engine = trained_completions(model_dir, tmp_path / "unsynced", monkeypatch)
    assert stale_engine.syncs == 0
    half = len(completions) // 2
    assert unsynced[:half] == completions[:half] and unsynced[half:] != completions[half:]


# ---- stock against the plugin ---------------------------------------------------------------------------------------


def compare_with_stock(model_dir, tmp_path, stock, plugin, **fields) -> dict:
    """``stock`` and ``plugin`` (trainer, config classes) trained from the same model, each in a stand-in of its own:
    the same completions and weight syncs, parameters and every logged metric as stock's. Returns stock's
    history."""
    runs = {}
    for name, classes, own in (("stock", stock, {}), ("ours", plugin, dict(max_tokens_per_microbatch=SMALL_BUDGET))):
        with vllm_standin() as standin:
            run = run_training(*classes, model_dir, str(tmp_path / name), **fields, **own)
        runs[name] = SimpleNamespace(**dict(zip(("initial", "final", "completions", "history"), run)))
        runs[name].engines = [(engine.syncs, engine.requests) for engine in standin.engines]
    stock_run, ours = runs["stock"], runs["ours"]
    assert ours.completions == stock_run.completions
    assert ours.engines == stock_run.engines and stock_run.engines[0][0] == 2  # two rounds, each after a sync
    assert relative_difference(ours.initial, stock_run.initial) == 0.0
    assert relative_difference(ours.final, stock_run.final) <= PARAM_TOLERANCE
    assert update_difference(stock_run.initial, ours.final, stock_run.final) <= UPDATE_TOLERANCE
    assert len([entry for entry in ours.history if "dynbsz/microbatches" in entry]) == fields["max_steps"]
    assert not metric_mismatches(logged_metrics(ours.history), logged_metrics(stock_run.history), rel=METRIC_TOLERANCE)
    return stock_run.history


def grpo_matrix():
    """Every (loss type, sampling mode, vLLM mode, iterations); the default run of a pair takes the ``RUNS`` entry of
    ``(loss index + mode index) mod 4``, so every loss type and every sampling mode meets all four entries."""
    for i, loss_type in enumerate(LOSS_TYPES):
        for j, mode in enumerate(IS_MODES):
            if loss_type == "vespo" and mode.startswith("sequence"):
                continue  # TRL refuses it (test_vespo_refuses_sequence_level_correction_as_stock_does)
            for run in RUNS:
                marks = [pytest.mark.long] + ([pytest.mark.representative] if run == RUNS[(i + j) % 4] else [])
                yield pytest.param(loss_type, mode, *run, marks=marks, id=f"{loss_type}-{mode}-{run[0]}-{run[1]}")


@pytest.mark.parametrize(("loss_type", "mode", "vllm_mode", "num_iterations"), list(grpo_matrix()))
def test_grpo_matches_stock_on_the_vllm_path(model_dir, tmp_path, loss_type, mode, vllm_mode, num_iterations):
    fields = vllm_fields(vllm_mode, num_iterations, loss_type=loss_type, vllm_importance_sampling_mode=mode)
    fields.update(IS_BOUNDS, beta=0.0, **LOSS_FIELDS.get(loss_type, {}))
    history = compare_with_stock(model_dir, tmp_path, (GRPOTrainer, GRPOConfig), PLUGIN_GRPO, **fields)
    rounds = [entry for entry in history if IS_METRICS[0] in entry]
    assert len(rounds) == 2 and all(metric in rounds[0] for metric in IS_METRICS)  # logged once per round
    assert all(entry[IS_METRICS[0]] > 0.1 for entry in rounds)  # the stand-in's noise: a correction to make


PLUGIN_GRPO = (DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig)


def test_grpo_matches_stock_with_kl_and_off_policy_mask_on_the_vllm_path(model_dir, tmp_path):
    # beta > 0: the KL term weighted by the ratio (use_bias_correction_kl); the off-policy mask reads vLLM's log-probs
    fields = vllm_fields("server", 2, loss_type="grpo", vllm_importance_sampling_mode="token_truncate", beta=0.05)
    fields.update(IS_BOUNDS, off_policy_mask_threshold=0.05)
    compare_with_stock(model_dir, tmp_path, (GRPOTrainer, GRPOConfig), PLUGIN_GRPO, **fields)


@pytest.mark.long
def test_grpo_matches_stock_with_colocate_sleep_mode(model_dir, tmp_path):
    # sleep level 2 drops the engine's weights after each generation: TRL syncs again before the next
    fields = vllm_fields("colocate", 1, loss_type="dapo", vllm_importance_sampling_mode="sequence_mask", beta=0.0)
    compare_with_stock(
        model_dir, tmp_path, (GRPOTrainer, GRPOConfig), PLUGIN_GRPO, vllm_enable_sleep_mode=True, **IS_BOUNDS, **fields
    )


def test_vespo_refuses_sequence_level_correction_as_stock_does(model_dir, tmp_path):
    errors = []
    for trainer_cls, config_cls in ((GRPOTrainer, GRPOConfig), PLUGIN_GRPO):
        fields = vllm_fields("server", loss_type="vespo", vllm_importance_sampling_mode="sequence_mask")
        with vllm_standin():
            args = config_cls(**base_config_kwargs(str(tmp_path), **fields))
            errors.append(construction_error(trainer_cls, model_dir, args=args, **construction_inputs()))
    assert errors[0] == errors[1] and errors[0][0] is ValueError and "VESPO loss requires" in errors[0][1]


def construction_inputs() -> dict:
    return dict(reward_funcs=RecordingReward(), train_dataset=prompt_dataset())


def rloo_runs():
    for run in RUNS:
        marks = [pytest.mark.long] + ([pytest.mark.representative] if run in RUNS[:2] else [])
        yield pytest.param(*run, marks=marks, id=f"{run[0]}-{run[1]}")


@pytest.mark.parametrize(("vllm_mode", "num_iterations"), list(rloo_runs()))
def test_rloo_matches_stock_on_the_vllm_path(model_dir, tmp_path, vllm_mode, num_iterations):
    # RLOO asks vLLM for no log-probs; with two iterations its ratio reads the plugin's packed old log-probs
    fields = vllm_fields(vllm_mode, num_iterations, beta=0.0)
    compare_with_stock(
        model_dir, tmp_path, (RLOOTrainer, RLOOConfig), (DynamicBatchRLOOTrainer, DynamicBatchRLOOConfig), **fields
    )


# ---- whose old log-probs the ratio reads ---------------------------------------------------------------------------


def probe_old_logps(monkeypatch) -> SimpleNamespace:
    """Records, while training: the log-probs each of the plugin's no-grad pass sets returned (``plugin``), the number
    of no-grad calls to stock's ``_get_per_token_logps_and_entropies`` (``stock``), what TRL's
    ``_generate_and_score_completions`` returned (``rounds``) and the stock slices each optimizer step trained
    (``windows``)."""
    from hf_dynbsz.execution.batch import StepBatch

    record = SimpleNamespace(plugin=[], stock=0, rounds=[], windows=[])
    no_grad_passes, stock_pass = PassExecutor.no_grad_passes, GRPOTrainer._get_per_token_logps_and_entropies
    score, from_slices = GRPOTrainer._generate_and_score_completions, StepBatch.from_slices.__func__

    def plugin_passes(self, *args, **kwargs):
        result = no_grad_passes(self, *args, **kwargs)
        record.plugin.append(result[0])
        return result

    def stock_passes(self, *args, **kwargs):
        record.stock += not torch.is_grad_enabled()
        return stock_pass(self, *args, **kwargs)

    def scored(self, inputs):
        record.rounds.append(score(self, inputs))
        return record.rounds[-1]

    def step_batch(cls, window, *args, **kwargs):
        record.windows.append(window)
        return from_slices(cls, window, *args, **kwargs)

    monkeypatch.setattr(PassExecutor, "no_grad_passes", plugin_passes)
    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", stock_passes)
    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", scored)
    monkeypatch.setattr(StepBatch, "from_slices", classmethod(step_batch))
    return record


def probed_run(model_dir, tmp_path, monkeypatch, num_iterations: int) -> SimpleNamespace:
    """The plugin on the vLLM path (server mode, token-level truncated correction, no reference model) under
    :func:`probe_old_logps`."""
    record = probe_old_logps(monkeypatch)
    fields = vllm_fields("server", num_iterations, loss_type="grpo", vllm_importance_sampling_mode="token_truncate")
    args = DynamicBatchGRPOConfig(
        **base_config_kwargs(str(tmp_path), beta=0.0, max_tokens_per_microbatch=SMALL_BUDGET, **IS_BOUNDS, **fields)
    )
    with vllm_standin():
        saved_model_trainer(args, model_dir).train()
    return record


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_the_ratio_is_built_from_the_plugins_packed_old_logps(model_dir, tmp_path, monkeypatch, num_iterations):
    record = probed_run(model_dir, tmp_path, monkeypatch, num_iterations)
    assert record.stock == 0  # stock's padded no-grad pass never ran
    assert len(record.rounds) == len(record.plugin) == 2  # one old-policy pass set per round (no reference model)
    for scored, packed in zip(record.rounds, record.plugin):
        old, sampling = scored["old_per_token_logps"], scored["sampling_per_token_logps"]
        assert old is packed
        mask = scored["completion_mask"].bool()
        expected = torch.exp(((old - sampling) * mask).nan_to_num()).clamp(0.5, 2.0)  # TRL's token_truncate
        assert torch.allclose(scored["importance_sampling_ratio"], expected, rtol=1e-6, atol=0)
        assert (expected[mask] != 1).float().mean() > 0.9  # the ratio corrects nearly every token
    # every optimizer step (both iterations of a round with 2) trained rows of these old log-probs
    assert len(record.windows) == 1 + num_iterations
    for window in record.windows:
        for stock_slice in window:
            for row in stock_slice["old_per_token_logps"]:
                assert any(torch.equal(row, packed_row) for packed in record.plugin for packed_row in packed)


def test_the_probe_sees_stocks_pass_when_the_plugin_falls_back(model_dir, tmp_path, monkeypatch):
    # the probe of the test above can fail: with the plugin's no-grad tables refused, TRL's ratio reads stock's pass
    monkeypatch.setattr(DynamicBatchGRPOTrainer, "_no_grad_table", lambda self, *args: None)
    record = probed_run(model_dir, tmp_path, monkeypatch, 1)
    assert record.plugin == [] and record.stock == len(record.rounds) == 2

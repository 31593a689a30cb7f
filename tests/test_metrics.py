"""Specification of :mod:`hf_dynbsz.execution.metrics`: stock's loss metrics per stock slice (the rules on hand-made
passes here; against stock's own ``_compute_loss`` in ``tests/test_loss.py``, ``tests/test_rloo_loss.py`` and the
trainer tests), the ``dynbsz/*`` figures of each optimizer step, what they measure, and that they reach a real
reporter (TensorBoard event files, read back)."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
from hf_dynbsz.execution.metrics import PeakMemory, StepClock, StepMetrics, device_peak_tflops
from hf_dynbsz.planning.cost import ModelFlops
from hf_dynbsz.testing import ScriptedRollout, build_char_tokenizer, build_tiny_causal_lm, run_training, save_tiny_model

PEAK_TFLOPS = 0.05  # a made-up device peak, so that dynbsz/mfu is logged on CPU

# ---- stock's loss metrics, per stock slice ---------------------------------------------------------------------
CLIP_FLAGS = ("clip_ratio/low", "clip_ratio/high")


def published(metrics: StepMetrics) -> dict[str, list]:
    store = defaultdict(list)
    metrics.publish_slices(store)
    return dict(store)


def test_a_slices_entropy_is_its_token_mean_over_every_pass_and_process():
    """Slice 0 gets tokens from two passes (one sample from process 1's slice 0: slice id 3 of 3 slices a process),
    slice 1 has none (stock logs 0.0, its count read as 1), slice 2 one pass."""
    metrics = StepMetrics(3, "cpu")
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    metrics.add_pass(5, 6, {}, torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]]), mask, torch.tensor([0, 2]))
    metrics.add_pass(2, 2, {}, torch.tensor([[6.0, 9.0, 9.0]]), torch.tensor([[1, 0, 0]]), torch.tensor([3]))
    assert published(metrics) == {"entropy": [(1.0 + 2.0 + 6.0) / 3, 0.0, 4.0]}
    assert metrics.pass_real_tokens == [5, 2] and metrics.computed_tokens == 8


def test_per_token_and_per_sequence_values_and_the_clip_extremes_per_slice():
    """A ``(rows, width)`` value is a mean over the slice's loss tokens, a ``(rows,)`` one over its sequences; the
    extremes are over the sequences' token means, a sequence without loss tokens left out (stock's nanmin, nanmax),
    NaN for a slice that has none."""
    metrics = StepMetrics(2, "cpu", ("kl", *CLIP_FLAGS, "vespo/phi_seq_mean"))
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    values = {
        "kl": torch.tensor([[1.0, 2.0, 3.0, 7.0], [4.0, 7.0, 7.0, 7.0], [7.0] * 4, [7.0] * 4]),
        "clip_ratio/low": torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [1.0] * 4, [1.0] * 4]),
        "clip_ratio/high": torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0], [1.0] * 4, [1.0] * 4]),
        "vespo/phi_seq_mean": torch.tensor([0.5, 1.5, 2.0, 4.0]),
    }
    metrics.add_pass(4, 16, values, torch.ones(4, 4), mask, torch.tensor([0, 0, 1, 1]))
    store = published(metrics)
    assert store["kl"] == [(1 + 2 + 3 + 4) / 4, 0.0]
    assert store["vespo/phi_seq_mean"] == [(0.5 + 1.5) / 2, (2.0 + 4.0) / 2]
    assert store["clip_ratio/low_mean"] == [2 / 4, 0.0] and store["clip_ratio/high_mean"] == [2 / 4, 0.0]
    assert store["clip_ratio/region_mean"] == [1.0, 0.0]
    assert store["clip_ratio/low_min"][0] == pytest.approx(1 / 3) and store["clip_ratio/high_max"][0] == pytest.approx(
        2 / 3
    )
    assert math.isnan(store["clip_ratio/low_min"][1]) and math.isnan(store["clip_ratio/high_max"][1])


def test_each_slice_logs_its_own_value_where_a_step_value_would_differ():
    """The value stock logs is each slice's; their mean over the step differs from the step's token mean when the
    slices have different token counts (what the plugin logged for GRPO before)."""
    metrics = StepMetrics(2, "cpu")
    entropies, mask = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]]), torch.tensor([[1, 1, 1], [1, 0, 0]])
    metrics.add_pass(4, 6, {}, entropies, mask, torch.tensor([0, 1]))
    assert published(metrics) == {"entropy": [1.0, 4.0]}  # logged 2.5; the step's token mean is 7 / 4


# ---- the step clock ----------------------------------------------------------------------------------------------


def test_clock_counts_each_second_once_in_the_innermost_phase(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("hf_dynbsz.execution.metrics.time.perf_counter", lambda: now[0])
    clock = StepClock()
    with clock.phase("generation"):
        now[0] += 5.0  # generating
        with clock.phase("logprob"):
            now[0] += 2.0  # old-policy log-probs inside TRL's rollout
        now[0] += 1.0
    with clock.phase("train"):
        now[0] += 3.0
        with clock.phase("logprob"):
            now[0] += 0.5  # the entropy mask's no-grad pass
    assert clock.seconds == {"generation": 6.0, "logprob": 2.5, "train": 3.0}
    assert sum(clock.seconds.values()) == now[0]


# ---- peak memory -------------------------------------------------------------------------------------------------


def test_peak_memory_on_cpu_is_the_process_peak_since_reset():
    meter = PeakMemory(torch.device("cpu"))
    block = bytearray(256 * 2**20)  # touched: 256 MiB resident
    meter.reset()
    before = meter.mib()
    del block
    block = bytearray(512 * 2**20)
    after = meter.mib()
    del block
    assert after - before >= 200  # the new 512 MiB block raised the peak above the 256 MiB one


def test_a_pass_peak_restarts_at_held_and_the_step_peak_survives_it():
    meter = PeakMemory(torch.device("cpu"))
    meter.reset()
    block = bytearray(300 * 2**20)  # a first pass's 300 MiB
    del block
    held = meter.held()  # the freed 300 MiB given back: the next pass's peak starts here
    assert meter.pass_peak() - held < 100
    block = bytearray(100 * 2**20)
    assert 80 <= meter.pass_peak() - held < 200
    del block
    assert meter.mib() - held >= 250  # the step's peak still counts the first pass


def test_no_mfu_on_cpu_unless_the_peak_is_given():
    assert device_peak_tflops(torch.device("cpu"), "bf16", None) is None
    assert device_peak_tflops(torch.device("cpu"), "no", 12.5) == 12.5


# ---- model FLOPs -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eager_model():
    return build_tiny_causal_lm(
        build_char_tokenizer(),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )


def test_model_flops_match_torch_flop_counter(eager_model):
    """torch's FLOP counter on a forward and backward of one sample (eager attention computes every (query, key)
    pair; the model FLOPs count the causal half, which is what a causal sample needs)."""
    from torch.utils.flop_counter import FlopCounterMode

    flops = ModelFlops.from_model_config(eager_model.config)
    prompt, completion = 30, 20
    total = prompt + completion
    with FlopCounterMode(display=False) as counter:
        outputs = eager_model(input_ids=torch.randint(3, 20, (1, total)), logits_to_keep=completion)
        outputs.logits.sum().backward()
    dense_pairs, causal_pairs = total * total, total * (total + 1) // 2
    assert counter.get_total_flops() == 6 * (
        flops.per_token * total + flops.per_pair * dense_pairs + flops.per_logit_token * completion
    )
    assert flops.training_flops([prompt], [completion]) == counter.get_total_flops() - 6 * flops.per_pair * (
        dense_pairs - causal_pairs
    )


def test_shared_prompt_tokens_are_not_counted_twice(eager_model):
    flops = ModelFlops.from_model_config(eager_model.config)
    assert (
        flops.training_flops([10, 10], [5, 7]) - flops.training_flops([10, 10], [5, 7], shared_prompt_tokens=10)
        == 6 * flops.per_token * 10
    )


# ---- a real run: values, and TensorBoard event files -----------------------------------------------------------


@pytest.fixture(scope="module")
def tensorboard_run(tmp_path_factory):
    model_dir = save_tiny_model(str(tmp_path_factory.mktemp("model")))
    output_dir = tmp_path_factory.mktemp("run")
    rollout = ScriptedRollout(
        lambda rng, n, rank: rng.integers(1, 20, n),
        lambda rng: rng.integers(3, 12),
        max_completion_length=24,
        seed=3,
    )
    *_, history = run_training(
        DynamicBatchGRPOTrainer,
        DynamicBatchGRPOConfig,
        model_dir,
        str(output_dir),
        max_steps=3,
        report_to=["tensorboard"],
        peak_tflops_per_device=PEAK_TFLOPS,
        trainer_kwargs={"rollout_func": rollout},
    )
    return model_dir, output_dir, rollout, [entry for entry in history if "dynbsz/microbatches" in entry]


def test_every_step_logs_time_throughput_memory_and_mfu(tensorboard_run):
    from transformers import AutoConfig

    model_dir, _, rollout, steps = tensorboard_run
    flops = ModelFlops.from_model_config(AutoConfig.from_pretrained(model_dir))
    assert len(steps) == 3 == len(rollout.rounds)  # one generation round per optimizer step here
    for entry, generated in zip(steps, rollout.rounds):
        prompts, completions = zip(*generated["lengths"])
        seconds = entry["dynbsz/train_seconds"]
        assert seconds > 0 and entry["dynbsz/generation_seconds"] > 0 and entry["dynbsz/logprob_seconds"] >= 0
        # tokens/s: every sample's prompt + completion tokens, over the training passes' time
        assert entry["dynbsz/tokens_per_second"] * seconds == pytest.approx(generated["real_tokens"], rel=1e-9)
        # MFU: the model FLOPs of these samples (shared prompts computed once) over time x peak
        expected = flops.training_flops(prompts, completions, entry["dynbsz/shared_tokens_saved"])
        # the former name, deprecated, logged alongside for one release with the same value
        assert entry["dynbsz/prompt_tokens_saved"] == entry["dynbsz/shared_tokens_saved"] > 0
        assert entry["dynbsz/mfu"] * seconds * PEAK_TFLOPS * 1e12 == pytest.approx(expected, rel=1e-9)
        assert 100 < entry["dynbsz/peak_memory_mib"] < 24 * 1024  # this process's peak resident set, in MiB


def test_dynbsz_metrics_reach_tensorboard_event_files(tensorboard_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, output_dir, _, steps = tensorboard_run
    event_files = list(output_dir.glob("runs/*/events.out.tfevents.*"))
    assert len(event_files) == 1
    events = EventAccumulator(str(event_files[0].parent))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    names = {key for entry in steps for key in entry if key.startswith("dynbsz/")}
    for name in (
        "dynbsz/tokens_per_second",
        "dynbsz/peak_memory_mib",
        "dynbsz/mfu",
        "dynbsz/train_seconds",
        "dynbsz/generation_seconds",
        "dynbsz/logprob_seconds",
        "dynbsz/padding_fraction",
        "dynbsz/microbatches",
        "dynbsz/computed_tokens",
    ):
        assert name in names
    for name in names:
        assert f"train/{name}" in tags, name
        written = {event.step: event.value for event in events.Scalars(f"train/{name}")}
        logged = {entry["step"]: entry[name] for entry in steps}
        assert written.keys() == logged.keys(), name
        for step, value in logged.items():
            assert math.isclose(written[step], value, rel_tol=1e-6, abs_tol=1e-6), (name, step)

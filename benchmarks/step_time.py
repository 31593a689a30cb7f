"""Training-step time and peak memory: stock ``trl.GRPOTrainer`` vs ``hf_dynbsz.DynamicBatchGRPOTrainer``.

What it runs
------------
Every configuration trains the same small Qwen2-style model (random weights, fp32, sdpa attention, built
from a config: no download) on the same data.  Completions do not come from ``generate``: TRL 1.16's
``rollout_func`` (a ``GRPOTrainer`` argument, ``rollout_func(prompts, trainer) -> {"prompt_ids",
"completion_ids", "logprobs"}``) returns token ids whose lengths are drawn from one of the mixes of
``benchmarks/common.py`` (long-tailed, bimodal, uniform), seeded by the generation round, so every trainer
sees exactly the same prompts and completions and only the training side differs (the worker records a
fingerprint of the lengths of every round; the driver checks that all configurations agree).

Schedule (default): ``per_device_train_batch_size=4``, ``gradient_accumulation_steps=2`` (8 samples per
optimizer step) and ``steps_per_generation=4``: a generation round of 16 samples feeds two optimizer steps, and
stock TRL pads every micro-batch to the longest row of those 16 (TRL issue #7179).  Because
``gradient_accumulation_steps`` is not a multiple of ``steps_per_generation * num_iterations``, TRL computes
the old-policy log-probs in a no-grad pass over the round's samples (``_get_per_token_logps_and_entropies``
under ``torch.no_grad``), which the dynamic trainer packs by its log-prob token budget.

Configurations (``--configs``):

* ``stock``: TRL's ``GRPOTrainer``;
* ``padded``, ``padding_free``: ``DynamicBatchGRPOTrainer`` with that ``packing_layout`` and every other
  setting at its default: the "auto" token budget (``per_device_train_batch_size`` x the padded width of
  stock's micro-batch, i.e. stock's own memory bound, per step) and ``tensor_batch_size`` 1024 (the plug-in
  tiles TRL's fused LM head by 1024 tokens x 8192 vocabulary columns; stock uses TRL's 4096 x 32768);
* ``padded_half`` (``padding_free_half``): a fixed, smaller budget of ``per_device_train_batch_size / 2 x
  (longest prompt + max_completion_length)`` tokens, half of stock's worst case (long-tailed and bimodal
  mixes only);
* ``padded_trl_tile``: ``padded`` with ``tensor_batch_size=None`` (TRL's own LM-head tile, as stock): the
  effect of repacking alone, without the plug-in's smaller LM-head tile.

What it measures, per optimizer step
------------------------------------
* Training phase: wall time from the Trainer's ``on_step_begin`` to ``on_step_end`` callback (all
  ``training_step`` calls of the step, gradient clipping, ``optimizer.step``, ``zero_grad``) minus the time
  spent inside ``_generate_and_score_completions``.  That method is wrapped on the trainer instance (no
  change to either trainer); it holds the rollout, the rewards and the no-grad log-prob pass.
* Log-prob passes: time inside ``_get_per_token_logps_and_entropies`` calls made with gradients disabled
  (wrapped on the instance), once per generation round.
* Tokens: a forward pre-hook on the model adds up ``input_ids.numel()`` of every forward (positions
  computed, padding included), split into training (grad enabled) and log-prob (no grad) passes; real
  tokens are the positions not holding the pad id (the rollout never emits it).  "limit" = stock computed tokens / this
  configuration's computed tokens: the speed-up that token counts alone would predict.
* Peak memory: process RSS high-water mark (``VmHWM`` of ``/proc/self/status``) over a baseline, in a fresh
  subprocess per configuration and repeat.  The baseline is the RSS right before ``trainer.train()`` (model,
  tokenizer, trainer built).  The high-water mark is reset (``/proc/self/clear_refs``, value 5) at the start
  of every optimizer step and after every generation round, so the peak of the training phase and of the
  generation + log-prob phase are read separately; the reported peak is the larger of the two, maximised
  over the steps of the run (median over repeats).

The first optimizer step and the first generation round of every process are warm-up and are left out of
the times (not out of the memory peak); the report's second table gives the first step apart
(:func:`first_step`).  Every configuration sees the same steps (same data), so a time is
aggregated per step index: the median over repeats (robust to other jobs on the machine), then the mean over
the measured steps (steps differ in their data; the mean is the throughput figure).  Runs are interleaved
(stock, dynamic..., then the reverse order in the next repeat), one fresh process each.

Threads: every worker runs torch with 1 thread (``--threads``).  On this shared 2-core machine, with other
jobs running, 2 OpenMP threads per process made a forward/backward 2-10x slower and erratic (threads
spin-waiting for a descheduled sibling); 1 thread per process gave stable times.

Usage (from the repository root)::

    /work/venv/bin/python benchmarks/step_time.py            # default run (< ~20 min on 2 cores)
    /work/venv/bin/python benchmarks/step_time.py --quick    # smoke run, ~1-2 min
    /work/venv/bin/python benchmarks/step_time.py --help

Writes ``benchmarks/results/step_time.md``, ``step_time.png`` and the raw per-step data ``step_time.json``
(``--out-dir`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, load_average, machine_description, markdown_table, median  # noqa: E402

from hf_dynbsz.testing import MIX_LABELS, PROMPT_RANGE, completion_lengths, longest_prompt  # noqa: E402

CONFIGS = {
    "stock": {"label": "stock GRPOTrainer", "layout": None, "budget": None},
    "padded": {"label": "dynamic, padded", "layout": "padded", "budget": "auto"},
    "padding_free": {"label": "dynamic, padding_free, shared prompts", "layout": "padding_free", "budget": "auto"},
    "padding_free_no_share": {
        "label": "dynamic, padding_free, prompts not shared",
        "layout": "padding_free",
        "budget": "auto",
        "share_prompt_prefix": False,
    },
    "padding_free_groups": {
        "label": "dynamic, padding_free, prompts shared in their groups",
        "layout": "padding_free",
        "budget": "auto",
        "share_prompt_prefix": "groups",
    },
    "padding_free_tree": {
        "label": "dynamic, padding_free, prefix tree",
        "layout": "padding_free",
        "budget": "auto",
        "share_prompt_prefix": "tree",
    },
    "padded_half": {"label": "dynamic, padded, budget B/2 x max length", "layout": "padded", "budget": "half"},
    "padding_free_half": {
        "label": "dynamic, padding_free, budget B/2 x max length",
        "layout": "padding_free",
        "budget": "half",
    },
    "padded_trl_tile": {
        "label": "dynamic, padded, TRL's LM-head tile",
        "layout": "padded",
        "budget": "auto",
        "tensor_batch_size": None,
    },
}
HALF_BUDGET_MIXES = ("long_tailed", "bimodal")
#: ``--model qwen2_vl``: the longest prompt (2 images of 256 image tokens and the text), for the "half" budget.
VISION_PROMPT_TOKENS = 2 * 256 + 32
#: ``--model qwen2_vl`` defaults: the long-tailed mix and a prompt-heavy one (large images, short answers), stock vs
#: padded rows vs padding-free rows without and with shared (image) prompts.
VISION_DEFAULTS = dict(mixes="long_tailed,prompt_heavy", configs="stock,padded,padding_free_no_share,padding_free")
#: ``--model qwen2_vl``: image sides (pixels) of the prompt-heavy mix (144-256 image tokens each) and of the others.
VISION_SIDES = {"prompt_heavy": (336, 448), "default": (28, 56, 112, 224, 448)}
#: ``--model qwen3_moe`` defaults: the router aux loss on (TRL's default for MoE models), long-tailed completions.
MOE_DEFAULTS = dict(mixes="long_tailed", configs="stock,padded,padding_free")
#: ``--model qwen3_moe``: experts, experts per token, router aux loss coefficient (Qwen3-MoE's default).
MOE_EXPERTS, MOE_TOP_K, MOE_AUX_COEF = 8, 2, 0.001
#: ``--model qwen3_5`` defaults: a Qwen3.5-style hybrid (Gated DeltaNet and full attention) on the long-tailed and
#: the prompt-heavy mixes, stock vs padded rows vs padding-free rows (segment recurrence) without and with shared
#: prompts.
HYBRID_DEFAULTS = dict(mixes="long_tailed,prompt_heavy", configs="stock,padded,padding_free_no_share,padding_free")
#: ``--model qwen3_5``: every how-many-th layer is full attention (Qwen3.5's ``full_attention_interval``).
HYBRID_FULL_ATTENTION_INTERVAL = 4

#: Both presets' schedule: 8 samples per optimizer step (4 per pass, 2 accumulated), a generation round of 16 samples
#: (4 completions per prompt) feeding two optimizer steps.
SCHEDULE = dict(batch_size=4, grad_accum=2, steps_per_generation=4, num_iterations=1, num_generations=4)
PRESETS = {
    # ~1-2 minutes: tiny model, short completions, one repeat, two workloads.
    "quick": dict(
        mixes="long_tailed,uniform",
        configs="stock,padded,padding_free",
        repeats=1,
        **dict(rounds=2, max_completion_length=256, hidden_size=64, num_layers=2, vocab_size=1024),
        **SCHEDULE,
    ),
    # the default run: < ~20 minutes on 2 CPU cores.
    "default": dict(
        mixes="long_tailed,bimodal,uniform",
        configs="stock,padded,padding_free,padding_free_no_share,padding_free_half,padded_trl_tile",
        repeats=3,
        **dict(rounds=3, max_completion_length=1024, hidden_size=128, num_layers=3, vocab_size=4096),
        **SCHEDULE,
    ),
}
SPEC_KEYS = (
    "rounds",
    "max_completion_length",
    "hidden_size",
    "num_layers",
    "vocab_size",
    "batch_size",
    "grad_accum",
    "steps_per_generation",
    "num_iterations",
    "num_generations",
)


# --------------------------------------------------------------------------------------------------- worker
def _read_status_kb(field: str) -> int:
    """A ``/proc/self/status`` figure in kB (the unit of the raw data), read by the package's reader."""
    from hf_dynbsz.execution.device_memory import status_mib

    value = status_mib(field)
    if value is None:
        raise RuntimeError(f"{field} not in /proc/self/status")
    return round(value * 1024)


def reward_by_content(completions, **kwargs):
    """A cheap deterministic reward that varies within a group (so advantages are not all zero)."""
    completions = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # conversational: the text
    return [((len(c) * 7919) % 101) / 100.0 for c in completions]


#: The attention kernels' own operators (their time inside hf_dynbsz's ``dynbsz/attention`` label is compute; the
#: rest of the label is the span formulation's gathers, masks and dispatch).
ATTENTION_KERNELS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math")


class StepProfile:
    """torch.profiler (CPU) over optimizer step ``step`` (1-based): the step's wall time and the CPU time under each
    ``dynbsz/*`` label the executor records (plan, exchange, pack, forward, loss, backward, no_grad_forward, attention)
    and under the attention kernels' operators. ``result``: seconds by name (None until the step ran)."""

    def __init__(self, step: int):
        from transformers import TrainerCallback

        self.step, self.result, self.profiler, self.started = step, None, None, 0.0
        profile = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step + 1 == profile.step:
                    profile.begin()

            def on_step_end(self, args, state, control, **kwargs):
                if profile.profiler is not None:
                    profile.end()

        self.callback = Callback()

    def begin(self) -> None:
        import torch

        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.profiler.__enter__()
        self.started = time.perf_counter()

    def end(self) -> None:
        wall = time.perf_counter() - self.started
        self.profiler.__exit__(None, None, None)
        seconds = {"step": wall}
        for event in self.profiler.key_averages():
            if event.key.startswith("dynbsz/") or event.key in ATTENTION_KERNELS:
                seconds[event.key] = seconds.get(event.key, 0.0) + event.cpu_time_total / 1e6
        self.result, self.profiler = seconds, None


class Probe:
    """Wraps one trainer instance to time phases, count computed tokens and read peak RSS per step. ``counted``: the
    module whose forwards count the tokens (default: the trained model; a distillation's student backbone, which
    its passes call directly)."""

    def __init__(self, trainer, rollout, counted=None):
        import torch

        from hf_dynbsz.execution.device_memory import reset_peak_rss

        self.torch = torch
        self.trainer, self.rollout = trainer, rollout
        self.steps: list[dict] = []
        self.generation_rounds: list[dict] = []
        self.current: dict | None = None
        self._round: dict | None = None
        self.baseline_kb = None
        self.can_reset_peak = reset_peak_rss()
        self._generate = trainer._generate_and_score_completions
        trainer._generate_and_score_completions = self.timed_generate
        self._logps = getattr(trainer, "_get_per_token_logps_and_entropies", None)  # (a distillation has none)
        if self._logps is not None:
            trainer._get_per_token_logps_and_entropies = self.timed_logps
        self.pad_id = trainer._tokenizer.pad_token_id
        (counted or trainer.model).register_forward_pre_hook(self.count_tokens, with_kwargs=True)
        trainer.add_callback(self._step_clock())

    def timed_generate(self, *args, **kwargs):
        """The trainer's ``_generate_and_score_completions``, timed, with the round's peak RSS."""
        self._reset_peak()
        self._round = {
            "logprob_s": 0.0,
            "logprob_cpu_s": 0.0,
            "logprob_tokens": 0,
            "logprob_real_tokens": 0,
            "logprob_passes": 0,
        }
        start, cpu_start = time.perf_counter(), time.process_time()
        result = self._generate(*args, **kwargs)
        elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
        round_record = self._round
        self._round = None
        round_record.update(generation_total_s=elapsed, peak_kb=_read_status_kb("VmHWM"))
        round_record["rollout_and_rewards_s"] = elapsed - round_record["logprob_s"]
        round_record.update(self.rollout.rounds[-1])
        self.generation_rounds.append(round_record)
        if self.current is not None:
            self.current["generation_s"] += elapsed
            self.current["generation_cpu_s"] += cpu_elapsed
            self.current["round"] = len(self.generation_rounds) - 1
        self._reset_peak()
        return result

    def timed_logps(self, *args, **kwargs):
        """The trainer's ``_get_per_token_logps_and_entropies``, timed when it is a round's no-grad pass."""
        if self.torch.is_grad_enabled() or self._round is None:
            return self._logps(*args, **kwargs)
        start, cpu_start = time.perf_counter(), time.process_time()
        result = self._logps(*args, **kwargs)
        self._round["logprob_s"] += time.perf_counter() - start
        self._round["logprob_cpu_s"] += time.process_time() - cpu_start
        return result

    def count_tokens(self, module, args, kwargs):
        """Forward pre-hook: positions computed (and real ones) by training and log-prob passes."""
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            return
        # The rollout never emits the pad id, so every pad-id position is padding.
        real = int((input_ids != self.pad_id).sum())
        if self.torch.is_grad_enabled():
            if self.current is not None:
                self.current["train_tokens"] += int(input_ids.numel())
                self.current["train_real_tokens"] += real
                self.current["train_passes"] += 1
        elif self._round is not None:
            self._round["logprob_tokens"] += int(input_ids.numel())
            self._round["logprob_real_tokens"] += real
            self._round["logprob_passes"] += 1

    def _step_clock(self):
        """A Trainer callback recording each optimizer step's times, tokens and peak RSS."""
        from transformers import TrainerCallback

        probe = self

        class StepClock(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                probe._reset_peak()
                probe.current = {
                    "generation_s": 0.0,
                    "generation_cpu_s": 0.0,
                    "train_tokens": 0,
                    "train_real_tokens": 0,
                    "train_passes": 0,
                    "round": None,
                    "begin": time.perf_counter(),
                    "cpu_begin": time.process_time(),
                }

            def on_step_end(self, args, state, control, **kwargs):
                record = probe.current
                record["wall_s"] = time.perf_counter() - record.pop("begin")
                record["train_s"] = record["wall_s"] - record["generation_s"]
                record["train_cpu_s"] = time.process_time() - record.pop("cpu_begin") - record["generation_cpu_s"]
                record["peak_kb"] = _read_status_kb("VmHWM")
                if record["round"] is None:
                    record["round"] = len(probe.generation_rounds) - 1
                probe.steps.append(record)
                probe.current = None

        return StepClock()

    def _reset_peak(self):
        if self.can_reset_peak:
            from hf_dynbsz.execution.device_memory import reset_peak_rss

            reset_peak_rss()


def code_fingerprint() -> str:
    """Hash of the hf_dynbsz sources this process imports (others may edit the repository during a run)."""
    import hashlib

    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1] / "hf_dynbsz"
    for path in sorted(package.rglob("*.py")):  # every layer (planning/, execution/, parallel/, testing/)
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def run_worker(spec: dict) -> dict:
    from hf_dynbsz.testing import ModelShape, build_char_tokenizer, mix_rollout, numbered_prompts, quiet_worker

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    fingerprint = code_fingerprint()
    quiet_worker(spec.get("threads"))
    if spec.get("threads"):
        import torch

        torch.set_num_interop_threads(spec["threads"])
    if spec.get("model") == "qwen2_vl":
        return run_vision_worker(spec, fingerprint)
    tokenizer = build_char_tokenizer()
    if spec.get("model") == "qwen3_moe":
        model = build_moe_model(spec, len(tokenizer))
    elif spec.get("model") == "qwen3_5":
        model = build_hybrid_model(spec, len(tokenizer))
    else:
        shape = ModelShape(spec["hidden_size"], spec["num_layers"], vocab_size=spec["vocab_size"])
        model = shape.build(tokenizer, max_positions=longest_prompt(spec["mix"]) + spec["max_completion_length"] + 64)
    num_params = sum(p.numel() for p in model.parameters())
    rollout = mix_rollout(spec["mix"], tokenizer, spec["max_completion_length"], spec["seed"])
    dataset = numbered_prompts(num_prompts(spec), width=5)
    return train_and_measure(spec, fingerprint, model, tokenizer, rollout, dataset, num_params)


def _shared_config_fields(spec: dict) -> dict:
    """Config fields every benchmark model shares: positions for the mix's longest sequence, the tokenizer's ids."""
    return dict(
        max_position_embeddings=longest_prompt(spec["mix"]) + spec["max_completion_length"] + 64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
        tie_word_embeddings=False,
    )


def _seeded_sdpa_model(model_class, config):
    """``model_class(config)`` on sdpa, with seed-0 random weights (the same model in every worker)."""
    import torch

    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return model_class(config)


def build_hybrid_model(spec: dict, tokenizer_size: int):
    """A Qwen3.5-style hybrid: Gated DeltaNet (linear attention) layers with a full-attention layer every
    HYBRID_FULL_ATTENTION_INTERVAL-th, transformers' torch fallbacks of its kernels (no flash-linear-attention)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hidden, layers = spec["hidden_size"], spec["num_layers"]
    heads = max(2, hidden // 32)
    config = Qwen3_5TextConfig(
        vocab_size=max(spec["vocab_size"], tokenizer_size),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, hidden // 64),
        head_dim=32 if hidden >= 64 else hidden // 2,
        linear_num_key_heads=heads,
        linear_num_value_heads=heads,
        linear_key_head_dim=32 if hidden >= 64 else hidden // 2,
        linear_value_head_dim=32 if hidden >= 64 else hidden // 2,
        layer_types=[
            "full_attention" if (i + 1) % HYBRID_FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
            for i in range(layers)
        ],
        **_shared_config_fields(spec),
    )
    return _seeded_sdpa_model(Qwen3_5ForCausalLM, config).float()


def build_moe_model(spec: dict, tokenizer_size: int):
    """A Qwen3-MoE-style model: every layer a mixture of MOE_EXPERTS experts (MLP 3 x hidden / MOE_TOP_K each, so
    a token's expert work equals the dense model's MLP), MOE_TOP_K per token, the router aux loss on."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hidden = spec["hidden_size"]
    config = Qwen3MoeConfig(
        vocab_size=max(spec["vocab_size"], tokenizer_size),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        moe_intermediate_size=3 * hidden // MOE_TOP_K,
        num_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOP_K,
        num_hidden_layers=spec["num_layers"],
        num_attention_heads=max(2, hidden // 32),
        num_key_value_heads=max(1, hidden // 64),
        head_dim=32 if hidden >= 64 else hidden // 2,
        router_aux_loss_coef=MOE_AUX_COEF,
        **_shared_config_fields(spec),
    )
    return _seeded_sdpa_model(Qwen3MoeForCausalLM, config)


def num_prompts(spec: dict) -> int:
    samples_per_round = spec["batch_size"] * spec["steps_per_generation"]
    return samples_per_round * spec["rounds"] // spec["num_generations"] + 8


def run_vision_worker(spec: dict, fingerprint: str) -> dict:
    """The same measurement on a tiny Qwen2-VL: 1-2 images per prompt of 28-448 pixels a side (1-256 image tokens
    each, on top of a short text; 336-448 pixels, 144-256 tokens, for the prompt-heavy mix), the completions of
    ``spec["mix"]``."""
    import numpy as np

    from hf_dynbsz.testing import VisionScriptedRollout, build_tiny_vision_language_model, image_prompt_dataset

    model, processor = build_tiny_vision_language_model(
        "qwen2_vl",
        hidden_size=spec["hidden_size"],
        num_hidden_layers=spec["num_layers"],
        vocab_size=spec["vocab_size"],
        max_image_side=448,
    )
    num_params = sum(p.numel() for p in model.parameters())
    mix, max_len = spec["mix"], spec["max_completion_length"]
    # Completion tokens are characters only: an image token in a completion would break the model.
    rollout = VisionScriptedRollout(
        processor,
        lambda rng, n, rank: completion_lengths(mix, n, max_len, rng),
        max_completion_length=max_len,
        seed=spec["seed"],
        token_low=3,
        token_high=processor.tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_id=processor.tokenizer.eos_token_id,
    )
    counts = np.random.default_rng(spec["seed"]).integers(1, 3, num_prompts(spec)).tolist()
    dataset = image_prompt_dataset(counts, seed=spec["seed"], sizes=VISION_SIDES.get(mix, VISION_SIDES["default"]))
    return train_and_measure(spec, fingerprint, model, processor, rollout, dataset, num_params)


def schedule_fields(spec: dict) -> dict:
    """The config fields of the benchmark's schedule (shared with ``rloo_step_time.py``): ``spec``'s batch,
    accumulation, generation and step counts, a constant learning rate of 1e-5, the seed."""
    steps_per_round = spec["steps_per_generation"] * spec["num_iterations"] // spec["grad_accum"]
    return dict(
        per_device_train_batch_size=spec["batch_size"],
        gradient_accumulation_steps=spec["grad_accum"],
        steps_per_generation=spec["steps_per_generation"],
        num_generations=spec["num_generations"],
        max_completion_length=spec["max_completion_length"],
        num_iterations=spec["num_iterations"],
        max_steps=spec["rounds"] * steps_per_round,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        seed=spec["seed"],
    )


def config_of(spec: dict):
    """The trainer config of ``spec["config"]`` (a key of :data:`CONFIGS`)."""
    from hf_dynbsz.testing import run_config

    config = CONFIGS[spec["config"]]
    if config["layout"] is None:
        return run_config("grpo_stock", spec["output_dir"], **schedule_fields(spec))
    extra = {key: config[key] for key in ("tensor_batch_size", "share_prompt_prefix") if key in config}
    budget = None
    if config["budget"] == "half":
        longest = VISION_PROMPT_TOKENS if spec.get("model") == "qwen2_vl" else longest_prompt(spec["mix"])
        budget = spec["batch_size"] // 2 * (longest + spec["max_completion_length"])
    return run_config(
        "grpo_dynamic",
        spec["output_dir"],
        **schedule_fields(spec),
        packing_layout=config["layout"],
        max_tokens_per_microbatch=budget,
        **extra,
    )


def train_and_measure(spec, fingerprint, model, processing_class, rollout, dataset, num_params) -> dict:
    import torch

    from hf_dynbsz.testing import build_trainer

    args = config_of(spec)
    trainer = build_trainer(args, model, processing_class, dataset=dataset, reward=reward_by_content, rollout=rollout)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()} if spec.get("params_out") else None
    probe = Probe(trainer, rollout)
    profile = StepProfile(spec["profile_step"]) if spec.get("profile_step") else None
    if profile is not None:
        trainer.add_callback(profile.callback)
    baseline_kb = _read_status_kb("VmRSS")
    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start
    history = trainer.state.log_history
    if initial is not None:  # before and after, for a comparison with stock (benchmarks/prefix_tree.py)
        final = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        torch.save({"initial": initial, "final": final}, spec["params_out"])
    return {
        "spec": spec,
        "code": fingerprint,
        "num_params": num_params,
        "threads": torch.get_num_threads(),
        "baseline_rss_mb": baseline_kb / 1024,
        "peak_reset_supported": probe.can_reset_peak,
        "train_wall_s": elapsed,
        "steps": probe.steps,
        "rounds": probe.generation_rounds,
        "budget_tokens": [e["dynbsz/budget_tokens"] for e in history if "dynbsz/budget_tokens" in e],
        "tensor_batch_size": getattr(args, "tensor_batch_size", "stock"),
        "profile": profile.result if profile is not None else None,
        "self_check_s": getattr(getattr(trainer, "_dynbsz", None), "self_check_seconds", None),
        "layout_used": trainer._dynbsz.scheduler.layout
        if getattr(trainer, "_dynbsz", None) and trainer._dynbsz.enabled
        else None,
    }


# --------------------------------------------------------------------------------------------------- driver
def run_one(spec: dict, timeout: float) -> dict:
    from hf_dynbsz.testing import run_script_worker

    label = f"worker for {spec['mix']}/{spec['config']}"
    return run_script_worker(__file__, spec, timeout, label, prefix="dynbsz-bench-", threads=spec.get("threads") or 1)


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def _per_index(runs: list[dict], records: str, key: str, skip: int) -> list[float]:
    """Per step (or round) index: the median over repeats; warm-up indices (< skip) left out."""
    count = min(len(run[records]) for run in runs)
    return [median([run[records][i][key] for run in runs]) for i in range(skip, count)]


def summarise(results: list[dict]) -> list[dict]:
    """One row per (mix, configuration) with ratios against stock on the same mix.

    Times: per optimizer step (round) index, the median over repeats; then the mean over the measured indices
    (every configuration sees the same steps, whose data differ, so the mean is the throughput figure).
    Speed-up and token limit are ratios of these means; memory is the median over repeats of each run's peak.
    """
    rows = []
    by_key: dict[tuple[str, str], list[dict]] = {}
    for result in results:
        by_key.setdefault((result["spec"]["mix"], result["spec"]["config"]), []).append(result)
    for (mix, config), runs in by_key.items():
        peaks, train_peaks = [], []
        for run in runs:
            train_peak = max(s["peak_kb"] for s in run["steps"]) / 1024
            round_peak = max(r["peak_kb"] for r in run["rounds"]) / 1024
            peaks.append(max(train_peak, round_peak) - run["baseline_rss_mb"])
            train_peaks.append(train_peak - run["baseline_rss_mb"])
        train_tokens = _per_index(runs, "steps", "train_tokens", 1)
        passes = _per_index(runs, "steps", "train_passes", 1)
        rows.append(
            {
                "mix": mix,
                "config": config,
                "train_s": _mean(_per_index(runs, "steps", "train_s", 1)),
                "train_cpu_s": _mean(_per_index(runs, "steps", "train_cpu_s", 1)),
                "logprob_s": _mean(_per_index(runs, "rounds", "logprob_s", 1)),
                "logprob_cpu_s": _mean(_per_index(runs, "rounds", "logprob_cpu_s", 1)),
                "rollout_s": _mean(_per_index(runs, "rounds", "rollout_and_rewards_s", 1)),
                "train_tokens": _mean(train_tokens),
                "padding": 1 - _mean(_per_index(runs, "steps", "train_real_tokens", 1)) / _mean(train_tokens),
                "train_passes": _mean(passes),
                "tokens_per_pass": _mean([t / max(p, 1) for t, p in zip(train_tokens, passes)]),
                "logprob_tokens": _mean(_per_index(runs, "rounds", "logprob_tokens", 1)),
                "logprob_passes": _mean(_per_index(runs, "rounds", "logprob_passes", 1)),
                "round_real_tokens": _mean(_per_index(runs, "rounds", "real_tokens", 1)),
                "peak_mb": median(peaks),
                "train_peak_mb": median(train_peaks),
                "budget": _mean([median(values) for values in list(zip(*[run["budget_tokens"] for run in runs]))[1:]])
                if config != "stock"
                else None,
                "num_steps": min(len(run["steps"]) for run in runs) - 1,
                "num_rounds": min(len(run["rounds"]) for run in runs) - 1,
                "repeats": len(runs),
                "baseline_mb": median([run["baseline_rss_mb"] for run in runs]),
                **first_step(runs),
            }
        )
    stock = {row["mix"]: row for row in rows if row["config"] == "stock"}
    for row in rows:
        base = stock.get(row["mix"])
        if base is None:
            continue
        row["speedup"] = base["train_s"] / row["train_s"]
        row["speedup_cpu"] = base["train_cpu_s"] / row["train_cpu_s"]
        row["limit"] = base["train_tokens"] / row["train_tokens"]
        # no log-prob pass when the generation and optimizer steps align (steps_per_generation == accumulation)
        row["logprob_speedup"] = base["logprob_s"] / row["logprob_s"] if row["logprob_s"] else None
        row["logprob_limit"] = base["logprob_tokens"] / row["logprob_tokens"] if row["logprob_tokens"] else None
        row["memory_ratio"] = row["peak_mb"] / base["peak_mb"]
        row["train_memory_ratio"] = row["train_peak_mb"] / base["train_peak_mb"]
    order = {name: i for i, name in enumerate(CONFIGS)}
    mix_order = {name: i for i, name in enumerate(MIX_LABELS)}
    rows.sort(key=lambda r: (mix_order.get(r["mix"], 99), order.get(r["config"], 99)))
    return rows


def first_step(runs: list[dict]) -> dict:
    """The first optimizer step against the steady ones, each with its share of its round's log-prob pass.

    A step's seconds: its training phase plus the log-prob pass of its generation round divided by the round's
    optimizer steps; the first step also carries all of the self-check (run once, in the first round's log-prob
    pass, the first pass of this schedule). ``first_steps``: the first step in steady steps (the mean of the later
    ones, per index the median over repeats); the first round's data differ from the later rounds', for stock as
    for the plugin, which this ratio does not take out. ``self_check_steps``: the self-check in steady steps, the
    plugin's start-up cost beyond the step's own work (data-independent).
    """
    spec = runs[0]["spec"]
    per_round = spec["steps_per_generation"] * spec["num_iterations"] // spec["grad_accum"]
    checks = [run.get("self_check_s") or 0.0 for run in runs]  # stock: none
    first = median(
        [
            run["steps"][0]["train_s"] + (run["rounds"][0]["logprob_s"] - check) / per_round + check
            for run, check in zip(runs, checks)
        ]
    )
    logprob = _mean(_per_index(runs, "rounds", "logprob_s", 1))
    steady = _mean(_per_index(runs, "steps", "train_s", 1)) + (0.0 if math.isnan(logprob) else logprob / per_round)
    check = median(checks) if runs[0].get("self_check_s") is not None else None
    return {
        "first_s": first,
        "steady_s": steady,
        "first_steps": first / steady,
        "self_check_s": check,
        "self_check_steps": None if check is None else check / steady,
    }


STEP_FIELDS = ("round", "train_s", "train_cpu_s", "train_tokens", "train_real_tokens", "train_passes", "peak_kb")
ROUND_FIELDS = (
    "logprob_s",
    "logprob_cpu_s",
    "logprob_tokens",
    "logprob_real_tokens",
    "logprob_passes",
    "rollout_and_rewards_s",
    "real_tokens",
    "samples",
    "peak_kb",
)


def compact_run(result: dict) -> dict:
    """The per-step and per-round raw data of one worker, without what the tables do not use."""
    return {
        "spec": {k: v for k, v in result["spec"].items() if k != "output_dir"},
        "code": result["code"],
        "baseline_rss_mb": result["baseline_rss_mb"],
        "budget_tokens": result["budget_tokens"],
        "self_check_s": result.get("self_check_s"),
        "steps": [[step[k] for k in STEP_FIELDS] for step in result["steps"]],
        "rounds": [[rnd[k] for k in ROUND_FIELDS] for rnd in result["rounds"]],
    }


def _rounded(value):
    """Floats rounded to 4 significant digits, recursively (keeps the raw-data file small)."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def _fmt(value, pattern="{:.2f}"):
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    return pattern.format(value)


def render_table(rows: list[dict]) -> str:
    header = ["workload", "trainer", "budget (tokens)", "train s/step", "speed-up", "token limit", "of limit"]
    header += ["train CPU s/step (speed-up)", "train tokens/step (padding)", "passes/step", "log-prob s/round"]
    header += ["log-prob speed-up (limit)", "peak RSS over baseline MB (vs stock)", "training-phase peak MB (vs stock)"]
    body = []
    for row in rows:
        if row["config"] == "stock":
            budget = f"{row['tokens_per_pass']:.0f} (B x width)"
        else:
            budget = _fmt(row["budget"], "{:.0f}")
        limit = row.get("limit")
        body.append(
            [
                MIX_LABELS[row["mix"]],
                CONFIGS[row["config"]]["label"],
                budget,
                _fmt(row["train_s"]),
                _fmt(row.get("speedup"), "{:.2f}x"),
                _fmt(limit, "{:.2f}x"),
                _fmt(row["speedup"] / limit if limit else None, "{:.0%}"),
                f"{_fmt(row['train_cpu_s'])} ({_fmt(row.get('speedup_cpu'), '{:.2f}x')})",
                f"{row['train_tokens']:.0f} ({row['padding']:.0%})",
                _fmt(row["train_passes"], "{:.1f}"),
                _fmt(row["logprob_s"]),
                f"{_fmt(row.get('logprob_speedup'), '{:.2f}x')} ({_fmt(row.get('logprob_limit'), '{:.2f}x')})",
                f"{row['peak_mb']:.0f} ({_fmt(row.get('memory_ratio'), '{:.2f}x')})",
                f"{row['train_peak_mb']:.0f} ({_fmt(row.get('train_memory_ratio'), '{:.2f}x')})",
            ]
        )
    return markdown_table(header, body)


def render_first_step_table(rows: list[dict]) -> str:
    header = ["workload", "trainer", "first step s", "steady step s", "first step in steady steps"]
    header += ["of which self-check s", "self-check in steady steps"]
    body = [
        [
            MIX_LABELS[row["mix"]],
            CONFIGS[row["config"]]["label"],
            _fmt(row["first_s"]),
            _fmt(row["steady_s"]),
            _fmt(row["first_steps"]),
            _fmt(row["self_check_s"]),
            _fmt(row["self_check_steps"]),
        ]
        for row in rows
    ]
    return markdown_table(header, body)


FIRST_STEP_NOTE = (
    "First step. A step's seconds here: its training phase plus its share of its generation round's log-prob pass "
    "(the pass / the round's optimizer steps); the first step also carries the whole self-check, which runs once, "
    "before the first round's log-prob pass. *steady step*: the mean over the measured steps. *first step in steady "
    "steps*: first / steady; the first round's samples differ from the later rounds' (for stock too, whose row "
    "shows what the data alone do to the ratio). *self-check in steady steps*: the self-check / the steady step, "
    "what the plugin's start-up adds to its first step's own work."
)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = [m for m in MIX_LABELS if any(r["mix"] == m for r in rows)]
    configs = [c for c in CONFIGS if any(r["config"] == c for r in rows)]
    colours = {
        "stock": "#7f7f7f",
        "padded": "#1f77b4",
        "padding_free": "#ff7f0e",
        "padded_half": "#2ca02c",
        "padding_free_half": "#d62728",
        "padded_trl_tile": "#9467bd",
    }
    figure, axes = plt.subplots(1, 3, figsize=(16, 5))
    panels = [
        ("train_s", "training phase, s / optimizer step"),
        ("logprob_s", "no-grad log-prob pass, s / round"),
        ("peak_mb", "peak RSS over baseline, MB"),
    ]
    width = 0.8 / len(configs)
    for axis, (key, label) in zip(axes, panels):
        for position, config in enumerate(configs):
            xs, ys = [], []
            for index, mix in enumerate(mixes):
                match = [r for r in rows if r["mix"] == mix and r["config"] == config]
                if match:
                    xs.append(index + (position - (len(configs) - 1) / 2) * width)
                    ys.append(match[0][key])
            bars = axis.bar(xs, ys, width, label=CONFIGS[config]["label"], color=colours.get(config))
            for bar, value in zip(bars, ys):
                axis.annotate(
                    f"{value:.2f}" if value < 10 else f"{value:.0f}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                )
        axis.set_xticks(range(len(mixes)), [MIX_LABELS[m] for m in mixes], fontsize=8)
        axis.set_title(label, fontsize=10)
    axes[0].legend(fontsize=7)
    figure.suptitle(title, fontsize=8, wrap=True)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def git_state() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "hf_dynbsz"], cwd=root, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown commit"
    return f"commit {commit}" + (" with uncommitted changes in hf_dynbsz/" if dirty else "")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run (~1-2 minutes)")
    parser.add_argument("--mixes", help="comma-separated: long_tailed,bimodal,uniform")
    parser.add_argument("--configs", help=f"comma-separated, from {','.join(CONFIGS)}")
    parser.add_argument("--repeats", type=int, help="fresh processes per configuration (interleaved)")
    parser.add_argument("--rounds", type=int, help="generation rounds per process")
    parser.add_argument("--max-completion-length", type=int)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--vocab-size", type=int)
    parser.add_argument("--batch-size", type=int, help="per_device_train_batch_size")
    parser.add_argument("--grad-accum", type=int, help="gradient_accumulation_steps")
    parser.add_argument("--steps-per-generation", type=int)
    parser.add_argument("--num-iterations", type=int)
    parser.add_argument("--num-generations", type=int)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per worker (default 1, see the README; 0: torch's default)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900, help="seconds per worker process")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--model",
        choices=("qwen2", "qwen2_vl", "qwen3_moe", "qwen3_5"),
        default="qwen2",
        help="qwen2: text prompts; qwen2_vl: a Qwen2-VL model, prompts with 1-2 images (writes "
        "vlm_step_time.*; default mixes/configs: long_tailed,prompt_heavy / stock,padded,"
        "padding_free_no_share,padding_free); qwen3_moe: a Qwen3-MoE model with TRL's router aux loss on (writes "
        "moe_step_time.*; default long_tailed / stock,padded,padding_free); qwen3_5: a Qwen3.5-style hybrid "
        "(Gated DeltaNet; writes hybrid_step_time.*; default long_tailed,prompt_heavy / stock,padded,"
        "padding_free_no_share,padding_free)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    return parser


def resolve_settings(args, parser: argparse.ArgumentParser) -> dict:
    """The preset of ``args`` (quick or default, with the model's defaults) overridden by the options given."""
    settings = dict(PRESETS["quick" if args.quick else "default"])
    if args.model == "qwen2_vl":
        settings.update(VISION_DEFAULTS)
    if args.model == "qwen3_moe":
        settings.update(MOE_DEFAULTS)
    if args.model == "qwen3_5":
        settings.update(HYBRID_DEFAULTS)
    for key in settings:
        value = getattr(args, key, None)
        if value is not None:
            settings[key] = value
    mixes, configs = settings["mixes"].split(","), settings["configs"].split(",")
    unknown = [c for c in configs if c not in CONFIGS] + [m for m in mixes if m not in MIX_LABELS]
    if unknown:
        parser.error(f"unknown configuration or mix: {unknown}")
    return settings


def run_all(settings: dict, args, started: float) -> tuple[list[dict], list[str]]:
    """Every (repeat, mix, configuration) in a fresh worker, interleaved; returns the results and the load averages
    before and after each repeat."""
    mixes, configs = settings["mixes"].split(","), settings["configs"].split(",")
    spec_base = {key: settings[key] for key in SPEC_KEYS}
    spec_base.update(seed=args.seed, threads=args.threads, model=args.model)
    loads = [load_average()]
    results = []
    for repeat in range(settings["repeats"]):
        for mix in mixes:
            order = [c for c in configs if not (c.endswith("_half") and mix not in HALF_BUDGET_MIXES)]
            if repeat % 2:
                order = order[::-1]
            for config in order:
                spec = dict(spec_base, mix=mix, config=config, repeat=repeat)
                tick = time.perf_counter()
                result = run_one(spec, args.timeout)
                measured = [s["train_s"] for s in result["steps"][1:]]
                peak = max(s["peak_kb"] for s in result["steps"]) / 1024 - result["baseline_rss_mb"]
                print(
                    f"[{time.perf_counter() - started:6.0f}s] repeat {repeat} {mix:11s} {config:17s} "
                    f"train s/step {_mean(measured):6.2f}  peak {peak:5.0f} MB  "
                    f"process {time.perf_counter() - tick:4.0f}s  load {load_average()}",
                    flush=True,
                )
                results.append(result)
        loads.append(load_average())
    return results, loads


def check_same_inputs(results: list[dict], mixes: list[str]) -> list[str]:
    """Same data for every configuration of a mix (raises otherwise); returns the plug-in code versions seen."""
    for mix in mixes:
        fingerprints = {
            json.dumps([r["fingerprint"] for r in res["rounds"]]) for res in results if res["spec"]["mix"] == mix
        }
        if len(fingerprints) != 1:
            raise RuntimeError(f"configurations saw different data for mix {mix}")
    code_versions = sorted({res["code"] for res in results})
    if len(code_versions) > 1:
        print(f"WARNING: hf_dynbsz changed during the run ({len(code_versions)} versions): rerun for clean numbers")
    return code_versions


def describe_setup(settings: dict, model: str, first: dict, rows: list[dict]) -> str:
    """The report's paragraph on the model, the GRPO schedule and the run's size."""
    steps_per_round = settings["steps_per_generation"] * settings["num_iterations"] // settings["grad_accum"]
    vision, moe, hidden = model == "qwen2_vl", model == "qwen3_moe", settings["hidden_size"]
    if vision:
        family = (
            "Model: Qwen2-VL-style (vision tower: 1 block of width 32; prompts: 1-2 images of 28-448 pixels a side, "
            "i.e. 1-256 image tokens each, and 1-6 text characters; prompt-heavy: images of 336-448 pixels, 144-256 "
            "image tokens each, completions of median ~40 tokens), language model"
        )
    elif moe:
        family = (
            f"Model: Qwen3-MoE-style ({MOE_EXPERTS} experts of MLP {3 * hidden // MOE_TOP_K} per layer, "
            f"{MOE_TOP_K} per token, router aux loss coefficient {MOE_AUX_COEF}: TRL trains it; the dynamic trainer "
            "adds one no-grad router pass per optimizer step),"
        )
    elif model == "qwen3_5":
        family = (
            f"Model: Qwen3.5-style hybrid (Gated DeltaNet linear attention, full attention every "
            f"{HYBRID_FULL_ATTENTION_INTERVAL}th layer; transformers' torch fallbacks of the delta rule and the "
            "causal convolution),"
        )
    else:
        family = "Model: Qwen2-style,"
    generation_batch = settings["batch_size"] * settings["steps_per_generation"]
    return (
        family + f" hidden {hidden}, {settings['num_layers']} layers, "
        f"{max(2, hidden // 32)} heads ({max(1, hidden // 64)} KV), MLP "
        f"{(2 if vision else 3) * hidden}, vocabulary {settings['vocab_size']}, "
        f"{first['num_params'] / 1e6:.2f} M parameters, fp32, sdpa, CPU, {first['threads']} torch thread(s) per "
        "process. GRPO (TRL defaults otherwise: loss dapo, beta 0, gradient checkpointing on): "
        f"per_device_train_batch_size {settings['batch_size']}, gradient_accumulation_steps {settings['grad_accum']} "
        f"({settings['batch_size'] * settings['grad_accum']} samples per optimizer step), steps_per_generation "
        f"{settings['steps_per_generation']} (generation batch {generation_batch}"
        f" samples, {steps_per_round} optimizer steps per round, old-policy log-probs computed), num_iterations "
        f"{settings['num_iterations']}, num_generations {settings['num_generations']}, max_completion_length "
        f"{settings['max_completion_length']}"
        + ("; " if vision else f", prompts {PROMPT_RANGE[0]}-{PROMPT_RANGE[1]} tokens (64 for uniform). ")
        + f"{settings['repeats']} fresh process(es) per configuration x {settings['rounds']} rounds; "
        f"{rows[0]['num_steps']} measured optimizer steps and {rows[0]['num_rounds']} measured rounds per process."
    )


COLUMNS_NOTE = (
    "Columns. *budget*: stock's micro-batch (per_device_train_batch_size x the generation batch's padded "
    "width), or the dynamic trainer's `max_tokens_per_microbatch` (\"auto\" = the same as stock's, per "
    "step); both averaged over the measured steps. *train s/step*: wall time of the training phase of one "
    "optimizer step (forward, backward, optimizer; no generation, no log-prob pass); per step, the median over "
    "repeats, then the mean "
    "over the measured steps. *speed-up*: stock / this. *token limit*: stock's computed tokens / this "
    "configuration's (the speed-up token counts alone predict); *of limit*: speed-up / token limit. "
    "*train CPU s/step*: the same in process CPU time (user + system), less sensitive to other jobs. "
    "*train tokens/step*: positions computed by the training forwards of one step, padding included "
    "(share of padding). *log-prob*: the no-grad old-policy pass, once per generation round. *peak RSS over "
    "baseline*: process high-water mark minus the RSS before `train()`, over the whole run (training, "
    "generation and log-prob phases), median over repeats; *training-phase peak*: the same over the "
    "training phases only."
)


def write_report(args, settings, results, rows, table, setup, loads, code_versions, started) -> str:
    """Writes the markdown report, the raw data (JSON) and the plot; returns the files' base name."""
    machine = (
        f"Machine: {machine_description()}. Load average (1/5/15 min) before and after each repeat: "
        f"{' | '.join(loads)} (a shared machine: other jobs ran during the measurement)."
    )
    code = (
        f"Code: {git_state()}; hf_dynbsz source hash {', '.join(code_versions)}"
        + (" (CHANGED DURING THE RUN)" if len(code_versions) > 1 else "")
        + "."
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    prefix = {"qwen2_vl": "vlm_", "qwen3_moe": "moe_", "qwen3_5": "hybrid_"}.get(args.model, "")
    name = prefix + ("step_time_quick" if args.quick else "step_time")
    command = " ".join(["python benchmarks/step_time.py", *sys.argv[1:]])  # as run, every option given
    kind = {"qwen2_vl": ", vision-language", "qwen3_moe": ", mixture of experts", "qwen3_5": ", hybrid model"}.get(
        args.model, ""
    )
    title = (
        f"# Training-step time{kind}: stock GRPOTrainer vs DynamicBatchGRPOTrainer"
        f"{' (quick run)' if args.quick else ''}"
    )
    generated = f"Generated by `{command}` in {(time.perf_counter() - started) / 60:.1f} min."
    first_steps = "## The first step\n\n" + render_first_step_table(rows)
    markdown = "\n\n".join([title, generated, setup, machine, code, table, COLUMNS_NOTE, first_steps, FIRST_STEP_NOTE])
    markdown += "\n"
    (args.out_dir / f"{name}.md").write_text(markdown)
    raw = {
        "settings": settings,
        "rows": rows,
        "step_fields": STEP_FIELDS,
        "round_fields": ROUND_FIELDS,
        "runs": [compact_run(res) for res in results],
    }
    (args.out_dir / f"{name}.json").write_text(json.dumps(_rounded(raw), separators=(",", ":")))
    plot(rows, args.out_dir / f"{name}.png", setup)
    return name


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.worker:
        result = run_worker(json.loads(args.worker))
        with open(args.worker_out, "w") as handle:
            json.dump(result, handle)
        return
    settings = resolve_settings(args, parser)
    started = time.perf_counter()
    results, loads = run_all(settings, args, started)
    code_versions = check_same_inputs(results, settings["mixes"].split(","))
    rows = summarise(results)
    table = render_table(rows)
    setup = describe_setup(settings, args.model, results[0], rows)
    name = write_report(args, settings, results, rows, table, setup, loads, code_versions, started)
    print()
    print(table)
    print(f"\nwrote {args.out_dir / (name + '.md')}, {name}.png, {name}.json")


if __name__ == "__main__":
    main()

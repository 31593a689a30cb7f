"""One command that proves the plugin's GPU paths against stock ``trl.GRPOTrainer``: at most 8 minutes on one H100
or H200, and the same plumbing in under a minute on CPU (``--device cpu --tiny``, which the test suite runs).

What it trains
--------------
A random Qwen2-style model built from a config (no download): hidden 1024, 24 layers, 16 heads (2 key/value heads),
MLP 2816, Qwen2's vocabulary of 151,936 ids (about 0.58B parameters; the character tokenizer of
:func:`hf_dynbsz.testing.build_char_tokenizer` uses the first ids). Completions come from a scripted ``rollout_func``
(:class:`hf_dynbsz.testing.ScriptedRollout`) drawing the long-tailed mix of ``benchmarks/common.py`` (prompts of 32-96
tokens, completions lognormal up to ``max_completion_length``), so stock and the plugin see exactly the same samples;
every run starts from the same weights (checked). SGD at a constant rate (the tests' comparison config,
:func:`hf_dynbsz.testing.base_config_kwargs`), TRL's defaults otherwise (gradient checkpointing on).

The checks (one table row each; ``--checks`` picks groups)
----------------------------------------------------------
* ``sdpa-fp32``: fp32, loss types grpo, bnpo, dapo (dapo with two iterations, so the old-policy log-probs come from
  packed no-grad passes), prompts shared and not: parameters after two optimizer steps (one in the tiny run) within
  1e-5 (relative) of stock's and their update within 1e-3 (relative), the tests' tolerances (``tests/test_trainer.py``).
* ``sdpa-bf16``: the same in bf16 mixed precision, where no two runs agree to the last bit. Stock's own noise is
  measured twice: stock against stock with another split of the same samples (``per_device_train_batch_size`` x
  ``gradient_accumulation_steps`` 4 x 2 against 2 x 4, the same math for dapo) and stock in bf16 against stock in
  fp32 (bf16's own error for that case). The plugin's update must be within 2 x the larger of the two from stock's.
  (The split alone would be too tight a yardstick: it changes only how gradients are summed, where the plugin's
  packed rows also round the forward differently, which is what bf16 against fp32 measures.)
* ``sdpa-padding-free``: one fp32 and one bf16 case (dapo, two iterations, shared prompts) with
  ``packing_layout="padding_free"``: on CUDA "auto" trains padded rows on sdpa, and the padding-free rows' padded span
  calls (at most ``SPAN_CALLS_PER_LAYER["cuda"]`` per layer) run on CUDA only. Skipped on CPU.
* ``flash_attention_2``: the bf16 check with flash-attention (skipped, and said so, where ``flash_attn`` is absent).
* ``flex_attention``: the fp32 check with transformers' flex attention: the plugin's padding-free rows take one
  flex_attention call per layer under the segments' block mask (the row says the layout it trained with). Skipped
  where stock cannot run it. Then the plugin's flex in bf16 against stock's sdpa in bf16 (stock's own flex does not
  compile in bf16 mixed precision on torch 2.11: autocast leaves its inputs in mixed dtypes, which the plugin casts
  as autocast casts sdpa's), and its step time on the speed mix.
* ``speed``: the long-tailed mix in bf16: median optimizer-step time after the first step, stock and plugin in the
  same process on the same rollouts; goal: faster than stock. The first step is reported on its own row, with the
  self-check's part of it; goal: at most 1.5 of the plugin's steady steps once the device's warm-up is taken out
  (what stock's own first step costs over its steady steps: on the H200 the first step was 2.2 steady steps for
  stock and 2.3 for the plugin's padded rows). (On CPU: fp32 and the tiny model, information only.)
* ``memory_fraction``: the plugin with ``max_memory_fraction_per_device`` set below what the speed run used (half of
  what its passes added, at most 0.5): the run's ``torch.cuda.max_memory_allocated`` must stay under fraction x
  total; the budgets it chose are reported.
* ``oom``: a real CUDA out-of-memory error. The plugin trains (fp32, no gradient checkpointing) with a budget that
  puts a whole optimizer step in one pass; ``torch.cuda.set_per_process_memory_fraction`` then caps the process at
  what it holds (gradients included) plus half of what that pass added, so the pass raises
  ``torch.OutOfMemoryError``. It must be recovered (``dynbsz/oom_retries`` > 0) and the run must end with stock's
  parameters (fp32 tolerances).

Rows that need CUDA read "skipped: no CUDA" on CPU and are not failures; the exit status is 1 when any row fails.
A run that has spent its time budget (``--time-budget-s``) skips the groups not started yet, and says so; flex
attention (its kernels compile first) starts only with :data:`FLEX_MIN_LEFT_S` left.

Usage (from the repository root; the script puts the root on ``sys.path``, so the package need not be installed)::

    python benchmarks/gpu_check.py --prepare .whl      # here: download the wheels the GPU image lacks (57 MiB)
    # there (offline): unpack them, then the full check (writes benchmarks/results/gpu_check.md)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/carried/site-packages .whl/*.whl
    python3 benchmarks/gpu_check.py --extra-site /tmp/carried/site-packages
    python benchmarks/gpu_check.py --device cpu --tiny --output /tmp/gpu_check.md   # the plumbing on CPU

``--extra-site`` appends a folder to ``sys.path`` after the installed packages: carried wheels fill in only what the
machine lacks, and never shadow its own torch, transformers or numpy. Its path must contain ``site-packages``: dill
(which datasets fingerprints a dataset with) pickles a module found anywhere else by value, and
``Dataset.from_dict`` then fails on pyarrow's types.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PROMPT_RANGE,
    REPO_ROOT,
    RESULTS_DIR,
    completion_lengths,
    ensure_repo_on_path,
    machine_description,
    markdown_table,
    prompt_lengths,
)

ensure_repo_on_path()

PARAM_TOLERANCE = 1e-5  # relative difference of the parameters (tests/test_trainer.py)
UPDATE_TOLERANCE = 1e-3  # relative difference of the parameter updates (tests/test_trainer.py)
NOISE_MULTIPLE = 2.0  # bf16: the plugin within this many times stock's own noise
NOISE_FLOOR = 1e-6
OOM_HEADROOM_SHARE = 0.5  # the out-of-memory cap: what the process holds + this share of what the big pass added
MEMORY_FRACTION_SHARE = 0.5  # the memory-fraction limit: held + this share of what the speed run's passes added
MEMORY_FRACTION_MAX = 0.5
MIX = "long_tailed"
FIRST_STEP_GOAL = 1.5  # the plugin's first step (self-check, first planning, any compilation) in its steady steps
HEADER = ["check", "setting", "measured", "limit / goal", "result"]
PASS, FAIL, INFO = "pass", "FAIL", "info"
CHECKS = (
    "sdpa-fp32",
    "sdpa-bf16",
    "sdpa-padding-free",
    "speed",
    "memory_fraction",
    "oom",
    "flash_attention_2",
    "flex_attention",
)
#: (loss type, num_iterations, share_prompt_prefix) of the exactness rows.
LOSS_CASES = (("grpo", 1, True), ("bnpo", 1, True), ("dapo", 2, True), ("dapo", 2, False))
#: The wheels a GPU image with torch, transformers, accelerate and peft (and nothing else) lacks: TRL, datasets and
#: what they import. Pinned to versions that work with transformers >= 5.0 and huggingface_hub 1.x (datasets 5.1+
#: needs huggingface_hub >= 1.31) and numpy 1.26 or 2.x (pandas 3 needs numpy 2); pyarrow 21 is the oldest TRL
#: accepts and the smallest wheel (43 MB).
WHEELS = (
    "trl==1.16.0",
    "datasets==5.0.1",
    "pyarrow==21.0.0",
    "pandas==2.3.3",
    "python-dateutil==2.9.0.post0",
    "six==1.17.0",
    "pytz==2026.6",
    "tzdata==2026.6",
    "dill==0.4.1",
    "multiprocess==0.70.19",
    "xxhash==4.1.0",
    "fsspec==2026.2.0",
    "requests==2.34.2",
    "urllib3==2.8.0",
    "charset-normalizer==3.5.3",
    "idna==3.20",
    "certifi==2026.10.19.post1",
)
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
CARRY_LIMIT_MIB = 64


@dataclasses.dataclass(frozen=True)
class Preset:
    """Model and run sizes: ``full`` for a GPU, ``tiny`` for the CPU plumbing run."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int | None  # None: the tokenizer's
    max_completion_length: int
    batch: tuple[int, int]  # per_device_train_batch_size, gradient_accumulation_steps of the exactness runs
    split: tuple[int, int]  # the same samples split otherwise: stock's own bf16 noise
    steps: int
    speed_batch: tuple[int, int]
    speed_steps: int
    speed_max_completion_length: int
    oom_batch: tuple[int, int]
    learning_rate: float
    time_budget_s: float
    bf16_cases: tuple  # the LOSS_CASES of the sdpa bf16 rows


_SHARED = dict(batch=(4, 2), split=(2, 4), oom_batch=(8, 2), learning_rate=0.1)
#: About 0.58B parameters (Qwen2.5-0.5B's vocabulary and depth, untied head); under 5 minutes on an H100.
FULL = Preset(
    name="0.5B",
    hidden_size=1024,
    num_layers=24,
    num_heads=16,
    num_kv_heads=2,
    intermediate_size=2816,
    vocab_size=151_936,
    max_completion_length=512,
    steps=2,
    speed_batch=(8, 4),
    speed_steps=6,
    speed_max_completion_length=1024,
    time_budget_s=420.0,
    bf16_cases=LOSS_CASES,
    **_SHARED,
)
#: The CPU plumbing run: under a minute on 2 cores.
TINY = Preset(
    name="tiny",
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    vocab_size=None,
    max_completion_length=48,
    steps=1,
    speed_batch=(4, 2),
    speed_steps=3,
    speed_max_completion_length=64,
    time_budget_s=240.0,
    bf16_cases=LOSS_CASES[::3],
    **_SHARED,
)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run; equal specs give equal runs (cached)."""

    trainer: str  # "stock" or "ours"
    precision: str = "fp32"  # "fp32" or "bf16" (mixed precision: fp32 weights, bf16 autocast)
    attention: str = "sdpa"
    loss_type: str = "dapo"
    num_iterations: int = 1
    batch: tuple[int, int] | None = None  # None: the preset's
    steps: int | None = None
    max_completion_length: int | None = None
    plugin: tuple = ()  # extra DynamicBatchGRPOConfig settings, as (name, value) pairs
    config: tuple = ()  # extra settings of both configs
    keep_params: bool = True
    memory_fraction: float | None = None  # torch.cuda.set_per_process_memory_fraction during train()


@dataclasses.dataclass
class Run:
    params: dict | None
    completions: list
    history: list
    step_seconds: list
    trained_as: str
    notes: list
    logs: list
    self_check_seconds: float | None = None  # ours: the self-check's share of the first step
    base_allocated_mib: float | None = None
    peak_allocated_mib: float | None = None
    base_reserved_mib: float | None = None
    peak_reserved_mib: float | None = None

    def logged(self, key: str) -> list:
        return [entry[key] for entry in self.history if key in entry]


class Skip(Exception):
    """A check that cannot run here (its row says why); not a failure."""


# --------------------------------------------------------------------------------------------------------- session
class Session:
    """The device, tokenizer, data, initial weights and the cache of runs of one invocation."""

    def __init__(self, args, preset: Preset):
        import torch
        from datasets import Dataset

        from hf_dynbsz.testing import build_char_tokenizer

        self.torch, self.preset, self.args = torch, preset, args
        # an explicit index: torch.cuda.set_per_process_memory_fraction refuses a bare "cuda"
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
        )
        self.cuda = self.device.type == "cuda"
        torch.set_float32_matmul_precision("highest")  # fp32 means fp32 (no TF32): the fp32 rows' tolerances need it
        self.start = time.monotonic()
        self.deadline = self.start + (args.time_budget_s or preset.time_budget_s)
        self.tokenizer = build_char_tokenizer()
        self.dataset = Dataset.from_dict({"prompt": [f"prompt-{i:05d}" for i in range(512)]})
        self.tmp = tempfile.mkdtemp(prefix="gpu_check-")
        self.cache: dict[RunSpec, Run] = {}
        self.split_noise: dict[str, float] = {}  # stock's bf16 noise per attention, measured once
        model = self.build_model("sdpa")
        self.initial = snapshot(model)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.param_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        del model
        self.release()

    def log(self, message: str) -> None:
        print(f"[gpu_check {time.monotonic() - self.start:6.1f} s] {message}", file=sys.stderr, flush=True)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def build_model(self, attention: str):
        from hf_dynbsz.testing import build_tiny_causal_lm

        preset = self.preset
        with self.torch.device(self.device):  # built on the device: a 0.5B model initialises there in a second
            return build_tiny_causal_lm(
                self.tokenizer,
                hidden_size=preset.hidden_size,
                num_hidden_layers=preset.num_layers,
                num_attention_heads=preset.num_heads,
                num_key_value_heads=preset.num_kv_heads,
                intermediate_size=preset.intermediate_size,
                vocab_size=preset.vocab_size,
                max_position_embeddings=PROMPT_RANGE[1] + preset.speed_max_completion_length + 64,
                attn_implementation=attention,
                seed=0,
            )

    def rollout(self, max_completion_length: int):
        from hf_dynbsz.testing import ScriptedRollout

        return ScriptedRollout(
            lambda rng, n, rank: completion_lengths(MIX, n, max_completion_length, rng),
            lambda rng: prompt_lengths(MIX, 1, rng)[0],
            max_completion_length=max_completion_length,
            seed=0,
            token_low=3,
            token_high=len(self.tokenizer),
            eos_id=self.tokenizer.eos_token_id,
        )

    def release(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def synchronize(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def run(self, spec: RunSpec, cache: bool = True) -> Run:
        """``spec`` trained once per invocation while cached (later calls return the cached run); ``cache=False``:
        not kept (its parameters are freed once the caller is done with them)."""
        if spec in self.cache:
            return self.cache[spec]
        label = f"{spec.trainer} {spec.precision} {spec.attention} {spec.loss_type} x{spec.num_iterations}"
        self.log(f"train {label} batch={spec.batch or self.preset.batch} {dict(spec.plugin) or ''}")
        run = train(self, spec)
        if cache:
            self.cache[spec] = run
        return run

    def forget(self, keep=lambda spec: False) -> None:
        """Drop cached runs (their parameters) but those ``keep`` names."""
        self.cache = {spec: run for spec, run in self.cache.items() if keep(spec)}
        self.release()


def snapshot(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# --------------------------------------------------------------------------------------------------------- training
def step_clock(synchronize):
    """A callback recording each optimizer step's wall time (device synchronised at both ends)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []
            self.begin = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            synchronize()
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            synchronize()
            self.seconds.append(time.perf_counter() - self.begin)

    return StepClock()


class _Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def faulty_trainer():
    """The plugin with one deliberate error: every pass's loss 10% too large before its backward (``--fault
    loss_scale``; the test of this script checks that the check then fails)."""
    from hf_dynbsz import DynamicBatchGRPOTrainer

    class LossScaled(DynamicBatchGRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            backward = self._dynbsz.backward
            self._dynbsz.backward = lambda model, loss, last: backward(model, loss * 1.1, last)

    return LossScaled


def make_trainer(session: Session, spec: RunSpec, model):
    from trl import GRPOConfig, GRPOTrainer

    from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
    from hf_dynbsz.testing import RecordingReward, base_config_kwargs

    preset = session.preset
    per_device, accumulation = spec.batch or preset.batch
    kwargs = base_config_kwargs(
        os.path.join(session.tmp, "run"),
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        max_completion_length=spec.max_completion_length or preset.max_completion_length,
        max_steps=spec.steps or preset.steps,
        learning_rate=preset.learning_rate,
        loss_type=spec.loss_type,
        num_iterations=spec.num_iterations,
        use_cpu=not session.cuda,
        bf16=spec.precision == "bf16",
        **dict(spec.config),
    )
    if spec.trainer == "stock":
        args, cls = GRPOConfig(**kwargs), GRPOTrainer
    else:
        args = DynamicBatchGRPOConfig(**kwargs, **dict(spec.plugin))
        cls = faulty_trainer() if session.args.fault == "loss_scale" else DynamicBatchGRPOTrainer
    reward = RecordingReward()
    trainer = cls(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=session.dataset,
        processing_class=session.tokenizer,
        rollout_func=session.rollout(kwargs["max_completion_length"]),
    )
    return trainer, reward


def trained_as(trainer) -> tuple[str, list]:
    """What the plugin trained with (its layout after the self-check) and its notes; "stock" for stock."""
    executor = getattr(trainer, "_dynbsz", None)
    if executor is None:
        return "stock", []
    notes = list(executor.capabilities.notes)
    summary = executor.self_check_summary
    if summary:
        print(f"[gpu_check] {summary}", file=sys.stderr, flush=True)
    if not executor.enabled:
        return f"stock math (dynamic batching off; {summary or 'no self-check'})", notes
    return executor.scheduler.describe(), notes


def train(session: Session, spec: RunSpec) -> Run:
    from transformers import PrinterCallback

    torch = session.torch
    model = session.build_model(spec.attention)
    if not all(torch.equal(p, session.initial[name]) for name, p in model.named_parameters()):
        raise RuntimeError("the model was not rebuilt with the same initial weights")
    trainer, reward = make_trainer(session, spec, model)
    trainer.remove_callback(PrinterCallback)  # the log dicts of every step: the table is what this prints
    clock = step_clock(session.synchronize)
    trainer.add_callback(clock)
    captured = _Captured()
    logging.getLogger("hf_dynbsz").addHandler(captured)
    session.release()
    memory = {}
    try:
        if session.cuda:
            torch.cuda.reset_peak_memory_stats()
            memory = dict(
                base_allocated_mib=torch.cuda.memory_allocated(), base_reserved_mib=torch.cuda.memory_reserved()
            )
            if spec.memory_fraction is not None:
                torch.cuda.set_per_process_memory_fraction(spec.memory_fraction, session.device)
        trainer.train()
        session.synchronize()
        if session.cuda:
            memory.update(
                peak_allocated_mib=torch.cuda.max_memory_allocated(), peak_reserved_mib=torch.cuda.max_memory_reserved()
            )
            memory = {key: value / 2**20 for key, value in memory.items()}
    finally:
        logging.getLogger("hf_dynbsz").removeHandler(captured)
        if session.cuda and spec.memory_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, session.device)
    layout, notes = trained_as(trainer)
    run = Run(
        params=snapshot(trainer.model) if spec.keep_params else None,
        completions=list(reward.completions),
        history=list(trainer.state.log_history),
        step_seconds=list(clock.seconds),
        trained_as=layout,
        notes=notes,
        logs=captured.messages,
        self_check_seconds=getattr(getattr(trainer, "_dynbsz", None), "self_check_seconds", None),
        **memory,
    )
    del trainer, model
    session.release()
    return run


# --------------------------------------------------------------------------------------------------------- checks
def differences(session: Session, ours: Run, stock: Run) -> tuple[float, float]:
    """(relative parameter difference, relative update difference) of ``ours`` from ``stock``."""
    from hf_dynbsz.testing import relative_difference, update_difference

    if ours.completions != stock.completions:
        raise AssertionError("the two runs did not see the same completions")
    return relative_difference(ours.params, stock.params), update_difference(session.initial, ours.params, stock.params)


def describe(spec: RunSpec, share: bool) -> str:
    prompts = "shared prompts" if share else "prompts not shared"
    forced = "".join(f", {name} {value}" for name, value in spec.plugin if name != "share_prompt_prefix")
    return (
        f"{spec.precision}, {spec.attention}, {spec.loss_type}, {spec.num_iterations} iteration(s), {prompts}{forced}"
    )


def trained_note(run: Run) -> str:
    notes = [note for note in run.notes if "share_prompt_prefix" in note or "attention" in note]
    return f"trained as: {run.trained_as}" + (f" ({'; '.join(notes)})" if notes else "")


def exact_fp32(session: Session, attention: str, plugin: tuple = ()) -> list[list]:
    """fp32 against stock; ``plugin``: settings of ours beyond ``share_prompt_prefix`` (one case when given)."""
    rows = []
    for loss, iterations, share in LOSS_CASES if attention == "sdpa" and not plugin else LOSS_CASES[2:3]:
        stock = session.run(RunSpec("stock", "fp32", attention, loss, iterations))
        settings = (("share_prompt_prefix", share), *plugin)
        spec = RunSpec("ours", "fp32", attention, loss, iterations, plugin=settings)
        ours = session.run(spec, cache=False)
        params, update = differences(session, ours, stock)
        ok = params <= PARAM_TOLERANCE and update <= UPDATE_TOLERANCE
        rows.append(
            [
                "equal to stock (fp32)",
                describe(spec, share),
                f"params {params:.1e}, update {update:.1e}; {trained_note(ours)}",
                f"params <= {PARAM_TOLERANCE:g}, update <= {UPDATE_TOLERANCE:g}",
                PASS if ok else FAIL,
            ]
        )
    return rows


def exact_bf16(session: Session, attention: str, stock_attention: str | None = None, plugin: tuple = ()) -> list[list]:
    """bf16 against stock's own noise: another split of the same samples, and bf16 against fp32 (sdpa).

    ``stock_attention``: stock's implementation when it differs from ours (flex_attention in bf16 is compared with
    stock's sdpa, what the plugin's flex formulation casts its inputs to mirror)."""
    from hf_dynbsz.testing import update_difference

    initial = session.initial
    stock_attention = stock_attention or attention
    rows = []
    if stock_attention not in session.split_noise:  # measured once per attention, its row shown once
        noise_a = session.run(RunSpec("stock", "bf16", stock_attention, "dapo", 2))
        noise_b = session.run(RunSpec("stock", "bf16", stock_attention, "dapo", 2, batch=session.preset.split))
        session.split_noise[stock_attention] = update_difference(initial, noise_b.params, noise_a.params)
        a, b = session.preset.batch, session.preset.split
        rows.append(
            [
                "stock's bf16 noise",
                f"bf16, {stock_attention}, dapo: stock {a[0]}x{a[1]} against {b[0]}x{b[1]} (same samples)",
                f"update {session.split_noise[stock_attention]:.1e}",
                "-",
                INFO,
            ]
        )
    split_noise = session.split_noise[stock_attention]
    if plugin or stock_attention != attention:  # a forced setting, or stock on another attention: one case
        cases = LOSS_CASES[2:3]
    else:
        cases = session.preset.bf16_cases if attention == "sdpa" else LOSS_CASES[::3]
    for loss, iterations, share in cases:
        stock = session.run(RunSpec("stock", "bf16", stock_attention, loss, iterations))
        exact = session.run(RunSpec("stock", "fp32", "sdpa", loss, iterations))
        bf16_error = update_difference(initial, stock.params, exact.params)
        settings = (("share_prompt_prefix", share), *plugin)
        spec = RunSpec("ours", "bf16", attention, loss, iterations, plugin=settings)
        ours = session.run(spec, cache=False)
        _, update = differences(session, ours, stock)
        limit = NOISE_MULTIPLE * max(split_noise, bf16_error, NOISE_FLOOR)
        rows.append(
            [
                "equal to stock (bf16)",
                describe(spec, share) + (f" (stock: {stock_attention})" if stock_attention != attention else ""),
                f"update {update:.1e} (stock bf16 vs fp32: {bf16_error:.1e}); {trained_note(ours)}",
                f"update <= {NOISE_MULTIPLE:g} x max(split, bf16 vs fp32) = {limit:.1e}",
                PASS if math.isfinite(update) and update <= limit else FAIL,
            ]
        )
    session.forget(keep=lambda spec: spec.precision == "fp32" and spec.attention == "sdpa" and spec.trainer == "stock")
    return rows


def speed_specs(session: Session, attention: str = "sdpa") -> tuple[RunSpec, RunSpec]:
    """Stock (sdpa, its users' default) and ours with ``attention`` (``name[:packing_layout]``) on the speed mix."""
    attention, _, layout = attention.partition(":")
    preset = session.preset
    common = dict(
        precision="bf16" if session.cuda else "fp32",
        batch=preset.speed_batch,
        steps=preset.speed_steps,
        max_completion_length=preset.speed_max_completion_length,
        keep_params=False,
    )
    plugin = (("packing_layout", layout),) if layout else ()
    return RunSpec("stock", **common), RunSpec("ours", attention=attention, plugin=plugin, **common)


def speed(session: Session) -> list[list]:
    rows = []
    # on a CPU "auto" already gives sdpa's padding-free rows: the forced row would repeat it
    default = "sdpa,sdpa:padding_free" if session.cuda else "sdpa"
    for attention in (session.args.speed_attention or default).split(","):
        rows += speed_of(session, attention)
    return rows


def speed_of(session: Session, attention: str) -> list[list]:
    stock_spec, ours_spec = speed_specs(session, attention)
    stock, ours = session.run(stock_spec), session.run(ours_spec)
    stock_s, ours_s = statistics.median(stock.step_seconds[1:]), statistics.median(ours.step_seconds[1:])
    ratio = ours_s / stock_s
    per_device, accumulation = ours_spec.batch
    setting = (
        f"{ours_spec.precision}, stock sdpa, ours {attention}, {MIX}, {per_device}x{accumulation} samples per step, "
        f"max completion {ours_spec.max_completion_length}, steps 2-{ours_spec.steps}"
    )
    tokens = sum(ours.logged("dynbsz/computed_tokens")) / max(sum(ours.logged("dynbsz/stock_computed_tokens")), 1)
    goal, result = ("ours/stock < 1", PASS if ratio < 1 else FAIL) if session.cuda else ("- (tiny model on CPU)", INFO)
    warm_up = max(stock.step_seconds[0] - stock_s, 0.0)  # what stock's first step costs over its steady ones
    first_steps = (ours.step_seconds[0] - warm_up) / ours_s
    start_goal = f"ours, less stock's warm-up, <= {FIRST_STEP_GOAL:g} of its steady steps"
    start_result = (PASS if first_steps <= FIRST_STEP_GOAL else FAIL) if session.cuda else INFO
    if ours_spec.plugin:  # a layout forced for comparison: measured, with no goal of its own
        goal, result = "- (a forced layout, for comparison)", INFO
        start_goal, start_result = goal, INFO
    return [
        [
            "step time (median)",
            setting,
            f"stock {stock_s:.3f} s, ours {ours_s:.3f} s: ours/stock {ratio:.2f} ({ours.trained_as})",
            goal,
            result,
        ],
        [
            "first step",
            setting.rsplit(",", 1)[0] + ", step 1",
            f"stock {stock.step_seconds[0]:.3f} s (warm-up {warm_up:.3f} s over its steady step), "
            f"ours {ours.step_seconds[0]:.3f} s ({first_step_parts(ours, ours_s, first_steps)})",
            start_goal,
            start_result,
        ],
        ["computed tokens", setting, f"ours/stock {tokens:.2f} (padding and shared prompts saved)", "-", INFO],
    ]


def first_step_parts(ours: Run, steady_s: float, first_steps: float) -> str:
    """The plugin's first step in its steady steps, with and without (``first_steps``) the device's warm-up that
    stock's first step pays too (allocator, library handles), and the self-check's part (the rest: any
    compilation, the first planning)."""
    check = "" if ours.self_check_seconds is None else f"; self-check {ours.self_check_seconds:.3f} s"
    return f"{ours.step_seconds[0] / steady_s:.2f} steady steps, {first_steps:.2f} less stock's warm-up{check}"


def memory_fraction(session: Session) -> list[list]:
    if not session.cuda:
        raise Skip("skipped: no CUDA")
    torch = session.torch
    session.forget(keep=lambda spec: not spec.keep_params)  # nothing held but the weights of the run
    _, ours_spec = speed_specs(session)
    free = session.run(ours_spec)
    total = torch.cuda.get_device_properties(session.device).total_memory / 2**20
    held = free.base_allocated_mib + session.param_mib  # weights (and whatever the process keeps) + gradients
    target = held + MEMORY_FRACTION_SHARE * max(free.peak_allocated_mib - held, 0.0)
    fraction = round(min(MEMORY_FRACTION_MAX, target / total), 4)
    capped = session.run(
        dataclasses.replace(ours_spec, plugin=(("max_memory_fraction_per_device", fraction),)), cache=False
    )
    limit = fraction * total
    budgets, free_budgets = capped.logged("dynbsz/budget_tokens"), free.logged("dynbsz/budget_tokens")
    retries = sum(capped.logged("dynbsz/oom_retries"))
    return [
        [
            "max_memory_fraction_per_device held",
            f"fraction {fraction} of {total / 1024:.1f} GiB, {ours_spec.precision}, {ours_spec.steps} steps, speed mix",
            f"peak allocated {capped.peak_allocated_mib / 1024:.2f} GiB (without the limit "
            f"{free.peak_allocated_mib / 1024:.2f} GiB); budgets {min(budgets):.0f}-{max(budgets):.0f} tokens "
            f"(without {min(free_budgets):.0f}-{max(free_budgets):.0f}); predicted peak "
            f"{max(capped.logged('dynbsz/predicted_peak_memory_mib'), default=math.nan) / 1024:.2f} GiB; "
            f"oom retries {retries:.0f}",
            f"<= {limit / 1024:.2f} GiB",
            PASS if capped.peak_allocated_mib <= limit else FAIL,
        ]
    ]


def oom(session: Session) -> list[list]:
    if not session.cuda:
        raise Skip("skipped: no CUDA")
    from hf_dynbsz.testing import checkpointing_field, relative_difference, update_difference

    torch, preset = session.torch, session.preset
    session.forget(keep=lambda spec: not spec.keep_params)
    per_device, accumulation = preset.oom_batch
    whole_step = per_device * accumulation * (PROMPT_RANGE[1] + preset.speed_max_completion_length)
    common = dict(
        batch=preset.oom_batch,
        max_completion_length=preset.speed_max_completion_length,
        config=((checkpointing_field(), False),),
    )
    stock = session.run(RunSpec("stock", **common))
    plugin = (("max_tokens_per_microbatch", whole_step),)
    free = session.run(RunSpec("ours", plugin=plugin, keep_params=False, **common))  # same memory held as below
    total = torch.cuda.get_device_properties(session.device).total_memory / 2**20
    held = free.base_reserved_mib + session.param_mib
    cap = held + OOM_HEADROOM_SHARE * max(free.peak_reserved_mib - held, 0.0)
    capped = session.run(RunSpec("ours", plugin=plugin, memory_fraction=cap / total, **common), cache=False)
    retries = sum(capped.logged("dynbsz/oom_retries"))
    errors = [line for line in capped.logs if "out of memory" in line.lower()]
    params = relative_difference(capped.params, stock.params)
    update = update_difference(session.initial, capped.params, stock.params)
    first = errors[0].removeprefix("hf_dynbsz: ")[:170] if errors else "none logged"
    budgets = [int(value) for value in capped.logged("dynbsz/budget_tokens")]
    ok = retries > 0 and params <= PARAM_TOLERANCE and update <= UPDATE_TOLERANCE
    return [
        [
            "real CUDA out-of-memory recovered",
            f"fp32, no checkpointing, budget {whole_step} tokens (a step in one pass), process capped at "
            f"{cap / 1024:.2f} GiB (set_per_process_memory_fraction {cap / total:.4f})",
            f"oom retries {retries:.0f}, budgets per step {budgets}; params {params:.1e}, update {update:.1e} from "
            f"stock; first: {first}",
            f"retries > 0, params <= {PARAM_TOLERANCE:g}, update <= {UPDATE_TOLERANCE:g}",
            PASS if ok else FAIL,
        ]
    ]


def stock_runs(session: Session, spec: RunSpec) -> None:
    """Skip (not fail) an attention implementation that stock itself cannot train with here."""
    try:
        session.run(spec)
    except Exception as error:  # noqa: BLE001 - stock cannot run it here: not the plugin's failure
        traceback.print_exc()
        message = " ".join(str(error).split())[:120]
        why = f"{type(error).__name__}: {message}"
        raise Skip(f"skipped: stock GRPOTrainer fails with {spec.attention} here ({why})") from None


def sdpa_padding_free(session: Session) -> list[list]:
    """sdpa's padding-free rows, which "auto" leaves out on CUDA: their padded span calls run on CUDA only."""
    if not session.cuda:
        raise Skip("skipped: no CUDA (on a CPU the sdpa rows above train padding-free rows)")
    forced = (("packing_layout", "padding_free"),)
    return exact_fp32(session, "sdpa", plugin=forced) + exact_bf16(session, "sdpa", plugin=forced)


def flash_attention(session: Session) -> list[list]:
    if not session.cuda:
        raise Skip("skipped: no CUDA")
    if importlib.util.find_spec("flash_attn") is None:
        raise Skip("skipped: flash-attn is not installed")
    stock_runs(session, RunSpec("stock", "bf16", "flash_attention_2", "dapo", 2))
    return exact_bf16(session, "flash_attention_2")


def flex_attention(session: Session) -> list[list]:
    if not session.cuda:
        raise Skip("skipped: no CUDA (flex attention compiles its kernels for CUDA)")
    from transformers.utils import is_torch_flex_attn_available

    if not is_torch_flex_attn_available():
        raise Skip("skipped: this torch has no flex attention")
    stock_runs(session, RunSpec("stock", "fp32", "flex_attention", "dapo", 2))
    rows = exact_fp32(session, "flex_attention")
    rows += exact_bf16(session, "flex_attention", stock_attention="sdpa")
    return rows + speed_of(session, "flex_attention")


#: Flex attention compiles its kernels on first use (and again for new shapes): it starts only with this much left.
FLEX_MIN_LEFT_S = 150.0
#: Each group: its function, the check and setting its row has when skipped, the time it needs left to start.
GROUPS = {
    "sdpa-fp32": (lambda session: exact_fp32(session, "sdpa"), "equal to stock (fp32)", "sdpa", 0.0),
    "sdpa-bf16": (lambda session: exact_bf16(session, "sdpa"), "equal to stock (bf16)", "sdpa", 0.0),
    "sdpa-padding-free": (sdpa_padding_free, "equal to stock (fp32)", "sdpa, packing_layout padding_free", 0.0),
    "speed": (speed, "step time (median)", "stock vs ours, long-tailed", 0.0),
    "memory_fraction": (memory_fraction, "max_memory_fraction_per_device held", "-", 0.0),
    "oom": (oom, "real CUDA out-of-memory recovered", "-", 0.0),
    "flash_attention_2": (flash_attention, "equal to stock (bf16)", "flash_attention_2", 0.0),
    "flex_attention": (flex_attention, "equal to stock (fp32)", "flex_attention", FLEX_MIN_LEFT_S),
}


def run_checks(session: Session, names: list[str], progress=lambda rows: None) -> list[list]:
    """The rows of the groups ``names``; ``progress(rows)`` after each group (the table so far)."""
    rows = []
    for name in names:
        function, check, setting, needs_s = GROUPS[name]
        if session.time_left() <= needs_s:
            spent = f"skipped: time budget ({session.args.time_budget_s:.0f} s) spent"
            rows.append([check, setting, "-", "-", spent if needs_s == 0 else f"{spent} to {needs_s:.0f} s of it"])
            continue
        session.log(f"check {name}")
        try:
            rows += function(session)
        except Skip as skip:
            rows.append([check, setting, "-", "-", str(skip)])
        except Exception as error:  # noqa: BLE001 - one failing check is a row, the others still run
            traceback.print_exc()
            message = " ".join(str(error).split())[:300]
            rows.append([check, setting, f"{type(error).__name__}: {message}", "-", FAIL])
            session.forget()
        progress(rows)
    return rows


# --------------------------------------------------------------------------------------------------------- output
def environment(session: Session) -> str:
    torch = session.torch
    device = "CPU"
    if session.cuda:
        total = torch.cuda.get_device_properties(session.device).total_memory / 2**30
        device = f"{torch.cuda.get_device_name(session.device)} ({total:.1f} GiB, CUDA {torch.version.cuda})"
    versions = []
    for name in ("accelerate", "datasets", "flash_attn"):
        with contextlib.suppress(Exception):
            versions.append(f"{name} {__import__(name).__version__}")
    return (
        f"Device: {device}. Model: {session.preset.name} preset, {session.num_params:,} parameters. "
        f"{machine_description()}; {'; '.join(versions)}."
    )


def render(session: Session, rows: list[list], elapsed: float, finished: bool = True) -> str:
    failed = sum(row[-1] == FAIL for row in rows)
    verdict = f"{failed} check(s) FAILED" if failed else "no check failed"
    if not finished:
        verdict += " so far (INCOMPLETE: the run had not finished when this was written)"
    return "\n".join(
        [
            "# GPU check: hf-dynbsz against stock trl.GRPOTrainer",
            "",
            f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`; {elapsed:.0f} s; {verdict}.",
            "",
            environment(session),
            "",
            markdown_table(HEADER, [[str(cell).replace("|", "/") for cell in row] for row in rows]),
            "",
        ]
    )


# --------------------------------------------------------------------------------------------------------- wheels
def prepare(directory: Path) -> int:
    """Download :data:`WHEELS` for Python 3.12 on manylinux x86_64 into ``directory`` (no dependencies resolved)."""
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    command += ["--implementation", "cp", *[arg for p in WHEEL_PLATFORMS for arg in ("--platform", p)]]
    status = subprocess.call([*command, "-d", str(directory), *WHEELS])
    if status:
        return status
    wheels = sum(path.stat().st_size for path in directory.glob("*.whl"))
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    tree = sum(
        (REPO_ROOT / name).stat().st_size for name in tracked.decode().split("\0") if (REPO_ROOT / name).is_file()
    )
    total = (wheels + tree) / 2**20
    print(f"wheels {wheels / 2**20:.1f} MiB + tracked tree {tree / 2**20:.1f} MiB = {total:.1f} MiB "
          f"(the device carries at most {CARRY_LIMIT_MIB} MiB)")  # fmt: skip
    return 0 if total < CARRY_LIMIT_MIB else 1


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and short runs (the CPU plumbing run)")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "gpu_check.md", help="where the table goes")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated groups of {', '.join(CHECKS)}")
    parser.add_argument(
        "--speed-attention",
        default=None,
        help="comma-separated ATTENTION[:PACKING_LAYOUT]: the plugin's attention (and layout) in the speed rows "
        "(default: sdpa and sdpa:padding_free on CUDA, sdpa on a CPU)",
    )
    parser.add_argument(
        "--span-calls",
        type=int,
        default=None,
        help="sdpa / eager calls per layer over a padding-free row on CUDA (default: the package's "
        "SPAN_CALLS_PER_LAYER; 0: one call per span shape)",
    )
    parser.add_argument("--time-budget-s", type=float, default=None, help="groups not started by then are skipped")
    parser.add_argument(
        "--extra-site", type=Path, help="a site-packages folder appended to sys.path (carried wheels, unpacked)"
    )
    parser.add_argument("--prepare", type=Path, metavar="DIR", help="download the wheels a GPU image lacks, and exit")
    parser.add_argument("--fault", choices=("loss_scale",), help=argparse.SUPPRESS)  # the test of this script
    args = parser.parse_args(argv)
    if args.extra_site and "site-packages" not in str(args.extra_site.resolve()):
        parser.error(
            "--extra-site must be a folder named site-packages (e.g. /tmp/carried/site-packages): dill, which "
            "datasets fingerprints with, pickles modules from any other folder by value, and fails"
        )
    unknown = set(args.checks.split(",")) - set(CHECKS)
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}; choose from {', '.join(CHECKS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.prepare:
        return prepare(args.prepare)
    if args.extra_site:
        sys.path.append(str(args.extra_site.resolve()))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    if args.span_calls is not None:
        from hf_dynbsz.execution.attention import SPAN_CALLS_PER_LAYER

        if args.span_calls:
            SPAN_CALLS_PER_LAYER["cuda"] = args.span_calls
        else:
            SPAN_CALLS_PER_LAYER.pop("cuda", None)
    preset = TINY if args.tiny else FULL
    if args.device == "cpu" and args.tiny:
        torch.set_num_threads(1)  # tiny tensors: one thread is fastest, and steadiest on a shared machine
    args.time_budget_s = args.time_budget_s or preset.time_budget_s
    session = Session(args, preset)
    args.output.parent.mkdir(parents=True, exist_ok=True)

    def write(rows: list[list], finished: bool = False) -> str:  # after each group: a run cut short leaves a table
        text = render(session, rows, time.monotonic() - session.start, finished)
        args.output.write_text(text)
        return text

    rows = run_checks(session, [name for name in CHECKS if name in args.checks.split(",")], progress=write)
    print(write(rows, finished=True))
    return 1 if any(row[-1] == FAIL for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

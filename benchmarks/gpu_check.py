"""One command that proves the plugin's GPU paths against stock ``trl.GRPOTrainer``: at most 8 minutes on one H100
or H200 (a time budget of 450 s skips the groups not started by then, and says so), and the same plumbing in about
two minutes on CPU (``--device cpu --tiny``, which the test suite runs).

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
* ``sdpa-padding-free``: one fp32 and one bf16 case (dapo, two iterations, shared prefixes) with
  ``packing_layout="padding_free"``: on CUDA "auto" trains padded rows on sdpa, and the padding-free rows' padded span
  calls (at most ``SPAN_CALLS_PER_LAYER["cuda"]`` per layer) run on CUDA only. Skipped on CPU.
* ``flash_attention_2``: the bf16 check with flash-attention (skipped, and said so, where ``flash_attn`` is absent).
* ``flex_attention``: the fp32 check with transformers' flex attention: the plugin's padding-free rows take one
  flex_attention call per layer under the segments' block mask (the row says the layout it trained with). Skipped
  where stock cannot run it. Then the plugin's flex in bf16 against stock's sdpa in bf16 (stock's own flex does not
  compile in bf16 mixed precision on torch 2.11: autocast leaves its inputs in mixed dtypes, which the plugin casts
  as autocast casts sdpa's), and its step time on the speed mix.
* ``padded``: padded rows pinned (``packing_layout="padded"``), one fp32 and one bf16 case: a layout the speed rows
  time. (On CUDA the sdpa fp32 rows train padded rows too: torch's varlen_attn computes in bf16 and fp16 only; the
  sdpa bf16 rows train its padding-free rows, which "auto" and "padding_free" give there.)
* ``speed``: bf16, at the ``0.5B`` preset and a ``1.5B`` preset (Qwen2.5-1.5B's shape: hidden 1536, 28 layers,
  where compute rather than launches dominates), on the ``long_tailed`` and ``prompt_heavy`` mixes: one row for
  stock (``speed: stock``) and one per plugin layout (``speed: padded``, ``speed: varlen``, ``speed: flex``,
  ``speed: auto``: the default, whose layout the layout timing chooses), stock and plugin in the same process on the
  same rollouts. Each row: the median steady step (after the first) and its training phase (the step less TRL's
  generation and scoring), the computed tokens against stock's, the token limit (stock's computed tokens over
  ours) and the share of it reached. Goals: every row faster than stock; ``auto`` at least 3x stock and 70% of the
  token limit on the long-tailed mix at 1.5B, at least 4x on the prompt-heavy mix. ``first step: auto``: the first
  step in steady steps, less the device's warm-up (stock's first step over its steady one), with the self-check's
  part; goal: at most 1.5. ``flex compiles``: the flex_attention shapes the run compiled, and dynamo's graphs, against
  the row widths it used; goal: at most one per row width. ``prefix tree``: the ``agentic`` mix (a 600-token tool
  block every prompt begins with, completions up to 384 tokens) at the main preset: stock, the plugin with
  ``share_prompt_prefix="groups"`` and with its default (a prefix tree, the block once per pass), and the tree
  against the groups; goal: faster than the groups. (On CPU: fp32 and the tiny model, information only; varlen and
  flex need CUDA.)
* ``probes``: ``host syncs``: the plugin's steady training passes (steps 2-3) under
  ``torch.cuda.set_sync_debug_mode("warn")``, every sync counted by the package that issued it; goal: none from the
  plugin (TRL's fused LM head selects its scored positions with a boolean mask, a sync per pass that stock has too).
  ``profile``: one steady plugin step under ``torch.profiler``: the top operators by CUDA time and the share of the
  step the GPU sits idle, written next to the table (``<output>_profile.md``).

How long it takes on one H100 (estimated, not measured: the one GPU run so far was on an H200, 225 s for the groups
before this version): about 70 s of exactness runs at 0.5B; the speed rows about 200 s at 0.5B (stock's step about
1 s there, 5 steps a run, 5 runs a mix, 2 mixes, a minute of them flex_attention's compiles) and about 100 s at 1.5B
(3 times the FLOPs a step; stock, padded, varlen and auto: flex is timed at 0.5B only); the probes, the memory and
out-of-memory checks about 80 s: about 450 s. The 450 s budget skips the groups not started by then (the flash and
flex exactness rows come last), and the speed group skips the mixes not started.
* ``memory_fraction``: the plugin with ``max_memory_fraction_per_device`` set below what the speed run used (half of
  what its passes added, at most 0.5): the run's ``torch.cuda.max_memory_allocated`` must stay under fraction x
  total; the budgets it chose are reported.
* ``oom``: a real CUDA out-of-memory error. The plugin trains (fp32, no gradient checkpointing) with a budget that
  puts a whole optimizer step in one pass; ``torch.cuda.set_per_process_memory_fraction`` then caps the process at
  what it holds (gradients included) plus half of what that pass added, so the pass raises
  ``torch.OutOfMemoryError``. It must be recovered (``dynbsz/oom_retries`` > 0) and the run must end with stock's
  parameters (fp32 tolerances).
* ``async_grpo`` (``benchmarks/gpu_async.py``, not run on a GPU yet): ``DynamicBatchAsyncGRPOTrainer`` against stock
  ``AsyncGRPOTrainer``: fp32 exactness against stock's fixed-count step (stock's tree kernel in plain torch), and the
  bf16 training phase per 16 samples against stock's fixed-count mode and its default budget on stock's own
  FlashAttention-3 kernel where it loads (information).

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
import gpu_async  # noqa: E402
import gpu_probes  # noqa: E402
from common import REPO_ROOT, RESULTS_DIR, machine_description, markdown_table  # noqa: E402

from hf_dynbsz.testing import PROMPT_HEAVY_RANGE, PROMPT_RANGE, ModelShape, snapshot_parameters, step_clock  # noqa: E402

PROFILED_STEP = 3  # the plugin's step profiled by the "profile" probe: a steady one

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
    "padded",
    "speed",
    "probes",
    "memory_fraction",
    "oom",
    "flash_attention_2",
    "flex_attention",
    "async_grpo",
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
    model: ModelShape  # vocab_size None: the tokenizer's
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
    model=ModelShape(
        hidden_size=1024, num_layers=24, num_heads=16, num_kv_heads=2, intermediate_size=2816, vocab_size=151_936
    ),
    **dict(max_completion_length=512, steps=2, time_budget_s=450.0, bf16_cases=LOSS_CASES),
    **dict(speed_batch=(8, 4), speed_steps=5, speed_max_completion_length=1024),
    **_SHARED,
)
#: Qwen2.5-1.5B's shape (hidden 1536, 28 layers, 12 heads on 2 key/value heads, MLP 8960; about 1.8B parameters with
#: an untied head): where compute rather than launches dominates a step. The speed rows only.
LARGE = dataclasses.replace(
    FULL,
    name="1.5B",
    model=dataclasses.replace(FULL.model, hidden_size=1536, num_layers=28, num_heads=12, intermediate_size=8960),
)
#: The CPU plumbing run: under two minutes on 2 cores.
TINY = Preset(
    name="tiny",
    model=ModelShape(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64),
    **dict(max_completion_length=48, steps=1, time_budget_s=240.0, bf16_cases=LOSS_CASES[::3]),
    **dict(speed_batch=(4, 2), speed_steps=3, speed_max_completion_length=64),
    **_SHARED,
)


PRESETS = {preset.name: preset for preset in (FULL, LARGE, TINY)}
#: The presets of the speed rows, by the run's preset.
SPEED_PRESETS = {FULL.name: (FULL.name, LARGE.name), TINY.name: (TINY.name,)}


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
    preset: str | None = None  # the model's preset (None: the session's); other presets' weights are not checked
    mix: str = "long_tailed"  # the length mix of the rollouts (benchmarks/common.py)
    probe: str | None = None  # "syncs": count the host syncs of steady passes; "profile": profile a steady step


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
    generation_seconds: list = dataclasses.field(default_factory=list)  # per step: TRL's generation and scoring
    probe: object = None  # the probe's result: a SyncCounter, or (profile markdown, GPU idle share)
    flex_compiles: int | None = None  # flex_attention shapes the process compiled (ours, flex)
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

        from hf_dynbsz.testing import build_char_tokenizer, numbered_prompts

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
        self.dataset = numbered_prompts(512, width=5)
        self.tmp = tempfile.mkdtemp(prefix="gpu_check-")
        self.cache: dict[RunSpec, Run] = {}
        self.split_noise: dict[str, float] = {}  # stock's bf16 noise per attention, measured once
        model = self.build_model("sdpa")
        self.initial = snapshot_parameters(model)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.param_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        del model
        self.release()

    def log(self, message: str) -> None:
        print(f"[gpu_check {time.monotonic() - self.start:6.1f} s] {message}", file=sys.stderr, flush=True)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def build_model(self, attention: str, preset: str | None = None):
        preset = PRESETS[preset] if preset else self.preset
        positions = PROMPT_HEAVY_RANGE[1] + preset.speed_max_completion_length + 64
        with self.torch.device(self.device):  # built on the device: a 0.5B model initialises there in a second
            return preset.model.build(self.tokenizer, max_positions=positions, attention=attention)

    def rollout(self, max_completion_length: int, mix: str = MIX):
        from hf_dynbsz.testing import mix_rollout

        return mix_rollout(mix, self.tokenizer, max_completion_length)

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
    from hf_dynbsz.testing import RecordingReward, base_config_kwargs, build_trainer

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
    reward, rollout = RecordingReward(), session.rollout(kwargs["max_completion_length"], spec.mix)
    trainer = build_trainer(
        args, model, session.tokenizer, dataset=session.dataset, reward=reward, rollout=rollout, trainer_cls=cls
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
    model = session.build_model(spec.attention, spec.preset)
    if spec.preset is None and not all(torch.equal(p, session.initial[name]) for name, p in model.named_parameters()):
        raise RuntimeError("the model was not rebuilt with the same initial weights")
    trainer, reward = make_trainer(session, spec, model)
    trainer.remove_callback(PrinterCallback)  # the log dicts of every step: the table is what this prints
    clock = step_clock(session.synchronize)
    trainer.add_callback(clock)
    trainer._gpu_check_synchronize = session.synchronize
    generation = gpu_probes.generation_clock(trainer)
    probe = install_probe(session, spec, trainer)
    compiled_before = flex_compiles()
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
        params=snapshot_parameters(trainer.model) if spec.keep_params else None,
        completions=list(reward.completions),
        history=list(trainer.state.log_history),
        step_seconds=list(clock.seconds),
        trained_as=layout,
        notes=notes,
        logs=captured.messages,
        self_check_seconds=getattr(getattr(trainer, "_dynbsz", None), "self_check_seconds", None),
        generation_seconds=generation,
        probe=probe_result(session, probe),
        flex_compiles=compiled_in(compiled_before)
        if spec.attention == "flex_attention" and spec.trainer == "ours"
        else None,
        **memory,
    )
    del trainer, model
    session.release()
    return run


def install_probe(session: Session, spec: RunSpec, trainer):
    """The run's probe: a sync counter on the plugin's executor, or a profiler of one steady step (the third)."""
    if spec.probe == "syncs":
        counter = gpu_probes.SyncCounter(session.torch)
        counter.install(trainer._dynbsz)
        return counter
    if spec.probe == "profile":
        profiler = gpu_probes.step_profiler(session.torch, PROFILED_STEP, session.cuda)
        trainer.add_callback(profiler)
        return profiler
    return None


def compiled_in(before: tuple[set, int | None]) -> tuple[set, int | None]:
    """What a run compiled: the shapes new since ``before`` and dynamo's graphs added."""
    shapes, graphs = flex_compiles()
    return shapes - before[0], None if graphs is None or before[1] is None else graphs - before[1]


def probe_result(session: Session, probe):
    if isinstance(probe, gpu_probes.SyncCounter) or probe is None:
        return probe
    return gpu_probes.profile_summary(probe, session.cuda)


def flex_compiles() -> tuple[set, int | None]:
    """``(shapes, dynamo graphs)`` compiled by this process so far: the flex_attention shapes of segment attention's
    kernel (one per row width, dtype and head layout), and dynamo's count of distinct graphs."""
    from torch._dynamo.utils import counters

    from hf_dynbsz.execution.attention import FLEX_KERNEL

    return set(FLEX_KERNEL.compiled), counters["stats"].get("unique_graphs")


# --------------------------------------------------------------------------------------------------------- checks
def differences(session: Session, ours: Run, stock: Run) -> tuple[float, float]:
    """(relative parameter difference, relative update difference) of ``ours`` from ``stock``."""
    from hf_dynbsz.testing import relative_difference, update_difference

    if ours.completions != stock.completions:
        raise AssertionError("the two runs did not see the same completions")
    return relative_difference(ours.params, stock.params), update_difference(session.initial, ours.params, stock.params)


def describe(spec: RunSpec, share: bool) -> str:
    prompts = "shared prefixes (the default: a prefix tree)" if share else "prompts not shared"
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


#: The speed rows' layouts of the plugin: name -> (attention implementation, packing_layout; None: "auto").
SPEED_LAYOUTS = {
    "padded": ("sdpa", "padded"),
    "varlen": ("sdpa", "padding_free"),  # on CUDA in bf16: torch's varlen_attn (the run's "trained as" says)
    "flex": ("flex_attention", "padding_free"),
    "auto": ("sdpa", None),  # the default: the layout timing's choice among those the self-check passes
}
SPEED_MIXES = ("long_tailed", "prompt_heavy")
#: The speed goals of the automatic choice, by (preset, mix): (least speed-up over stock, least share of the token
#: limit); every row must also be faster than stock.
SPEED_GOALS = {
    ("1.5B", "long_tailed"): (3.0, 0.7),
    ("0.5B", "prompt_heavy"): (4.0, 0.0),
    ("1.5B", "prompt_heavy"): (4.0, 0.0),
}


def speed_spec(session: Session, preset: str, mix: str, layout: str | None = None, share: str | None = None) -> RunSpec:
    """Stock (``layout`` None: sdpa, its users' default) or the plugin in one of :data:`SPEED_LAYOUTS` on ``mix`` at
    ``preset``, bf16 on CUDA (fp32 on a CPU); ``share``: the plugin's ``share_prompt_prefix`` (None: its default)."""
    main = preset == session.preset.name
    sizes = PRESETS[preset]
    common = dict(
        precision="bf16" if session.cuda else "fp32",
        batch=sizes.speed_batch,
        steps=sizes.speed_steps,
        max_completion_length=sizes.speed_max_completion_length,
        keep_params=False,
        preset=None if main else preset,
        mix=mix,
    )
    if layout is None:
        return RunSpec("stock", **common)
    attention, packing = SPEED_LAYOUTS[layout]
    plugin = (("packing_layout", packing),) if packing else ()
    plugin += (("share_prompt_prefix", share),) if share else ()
    return RunSpec("ours", attention=attention, plugin=plugin, **common)


def speed(session: Session) -> list[list]:
    """The speed rows: per preset and mix, stock's, then each plugin layout's against it in the same process."""
    layouts = (session.args.speed_layouts or ",".join(SPEED_LAYOUTS)).split(",")
    rows = []
    for preset in SPEED_PRESETS[session.preset.name]:
        for mix in SPEED_MIXES:
            if session.time_left() <= 0:
                rows.append([f"speed: {preset}", f"{preset}, {mix}", "-", "-", "skipped: time budget spent"])
                continue
            rows += speed_rows(session, preset, mix, layouts)
            session.forget(keep=lambda spec: spec.keep_params)
    rows += prefix_tree_rows(session)
    session.forget(keep=lambda spec: spec.keep_params)
    return rows


#: The prefix-tree rows' mix (a 600-token tool block every prompt begins with, 20-120-token questions, long-tailed
#: completions) and its longest completion; goal on CUDA: the default (a prefix tree) faster than prompt groups.
PREFIX_TREE_MIX, PREFIX_TREE_COMPLETION = "agentic", 384


def prefix_tree_rows(session: Session) -> list[list]:
    """The agentic mix at the main preset: stock, the plugin sharing each prompt in its group, and its default (a
    prefix tree, the tool block once per pass), each against stock, then the tree against the groups."""
    preset = session.preset.name
    if session.time_left() <= 0:
        return [["prefix tree: tree", f"{preset}, {PREFIX_TREE_MIX}", "-", "-", "skipped: time budget spent"]]

    def spec(layout=None, share=None):
        return dataclasses.replace(
            speed_spec(session, preset, PREFIX_TREE_MIX, layout, share),
            max_completion_length=min(PRESETS[preset].speed_max_completion_length, PREFIX_TREE_COMPLETION),
        )

    stock, groups, tree = session.run(spec()), session.run(spec("auto", "groups")), session.run(spec("auto"))
    setting = (
        f"{preset}, {PREFIX_TREE_MIX}, {'bf16' if session.cuda else 'fp32'}, steps 2-{PRESETS[preset].speed_steps}"
    )
    rows = [["prefix tree: stock", setting, f"step {steady(stock)[0]:.3f} s", "-", INFO]]
    for name, run in (("groups", groups), ("tree", tree)):
        rows.append(layout_row(session, "auto", setting, stock, run, None))
        rows[-1][0] = f"prefix tree: {name}"
    speedup = steady(groups)[0] / steady(tree)[0]
    tokens = sum(tree.logged("dynbsz/computed_tokens")[1:]) / max(sum(groups.logged("dynbsz/computed_tokens")[1:]), 1)
    saved = sum(tree.logged("dynbsz/tree_tokens_saved")[1:])
    measured = f"{speedup:.2f}x the groups' step; computed tokens {tokens:.2f}x theirs ({saved:.0f} saved by the tree)"
    rows.append(["prefix tree: tree vs groups", setting, measured, "faster than groups" if session.cuda else
                 "- (CPU: information)", (PASS if speedup > 1 else FAIL) if session.cuda else INFO])  # fmt: skip
    return rows


def speed_rows(session: Session, preset: str, mix: str, layouts: list[str]) -> list[list]:
    stock = session.run(speed_spec(session, preset, mix))
    sizes = PRESETS[preset]
    per_device, accumulation = sizes.speed_batch
    setting = (
        f"{preset}, {mix}, {'bf16' if session.cuda else 'fp32'}, {per_device}x{accumulation} samples per step, "
        f"max completion {sizes.speed_max_completion_length}, steps 2-{sizes.speed_steps}"
    )
    stock_s, stock_train = steady(stock)
    rows = [["speed: stock", setting, f"step {stock_s:.3f} s (training phase {stock_train:.3f} s)", "-", INFO]]
    for layout in layouts:
        if layout == "flex" and preset != session.preset.name:
            rows.append([f"speed: {layout}", setting, "-", "-", "skipped: flex is timed at the main preset only "
                         "(its compiles for another model shape would take a minute of the time budget)"])  # fmt: skip
            continue
        if not session.cuda and layout in ("varlen", "flex"):
            why = "torch's varlen_attn has no CPU kernel" if layout == "varlen" else "flex_attention compiles for CUDA"
            rows.append([f"speed: {layout}", setting, "-", "-", f"skipped: no CUDA ({why})"])
            continue
        ours = session.run(speed_spec(session, preset, mix, layout))
        rows.append(layout_row(session, layout, setting, stock, ours, SPEED_GOALS.get((preset, mix))))
        if layout == "auto":
            rows.append(first_step_row(session, setting, stock, ours))
        if ours.flex_compiles is not None:
            rows.append(compiles_row(setting, ours))
    return rows


def steady(run: Run) -> tuple[float, float]:
    """``(median steady step, median steady training phase)`` in seconds: steps after the first; the training phase
    is the step less TRL's generation and scoring (:func:`gpu_probes.generation_clock`)."""
    steps = run.step_seconds[1:]
    generation = run.generation_seconds[1 : len(run.step_seconds)]
    train = [step - gen for step, gen in zip(steps, generation)] or steps
    return statistics.median(steps), statistics.median(train)


def layout_row(session: Session, layout: str, setting: str, stock: Run, ours: Run, goals) -> list:
    stock_s, stock_train = steady(stock)
    ours_s, ours_train = steady(ours)
    speedup, train_speedup = stock_s / ours_s, stock_train / ours_train
    computed = sum(ours.logged("dynbsz/computed_tokens")[1:])
    tokens = computed / max(sum(ours.logged("dynbsz/stock_computed_tokens")[1:]), 1)
    limit = 1.0 / tokens if tokens else math.nan
    reached = speedup / limit if limit else math.nan
    measured = (
        f"step {ours_s:.3f} s (training phase {ours_train:.3f} s): {speedup:.2f}x stock's step, {train_speedup:.2f}x "
        f"its training phase; computed tokens {tokens:.2f}x stock's, token limit {limit:.2f}x, {reached:.0%} of it "
        f"reached (trained as: {ours.trained_as})"
    )
    goal, ok = "faster than stock", speedup > 1
    if layout == "varlen" and session.cuda and "varlen_attn" not in ours.trained_as:
        goal, ok = "faster than stock, through varlen_attn", False
    if layout == "auto" and goals:
        least, share = goals
        goal += f", >= {least:g}x" + (f" and >= {share:.0%} of the token limit" if share else "")
        ok = ok and speedup >= least and reached >= share
    return [f"speed: {layout}", setting, measured, goal if session.cuda else "- (CPU: information)",
            (PASS if ok else FAIL) if session.cuda else INFO]  # fmt: skip


def first_step_row(session: Session, setting: str, stock: Run, ours: Run) -> list:
    """The plugin's first step in its steady steps, less the device's warm-up (stock's first step over its steady
    ones), with the self-check's part; goal :data:`FIRST_STEP_GOAL`."""
    stock_s, ours_s = steady(stock)[0], steady(ours)[0]
    warm_up = max(stock.step_seconds[0] - stock_s, 0.0)
    first_steps = (ours.step_seconds[0] - warm_up) / ours_s
    check = "" if ours.self_check_seconds is None else f"; self-check {ours.self_check_seconds:.3f} s"
    return [
        "first step: auto",
        setting.rsplit(",", 1)[0] + ", step 1",
        f"stock {stock.step_seconds[0]:.3f} s (warm-up {warm_up:.3f} s over its steady step), ours "
        f"{ours.step_seconds[0]:.3f} s: {ours.step_seconds[0] / ours_s:.2f} steady steps, {first_steps:.2f} less "
        f"stock's warm-up{check}",
        f"<= {FIRST_STEP_GOAL:g} steady steps less stock's warm-up" if session.cuda else "-",
        (PASS if first_steps <= FIRST_STEP_GOAL else FAIL) if session.cuda else INFO,
    ]


def compiles_row(setting: str, ours: Run) -> list:
    """flex_attention's compiles in a run: the shapes the process compiled (one per row width and dtype)."""
    compiled, graphs = ours.flex_compiles
    widths = sorted({shape[0][2] for shape in compiled})
    ok = graphs <= len(widths) if graphs is not None else len(compiled) <= len(widths)
    return [
        "flex compiles",
        setting,
        f"{len(compiled)} shapes compiled for {len(widths)} row widths {widths}; dynamo graphs {graphs}",
        "at most one per row width",
        PASS if ok else FAIL,
    ]


def probes(session: Session) -> list[list]:
    """The host syncs of the plugin's steady passes, and a profile of one of its steady steps."""
    return host_syncs(session) + profile_row(session)


def host_syncs(session: Session) -> list[list]:
    setting = f"{session.preset.name}, {MIX}, bf16, packing_layout auto, training passes of steps 2-3"
    if not session.cuda:
        return [["host syncs", setting, "-", "-", "skipped: no CUDA (tests/test_host_reads.py counts them on a CPU)"]]
    spec = dataclasses.replace(speed_spec(session, session.preset.name, MIX, "auto"), steps=3, probe="syncs")
    counter = session.run(spec, cache=False).probe
    per_pass = counter.per_pass()
    plugin = sum(count for origin, count in per_pass.items() if origin.startswith("plugin"))
    found = "; ".join(f"{origin} {count:.2f}" for origin, count in per_pass.items()) or "none"
    return [
        [
            "host syncs",
            setting + " under torch.cuda.set_sync_debug_mode('warn')",
            f"per steady pass ({counter.passes} passes): {found}",
            "plugin's own: 0 (others: stock has them too)",
            PASS if plugin == 0 else FAIL,
        ]
    ]


def profile_row(session: Session) -> list[list]:
    spec = dataclasses.replace(speed_spec(session, session.preset.name, MIX, "auto"), steps=PROFILED_STEP,
                               probe="profile")  # fmt: skip
    summary, idle = session.run(spec, cache=False).probe
    path = session.args.output.with_name(session.args.output.stem + "_profile.md")
    path.write_text(f"# One steady plugin step under torch.profiler (step {PROFILED_STEP}, {spec.mix}, "
                    f"{session.preset.name}, packing_layout auto)\n\n{summary}")  # fmt: skip
    measured = (f"GPU idle {idle:.0%} of the step" if idle is not None else "no GPU") + f"; top operators: {path.name}"
    return [["profile", f"{session.preset.name}, {MIX}, step {PROFILED_STEP} of the plugin", measured, "-", INFO]]


def memory_fraction(session: Session) -> list[list]:
    if not session.cuda:
        raise Skip("skipped: no CUDA")
    torch = session.torch
    session.forget(keep=lambda spec: not spec.keep_params)  # nothing held but the weights of the run
    ours_spec = speed_spec(session, session.preset.name, MIX, "auto")
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


def padded(session: Session) -> list[list]:
    """Padded rows pinned (a layout the speed rows time): one fp32 and one bf16 case."""
    pinned = (("packing_layout", "padded"),)
    return exact_fp32(session, "sdpa", plugin=pinned) + exact_bf16(session, "sdpa", plugin=pinned)


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
    return rows + exact_bf16(session, "flex_attention", stock_attention="sdpa")


#: Flex attention compiles its kernels on first use (and again for new shapes): it starts only with this much left.
FLEX_MIN_LEFT_S = 150.0
#: Each group: its function, the check and setting its row has when skipped, the time it needs left to start.
GROUPS = {
    "sdpa-fp32": (lambda session: exact_fp32(session, "sdpa"), "equal to stock (fp32)", "sdpa", 0.0),
    "sdpa-bf16": (lambda session: exact_bf16(session, "sdpa"), "equal to stock (bf16)", "sdpa", 0.0),
    "sdpa-padding-free": (sdpa_padding_free, "equal to stock (fp32)", "sdpa, packing_layout padding_free", 0.0),
    "padded": (padded, "equal to stock (fp32)", "sdpa, packing_layout padded", 0.0),
    "speed": (speed, "speed", "stock vs ours", 0.0),
    "probes": (probes, "host syncs", "-", 0.0),
    "memory_fraction": (memory_fraction, "max_memory_fraction_per_device held", "-", 0.0),
    "oom": (oom, "real CUDA out-of-memory recovered", "-", 0.0),
    "flash_attention_2": (flash_attention, "equal to stock (bf16)", "flash_attention_2", 0.0),
    "flex_attention": (flex_attention, "equal to stock (fp32)", "flex_attention", FLEX_MIN_LEFT_S),
    "async_grpo": (gpu_async.rows, "async GRPO", "-", 0.0),
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
        "--speed-layouts",
        default=None,
        help=f"comma-separated layouts of the plugin's speed rows, of {', '.join(SPEED_LAYOUTS)} (default: all)",
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
    unknown = set((args.speed_layouts or "auto").split(",")) - set(SPEED_LAYOUTS)
    if unknown:
        parser.error(f"unknown speed layouts {sorted(unknown)}; choose from {', '.join(SPEED_LAYOUTS)}")
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

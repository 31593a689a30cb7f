"""``benchmarks/gpu_check.py``'s ``async_grpo`` group: ``DynamicBatchAsyncGRPOTrainer`` against stock
``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``) on the check's model, through TRL's own protocols (the stand-in
rollout worker over the long-tailed mix, the no-op weight transfer; :mod:`hf_dynbsz.testing.async_grpo`).

* ``async GRPO: equal to stock (fp32)``: the plugin's step written 8 x 2 and cut by a budget of a quarter of its
  samples' tokens against stock's fixed-count step in one micro-batch (16 x 1), fp32, stock's tree attention in plain
  torch (FlashAttention-3 computes in bf16 and fp16 only): parameters within 1e-5 and the update within 1e-3, the
  tests' tolerances.
* ``async GRPO: training phase``: bf16, the training phase per 16 samples (stock's ``perf/fwd_bwd_s`` +
  ``perf/optimizer_s``, steps after the first): stock in fixed-count mode and at its default budget (the server's
  ``max_model_len``: the longest prompt + ``max_completion_length``) on its own FA3 kernel where ``kernels`` fetches
  it (a Hopper GPU with the Hub's ``kernels-community/flash-attn3`` cached), else on the plain-torch kernel (the row
  says which), against the plugin at its defaults. Information: the ratio, stock's over the plugin's.
"""

from __future__ import annotations

import math
import os

from hf_dynbsz.testing import PROMPT_RANGE

SAMPLES = 16


def model_directory(session) -> str:
    """The check's model (its initial weights) saved once for the asynchronous trainers, which load a path."""
    directory = os.path.join(session.tmp, "async-model")
    if not os.path.isdir(directory):
        model = session.build_model("sdpa")
        model.save_pretrained(directory)
        session.tokenizer.save_pretrained(directory)
        del model
        session.release()
    return directory


def stock_kernel() -> tuple[str, str]:
    """``("fa3", why)`` where stock's own FA3 kernel loads here, else ``("reference", why not)``."""
    try:
        from trl.experimental.async_grpo import packing

        packing._flash_attn()
    except Exception as error:  # noqa: BLE001 - any failure to fetch or load it: the plain-torch kernel runs
        return "reference", f"stock on the plain-torch tree kernel (FA3: {type(error).__name__})"
    return "fa3", "stock on FlashAttention-3"


def run(session, trainer: str, precision: str, kernel: str = "reference", **fields):
    """One asynchronous run on the check's device."""
    from hf_dynbsz.testing import RolloutScript, async_grpo_run

    preset = session.preset
    script = RolloutScript(
        mix="long_tailed",
        max_completion_length=preset.max_completion_length,
        prompt_lengths=PROMPT_RANGE,
        token_range=(3, len(session.tokenizer)),
        old_log_prob=-math.log(preset.model.vocab_size or len(session.tokenizer)),
        seed=1,
    )
    fields = dict(
        dict(use_cpu=not session.cuda, bf16=precision == "bf16", max_steps=preset.steps + 1),
        max_completion_length=preset.max_completion_length,
        learning_rate=preset.learning_rate,
        **fields,
    )
    out = os.path.join(session.tmp, f"async-{trainer}-{precision}-{len(os.listdir(session.tmp))}")
    result = async_grpo_run(trainer, model_directory(session), out, script, stock_kernel=kernel, **fields)
    session.release()
    return result


def per_sixteen(history: list[dict]) -> float:
    steps = [entry for entry in history if "perf/fwd_bwd_s" in entry][1:]
    seconds = sum(entry["perf/fwd_bwd_s"] + entry["perf/optimizer_s"] for entry in steps)
    return seconds / max(sum(entry["batch/samples_per_step"] for entry in steps), 1.0) * SAMPLES


def exact_row(session) -> list:
    from hf_dynbsz.testing import relative_difference, update_difference

    stock = run(session, "async_grpo_stock", "fp32", per_device_train_batch_size=SAMPLES)
    budget = max(64, int(stock.history[0]["batch/forwarded_tokens_per_step"]) // 4)
    ours = run(
        session,
        "async_grpo_dynamic",
        "fp32",
        per_device_train_batch_size=SAMPLES // 2,
        gradient_accumulation_steps=2,
        token_budget=budget,
        async_step="samples",  # the plugin's own step: 8 x 2 trains stock's 16 x 1
    )
    parameters = relative_difference(ours.final, stock.final)
    update = update_difference(stock.initial, ours.final, stock.final)
    passed = parameters <= 1e-5 and update <= 1e-3
    measured = f"params {parameters:.1e}, update {update:.1e}; {ours.history[0]['dynbsz/microbatches']:.0f} passes"
    setting = f"fp32, async_step='samples' 8 x 2 cut by {budget} tokens vs stock 16 x 1"
    return ["async GRPO: equal to stock (fp32)", setting, measured, "1e-5 / 1e-3", "pass" if passed else "FAIL"]


def speed_rows(session) -> list[list]:
    kernel, note = stock_kernel()
    budget = PROMPT_RANGE[1] + session.preset.max_completion_length
    ours = per_sixteen(run(session, "async_grpo_dynamic", "bf16", per_device_train_batch_size=SAMPLES).history)
    rows = []
    for label, fields in (
        ("fixed count 16 x 1", dict(per_device_train_batch_size=SAMPLES)),
        (f"default budget ({budget} tokens)", dict(token_budget=budget, max_steps=4 * session.preset.steps + 1)),
    ):
        stock = per_sixteen(run(session, "async_grpo_stock", "bf16", kernel, **fields).history)
        measured = f"stock {stock:.3f} s, ours {ours:.3f} s per 16 samples: {stock / ours:.2f}x"
        rows.append(["async GRPO: training phase", f"bf16, stock {label}; {note}", measured, "-", "info"])
    return rows


def rows(session) -> list[list]:
    """The group's rows."""
    return [exact_row(session), *speed_rows(session)]

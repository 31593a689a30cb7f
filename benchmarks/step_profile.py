"""A profile-backed account of one steady training step: where the plugin's time goes, beside stock's step.

It runs ``benchmarks/step_time.py``'s worker (the same model, scripted long-tailed rollouts and schedule: its default
preset, 1 thread) for stock ``GRPOTrainer`` and for the plugin (padding-free rows with shared prompts, the CPU
default), each in a fresh process, and profiles one steady optimizer step with ``torch.profiler`` (CPU): step 4 by
default, after the first and one that does not generate. The plugin's executor labels every phase of a pass
(``torch.profiler.record_function``, free without a profiler), so the plugin's step splits into:

* planning (budget, partition, lockstep agreement), the exchange of balanced samples, packing the micro-batches;
* the forward passes, of which attention: the kernels' own time against the span formulation's gathers, masks and
  dispatch around them;
* the loss, the backward passes, the no-grad log-prob passes;
* the rest: what TRL and Python do outside the passes (the optimizer step, clipping, the trainer's loop).

The profiler adds its own cost to every operator, so the shares are the figures to read; the step times without a
profiler are ``benchmarks/step_time.py``'s. Writes ``benchmarks/results/step_profile.md`` (under a minute)::

    python benchmarks/step_profile.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import step_time  # noqa: E402  (the benchmark whose worker this profiles)

#: Top-level phases of a pass (their labels do not nest in one another) and how the account names them.
PHASES = {
    "dynbsz/plan": "planning (budget, partition, lockstep)",
    "dynbsz/exchange": "exchange of balanced samples",
    "dynbsz/pack": "packing the micro-batches",
    "dynbsz/forward": "training forwards",
    "dynbsz/loss": "loss",
    "dynbsz/backward": "backwards",
    "dynbsz/no_grad_forward": "no-grad log-prob forwards",
}


def account(profile: dict) -> list[tuple[str, float]]:
    """``(what, seconds)`` rows of one profiled step of the plugin, the rest last."""
    rows = [(label, profile.get(key, 0.0)) for key, label in PHASES.items()]
    kernels = sum(profile.get(name, 0.0) for name in step_time.ATTENTION_KERNELS)
    attention = profile.get("dynbsz/attention", 0.0)
    rows.append(("  of which attention kernels (forwards and backwards' recomputation)", kernels))
    rows.append(("  of which attention's gathers, masks and dispatch", max(attention - kernels, 0.0)))
    rows.append(("the rest (optimizer, clipping, TRL's loop, Python)", profile["step"] - sum(s for _, s in rows[:7])))
    return rows


def render(stock: dict, ours: dict, spec: dict) -> str:
    step = ours["profile"]["step"]
    lines = [
        "# One steady step, profiled",
        "",
        f"`python benchmarks/step_profile.py`: step {spec['profile_step']} of the long-tailed mix, "
        f"{spec['batch_size']} x {spec['grad_accum']} samples a step, completions up to "
        f"{spec['max_completion_length']} tokens, hidden {spec['hidden_size']}, {spec['num_layers']} layers, "
        f"1 thread, torch.profiler on (its overhead included in every figure).",
        "",
        f"Stock GRPOTrainer's step: {stock['profile']['step']:.2f} s. The plugin's (padding-free, shared prompts): "
        f"{step:.2f} s ({stock['profile']['step'] / step:.2f}x faster).",
        "",
        "| the plugin's step | seconds | share |",
        "|---|---:|---:|",
    ]
    lines += [f"| {what} | {seconds:.3f} | {seconds / step:.0%} |" for what, seconds in account(ours["profile"])]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=int, default=4, help="the optimizer step to profile (1-based)")
    parser.add_argument("--quick", action="store_true", help="step_time's quick preset (tiny model, seconds)")
    parser.add_argument("--output", type=Path, default=step_time.RESULTS_DIR / "step_profile.md")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    settings = dict(step_time.PRESETS["quick" if args.quick else "default"])
    spec = {key: settings[key] for key in step_time.SPEC_KEYS}
    spec.update(mix="long_tailed", seed=0, threads=1, model="qwen2", repeat=0, profile_step=args.step)
    spec["rounds"] = max(spec["rounds"], args.step)  # enough steps to reach it
    stock = step_time.run_one(dict(spec, config="stock"), args.timeout)
    ours = step_time.run_one(dict(spec, config="padding_free"), args.timeout)
    report = render(stock, ours, spec)
    args.output.write_text(report)
    print(report)


if __name__ == "__main__":
    main()

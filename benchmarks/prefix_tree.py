"""Prefix trees: stock ``GRPOTrainer`` vs ``DynamicBatchGRPOTrainer`` sharing each prompt in its group vs a prefix tree.

Runs the training-step measurement of ``benchmarks/step_time.py`` (same worker, probes and aggregation: see its
docstring) on four mixes (:mod:`hf_dynbsz.testing.mixes`), each with prefix structure a prefix tree shares beyond
prompt groups, or none, and three trainers: stock, and the dynamic trainer's padding-free layout (segment attention on
sdpa) with ``share_prompt_prefix="groups"`` and ``"tree"`` (the default), interleaved in one run:

* ``agentic``: a 600-token tool block every prompt begins with, 20-120-token questions, 8 long-tailed completions
  (at most 384 tokens);
* ``few_shot``: a 400-token block of exemplars every prompt begins with, 20-60-token questions, long-tailed
  completions;
* ``tree``: tree-search rollouts: each prompt's 8 completions share a 64-token trunk, then one of 2 branches of 48
  tokens, then a long-tailed leaf;
* ``long_tailed``: plain: distinct prompts of 32-96 tokens, long-tailed completions, nothing beyond prompt groups to
  share (completions of the character tokenizer's alphabet begin alike now and then).

Shape: 32 samples per optimizer step (4 prompts x 8 completions: ``per_device_train_batch_size`` 8 x
``gradient_accumulation_steps`` 4), one generation round per step (so the step's samples are the round's), the
automatic budget (a step fits one pass), 4 steps, the first left out. Goals (training phase of a steady step, the same
run): the tree >= 1.3x the groups' speed on ``agentic``, >= 1.5x on ``tree``, >= 0.97x on ``long_tailed``; its
parameters within 1e-5 (relative) of stock's, and its update within 1e-3. (That a pass computes each distinct token
prefix once is a test's: ``tests/test_distillation_trainer.py`` counts them by brute force.)

Usage (from the repository root)::

    python benchmarks/prefix_tree.py           # about 8 minutes on 2 cores
    python benchmarks/prefix_tree.py --quick   # smoke run

Writes ``benchmarks/results/prefix_tree.md`` and ``prefix_tree.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_time  # noqa: E402
from common import RESULTS_DIR, load_average, machine_description, markdown_table  # noqa: E402

from hf_dynbsz.testing import MIX_LABELS  # noqa: E402

MIXES = ("agentic", "few_shot", "tree", "long_tailed")
CONFIGS = ("stock", "padding_free_groups", "padding_free_tree")
LABELS = {"stock": "stock GRPOTrainer", "padding_free_groups": "dynamic, groups", "padding_free_tree": "dynamic, tree"}
MODEL = dict(hidden_size=128, num_layers=3, vocab_size=4096, num_iterations=1)
SHAPE = dict(max_completion_length=384, batch_size=8, grad_accum=4, steps_per_generation=4, num_generations=8, rounds=4)
#: Least speed of the tree's training phase over the groups', by mix (None: information).
GOALS = {"agentic": 1.3, "few_shot": None, "tree": 1.5, "long_tailed": 0.97}
PARAM_TOLERANCE, UPDATE_TOLERANCE = 1e-5, 1e-3


def run(repeats: int, mixes: list[str], rounds: int, timeout: float, scratch: Path) -> list[dict]:
    """Every (repeat, mix, trainer) in a fresh worker, the trainers in alternating order; each result gains the
    relative parameter and update differences from stock's run of the same repeat and mix."""
    from hf_dynbsz.testing import relative_difference, update_difference

    results, started = [], time.perf_counter()
    for repeat in range(repeats):
        for mix in mixes:
            params = {}
            for config in CONFIGS if repeat % 2 == 0 else reversed(CONFIGS):
                params[config] = scratch / f"{mix}-{config}-{repeat}.pt"
                spec = {**MODEL, **SHAPE, "rounds": rounds, "mix": mix, "config": config, "repeat": repeat}
                spec.update(seed=0, threads=1)
                result = step_time.run_one(dict(spec, params_out=str(params[config])), timeout)
                results.append(result)
                measured = [s["train_s"] for s in result["steps"][1:]]
                print(f"[{time.perf_counter() - started:6.0f}s] repeat {repeat} {mix:12s} {config:20s} train s/step "
                      f"{sum(measured) / len(measured):6.3f}  load {load_average()}", flush=True)  # fmt: skip
            stock = _load(params["stock"])
            for result in results[-len(CONFIGS) :]:
                ours = _load(params[result["spec"]["config"]])
                result["param_difference"] = relative_difference(ours["final"], stock["final"])
                result["update_difference"] = update_difference(stock["initial"], ours["final"], stock["final"])
    return results


def _load(path: Path) -> dict:
    import torch

    return torch.load(path)


def render(results: list[dict], rows: list[dict], minutes: float) -> tuple[str, list[str]]:
    """The report: one row per mix and trainer, then one line per goal."""
    by = {(row["mix"], row["config"]): row for row in rows}
    differences = {}
    for result in results:
        key = (result["spec"]["mix"], result["spec"]["config"])
        previous = differences.get(key, (0.0, 0.0))
        differences[key] = (max(previous[0], result["param_difference"]), max(previous[1], result["update_difference"]))
    body, verdicts = [], []
    for mix in [m for m in MIXES if (m, "stock") in by]:
        stock, groups, tree = (by[mix, config] for config in CONFIGS)
        for config in CONFIGS:
            row = by[mix, config]
            param, update = differences[mix, config]
            speed = row["train_s"]
            body.append([MIX_LABELS[mix], LABELS[config], f"{speed:.3f}", f"{stock['train_s'] / speed:.2f}x",
                         f"{groups['train_s'] / speed:.2f}x", f"{row['train_tokens']:.0f}",
                         f"{row['round_real_tokens']:.0f}", f"{row['train_peak_mb']:.0f}",
                         "-" if config == "stock" else f"{param:.1e} / {update:.1e}"])  # fmt: skip
        verdicts.append(_verdict(mix, groups, tree, differences[mix, CONFIGS[2]]))
    header = ["mix", "trainer", "train s/step", "vs stock", "vs groups", "computed tokens/step", "samples' tokens/step",
              "training peak MB", "params / update vs stock"]  # fmt: skip
    text = "\n".join([
        "# Prefix trees: stock vs prompt groups vs a prefix tree", "",
        f"Generated by `python benchmarks/prefix_tree.py` in {minutes:.1f} min. Machine: {machine_description()}.", "",
        "Model: Qwen2-style, hidden 128, 3 layers, vocabulary 4096, fp32, sdpa (segment attention for the dynamic "
        "trainer's padding-free rows), CPU, 1 thread; 32 samples a step (4 prompts x 8 completions up to 384 tokens), "
        "one pass a step, the first step left out. Times, tokens and peaks as in `benchmarks/step_time.py` (training "
        "phase of an optimizer step; per step the median over repeats, then the mean over the measured steps); "
        "samples' tokens: each sample's prompt and completion; params / update: the largest relative difference "
        "from stock's over the repeats.", "",
        markdown_table(header, body), "", *verdicts, "",
    ])  # fmt: skip
    return text, verdicts


def _verdict(mix: str, groups: dict, tree: dict, differences: tuple) -> str:
    speed = groups["train_s"] / tree["train_s"]
    goal = GOALS[mix]
    parts = [f"{speed:.2f}x the groups' speed" + (f" (goal >= {goal}: {'met' if speed >= goal else 'missed'})"
                                                  if goal is not None else " (information)")]  # fmt: skip
    param, update = differences
    exact = param <= PARAM_TOLERANCE and update <= UPDATE_TOLERANCE
    parts.append(f"parameters {param:.1e} and update {update:.1e} from stock's ({'met' if exact else 'missed'})")
    return f"* {MIX_LABELS[mix]}, tree: " + "; ".join(parts) + "."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat of 2 steps per mix")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mixes", default=",".join(MIXES))
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    started, mixes = time.perf_counter(), args.mixes.split(",")
    with tempfile.TemporaryDirectory(prefix="dynbsz-prefix-tree-") as scratch:
        repeats, rounds = (1, 2) if args.quick else (args.repeats, SHAPE["rounds"])
        results = run(repeats, mixes, rounds, args.timeout, Path(scratch))
    for mix in mixes:
        prints = {json.dumps([r["fingerprint"] for r in res["rounds"]]) for res in results if res["spec"]["mix"] == mix}
        if len(prints) != 1:
            raise RuntimeError(f"the trainers saw different data for mix {mix}")
    rows = step_time.summarise(results)
    text, _ = render(results, rows, (time.perf_counter() - started) / 60)
    name = "prefix_tree_quick" if args.quick else "prefix_tree"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.md").write_text(text)
    raw = {"rows": rows, "differences": [(r["spec"]["mix"], r["spec"]["config"], r["param_difference"],
                                          r["update_difference"]) for r in results]}  # fmt: skip
    (args.out_dir / f"{name}.json").write_text(json.dumps(step_time._rounded(raw), indent=1))
    print(text)


if __name__ == "__main__":
    main()

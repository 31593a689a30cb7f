"""The budget from memory: predicted vs measured peaks, the budget chosen under a limit, and its speed.

Every run is a fresh process (its whole-process peak is its own) training a tiny decoder whose activations count
(4 layers, hidden 512 or 1024, vocabulary 4000) on scripted completions (no generation cost):

1. **Prediction**: with ``max_memory_per_device_mib`` set, every training pass's predicted whole-process peak
   (what the process held before it + the memory model's increment, predicted before the pass ran) against the
   measured one, over hidden sizes and gradient checkpointing; the first step runs on the prior alone.
2. **Budget and limit**: fixed budgets swept to find the largest whose run stays under each limit (measured like
   the limited runs: with a limit far above, so that freed heap is given back before each pass as there); the run
   with the memory-chosen budget at that limit: its whole-process peak, and its budget over the largest that fits.
3. **Speed**: step time of stock GRPOTrainer, the default budget (stock's micro-batch size) and the memory-chosen
   budget at two limits, on long-tailed and on short completions.
4. **Cap** (issue 58): on the long-tailed, agentic and tree-rollout mixes (the prefix tree on, the default), a
   Qwen2-style decoder of hidden 384 and 4 layers with gradient checkpointing, 8 completions of up to 2600 tokens a
   step: the cap halfway between the floor (every sequence alone) and the ceiling (the whole step in one pass), five
   capped runs each, their whole-process peaks against the cap, and their parameters against stock GRPOTrainer's
   on the same completions; and the reason identical runs differed before: the same forward and backward measured
   in fresh processes under glibc's default heap and with large blocks mapped on their own.

Writes ``benchmarks/results/memory_budget.md``, ``memory_budget.png`` and ``memory_budget.json``.
Run: ``python benchmarks/memory_budget.py`` (about 15 minutes on 2 CPU cores, the cap section an hour more),
``--quick`` for a smoke run, ``--only cap`` for section 4 alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS_DIR, ensure_repo_on_path, machine_description, markdown_table

MIX = {"long_tailed": 2048, "short": 256}  # max completion length of each mix
LIMITS_MIB = (1300, 1800)  # section 2 (completions up to 1024 tokens)
SPEED_LIMITS_MIB = (1700, 2200)  # section 3: the longest sequence alone (2048 + prompt tokens) needs about 1550 MiB
SWEEP_BUDGETS = (512, 768, 1024, 1536, 2048, 3072, 4096)
#: Section 4: the mixes, capped runs per mix, and the run's shape (the issue's check: Qwen2 hidden 384, 4 layers,
#: gradient checkpointing, 8 completions of up to 2600 tokens a step, 4 of each prompt).
CAP_MIXES = ("long_tailed", "agentic", "tree")
CAP_RUNS = 5
CAP_RUN = dict(hidden=384, max_completion=2600, steps=4, batch=2, accum=4, generations=4, learning_rate=1e-4)
#: A capped run holds its cap when its whole-process peak is at most this much over it.
CAP_TOLERANCE = 0.03


def completion_lengths(mix: str, longest: int):
    """This benchmark's completion lengths (tokens, 8 to ``longest``): lognormal with median ``longest / 7`` and
    sigma 1.0 ("long_tailed"), or median ``longest / 3`` and sigma 0.4 ("short")."""
    import numpy as np

    median = longest / 7 if mix == "long_tailed" else longest / 3
    sigma = 1.0 if mix == "long_tailed" else 0.4
    return lambda rng, n, rank: np.clip(rng.lognormal(np.log(median), sigma, n), 8, longest).astype(int)


def build_run(spec: dict):
    """The trainer of ``spec``: stock's or the plugin's (its token budget and memory limit), 4 layers of
    ``spec["hidden"]``, the mix's scripted completions."""
    from hf_dynbsz.testing import ModelShape, scripted_run

    hidden, longest = spec["hidden"], spec.get("max_completion", MIX[spec["mix"]])
    batch, accum = spec.get("batch", 2), spec.get("accum", 4)
    stock = spec["trainer"] == "stock"
    limits = (
        {} if stock else dict(max_tokens_per_microbatch=spec.get("budget"), max_memory_per_device_mib=spec.get("limit"))
    )
    return scripted_run(
        "grpo_stock" if stock else "grpo_dynamic",
        spec["output_dir"],
        ModelShape(hidden, 4, num_heads=hidden // 64, num_kv_heads=hidden // 64, vocab_size=4000),
        completion_lengths=completion_lengths(spec["mix"], longest),
        prompt_length=lambda rng: int(rng.integers(32, 96)),
        max_completion_length=longest,
        max_positions=longest + 128,
        prompts=batch * accum * spec["steps"] // 8 + 8,
        prompt_prefix="p",
        rollout_seed=spec["seed"],
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accum,
        num_generations=8,
        max_steps=spec["steps"],
        learning_rate=1e-5,
        beta=0.0,
        gradient_checkpointing=spec["checkpointing"],
        seed=spec["seed"],
        **limits,
    )


def cap_run(spec: dict):
    """Section 4's trainer: stock's or the plugin's (``spec["fields"]``: its budget and limit) on a Qwen2-style model of
    :data:`CAP_RUN`'s shape and the scripted rollout of ``spec["mix"]`` (a prefix mix's structure included)."""
    from hf_dynbsz.testing import ModelShape
    from hf_dynbsz.testing.fixtures import build_char_tokenizer
    from hf_dynbsz.testing.harness import build_trainer, mix_rollout, numbered_prompts, run_config
    from hf_dynbsz.testing.mixes import longest_prompt

    shape, tokenizer = CAP_RUN, build_char_tokenizer()
    longest = shape["max_completion"]
    model = ModelShape(shape["hidden"], 4).build(tokenizer, max_positions=longest + longest_prompt(spec["mix"]) + 8)
    rollout = mix_rollout(spec["mix"], tokenizer, longest, seed=spec["seed"])
    fields = dict(per_device_train_batch_size=shape["batch"], gradient_accumulation_steps=shape["accum"])
    fields.update(num_generations=shape["generations"], max_steps=shape["steps"], learning_rate=shape["learning_rate"])
    fields.update(beta=0.0, gradient_checkpointing=True, max_completion_length=longest, seed=spec["seed"])
    name = "grpo_stock" if spec["trainer"] == "stock" else "grpo_dynamic"
    args = run_config(name, spec["output_dir"], **fields, **spec.get("fields", {}))
    dataset = numbered_prompts(shape["steps"] * 8, prefix="p")
    return build_trainer(args, model, tokenizer, dataset=dataset, rollout=rollout)


def worker(spec: dict) -> dict:
    """One training run in this (fresh) process."""
    ensure_repo_on_path()
    from hf_dynbsz.testing import ResidentSetSampler, quiet_worker, run_peak_mib, snapshot_parameters

    quiet_worker(threads=1)
    if spec.get("section") == "heap":
        return heap_probe(spec)
    trainer = cap_run(spec) if spec.get("section") == "cap" else build_run(spec)
    initial = snapshot_parameters(trainer.model) if spec.get("params_out") else None
    start = time.perf_counter()
    with ResidentSetSampler() as sampler:  # with a limit the trainer resets VmHWM before each pass
        trainer.train()
    elapsed = time.perf_counter() - start
    steps = [e for e in trainer.state.log_history if "step_time" in e]
    result = {
        "spec": spec,
        "run_peak_mib": run_peak_mib(trainer.state.log_history, sampler),
        "train_s": elapsed,
        "step_times": [e["step_time"] for e in steps],
        "budgets": [e.get("dynbsz/budget_tokens") for e in steps],
        "passes": [e.get("dynbsz/microbatches") for e in steps],
    }
    executor = getattr(trainer, "_dynbsz", None)
    if executor is not None:
        result["history"] = [list(h) for h in executor.memory.history]
        result["model"] = {kind: executor.memory.describe(kind) for kind in ("training", "logprob")}
    if initial is not None:
        import torch

        torch.save({"initial": initial, "final": snapshot_parameters(trainer.model)}, spec["params_out"])
    return result


def heap_probe(spec: dict) -> dict:
    """Section 4's allocator probe, in this fresh process: the same forward and backward (a Qwen2-style model of
    :data:`CAP_RUN`'s shape, gradient checkpointing, ``spec["tokens"]`` tokens) ``spec["repeats"]`` times, each from
    freed heap given back and the peak resident set restarted; with ``spec["mapped"]`` after
    :func:`~hf_dynbsz.execution.device_memory.map_large_blocks`. Returns each pass's peak over what the process held."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hf_dynbsz.execution.device_memory import map_large_blocks, release_cached_memory, reset_peak_rss, status_mib

    if spec["mapped"]:
        map_large_blocks(torch.device("cpu"))
    hidden = CAP_RUN["hidden"]
    config = Qwen2Config(hidden_size=hidden, num_hidden_layers=4, num_attention_heads=hidden // 32,
                         num_key_value_heads=hidden // 64, intermediate_size=3 * hidden, vocab_size=64,
                         max_position_embeddings=spec["tokens"], attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 64, (1, spec["tokens"]))
    increments = []
    for _ in range(spec["repeats"]):
        model.zero_grad(set_to_none=False)
        release_cached_memory(torch.device("cpu"))
        reset_peak_rss()
        held = status_mib("VmRSS")
        model(input_ids=ids).logits.logsumexp(-1).sum().backward()
        increments.append(status_mib("VmHWM") - held)
    return {"spec": spec, "increments": increments}


def run(spec: dict, timeout: float = 1200) -> dict:
    with tempfile.TemporaryDirectory(prefix="dynbsz-memory-") as tmp:
        spec = dict(spec, output_dir=tmp)
        out = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--worker", json.dumps(spec), "--out", str(out)]
        completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if completed.returncode:
            raise RuntimeError(f"run {spec} failed:\n{completed.stderr[-3000:]}")
        return json.loads(out.read_text())


def prediction_rows(runs: list[dict]) -> list[list]:
    rows = []
    for result in runs:
        history = [h for h in result["history"] if h[0] == "training"]
        first_step = len([p for p in result["passes"][:1] for _ in range(int(p or 0))]) or 1
        errors = [(h[4] - h[5]) / h[5] for h in history]
        increments = [(h[4] - h[3]) / max(h[5] - h[3], 1e-9) - 1 for h in history]
        later = errors[first_step:] or errors
        spec = result["spec"]
        rows.append(
            [
                spec["hidden"],
                "on" if spec["checkpointing"] else "off",
                len(history),
                f"{min(h[1] for h in history)}-{max(h[1] for h in history)}",
                f"{max(errors[:first_step], key=abs):+.1%}",
                f"{statistics.median(abs(e) for e in later):.1%}",
                f"{max(later, key=abs):+.1%}",
                f"{statistics.median(abs(e) for e in increments[first_step:] or increments):.1%}",
                result["model"]["training"],
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker")
    parser.add_argument("--out")
    parser.add_argument("--quick", action="store_true", help="smoke run: few steps, fewer runs")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--render", action="store_true", help="only write the tables again from memory_budget.json")
    parser.add_argument(
        "--only",
        help="comma-separated sections to run again (prediction, limit, speed); the others "
        "are kept from memory_budget.json",
    )
    cli = parser.parse_args()
    if cli.worker:
        Path(cli.out).write_text(json.dumps(worker(json.loads(cli.worker))))
        return
    if cli.render:
        results = json.loads((cli.out_dir / "memory_budget.json").read_text())
        return report(results, cli.out_dir, results.get("quick", False), results.get("seconds", 0.0))
    steps = 3 if cli.quick else 8
    base = dict(hidden=512, checkpointing=False, mix="long_tailed", steps=steps, seed=0, trainer="ours")
    started = time.time()
    results: dict = {"prediction": [], "sweep": [], "limited": [], "speed": [], "quick": cli.quick, "steps": steps}
    sections = set(cli.only.split(",")) if cli.only else {"prediction", "limit", "speed", "cap"}
    keys = {"prediction": ["prediction"], "limit": ["sweep", "limited"], "speed": ["speed"], "cap": ["cap", "heap"]}
    if cli.only:
        rerun = {key for section in sections for key in keys[section]}
        kept = json.loads((cli.out_dir / "memory_budget.json").read_text())
        every = [key for section in keys.values() for key in section]
        results.update({key: value for key, value in kept.items() if key in every and key not in rerun})

    # 1. prediction over hidden sizes and gradient checkpointing
    for hidden, checkpointing in (
        []
        if "prediction" not in sections
        else [(512, False)]
        if cli.quick
        else [(512, False), (512, True), (1024, False), (1024, True)]
    ):
        limit = {512: 1300, 1024: 2600}[hidden]
        results["prediction"].append(run(dict(base, hidden=hidden, checkpointing=checkpointing, limit=limit)))
        print("prediction", hidden, checkpointing, flush=True)

    # 2. largest fixed budget under each limit, and the memory-chosen budget there: 32 samples per step, so that
    # passes fill their budget
    full = dict(base, batch=8, accum=4, max_completion=1024, steps=3)
    for budget in [] if "limit" not in sections else SWEEP_BUDGETS[::3] if cli.quick else SWEEP_BUDGETS:
        # measured as the memory-limited runs are (a limit far away: passes measured, freed heap given back)
        results["sweep"].append(run(dict(full, budget=budget, limit=10**6)))
        print("sweep", budget, flush=True)
    for limit in LIMITS_MIB if "limit" in sections else []:
        results["limited"].append(run(dict(full, limit=limit, steps=5)))
        print("limited", limit, flush=True)
    # 3. speed: stock, default budget, memory-chosen budget at two limits, per mix
    for mix in ("long_tailed", "short") if "speed" in sections else ():
        for label, extra in (
            ("stock", dict(trainer="stock")),
            ("default budget", {}),
            *((f"memory, {limit} MiB", dict(limit=limit)) for limit in SPEED_LIMITS_MIB),
        ):
            if cli.quick and mix == "short":
                continue
            results["speed"].append(dict(run(dict(base, mix=mix, **extra)), label=label))
            print("speed", mix, label, flush=True)

    if "cap" in sections:
        results.update(cap_section_runs(cli.quick))

    results["seconds"] = time.time() - started
    cli.out_dir.mkdir(parents=True, exist_ok=True)
    (cli.out_dir / "memory_budget.json").write_text(json.dumps(results))
    report(results, cli.out_dir, cli.quick, results["seconds"])


def cap_section_runs(quick: bool) -> dict:
    """Section 4's runs, each a fresh process: the allocator probe (glibc's default heap, then large blocks mapped;
    two processes each), then per mix stock GRPOTrainer, the floor, the ceiling, the default budget without a limit
    and :data:`CAP_RUNS` runs capped halfway between the floor and the ceiling."""
    heap = [
        run(dict(section="heap", mapped=mapped, tokens=2800, repeats=3)) for mapped in (False, True) for _ in (0, 1)
    ]
    print("heap", flush=True)
    caps = []
    with tempfile.TemporaryDirectory(prefix="dynbsz-cap-params-") as params:
        for mix in CAP_MIXES[:1] if quick else CAP_MIXES:
            base = dict(section="cap", mix=mix, seed=0, trainer="ours")
            stock = run(dict(base, trainer="stock", params_out=f"{params}/{mix}-stock.pt"))
            floor = run(dict(base, fields=dict(max_tokens_per_microbatch=1, max_memory_per_device_mib=10**6)))
            ceiling = run(dict(base, fields=dict(max_memory_per_device_mib=10**6)))
            default = run(base)  # no limit: stock's micro-batch size, glibc's default heap
            cap = round((floor["run_peak_mib"] + ceiling["run_peak_mib"]) / 2)
            capped = []
            for index in range(1 if quick else CAP_RUNS):
                out = f"{params}/{mix}-{index}.pt"
                result = run(dict(base, fields=dict(max_memory_per_device_mib=cap), params_out=out))
                result.update(parameter_differences(out, f"{params}/{mix}-stock.pt"))
                capped.append(result)
                print("cap", mix, index, round(result["run_peak_mib"]), cap, flush=True)
            caps.append(
                dict(mix=mix, cap=cap, stock=stock, floor=floor, ceiling=ceiling, default=default, capped=capped)
            )
    return {"cap": caps, "heap": heap}


def parameter_differences(ours: str, stock: str) -> dict:
    """Two runs' final parameters, from the files their workers saved: their relative difference
    (:func:`~hf_dynbsz.testing.relative_difference`) and that of their updates
    (:func:`~hf_dynbsz.testing.update_difference`)."""
    import torch

    from hf_dynbsz.testing import relative_difference, update_difference

    ours, stock = torch.load(ours), torch.load(stock)
    assert relative_difference(ours["initial"], stock["initial"]) == 0.0, "the runs must start from the same weights"
    return {
        "parameter_difference": relative_difference(ours["final"], stock["final"]),
        "update_difference": update_difference(stock["initial"], ours["final"], stock["final"]),
    }


def heap_section(heap: list[dict]) -> list[str]:
    """Section 4's first table: the same pass's peak in fresh processes, glibc's default heap against large blocks
    mapped on their own."""
    rows = []
    for mapped in (False, True):
        runs = [r for r in heap if r["spec"]["mapped"] == mapped]
        values = [v for r in runs for v in r["increments"]]
        rows.append(
            [
                "large blocks mapped on their own" if mapped else "glibc's default (threshold raised as blocks free)",
                "; ".join(", ".join(f"{v:.0f}" for v in r["increments"]) for r in runs),
                f"{min(values):.0f}-{max(values):.0f}",
            ]
        )
    header = ["heap", "each pass's peak over what the process held (MiB), per process", "range"]
    return [
        "## 4. The cap on long-tailed, agentic and tree-rollout steps",
        "",
        "Why identical capped runs peaked apart: the same forward and backward (hidden 384, 4 layers, gradient "
        f"checkpointing, {heap[0]['spec']['tokens']} tokens) {len(heap[0]['increments'])} times in each of two fresh "
        "processes, freed heap given back and the peak restarted before each:",
        "",
        markdown_table(header, rows),
        "",
    ]


def cap_rows(entry: dict) -> list[list]:
    """One mix's rows of section 4: each capped run's peak against the cap, its budgets, its predictions and its
    parameters against stock's."""
    rows = []
    for index, result in enumerate(entry["capped"]):
        history = [h for h in result["history"] if h[0] == "training"]
        first = int(result["passes"][0] or 0)
        errors = [(h[4] - h[5]) / h[5] for h in history[first:]] or [0.0]
        budgets = [b for b in result["budgets"][1:] if b]
        peak = result["run_peak_mib"]
        rows.append(
            [
                entry["mix"] if index == 0 else "",
                f"{entry['cap']}" if index == 0 else "",
                index + 1,
                f"{peak:.0f}",
                f"{peak / entry['cap'] - 1:+.1%}",
                "yes" if peak <= entry["cap"] * (1 + CAP_TOLERANCE) else "NO",
                f"{min(budgets):.0f}-{max(budgets):.0f}" if budgets else "-",
                "/".join(f"{p:.0f}" for p in result["passes"]),
                f"{max(errors, key=abs):+.1%}",
                f"{result['parameter_difference']:.1e}",
                f"{result['update_difference']:.1e}",
                f"{mean_step(result):.1f}",
            ]
        )
    return rows


def cap_section(results: dict) -> list[str]:
    """Section 4: the allocator probe, then per mix its floor, ceiling and cap and each capped run."""
    if not results.get("cap"):
        return []
    lines = heap_section(results["heap"]) if results.get("heap") else []
    bounds = [
        [
            entry["mix"],
            f"{entry['floor']['run_peak_mib']:.0f}",
            f"{entry['ceiling']['run_peak_mib']:.0f}",
            entry["cap"],
            f"{entry['default']['run_peak_mib']:.0f}",
            f"{mean_step(entry['stock']):.1f}",
        ]
        for entry in results["cap"]
    ]
    header = ["mix", "floor (MiB)", "ceiling (MiB)", "cap (MiB)", "default budget, no limit (MiB)", "stock step (s)"]
    held = sum(row[5] == "yes" for entry in results["cap"] for row in cap_rows(entry))
    runs = sum(len(entry["capped"]) for entry in results["cap"])
    columns = ["mix", "cap (MiB)", "run", "peak (MiB)", "over the cap", f"within {CAP_TOLERANCE:.0%}", "budgets",
               "passes per step", "worst prediction (after step 1)", "parameters vs stock", "update vs stock",
               "step (s)"]  # fmt: skip
    return lines + [
        "Qwen2-style decoder, hidden 384, 4 layers, gradient checkpointing, sdpa, fp32, the prefix tree (the "
        f"default); {CAP_RUN['batch'] * CAP_RUN['accum']} completions a step, {CAP_RUN['generations']} of each "
        f"prompt, up to {CAP_RUN['max_completion']} tokens, {CAP_RUN['steps']} steps, one process. The floor is the "
        "run's whole-process peak with every sequence alone, the ceiling with the whole step in one pass (both "
        "under a limit far above, measured as the capped runs are), the cap halfway between; the default budget's "
        "run has no limit (glibc's default heap).",
        "",
        markdown_table(header, bounds),
        "",
        f"Capped runs: {held} of {runs} within {CAP_TOLERANCE:.0%} of their cap. Budgets after the first step (tokens "
        "per pass), the worst predicted-vs-measured pass peak after the first step, and the relative differences of "
        "the final parameters and of the parameter updates from stock GRPOTrainer's on the same completions:",
        "",
        markdown_table(columns, [row for entry in results["cap"] for row in cap_rows(entry)]),
        "",
    ]


def prediction_section(results: dict, quick: bool, seconds: float) -> list[str]:
    """The report's heading and section 1: predicted against measured peaks of every training pass."""
    steps = results.get("steps", 8)
    header = ["hidden", "checkpointing", "passes", "pass tokens", "first step (prior) max error"]
    header += ["later: median error", "later: max error", "increment median error", "fitted model"]
    return [
        f"# The budget from memory ({'quick' if quick else 'full'} run)",
        "",
        f"{machine_description()}; {seconds:.0f} s. Tiny decoder, 4 layers, vocabulary 4000, "
        "sdpa, fp32; per_device_train_batch_size 2, gradient_accumulation_steps 4 (8 samples per step), "
        f"{steps} steps, scripted completions. `python benchmarks/memory_budget.py`.",
        "",
        "## 1. Predicted vs measured peak of every training pass",
        "",
        "Whole-process peak (resident set on CPU) predicted before each pass from what the process held and "
        "the memory model, against the measured one. The first step runs on the prior (read off the config); "
        "later steps on the model refitted from the passes measured so far.",
        "",
        markdown_table(header, prediction_rows(results["prediction"])),
        "",
    ]


def mean_step(run: dict) -> float:
    """Mean step time (seconds) after the first step (all steps when there is one)."""
    return statistics.mean(run["step_times"][1:] or run["step_times"])


def sweep_section(sweep: list[dict]) -> list[str]:
    """Section 2's first table: each fixed budget's run peak and mean step."""
    rows = [[r["spec"]["budget"], f"{r['run_peak_mib']:.0f}", f"{mean_step(r):.2f}"] for r in sweep]
    return [
        "## 2. The budget chosen under a limit, against the largest that fits",
        "",
        "32 samples per step (per_device_train_batch_size 8, gradient_accumulation_steps 4), long-tailed "
        "completions up to 1024 tokens, 3 steps, hidden 512: passes fill their budget. Fixed budgets (tokens "
        "per pass) and each run's whole-process peak (the resident set sampled every 2 ms, the logged step peaks "
        "and VmHWM):",
        "",
        markdown_table(["budget", "run peak (MiB)", "mean step (s)"], rows),
        "",
    ]


def limited_section(results: dict, sweep: list[dict]) -> list[str]:
    """Section 2's second table: per limit, the memory-chosen budgets against the largest fixed one under it."""
    rows = []
    for limit in LIMITS_MIB:
        fitting = [r["spec"]["budget"] for r in sweep if r["run_peak_mib"] <= limit]
        chosen = next((r for r in results["limited"] if r["spec"].get("limit") == limit), None)
        if chosen is None:
            continue
        budgets = [b for b in chosen["budgets"] if b]
        learnt = budgets[1:] or budgets  # after the first step, which runs on the prior
        largest = max(fitting, default=None)
        rows.append(
            [
                limit,
                f"{chosen['run_peak_mib']:.0f}",
                "yes" if chosen["run_peak_mib"] <= limit else "NO",
                largest if largest else "none",
                f"{budgets[0]:.0f}",
                f"{min(learnt):.0f}-{max(learnt):.0f}",
                f"{statistics.median(learnt) / largest:.2f}" if largest else "-",
            ]
        )
    header = ["limit (MiB)", "run peak (MiB)", "under the limit", "largest fixed budget under it"]
    header += ["first step's budget (prior)", "later budgets", "median later / largest"]
    return ["The run with the memory-chosen budget at each limit:", "", markdown_table(header, rows), ""]


def speed_section(results: dict) -> list[str]:
    """Section 3: step times, passes and budgets per mix, speed-up against stock."""
    speed_rows = []
    for mix in ("long_tailed", "short"):
        runs = [r for r in results["speed"] if r["spec"]["mix"] == mix]
        stock = next((r for r in runs if r["label"] == "stock"), None)
        for r in runs:
            mean = mean_step(r)
            stock_mean = mean_step(stock) if stock else None
            budgets = [b for b in r["budgets"] if b]
            speed_rows.append(
                [
                    mix,
                    r["label"],
                    f"{mean:.2f}",
                    f"{stock_mean / mean:.2f}x" if stock_mean else "-",
                    f"{statistics.mean(p for p in r['passes'] if p):.1f}" if budgets else "-",
                    f"{statistics.median(budgets):.0f}" if budgets else "-",
                    f"{r['run_peak_mib']:.0f}",
                ]
            )
    header = ["mix", "run", "step (s)", "speed-up vs stock", "passes per step", "budget", "run peak (MiB)"]
    return [
        "## 3. Step time",
        "",
        "Mean step time after the first step; passes per step and median budget.",
        "",
        markdown_table(header, speed_rows),
        "",
    ]


def report(results: dict, out_dir: Path, quick: bool, seconds: float) -> None:
    sweep = sorted(results["sweep"], key=lambda r: r["spec"]["budget"])
    lines = prediction_section(results, quick, seconds) + sweep_section(sweep)
    lines += limited_section(results, sweep) + speed_section(results) + cap_section(results)
    (out_dir / "memory_budget.md").write_text("\n".join(lines))
    plot(results, out_dir / "memory_budget.png")
    print("\n".join(lines))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(5.5, 5))
    for result in results["prediction"]:
        history = [h for h in result["history"] if h[0] == "training"]
        spec = result["spec"]
        axis.scatter(
            [h[5] for h in history],
            [h[4] for h in history],
            s=12,
            label=f"hidden {spec['hidden']}, checkpointing {'on' if spec['checkpointing'] else 'off'}",
        )
    low, high = axis.get_xlim()
    axis.plot([low, high], [low, high], color="grey", linewidth=1)
    axis.plot([low, high], [low * 1.1, high * 1.1], color="grey", linewidth=0.5, linestyle="--")
    axis.plot([low, high], [low * 0.9, high * 0.9], color="grey", linewidth=0.5, linestyle="--")
    axis.set_xlabel("measured pass peak (MiB, whole process)")
    axis.set_ylabel("predicted before the pass (MiB)")
    axis.set_title("Memory model: predicted vs measured (±10%)")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

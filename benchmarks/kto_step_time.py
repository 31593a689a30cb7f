"""Training-step time and peak memory, KTO: stock ``trl.KTOTrainer`` vs ``hf_dynbsz.DynamicBatchKTOTrainer``, in one
run, on DPO's three mixes (``benchmarks/dpo_step_time.py``) as unpaired samples: each sample a prompt and one
completion (DPO's response lengths), desirable or not at even odds (``hf_dynbsz.testing.kto.unpaired_samples``):
long-tailed samples, long context (a long document per prompt), a system prompt common to every row.

The model is DPO's benchmark model (a Qwen2-style model, hidden 128, 2 layers, vocabulary 4096, fp32, sdpa, random
weights from a fixed seed), its reference a copy; ``loss_type="kto"`` (the KL sequences on, stock's default),
``beta`` 0.1; 8 samples per optimizer step (per_device_train_batch_size 4, gradient accumulation 2), AdamW at 1e-5,
``max_length`` unset; every other setting TRL's (gradient checkpointing on) or the plugin's default (padding-free
prefix-tree rows through segment attention, the automatic budgets). Measured as DPO's benchmark measures (per optimizer
step wall and CPU time, the KL sequences' and the reference's passes included, and peak resident set; the first step
left out; one fresh process per trainer, mix and repeat; one torch thread each).

*token limit*: every pass of the step counted, stock's computed positions over the plugin's. Stock runs four forwards
per micro-batch (the policy's, no grad, over the KL rows; the policy's with gradient over the sample rows; the
reference's over both), each padded to its rows' longest; the plugin, the training passes over the samples' unique
tokens, the policy's no-grad passes over the KL sequences', the reference's over both sets together (each prompt once
per pass through the prefix tree). Each position counts once whatever its pass (a training position costs a forward
and a backward, a no-grad one a forward). The training passes' limit alone (what the plugin logs,
``dynbsz/stock_computed_tokens`` / ``dynbsz/computed_tokens``) is in the report too.

Run as DPO's benchmark is (its command line, ``dpo_step_time.main``: from the repository root, alone on the machine,
under ``flock /work/cpu.lock`` where it is shared): ``python benchmarks/kto_step_time.py`` runs 3 repeats of 4 steps per
mix, ``--quick`` shorter samples and one repeat. Writes ``benchmarks/results/kto_step_time.md`` and the raw per-step
data ``kto_step_time.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import dpo_step_time as dpo  # noqa: E402

CONFIGS = {"stock": "stock KTOTrainer", "dynamic": "DynamicBatchKTOTrainer"}
#: Issue 68's speed goal on the long-tailed mix.
GOAL = 2.0


def samples(mix: str, count: int, scale: float, seed: int):
    """The mix's unpaired samples (a ``datasets.Dataset``): DPO's prompts, its responses as the completions."""
    from hf_dynbsz.testing.kto import unpaired_samples

    lengths = dpo.mix_lengths(mix, scale)
    return unpaired_samples(
        count, seed=seed, prompt=lengths["prompt"], completion=lengths["response"], system=lengths["system"],
        alphabet=dpo.ALPHABET,
    )  # fmt: skip


def count_positions(trainer) -> list[dict]:
    """Per optimizer step (index: the step's ``global_step`` before it), the positions every pass computes: stock's
    (its four padded forwards per micro-batch, from the step's collated micro-batches) and the plugin's (the
    schedules' tokens of its training and no-grad passes). Wraps the trainer's step batching and its executor's
    passes; read after training."""
    import hf_dynbsz.trainers.kto as kto_trainer

    counts: dict[int, dict] = {}
    step_batch, run = kto_trainer.kto_step_batch, trainer._dynbsz.run

    def step(index: int) -> dict:
        return counts.setdefault(index, {"stock": 0, "training": 0, "logprob": 0})

    def counted_batch(window, *args):
        rows = sum(inputs["input_ids"].numel() + inputs.get("KL_input_ids", inputs["input_ids"][:0]).numel()
                   for inputs in window)  # fmt: skip
        step(trainer.state.global_step)["stock"] += 2 * rows  # the policy's forwards and the reference's
        return step_batch(window, *args)

    def counted_run(model, kind, *args, **kwargs):
        schedule, state = run(model, kind, *args, **kwargs)
        step(trainer.state.global_step)[kind] += sum(schedule.pass_tokens)
        return schedule, state

    kto_trainer.kto_step_batch, trainer._dynbsz.run = counted_batch, counted_run
    return counts


def run_worker(spec: dict) -> dict:
    import copy

    from trl import KTOTrainer

    from hf_dynbsz import DynamicBatchKTOTrainer
    from hf_dynbsz.testing import ModelShape
    from hf_dynbsz.testing.kto import kto_config

    tokenizer, dataset, plugin, args = dpo.worker_run(spec, dpo.SCHEDULE, kto_config, data=samples)
    model = ModelShape(**dpo.MODEL).build(tokenizer, max_positions=8192)
    trainer = (DynamicBatchKTOTrainer if plugin else KTOTrainer)(
        model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=dataset, processing_class=tokenizer
    )
    counts = count_positions(trainer) if plugin else {}
    figures = dict(dpo.FIGURES, tree_saved="dynbsz/tree_tokens_saved")
    result = dpo.timed_training(trainer, spec, figures, dpo.SCHEDULE["gradient_accumulation_steps"])
    for index, step in enumerate(result["steps"]):  # every pass's positions replace the training passes' alone
        step["train_computed"], step["train_stock_computed"] = step["computed"], step["stock_computed"]
        if index in counts:
            step["computed"] = counts[index]["training"] + counts[index]["logprob"]
            step["stock_computed"] = counts[index]["stock"]
    return result


def run_one(spec: dict, timeout: float, keep: Path) -> dict:
    return dpo.run_one(spec, timeout, keep, script=__file__, prefix="dynbsz-kto-bench-")


def training_limits(results: list[dict]) -> str:
    """The training passes' token limit per mix (stock's sample rows over the plugin's training passes), the plugin's
    runs' measured steps."""
    parts = []
    for mix in dpo.MIXES:
        steps = [
            s for r in results if r["spec"]["mix"] == mix and r["spec"]["config"] == "dynamic" for s in r["steps"][1:]
        ]
        if steps:
            limit = sum(s["train_stock_computed"] for s in steps) / sum(s["train_computed"] for s in steps)
            parts.append(f"{mix} {limit:.2f}x")
    return ", ".join(parts)


def goal(rows: list[dict]) -> str:
    row = next((r for r in rows if r["mix"] == "long_tailed" and r["config"] == "dynamic"), None)
    if row is None:
        return "Goal (issue 68): not measured (the long-tailed mix did not run)."
    met = "met" if row["speedup"] >= GOAL else "missed"
    return (
        f"Goal (issue 68): at least {GOAL}x stock's step on the long-tailed mix, its KL passes included: "
        f"{row['speedup']:.2f}x ({met}); peak memory {row['memory_ratio']:.2f}x stock's."
    )


def report(args, spec: dict, results: list[dict], rows: list[dict], loads: list[str], minutes: float) -> str:
    title = "Training-step time and memory, KTO: stock KTOTrainer vs DynamicBatchKTOTrainer"
    return "\n\n".join(
        [
            *dpo.report_opening(title, "benchmarks/kto_step_time.py", args, minutes),
            f"Workload: {json.dumps(dpo.MIXES)} (tokens, times {spec['scale']}; the responses are the completions), "
            "unpaired samples desirable at even odds, `loss_type` kto (the KL sequences on), settings "
            f"{json.dumps(dpo.SCHEDULE)}, model {json.dumps(dpo.MODEL)} ({results[0]['parameters'] / 1e6:.2f} M "
            "parameters), its reference a copy; every other setting TRL's or the plugin's default. "
            f"{args.repeats} fresh process(es) per trainer and mix, {rows[0]['steps']} measured optimizer steps each "
            "(the first left out).",
            *dpo.report_machine(loads, results, dpo.SHARED_MACHINE),
            dpo.render_table(rows, CONFIGS),
            "*step s*: wall time of an optimizer step (the policy's no-grad forwards of the KL sequences, the "
            "reference's forwards of the samples and the KL sequences, the policy's forwards and backwards, the "
            "optimizer), per step the median over repeats, then the mean over the measured steps; *speed-up*: stock "
            "/ this, in the same run; *token limit*: every pass's positions, stock's (four padded forwards per "
            "micro-batch: the policy's of the KL rows and of the sample rows, the reference's of both) / the "
            "plugin's (its training passes' and no-grad passes' schedules, each prompt once per pass), a position "
            "counted once whatever its pass; *computed positions/step*: the same, per step; *of the limit*: speed-up "
            "/ token limit; *peak memory*: the highest resident set over a step less what the process held before "
            "training, the median over repeats; *parameters vs stock*: relative difference of the final parameters.",
            f"The training passes' token limit alone (stock's sample rows / the plugin's training passes, as "
            f"`dynbsz/stock_computed_tokens` / `dynbsz/computed_tokens` log it): {training_limits(results)}.",
            goal(rows),
        ]
    )


def main() -> None:
    dpo.main("kto_step_time", __doc__, CONFIGS, run_worker, run_one, report, after=lambda rows: print(goal(rows)))


if __name__ == "__main__":
    main()

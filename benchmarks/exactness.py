"""Exactness against stock TRL: the plugin's trainers against stock's at the same config, the figures the docs quote
(docs/dpo.md, docs/reward.md, docs/async-grpo.md; KTO's for the record).

Each row trains stock's trainer and the plugin's from the same saved tiny model on the same data, with the tests'
schedule and optimizer (SGD at a constant, large rate, no gradient clipping: a mis-weighted sample shows), and reports
the final parameters' relative difference from stock's and the update's (``||ours - stock|| / ||stock - initial||``,
far more sensitive), the plugin's passes per optimizer step, and where the row's figure is compared with it, stock's own
update moved by cutting the same samples into other micro-batches (its *split*: what a plugin that got the micro-batches
wrong would be off by). The runs are the tests' own (``hf_dynbsz.testing``'s helpers and settings):

* **DPO** (``tests/test_dpo_trainer.py``): the default ``sigmoid`` and stock's nine other loss settings of
  :data:`~hf_dynbsz.testing.DPO_LOSS_SETTINGS`; 2 optimizer steps of 2 micro-batches of 4 pairs, passes of at most 80
  tokens (a step cut unlike stock's 2 micro-batches); split: stock's ``2 x 4`` against its ``4 x 2``.
* **Reward** (``tests/test_reward_trainer.py``): Bradley-Terry, a ``margin`` column, ``center_rewards_coefficient``
  0.05, both; DPO's schedule and budget; split as DPO's.
* **KTO** (``tests/test_kto_trainer.py``): ``kto``, ``kto`` with unequal weights (1.5 / 0.7, samples 30% desirable),
  ``apo_zero_unpaired``, each with a reference 10x sharper than the policy and ``beta=1`` (the KL estimate positive
  from the first step); DPO's schedule and budget; split as DPO's.
* **Asynchronous GRPO** (``tests/test_async_grpo_stock_step.py``): the default step (``async_step="stock"``) against
  stock at the same config: stock's token-budget mode (``token_budget=400``, GA 2, in passes of stock's row size and
  of 64 tokens; ``token_budget=40``, where samples are dropped, in 24-token passes) and its fixed count ``8 x 2``
  (passes of stock's row size and of 100 tokens); the opt-in samples step ``8 x 2`` against stock's ``16 x 1``
  (split: stock's ``8 x 2`` against its ``16 x 1``); as a control, the samples step at ``token_budget=400`` GA 2
  against stock there (not stock's step: far off by design). 3 optimizer steps of scripted samples (a tenth train
  no token).
* **Asynchronous GRPO, the samples step** (``tests/test_async_grpo_trainer.py``): ``async_step="samples"`` written
  ``16 x 1`` and ``8 x 2``, its budget automatic or small, against stock's ``16 x 1``; split as above.

The asynchronous runs go through TRL's own protocols (a stand-in rollout worker over scripted samples, a no-op weight
transfer, stock's FA3 tree kernel written in plain torch so that stock runs on CPU).

One process, CPU, fp32, one torch thread. ``python benchmarks/exactness.py`` (about 2 minutes on 2 shared cores)
writes ``benchmarks/results/exactness.md``; ``--only dpo,reward`` runs some trainers, ``--quick`` each trainer's first
row alone, ``--no-split`` leaves stock's split runs out.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS_DIR, load_average, machine_description, markdown_table  # noqa: E402
from step_time import code_fingerprint, git_state  # noqa: E402

TRAINERS = ("dpo", "reward", "kto", "async_grpo", "async_samples")
#: The preference trainers' pass budget (the tests' ``SMALL_BUDGET``): pairs of 5-70 unique tokens, so a pass holds one
#: to a few, where stock's micro-batches hold 4.
BUDGET = 80
#: Stock's own split of the preference runs' steps: 4 micro-batches of 2 instead of 2 of 4.
SPLIT = dict(per_device_train_batch_size=2, gradient_accumulation_steps=4)


@dataclasses.dataclass
class Row:
    """One comparison: ``setting``, the plugin's passes per step, its parameters' and update's relative differences
    from stock's, stock's own split (update), and a note."""

    setting: str
    passes: str
    parameters: float
    update: float
    split: float | None = None
    note: str = ""

    def cells(self) -> list[str]:
        split = "-" if self.split is None else f"{self.split:.2g}"
        return [self.setting, self.passes, f"{self.parameters:.2g}", f"{self.update:.2g}", split, self.note]


def passes_per_step(history: list[dict]) -> str:
    """The plugin's passes per optimizer step, ``low-high`` over the run's steps."""
    counts = [round(entry["dynbsz/microbatches"]) for entry in history if "dynbsz/microbatches" in entry]
    if not counts:
        return "-"
    return str(counts[0]) if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"


def describe(name: str, fields: dict) -> str:
    """A row's setting: its name and the config fields it sets."""
    values = ", ".join(f"{key}={value!r}" for key, value in fields.items())
    return f"{name}: `{values}`" if values else name


def preference_row(run: Callable, plugin_fields: tuple, model_dir: str, work: Path, setting: str, dataset,
                   fields: dict, split: bool) -> Row:  # fmt: skip
    """Stock's run and the plugin's (:func:`~hf_dynbsz.testing.paired_runs`) at ``fields`` on ``dataset``, and with
    ``split`` stock's run at :data:`SPLIT`."""
    from hf_dynbsz.testing import paired_runs, update_difference

    runs = paired_runs(
        run, model_dir, work / setting, dataset, dict(fields), plugin_fields=plugin_fields, budget=BUDGET,
        trainer_kwargs=None,
    )  # fmt: skip
    row = Row(describe(setting, fields), passes_per_step(runs.history), runs.parameters, runs.update)
    if split:
        _, other, _, _ = run(False, model_dir, str(work / setting / "split"), dataset, **{**fields, **SPLIT})
        row.split = update_difference(runs.initial, other, runs.stock)
    return row


def dpo_rows(model_dir: str, work: Path, quick: bool, split: bool) -> list[Row]:
    """The default loss and stock's nine other loss settings."""
    from hf_dynbsz.testing import DPO_LOSS_SETTINGS, DPO_PLUGIN_FIELDS, dpo_run

    settings = {"sigmoid (default)": {}, **DPO_LOSS_SETTINGS}
    names = list(settings)[:1] if quick else list(settings)
    row = functools.partial(preference_row, dpo_run, DPO_PLUGIN_FIELDS, model_dir, work)
    return [row(name, None, settings[name], split) for name in names]


def reward_rows(model_dir: str, work: Path, quick: bool, split: bool) -> list[Row]:
    """Bradley-Terry, a ``margin`` column, ``center_rewards_coefficient``, both."""
    from hf_dynbsz.testing import preference_pairs
    from hf_dynbsz.testing.reward import REWARD_PLUGIN_FIELDS, reward_run, with_margins

    cases = ("bradley_terry", "margin", "center_rewards", "margin_and_center_rewards")
    rows = []
    for case in cases[:1] if quick else cases:
        dataset = with_margins(preference_pairs(16)) if "margin" in case else preference_pairs(16)
        fields = dict(center_rewards_coefficient=0.05) if "center" in case else {}
        rows.append(preference_row(reward_run, REWARD_PLUGIN_FIELDS, model_dir, work, case, dataset, fields, split))
    return rows


def kto_sharp_run(plugin: bool, model_dir: str, output_dir: str, dataset, trainer_kwargs=None, **fields):
    """:func:`~hf_dynbsz.testing.kto.kto_run` with the tests' reference, :data:`KTO_SHARPNESS` times sharper."""
    from hf_dynbsz.testing.kto import KTO_SHARPNESS, kto_run, sharpened_reference

    reference = sharpened_reference(model_dir, KTO_SHARPNESS)
    return kto_run(plugin, model_dir, output_dir, dataset, ref_model=reference, trainer_kwargs=trainer_kwargs, **fields)


def kto_rows(model_dir: str, work: Path, quick: bool, split: bool) -> list[Row]:
    """``kto``, ``kto`` with unequal weights, ``apo_zero_unpaired``; ``beta=1``, a sharpened reference."""
    from hf_dynbsz.testing.kto import KTO_BETA, KTO_LOSSES, KTO_PLUGIN_FIELDS, unpaired_samples

    rows = []
    for case in list(KTO_LOSSES)[:1] if quick else KTO_LOSSES:
        dataset = unpaired_samples(16, desirable=0.3 if "unequal" in case else 0.5)
        fields = {"beta": KTO_BETA, **KTO_LOSSES[case]}
        rows.append(preference_row(kto_sharp_run, KTO_PLUGIN_FIELDS, model_dir, work, case, dataset, fields, split))
    return rows


def async_row(setting: str, ours, stock, split=None, note: str = "") -> Row:
    """The plugin's asynchronous run ``ours`` against ``stock`` (and ``split``: stock written otherwise)."""
    from hf_dynbsz.testing import relative_difference, update_difference

    row = Row(setting, passes_per_step(ours.history), relative_difference(ours.final, stock.final), 0.0, note=note)
    row.update = update_difference(stock.initial, ours.final, stock.final)
    if split is not None:
        row.split = update_difference(stock.initial, split.final, stock.final)
    return row


def async_grpo_rows(model_dir: str, work: Path, quick: bool, split: bool) -> list[Row]:
    """The default step (``async_step="stock"``) against stock at the same config: its token budget (400, and 40 where
    samples are dropped) and its fixed count ``8 x 2``; the samples step ``8 x 2`` against stock's ``16 x 1``."""
    from hf_dynbsz.testing import STOCK_BUDGET_STEP, STOCK_STEP_SCRIPT, async_grpo_run, async_grpo_stock_cut

    def run(trainer: str, name: str, **fields):
        return async_grpo_run(trainer, model_dir, str(work / name), STOCK_STEP_SCRIPT, **fields)

    budget, cut_fields = "`token_budget=400`, GA 2", dict(per_device_train_batch_size=8, gradient_accumulation_steps=2)
    stock = run("async_grpo_stock", "stock-budget", **STOCK_BUDGET_STEP)
    ours = run("async_grpo_dynamic", "budget", **STOCK_BUDGET_STEP)
    samples_per_step = sorted({round(e["batch/samples_per_step"]) for e in stock.history if "loss" in e})
    note = f"stock's samples per step {', '.join(map(str, samples_per_step))}"
    rows = [async_row(f'`"stock"`, {budget}, passes of stock\'s row size', ours, stock, note=note)]
    if quick:
        return rows
    ours = run("async_grpo_dynamic", "budget-64", max_tokens_per_microbatch=64, **STOCK_BUDGET_STEP)
    rows.append(async_row(f'`"stock"`, {budget}, 64-token passes', ours, stock))
    small = dict(STOCK_BUDGET_STEP, token_budget=40)
    dropping = run("async_grpo_stock", "stock-budget-40", **small)
    ours = run("async_grpo_dynamic", "budget-40", max_tokens_per_microbatch=24, **small)
    dropped = [
        [round(e.get("batch/dropped_oversize_total", 0)) for e in r.history if "loss" in e] for r in (ours, dropping)
    ]
    note = f"`batch/dropped_oversize_total` {dropped[0]}, stock's {dropped[1]}"
    rows.append(async_row('`"stock"`, `token_budget=40`, GA 2, 24-token passes', ours, dropping, note=note))
    samples = run("async_grpo_dynamic", "samples-budget", async_step="samples", **STOCK_BUDGET_STEP)
    control = f'control: `"samples"` at {budget}, against stock there'
    rows.append(async_row(control, samples, stock, note="not stock's step"))
    cut = async_grpo_stock_cut(model_dir, str(work / "stock-8x2"), STOCK_STEP_SCRIPT)
    for passes, label in ((None, "passes of stock's row size"), (100, "100-token passes")):
        ours = run("async_grpo_dynamic", f"8x2-{passes}", max_tokens_per_microbatch=passes, **cut_fields)
        rows.append(async_row(f'`"stock"`, fixed count `8 x 2`, {label}', ours, cut))
    whole = run("async_grpo_stock", "stock-16x1", per_device_train_batch_size=16)
    ours = run("async_grpo_dynamic", "samples-8x2", async_step="samples", **cut_fields)
    rows.append(async_row('`"samples"`, `8 x 2`, against stock\'s `16 x 1`', ours, whole, cut if split else None))
    return rows


def async_samples_rows(model_dir: str, work: Path, quick: bool, split: bool) -> list[Row]:
    """The samples step (``async_step="samples"``) written ``16 x 1`` and ``8 x 2``, its budget automatic or small,
    against stock's fixed count with the step in one micro-batch (``16 x 1``), on the default scripted samples."""
    from hf_dynbsz.testing import async_grpo_run, async_grpo_stock_cut

    whole = async_grpo_run("async_grpo_stock", model_dir, str(work / "stock-16x1"), per_device_train_batch_size=16)
    cut = async_grpo_stock_cut(model_dir, str(work / "stock-8x2")) if split else None
    rows = []
    for per_device, accumulation, budget in ((16, 1, 0), (16, 1, 64), (8, 2, 0), (8, 2, 100))[: 1 if quick else 4]:
        ours = async_grpo_run(
            "async_grpo_dynamic", model_dir, str(work / f"{per_device}x{accumulation}-{budget}"), async_step="samples",
            per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation, token_budget=budget,
        )  # fmt: skip
        label = f"{budget}-token budget" if budget else "automatic budget"
        rows.append(async_row(f"`{per_device} x {accumulation}`, {label}", ours, whole, cut))
    return rows


SECTIONS = {
    "dpo": ("DPO", dpo_rows, "`DynamicBatchDPOTrainer` against `DPOTrainer`, 2 steps of 2 x 4 pairs, 80-token passes"),
    "reward": ("Reward model", reward_rows, "`DynamicBatchRewardTrainer` against `RewardTrainer`, as DPO's"),
    "kto": (
        "KTO",
        kto_rows,
        "`DynamicBatchKTOTrainer` against `KTOTrainer`, as DPO's, `beta=1`, a sharper reference",
    ),
    "async_grpo": (
        "Asynchronous GRPO",
        async_grpo_rows,
        "`DynamicBatchAsyncGRPOTrainer` against `AsyncGRPOTrainer` at the same config (the default step,\n"
        '`async_step="stock"`; and the opt-in samples step against stock\'s `16 x 1`), 3 steps of scripted samples\n'
        "of which a tenth train no token",
    ),
    "async_samples": (
        "Asynchronous GRPO, the samples step",
        async_samples_rows,
        '`async_step="samples"` against stock\'s fixed count with the step in one micro-batch (`16 x 1`), whatever\n'
        "the plugin's budget and however its step is written (`token_budget` is its pass budget), 3 steps of\n"
        "scripted samples",
    ),
}
HEADER = ["setting", "passes per step", "parameters (relative)", "update (relative)", "stock's own split (update)"]
HEADER.append("note")


def report(tables: dict[str, list[Row]], args, seconds: float, loads: tuple[str, str]) -> str:
    """The results file: how it was made, the machine and versions, a table per trainer."""
    command = " ".join(["python benchmarks/exactness.py", *args.argv])
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Exactness against stock TRL",
        "",
        f"Generated by `{command}` in {seconds / 60:.1f} min, {now}.",
        "",
        f"Machine: {machine_description()}. Load average before and after: {loads[0]} | {loads[1]}.",
        "",
        f"Code: {git_state()}; hf_dynbsz source hash {code_fingerprint()}.",
        "",
        "One process, CPU, fp32, one torch thread; SGD at a constant, large rate, no gradient clipping. *parameters*:",
        "`||ours - stock|| / ||stock||` of the final parameters; *update*: `||ours - stock|| / ||stock - initial||`",
        "(the tests' bars: parameters within 1e-5, updates within 1e-3, KTO's within 1e-5); *stock's own split*:",
        "stock's update moved by the same samples cut into other micro-batches (preference trainers: `2 x 4` against",
        "`4 x 2`; asynchronous GRPO: `8 x 2` against `16 x 1`), what a wrong micro-batch would be off by. How the runs",
        "are made: the docstring of `benchmarks/exactness.py`.",
    ]
    for key, rows in tables.items():
        title, _, what = SECTIONS[key]
        lines += ["", f"## {title}", "", what + ".", "", markdown_table(HEADER, [row.cells() for row in rows])]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(TRAINERS), help=f"comma-separated trainers of {TRAINERS}")
    parser.add_argument("--quick", action="store_true", help="each trainer's first row alone")
    parser.add_argument("--no-split", dest="split", action="store_false", help="leave stock's split runs out")
    parser.add_argument("--output", type=Path, default=RESULTS_DIR / "exactness.md")
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = set(args.only) - set(TRAINERS)
    if unknown:
        parser.error(f"unknown trainers {sorted(unknown)}; choose from {TRAINERS}")
    return args


def main(argv=None) -> str:
    """Run the comparisons ``argv`` asks for (default: the command line's), write the results file; returns it."""
    from hf_dynbsz.testing import save_tiny_model

    args = parse_args(argv)
    started, loads = time.perf_counter(), [load_average()]
    tables = {}
    with tempfile.TemporaryDirectory(prefix="dynbsz-exactness-") as directory:
        work = Path(directory)
        model_dir = save_tiny_model(str(work / "model"))
        for key in args.only:
            tables[key] = SECTIONS[key][1](model_dir, work / key, args.quick, args.split)
            print(f"{key}: {len(tables[key])} rows, {time.perf_counter() - started:.0f} s", flush=True)
    loads.append(load_average())
    text = report(tables, args, time.perf_counter() - started, tuple(loads))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    main()

"""Preference pairs and DPO runs for the tests, the benchmark and the example: offline, from a config's tiny model.

* :func:`preference_pairs`: a dataset of ``prompt`` / ``chosen`` / ``rejected`` strings of the test alphabet, their
  lengths drawn from given ranges (or a long-tailed draw), optionally every prompt opening with one shared block (a
  system prompt), and optionally several pairs per prompt (datasets with several ranked responses per prompt);
* :func:`dpo_run`: one training run of stock ``DPOTrainer`` or ``DynamicBatchDPOTrainer`` on such pairs, with the
  comparison runs' schedule and optimizer (:data:`DPO_COMPARISON_FIELDS`): initial and final parameters and the log;
  :func:`comparison_config`, the config of such a run (DPO's or the reward model's); :func:`paired_runs`, stock's
  run and the plugin's on the same pairs (:class:`PairedRuns`: their parameters' and updates' differences), and
  :func:`runs_against_stock`, the same with the differences asserted within tolerances; :data:`DPO_LOSS_SETTINGS`, the
  stock loss settings the comparisons train (the tests and ``benchmarks/exactness.py``);
* the loss tests' steps of pairs: stock's micro-batches (:func:`stock_micro_batches`) and step
  (:func:`stock_pair_step`), the step's pairs cut at random into passes of whole pairs (:func:`whole_pair_passes`),
  a step's outcome (:func:`pair_step_outcome`), gradients' relative difference (:func:`gradient_difference`), our
  steps of two cuts against stock's (:func:`pair_steps_against_stock`).

Nothing here downloads anything; torch, transformers, TRL and datasets are imported inside the functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from hf_dynbsz.testing.fixtures import CPU_RUN_FIELDS, TEST_ALPHABET

__all__ = [
    "DPO_COMPARISON_FIELDS",
    "DPO_LOSS_SETTINGS",
    "DPO_PLUGIN_FIELDS",
    "PairedRuns",
    "comparison_config",
    "config_classes",
    "dpo_config",
    "dpo_run",
    "gradient_difference",
    "pair_step_outcome",
    "pair_steps_against_stock",
    "paired_runs",
    "preference_pairs",
    "preference_run",
    "runs_against_stock",
    "spread_positions_collator",
    "text_draws",
    "stock_micro_batches",
    "stock_pair_step",
    "whole_pair_passes",
]

#: The DPO comparison runs' schedule (2 optimizer steps of 2 micro-batches of 4 pairs) and optimizer: SGD at a constant,
#: large rate, so that a mis-weighted pair shows; no gradient clipping.
DPO_COMPARISON_FIELDS = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2, seed=0)
DPO_COMPARISON_FIELDS.update(learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", max_grad_norm=1e9)
#: Stock's loss settings beyond the default ``sigmoid``, each a comparison run (``tests/test_dpo_trainer.py``,
#: ``benchmarks/exactness.py``): loss lists with weights (a coupled and a per-token term among them), LD-DPO, WPO
#: weighting, the f-divergences, and a small ``beta``.
DPO_LOSS_SETTINGS = {
    "list_with_weights": dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),
    "list_with_aot_unpaired": dict(loss_type=["aot_unpaired", "hinge"], loss_weights=[1.0, 0.5]),
    "ld_alpha": dict(ld_alpha=0.3),
    "ld_alpha_aot": dict(loss_type=["aot"], ld_alpha=0.5),
    "use_weighting": dict(use_weighting=True, loss_type=["sigmoid", "ipo"], learning_rate=0.05),
    "forward_kl": dict(f_divergence_type="forward_kl"),
    "js_divergence": dict(f_divergence_type="js_divergence", loss_type=["sigmoid", "hinge"]),
    "alpha_divergence": dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5),
    "beta_small": dict(beta=0.01, loss_type=["sigmoid", "apo_zero"]),
}
#: Settings only ``DynamicBatchDPOConfig`` has (a stock run leaves them out).
DPO_PLUGIN_FIELDS = (
    "dynamic_batching",
    "max_tokens_per_microbatch",
    "max_tokens_per_microbatch_logprob",
    "packing_layout",
    "share_prompt_prefix",
    "balance_across_ranks",
    "oversize_policy",
    "self_check",
    "max_memory_per_device_mib",
    "tensor_batch_size",
)


def text_draws(seed: int, alphabet: str = TEST_ALPHABET) -> tuple:
    """``(rng, lengths, text)`` on one generator seeded ``seed``: ``lengths(spec, n)``, ``n`` lengths (at least 1) from
    ``spec``, a ``[low, high)`` range drawn uniformly or a function ``(rng, n) -> lengths``; ``text(length)``, a string
    of that many characters of ``alphabet`` (the datasets of :func:`preference_pairs` and ``unpaired_samples``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    letters = list(alphabet)

    def lengths(spec, n: int):
        values = spec(rng, n) if callable(spec) else rng.integers(spec[0], spec[1], n)
        return [max(int(v), 1) for v in values]

    def text(length: int) -> str:
        return "".join(rng.choice(letters, length))

    return rng, lengths, text


def preference_pairs(
    count: int = 16,
    *,
    seed: int = 0,
    prompt: tuple[int, int] | Callable = (3, 20),
    response: tuple[int, int] | Callable = (1, 25),
    system: int = 0,
    pairs_per_prompt: int = 1,
    alphabet: str = TEST_ALPHABET,
):
    """``count`` preference pairs (a ``datasets.Dataset`` of ``prompt``, ``chosen``, ``rejected`` strings).

    ``prompt`` / ``response``: lengths in characters (one token each with the test tokenizer), uniform in ``[low,
    high)``, or a function ``(rng, n) -> lengths``; ``system``: every prompt opens with the same block of this many
    characters (a system prompt shared across pairs); ``pairs_per_prompt``: consecutive pairs share their prompt (a
    prompt with several ranked responses)."""
    from datasets import Dataset

    _, lengths, text = text_draws(seed, alphabet)
    block = text(system) if system else ""
    prompts = [block + text(length) for length in lengths(prompt, -(-count // pairs_per_prompt))]
    chosen, rejected = (lengths(response, count) for _ in range(2))
    return Dataset.from_dict(
        {
            "prompt": [prompts[i // pairs_per_prompt] for i in range(count)],
            "chosen": [text(length) for length in chosen],
            "rejected": [text(length) for length in rejected],
        }
    )


def comparison_config(
    stock_class: type, plugin_class: type, output_dir: str, plugin: bool, fields: dict, *,
    defaults: dict = DPO_COMPARISON_FIELDS, plugin_fields: tuple[str, ...] = DPO_PLUGIN_FIELDS,
):  # fmt: skip
    """A comparison run's config (``defaults`` on a CPU run, ``fields`` on top): ``plugin_class`` with ``plugin``,
    else ``stock_class`` (the plugin's fields, ``plugin_fields``, left out)."""
    values = {"output_dir": output_dir, **defaults, **CPU_RUN_FIELDS, **fields}
    if not plugin:
        values = {name: value for name, value in values.items() if name not in plugin_fields}
    return (plugin_class if plugin else stock_class)(**values)


def config_classes(name: str) -> tuple[type, type]:
    """TRL's config of trainer ``name`` ("DPO", "Reward", "KTO") and the plugin's: ``(trl.<name>Config,
    hf_dynbsz.DynamicBatch<name>Config)``, :func:`comparison_config`'s first two arguments."""
    import trl

    import hf_dynbsz

    return getattr(trl, f"{name}Config"), getattr(hf_dynbsz, f"DynamicBatch{name}Config")


def dpo_config(output_dir: str, *, plugin: bool, **fields):
    """The comparison runs' config (:data:`DPO_COMPARISON_FIELDS` on a CPU run, ``fields`` on top): a
    ``DynamicBatchDPOConfig`` with ``plugin``, else TRL's ``DPOConfig`` (the plugin's fields left out)."""
    return comparison_config(*config_classes("DPO"), output_dir, plugin, fields)


def preference_run(
    stock_class: type, plugin_class: type, config: Callable, plugin: bool, model_dir: str, output_dir: str, dataset, *,
    model=None, trainer_kwargs: dict | None = None, constructor: dict | None = None, **fields,
):  # fmt: skip
    """Train ``stock_class`` (``plugin`` False) or ``plugin_class`` from ``model_dir`` on ``dataset``, its config
    ``config(output_dir, plugin=plugin, **fields)`` (:func:`dpo_config`, ``reward_config``, ``kto_config``); returns
    ``(initial parameters, final parameters, log history, trainer)``. The run of :func:`dpo_run`, ``reward_run`` and
    ``kto_run``.

    ``model``: a model instance to train (default: the path, which the trainer loads; the initial parameters are then
    the path's, loaded fp32); ``constructor`` and ``trainer_kwargs``: more constructor arguments."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_dynbsz.testing.fixtures import load_tokenizer

    args = config(output_dir, plugin=plugin, **fields)
    initial_model = model if model is not None else AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    initial = {name: p.detach().clone() for name, p in initial_model.named_parameters()}
    trainer = (plugin_class if plugin else stock_class)(
        model=model if model is not None else model_dir,
        args=args,
        train_dataset=dataset,
        processing_class=load_tokenizer(model_dir),
        **(constructor or {}),
        **(trainer_kwargs or {}),
    )
    trainer.train()
    final = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return initial, final, trainer.state.log_history, trainer


def dpo_run(plugin: bool, model_dir: str, output_dir: str, dataset=None, *, ref_model=None, **kwargs):
    """Train stock ``DPOTrainer`` (``plugin`` False) or ``DynamicBatchDPOTrainer`` from ``model_dir`` on ``dataset``
    (default :func:`preference_pairs`): :func:`preference_run`, with ``ref_model`` an explicit reference (default:
    stock's ``ref_model=None``, the reference loaded from the model's path); ``kwargs``: ``model`` (an instance to
    train), ``trainer_kwargs`` (``peft_config``, ...) and the config's fields."""
    from trl import DPOTrainer

    from hf_dynbsz.trainers import DynamicBatchDPOTrainer

    dataset = dataset if dataset is not None else preference_pairs()
    ref = dict(ref_model=ref_model)
    return preference_run(DPOTrainer, DynamicBatchDPOTrainer, dpo_config, plugin, model_dir, output_dir, dataset,
                          constructor=ref, **kwargs)  # fmt: skip


def spread_positions_collator(collator_class: type, pad_token_id: int):
    """A collator of a subclass of ``collator_class`` (TRL's ``DataCollatorForPreference``,
    ``DataCollatorForUnpairedPreference``) that adds a model input: ``position_ids`` spread out (``2 * arange`` of
    each micro-batch's width), which stock's forward receives and which change its log-probs."""
    import torch

    class SpreadPositions(collator_class):
        def torch_call(self, examples):
            output = super().torch_call(examples)
            output["position_ids"] = 2 * torch.arange(output["input_ids"].size(1)).expand_as(output["input_ids"])
            return output

    return SpreadPositions(pad_token_id=pad_token_id)


@dataclasses.dataclass
class PairedRuns:
    """Stock's run and the plugin's from the same initial parameters (:func:`paired_runs`)."""

    initial: dict
    stock: dict
    ours: dict
    stock_history: list[dict]
    history: list[dict]
    trainer: object

    @property
    def parameters(self) -> float:
        """The final parameters' relative difference from stock's."""
        from hf_dynbsz.testing.oracles import relative_difference

        return relative_difference(self.ours, self.stock)

    @property
    def update(self) -> float:
        """The update's relative difference from stock's."""
        from hf_dynbsz.testing.oracles import update_difference

        return update_difference(self.initial, self.ours, self.stock)


def paired_runs(
    run: Callable, model_dir: str, tmp_path, dataset, fields: dict, *, plugin_fields: tuple[str, ...], budget: int,
    trainer_kwargs: dict | None,
) -> PairedRuns:  # fmt: skip
    """Stock's run (``run(False, ...)``: :func:`dpo_run`, ``reward_run``, ``kto_run``) and the plugin's on the same
    ``dataset`` from ``model_dir``, ``fields`` their config's (the plugin's own, ``plugin_fields``, popped from
    ``fields`` and given to the plugin's run only, ``max_tokens_per_microbatch`` ``budget`` unless given); the same
    initial parameters asserted."""
    from hf_dynbsz.testing.oracles import relative_difference

    ours_only = {name: fields.pop(name) for name in list(fields) if name in plugin_fields}
    ours_only.setdefault("max_tokens_per_microbatch", budget)
    kwargs = dict(trainer_kwargs=trainer_kwargs, **fields)
    init, stock, stock_history, _ = run(False, model_dir, str(Path(tmp_path) / "stock"), dataset, **kwargs)
    init2, ours, history, trainer = run(True, model_dir, str(Path(tmp_path) / "ours"), dataset, **kwargs, **ours_only)
    assert relative_difference(init2, init) == 0.0
    return PairedRuns(init, stock, ours, stock_history, history, trainer)


def runs_against_stock(
    run: Callable, model_dir: str, tmp_path, dataset, fields: dict, *, plugin_fields: tuple[str, ...], budget: int,
    trainer_kwargs: dict | None, param_tolerance: float, update_tolerance: float, trained_by: float | None = 1e-6,
):  # fmt: skip
    """:func:`paired_runs`, the final parameters and updates within the tolerances
    (:func:`~hf_dynbsz.testing.parameter_mismatches`, ``trained_by``). Returns ``(our log history, stock's log history,
    our trainer)``."""
    from hf_dynbsz.testing.oracles import parameter_mismatches

    runs = paired_runs(
        run, model_dir, tmp_path, dataset, fields, plugin_fields=plugin_fields, budget=budget,
        trainer_kwargs=trainer_kwargs,
    )  # fmt: skip
    tolerances = dict(update_tolerance=update_tolerance, param_tolerance=param_tolerance)
    assert not parameter_mismatches(runs.initial, runs.ours, runs.stock, trained_by=trained_by, **tolerances)
    return runs.history, runs.stock_history, runs.trainer


# ---- the loss tests' steps of pairs -------------------------------------------------------------------------------
def stock_micro_batches(trainer, accumulation: int, pairs: int) -> list[dict]:
    """Stock's ``accumulation`` micro-batches of ``pairs`` pairs each: the trainer's first rows, its collator's."""
    rows = [trainer.train_dataset[i] for i in range(accumulation * pairs)]
    return [trainer.data_collator(rows[k * pairs : (k + 1) * pairs]) for k in range(accumulation)]


def stock_pair_step(trainer, window: list[dict], micro_batch_loss: Callable):
    """Stock's step over ``window``: the sum of ``micro_batch_loss(inputs)`` (each backpropagated), its gradients and
    its logged metrics (the trainer's ``_metrics["train"]``, cleared first)."""
    trainer.model.zero_grad()
    trainer._metrics["train"].clear()
    total = 0.0
    for inputs in window:
        loss = micro_batch_loss(inputs)
        loss.backward()
        total += loss.item()
    gradients = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {key: list(values) for key, values in trainer._metrics["train"].items()}
    return total, gradients, metrics


def whole_pair_passes(count: int, seed: int, passes: int = 3) -> list[list[int]]:
    """The step's pairs (samples 2k, 2k + 1) cut at random into ``passes`` passes of whole pairs."""
    import random

    pairs = list(range(count // 2))
    random.Random(seed).shuffle(pairs)
    cuts = sorted(random.Random(seed + 1).sample(range(1, len(pairs)), passes - 1))
    return [
        sorted(i for k in pairs[start:end] for i in (2 * k, 2 * k + 1)) for start, end in zip([0, *cuts], [*cuts, None])
    ]


def pair_step_outcome(model, total: float, metrics):
    """Our step's outcome as :func:`stock_pair_step` gives stock's: ``total``, ``model``'s gradients and the metrics'
    per-slice values (``metrics.publish_slices``)."""
    from collections import defaultdict

    gradients = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    store = defaultdict(list)
    metrics.publish_slices(store)
    return total, gradients, dict(store)


def gradient_difference(ours: dict, stock: dict) -> float:
    """||ours - stock|| / ||stock|| over ``stock``'s names."""
    num = sum(((ours[k] - stock[k]).double() ** 2).sum() for k in stock) ** 0.5
    den = sum((stock[k].double() ** 2).sum() for k in stock) ** 0.5
    return float(num / den)


def pair_steps_against_stock(trainer, window: list[dict], stock_step: Callable, our_step: Callable):
    """Stock's step over ``window`` (``stock_step(trainer, window)``) against ours of two different cuts of the same
    pairs (``our_step(trainer, window, seed)``, seeds 0 and 1): each cut's loss within ``rel=1e-5, abs=1e-7`` of
    stock's and its gradients within 1e-5 (:func:`gradient_difference`) asserted; yields ``(our metrics, stock's
    metrics)`` per cut, for the test's own comparison. (Run by pytest: pytest is imported here.)"""
    import pytest

    stock_loss, stock_grads, stock_metrics = stock_step(trainer, window)
    for seed in (0, 1):  # two different cuts of the same pairs
        loss, grads, metrics = our_step(trainer, window, seed)
        assert loss == pytest.approx(stock_loss, rel=1e-5, abs=1e-7)
        assert gradient_difference(grads, stock_grads) <= 1e-5
        yield metrics, stock_metrics

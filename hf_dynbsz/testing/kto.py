"""KTO runs for the tests, the benchmark and the example: unpaired preference samples (``prompt``, ``completion``,
``label``) and one training run of stock ``KTOTrainer`` or ``DynamicBatchKTOTrainer``, offline, from a saved tiny
causal LM.

Imported by its module's name (``hf_dynbsz.testing.kto``). Nothing here downloads anything; torch, transformers, TRL
and datasets are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable

from hf_dynbsz.testing.fixtures import TEST_ALPHABET
from hf_dynbsz.testing.preference import (
    DPO_COMPARISON_FIELDS,
    DPO_PLUGIN_FIELDS,
    comparison_config,
    config_classes,
    preference_run,
    text_draws,
)

__all__ = [
    "KTO_BETA",
    "KTO_COMPARISON_FIELDS",
    "KTO_LOSSES",
    "KTO_PLUGIN_FIELDS",
    "KTO_SHARPNESS",
    "kto_config",
    "kto_metric_mismatches",
    "kto_run",
    "sharpened_reference",
    "unpaired_samples",
]

#: The comparison runs' schedule (2 optimizer steps of 2 micro-batches of 4 samples) and optimizer: SGD at a constant,
#: large rate, no gradient clipping (DPO's).
KTO_COMPARISON_FIELDS = dict(DPO_COMPARISON_FIELDS)
#: The loss settings the comparisons with stock train (``tests/test_kto_trainer.py``, ``benchmarks/exactness.py``; the
#: unequal weights on samples 30% desirable), with a reference :data:`KTO_SHARPNESS` times sharper than the policy
#: (:func:`sharpened_reference`) and ``beta`` :data:`KTO_BETA`, so that the KL estimate weighs in the loss.
KTO_LOSSES = {
    "kto": dict(loss_type="kto"),
    "kto_unequal_weights": dict(loss_type="kto", desirable_weight=1.5, undesirable_weight=0.7),
    "apo_zero_unpaired": dict(loss_type="apo_zero_unpaired"),
}
KTO_SHARPNESS = 10.0
KTO_BETA = 1.0
#: Settings only ``DynamicBatchKTOConfig`` has (a stock run leaves them out).
KTO_PLUGIN_FIELDS = DPO_PLUGIN_FIELDS


def unpaired_samples(
    count: int = 16,
    *,
    seed: int = 0,
    prompt: tuple[int, int] | Callable = (3, 20),
    completion: tuple[int, int] | Callable = (1, 25),
    system: int = 0,
    desirable: float = 0.5,
    alphabet: str = TEST_ALPHABET,
):
    """``count`` unpaired preference samples (a ``datasets.Dataset`` of ``prompt`` and ``completion`` strings and a
    boolean ``label``).

    ``prompt`` / ``completion``: lengths in characters (one token each with the test tokenizer), uniform in ``[low,
    high)``, or a function ``(rng, n) -> lengths``; ``system``: every prompt opens with the same block of this many
    characters; ``desirable``: the chance of a sample being desirable (``label`` True)."""
    from datasets import Dataset

    rng, lengths, text = text_draws(seed, alphabet)
    block = text(system) if system else ""
    return Dataset.from_dict(
        {
            "prompt": [block + text(length) for length in lengths(prompt, count)],
            "completion": [text(length) for length in lengths(completion, count)],
            "label": [bool(value) for value in rng.random(count) < desirable],
        }
    )


def sharpened_reference(model_dir: str, factor: float = 4.0):
    """The causal LM saved at ``model_dir`` (fp32) with its final norm's weight times ``factor``: its logits ``factor``
    times the model's, so it gives text of the test alphabet lower log-probs than the model does and KTO's KL estimate
    (the policy's log-probs over the reference's, clamped at 0) is positive from the first step. A reference the same
    as the policy estimates 0 there, where a wrong micro-batch would not show. A negative ``factor`` also turns the
    reference's preferences around (a tiny model with tied embeddings favours repeating its input token, which
    random text often does): on samples opening with a shared block, 10 can still estimate below 0, -10 does not."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    norm = [child for child in model.base_model.children() if type(child).__name__.endswith("Norm")][-1]
    with _whole(norm):
        _scale_final_norm(norm, factor)
    return model


def _whole(module):
    """Around a change of ``module``'s parameters: under DeepSpeed ZeRO-3 (a model loaded while a ZeRO-3 config is
    active is partitioned at load: each process holds an empty placeholder) its parameters gathered whole and the
    change kept (``GatheredParameters``); otherwise nothing."""
    import contextlib

    from transformers.integrations import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0)


def _scale_final_norm(norm, factor: float) -> None:
    """Make a base model's final ``norm`` (its last child whose class name ends in ``Norm``: ``norm``, ``norm_f``,
    ``final_layernorm``, LFM2's ``embedding_norm``) return ``factor`` times its output: its weight (and bias) times
    ``factor``, or, for a norm that scales by ``1 + weight`` (Gemma's), the weight set so that ``1 + weight`` is
    ``factor`` times what it was; checked on a random input."""
    import torch

    probe = torch.randn(3, norm.weight.numel(), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = factor * norm(probe)
        original = norm.weight.clone()
        for scale in (lambda w: w * factor, lambda w: (1 + w) * factor - 1):
            norm.weight.copy_(scale(original))
            if getattr(norm, "bias", None) is not None:
                norm.bias.mul_(factor)
            if torch.allclose(norm(probe), expected, rtol=1e-4, atol=1e-5):
                return
            if getattr(norm, "bias", None) is not None:
                norm.bias.div_(factor)
    raise ValueError(f"{type(norm).__name__} does not scale with its weight")


def kto_config(output_dir: str, *, plugin: bool, **fields):
    """The comparison runs' config (:data:`KTO_COMPARISON_FIELDS` on a CPU run, ``fields`` on top): a
    ``DynamicBatchKTOConfig`` with ``plugin``, else TRL's ``KTOConfig`` (the plugin's fields left out)."""
    defaults = dict(defaults=KTO_COMPARISON_FIELDS, plugin_fields=KTO_PLUGIN_FIELDS)
    return comparison_config(*config_classes("KTO"), output_dir, plugin, fields, **defaults)


def kto_run(plugin: bool, model_dir: str, output_dir: str, dataset=None, *, ref_model=None, **kwargs):
    """Stock ``KTOTrainer``'s run (``plugin`` False) or ``DynamicBatchKTOTrainer``'s on ``dataset`` (default
    :func:`unpaired_samples`), from ``model_dir``: :func:`~hf_dynbsz.testing.preference.preference_run`; returns
    ``(initial parameters, final parameters, log history, trainer)``. ``ref_model``: an explicit reference (default
    stock's ``None``: the model's path again); ``model``, ``trainer_kwargs`` and the config's fields in ``kwargs``."""
    from trl import KTOTrainer

    from hf_dynbsz.trainers import DynamicBatchKTOTrainer

    samples = unpaired_samples() if dataset is None else dataset
    classes = (KTOTrainer, DynamicBatchKTOTrainer)
    return preference_run(
        *classes, kto_config, plugin, model_dir, output_dir, samples, constructor={"ref_model": ref_model}, **kwargs
    )


#: The logged rewards and the sides whose sequence log-probs make each (``rewards/margins``: both).
REWARD_SIDES = {
    "rewards/chosen": ("chosen",),
    "rewards/rejected": ("rejected",),
    "rewards/margins": ("chosen", "rejected"),
}


def kto_metric_mismatches(ours: list[dict], stock: list[dict], beta: float, longest: int) -> list[str]:
    """Where two runs' :func:`~hf_dynbsz.testing.logged_metrics` differ (:func:`~hf_dynbsz.testing.metric_mismatches`),
    the rewards and the KL estimate within what fp32 rounding alone moves them (:func:`_rounding_bounds`)."""
    import math

    from hf_dynbsz.testing.oracles import metric_mismatches

    rounded = (*REWARD_SIDES, "kl")
    found = metric_mismatches(
        *([{k: v for k, v in e.items() if k not in rounded} for e in log] for log in (ours, stock))
    )
    for i, (our_entry, stock_entry) in enumerate(zip(ours, stock)):
        for name, bound in _rounding_bounds(stock_entry, beta, longest).items():
            if not math.isclose(
                our_entry.get(name, math.nan), stock_entry[name], rel_tol=1e-5, abs_tol=max(bound, 1e-6)
            ):
                found.append(
                    f"entry {i}: {name} {our_entry.get(name)!r} != stock {stock_entry[name]!r} (bound {bound:.1e})"
                )
    return found


def _rounding_bounds(entry: dict, beta: float, longest: int) -> dict[str, float]:
    """How far fp32 rounding alone moves each of ``entry``'s rewards and its ``kl``: a reward is ``beta`` times the
    difference of two sequence log-probs (the policy's and the reference's), each a fp32 sum of up to ``longest`` token
    log-probs that a packed pass adds in another order than stock's padded rows, so each sum's rounding is bounded by
    ``ceil(log2 longest)`` ulps of its magnitude and the difference cancels the magnitudes, not their rounding (the
    reference's sum is ``logps - rewards / beta``). ``kl`` is a mean of the same differences (no ``beta``) over the KL
    sequences, the samples' completions after other prompts: their magnitudes taken as the larger side's ``logps``, the
    reference's that minus ``kl``."""
    import math

    eps = 2.0**-23
    roundings = math.ceil(math.log2(max(longest, 2)))
    bounds = {}
    for name in set(REWARD_SIDES) & set(entry):
        bound = 0.0
        for side in REWARD_SIDES[name]:
            policy = entry[f"logps/{side}"]
            reference = policy - entry[f"rewards/{side}"] / beta
            bound += beta * roundings * eps * (abs(policy) + abs(reference))
        bounds[name] = bound
    sides = [abs(entry[f"logps/{side}"]) for side in ("chosen", "rejected") if f"logps/{side}" in entry]
    if "kl" in entry and sides:
        bounds["kl"] = roundings * eps * (2 * max(sides) + abs(entry["kl"]))
    return bounds

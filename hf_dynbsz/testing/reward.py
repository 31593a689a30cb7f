"""Reward-model runs for the tests: stock ``RewardTrainer`` or ``DynamicBatchRewardTrainer`` on preference pairs, from a
saved tiny causal LM loaded as a sequence classifier of one label (its score head drawn from a fixed seed), offline.

Imported by its module's name (``hf_dynbsz.testing.reward``). Nothing here downloads anything; torch, transformers and
TRL are imported inside the functions.
"""

from __future__ import annotations

from hf_dynbsz.testing.preference import (
    DPO_COMPARISON_FIELDS,
    DPO_PLUGIN_FIELDS,
    comparison_config,
    config_classes,
    preference_run,
)

__all__ = [
    "REWARD_COMPARISON_FIELDS",
    "REWARD_PLUGIN_FIELDS",
    "reward_config",
    "reward_model",
    "reward_run",
    "with_margins",
]

#: The comparison runs' schedule (2 optimizer steps of 2 micro-batches of 4 pairs) and optimizer: SGD at a constant,
#: large rate, no gradient clipping (DPO's).
REWARD_COMPARISON_FIELDS = dict(DPO_COMPARISON_FIELDS)
#: Settings only ``DynamicBatchRewardConfig`` has (a stock run leaves them out).
REWARD_PLUGIN_FIELDS = DPO_PLUGIN_FIELDS


def reward_model(model_dir: str, seed: int = 0):
    """The causal LM saved at ``model_dir`` as ``AutoModelForSequenceClassification`` with one label, fp32, its score
    head drawn after ``torch.manual_seed(seed)`` (the same model on every call)."""
    import torch
    from transformers import AutoModelForSequenceClassification
    from trl.trainer.reward_trainer import suppress_seqcls_warning

    torch.manual_seed(seed)
    with suppress_seqcls_warning():
        return AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)


def reward_config(output_dir: str, *, plugin: bool, **fields):
    """The comparison runs' config (:data:`REWARD_COMPARISON_FIELDS` on a CPU run, ``fields`` on top): a
    ``DynamicBatchRewardConfig`` with ``plugin``, else TRL's ``RewardConfig`` (the plugin's fields left out)."""
    defaults = dict(defaults=REWARD_COMPARISON_FIELDS, plugin_fields=REWARD_PLUGIN_FIELDS)
    return comparison_config(*config_classes("Reward"), output_dir, plugin, fields, **defaults)


def reward_run(plugin: bool, model_dir: str, output_dir: str, dataset, *, trainer_kwargs: dict | None = None, **fields):
    """Train stock ``RewardTrainer`` (``plugin`` False) or ``DynamicBatchRewardTrainer`` from :func:`reward_model` of
    ``model_dir`` on ``dataset`` (:func:`~hf_dynbsz.testing.preference.preference_run`); returns ``(initial
    parameters, final parameters, log history, trainer)``."""
    from trl import RewardTrainer

    from hf_dynbsz.trainers import DynamicBatchRewardTrainer

    model = reward_model(model_dir)
    return preference_run(RewardTrainer, DynamicBatchRewardTrainer, reward_config, plugin, model_dir, output_dir,
                          dataset, model=model, trainer_kwargs=trainer_kwargs, **fields)  # fmt: skip


def with_margins(dataset, seed: int = 0):
    """``dataset`` with a ``margin`` column (stock's margin loss), uniform in ``[-1, 2)`` from ``seed``."""
    import numpy as np

    margins = np.random.default_rng(seed).uniform(-1.0, 2.0, len(dataset)).tolist()
    return dataset.add_column("margin", margins)

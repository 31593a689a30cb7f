"""Preference pairs and DPO runs for the tests, the benchmark and the example: offline, from a config's tiny model.

* :func:`preference_pairs`: a dataset of ``prompt`` / ``chosen`` / ``rejected`` strings of the test alphabet, their
  lengths drawn from given ranges (or a long-tailed draw), optionally every prompt opening with one shared block (a
  system prompt), and optionally several pairs per prompt (datasets with several ranked responses per prompt);
* :func:`dpo_run`: one training run of stock ``DPOTrainer`` or ``DynamicBatchDPOTrainer`` on such pairs, with the
  comparison runs' schedule and optimizer (:data:`DPO_COMPARISON_FIELDS`): initial and final parameters and the log.

Nothing here downloads anything; torch, transformers, TRL and datasets are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable

from hf_dynbsz.testing.fixtures import CPU_RUN_FIELDS, TEST_ALPHABET

__all__ = ["DPO_COMPARISON_FIELDS", "DPO_PLUGIN_FIELDS", "dpo_config", "dpo_run", "preference_pairs"]

#: The DPO comparison runs' schedule (2 optimizer steps of 2 micro-batches of 4 pairs) and optimizer: SGD at a constant,
#: large rate, so that a mis-weighted pair shows; no gradient clipping.
DPO_COMPARISON_FIELDS = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2, seed=0)
DPO_COMPARISON_FIELDS.update(learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", max_grad_norm=1e9)
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
    import numpy as np
    from datasets import Dataset

    rng = np.random.default_rng(seed)
    letters = list(alphabet)

    def lengths(spec, n: int):
        values = spec(rng, n) if callable(spec) else rng.integers(spec[0], spec[1], n)
        return [max(int(v), 1) for v in values]

    def text(length: int) -> str:
        return "".join(rng.choice(letters, length))

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


def dpo_config(output_dir: str, *, plugin: bool, **fields):
    """The comparison runs' config (:data:`DPO_COMPARISON_FIELDS` on a CPU run, ``fields`` on top): a
    ``DynamicBatchDPOConfig`` with ``plugin``, else TRL's ``DPOConfig`` (the plugin's fields left out)."""
    from trl import DPOConfig

    from hf_dynbsz.configs.dpo import DynamicBatchDPOConfig

    values = {"output_dir": output_dir, **DPO_COMPARISON_FIELDS, **CPU_RUN_FIELDS, **fields}
    if not plugin:
        values = {name: value for name, value in values.items() if name not in DPO_PLUGIN_FIELDS}
    return (DynamicBatchDPOConfig if plugin else DPOConfig)(**values)


def dpo_run(
    plugin: bool,
    model_dir: str,
    output_dir: str,
    dataset=None,
    *,
    model=None,
    ref_model=None,
    trainer_kwargs: dict | None = None,
    **fields,
):
    """Train stock ``DPOTrainer`` (``plugin`` False) or ``DynamicBatchDPOTrainer`` from ``model_dir`` on ``dataset``
    (default :func:`preference_pairs`); returns ``(initial parameters, final parameters, log history, trainer)``.

    ``model``: a model instance to train (default: the path, which stock loads, with the reference from the same path
    as stock's default ``ref_model=None`` does); ``ref_model``: an explicit reference; ``trainer_kwargs``: more
    constructor arguments (``peft_config``, ...)."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl import DPOTrainer

    from hf_dynbsz.testing.fixtures import load_tokenizer
    from hf_dynbsz.trainers import DynamicBatchDPOTrainer

    args = dpo_config(output_dir, plugin=plugin, **fields)
    initial_model = model if model is not None else AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    initial = {name: p.detach().clone() for name, p in initial_model.named_parameters()}
    trainer_class = DynamicBatchDPOTrainer if plugin else DPOTrainer
    trainer = trainer_class(
        model=model if model is not None else model_dir,
        ref_model=ref_model,
        args=args,
        train_dataset=dataset if dataset is not None else preference_pairs(),
        processing_class=load_tokenizer(model_dir),
        **(trainer_kwargs or {}),
    )
    trainer.train()
    final = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return initial, final, trainer.state.log_history, trainer

"""hf-dynbsz: token-budget micro-batches for TRL's GRPOTrainer, with exactly stock TRL's training math.

Layers, bottom up (the README's "Architecture" section says what each module decides):

* planning core, no torch/TRL imports: :mod:`hf_dynbsz.settings`, :mod:`hf_dynbsz.env`, :mod:`hf_dynbsz.plan`,
  :mod:`hf_dynbsz.balance`, :mod:`hf_dynbsz.partition`, :mod:`hf_dynbsz.model_support`, :mod:`hf_dynbsz.schedule`,
  :mod:`hf_dynbsz._trl_compat`;
* configuration: :mod:`hf_dynbsz.config` (``DynamicBatchGRPOConfig``);
* torch layer: :mod:`hf_dynbsz.batch`, :mod:`hf_dynbsz.packing`, :mod:`hf_dynbsz.attention`,
  :mod:`hf_dynbsz.self_check`, :mod:`hf_dynbsz.loss`, :mod:`hf_dynbsz.router_loss`, :mod:`hf_dynbsz.metrics`,
  :mod:`hf_dynbsz.tiling`, :mod:`hf_dynbsz.distributed`, :mod:`hf_dynbsz.capabilities`;
* trainer layer: :mod:`hf_dynbsz.trainer` (``DynamicBatchGRPOTrainer``);
* tools: :mod:`hf_dynbsz.cli` (``hf-dynbsz plan``), :mod:`hf_dynbsz.testing` (shared by tests, benchmarks, examples),
  :mod:`hf_dynbsz.zoo` (tiny models of transformers' causal-LM architectures).

Heavy imports (torch, TRL) happen lazily, so ``import hf_dynbsz`` for the planning core stays cheap.
"""

from __future__ import annotations

import importlib

from ._trl_compat import TESTED_TRL_RANGE, check_trl_version

__version__ = "0.1.0"

_LAZY = {
    "DynamicBatchGRPOConfig": "hf_dynbsz.config",
    "ensure_dynamic_batch_fields": "hf_dynbsz.config",
    "apply_env_overrides": "hf_dynbsz.env",
    "BatchSizePlan": "hf_dynbsz.plan",
    "Scheduler": "hf_dynbsz.schedule",
    "partition_by_token_budget": "hf_dynbsz.partition",
    "WorkloadModel": "hf_dynbsz.partition",
    "OversizeSequenceError": "hf_dynbsz.partition",
    "MemoryModel": "hf_dynbsz.memory",
    "OutOfMemoryBudgetError": "hf_dynbsz.memory",
    "DynamicBatchGRPOTrainer": "hf_dynbsz.trainer",
}

__all__ = [*_LAZY, "check_trl_version", "TESTED_TRL_RANGE", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        if name == "DynamicBatchGRPOTrainer":
            check_trl_version()
        return getattr(module, name)
    raise AttributeError(f"module 'hf_dynbsz' has no attribute {name!r}")

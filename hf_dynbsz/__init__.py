"""hf-dynbsz: token-budget micro-batches for TRL's GRPOTrainer, RLOOTrainer, DistillationTrainer, DPOTrainer,
RewardTrainer, KTOTrainer and AsyncGRPOTrainer, with exactly stock TRL's training math.

Layers, as folders, bottom up (docs/architecture.md says what each module decides and may import):

* :mod:`hf_dynbsz.planning`: the pure planning core (settings, environment overrides, the batch-size plan, cost
  model, partition, balance, schedule, memory model, model support); no torch, TRL or transformers imports;
* :mod:`hf_dynbsz.execution`: the torch layer (step batch, packing, segment attention, tiling, loss weights, router
  loss, vision inputs, self-check, metrics, device memory, the pass executor and out-of-memory recovery);
* :mod:`hf_dynbsz.parallel`: across processes (the schedule's collectives, sequence parallelism);
* :mod:`hf_dynbsz.configs` (``DynamicBatchGRPOConfig``, ``DynamicBatchRLOOConfig``, ``DynamicBatchDistillationConfig``,
  ``DynamicBatchDPOConfig``, ``DynamicBatchRewardConfig``, ``DynamicBatchKTOConfig``, ``DynamicBatchAsyncGRPOConfig``,
  one module each) and
  :mod:`hf_dynbsz.trainers` (``DynamicBatchGRPOTrainer``, ``DynamicBatchRLOOTrainer``,
  ``DynamicBatchDistillationTrainer``, ``DynamicBatchDPOTrainer``, ``DynamicBatchRewardTrainer``,
  ``DynamicBatchKTOTrainer``, ``DynamicBatchAsyncGRPOTrainer``, one module each):
  TRL's hooks over the executor;
  :mod:`hf_dynbsz._trl_compat` lists every private name of TRL and its kin touched;
* tools: :mod:`hf_dynbsz.cli` (``hf-dynbsz plan``, ``report``), :mod:`hf_dynbsz.testing` (fixtures, the model zoo,
  oracles and process tools shared by tests, benchmarks and examples).

Heavy imports (torch, TRL) happen lazily, so ``import hf_dynbsz`` for the planning core stays cheap. The one thing
``import hf_dynbsz`` checks first is the installed TRL's version (its metadata; TRL is not imported): outside
``TESTED_TRL_RANGE`` it raises ``UntestedTRLVersionError`` (an ``ImportError``) unless
``HF_DYNBSZ_ALLOW_UNTESTED_TRL=1`` is set, which turns it into one warning
(:func:`hf_dynbsz._trl_compat.check_trl_version`).
"""

from __future__ import annotations

import importlib

from hf_dynbsz._trl_compat import TESTED_TRL_RANGE, UntestedTRLVersionError, check_trl_version

check_trl_version()  # before anything else: an untested TRL stops here, with one message

__version__ = "0.1.0"

_LAZY = {
    "DynamicBatchGRPOConfig": "hf_dynbsz.configs",
    "DynamicBatchRLOOConfig": "hf_dynbsz.configs",
    "DynamicBatchDistillationConfig": "hf_dynbsz.configs",
    "DynamicBatchDPOConfig": "hf_dynbsz.configs",
    "DynamicBatchAsyncGRPOConfig": "hf_dynbsz.configs",
    "DynamicBatchRewardConfig": "hf_dynbsz.configs",
    "DynamicBatchKTOConfig": "hf_dynbsz.configs",
    "ensure_dynamic_batch_fields": "hf_dynbsz.configs",
    "apply_env_overrides": "hf_dynbsz.planning.env",
    "BatchSizePlan": "hf_dynbsz.planning.plan",
    "Scheduler": "hf_dynbsz.planning.schedule",
    "partition_by_token_budget": "hf_dynbsz.planning.partition",
    "WorkloadModel": "hf_dynbsz.planning.cost",
    "OversizeSequenceError": "hf_dynbsz.planning.partition",
    "MemoryModel": "hf_dynbsz.planning.memory",
    "OutOfMemoryBudgetError": "hf_dynbsz.planning.memory",
    "DynamicBatchGRPOTrainer": "hf_dynbsz.trainers",
    "DynamicBatchRLOOTrainer": "hf_dynbsz.trainers",
    "DynamicBatchDistillationTrainer": "hf_dynbsz.trainers",
    "DynamicBatchDPOTrainer": "hf_dynbsz.trainers",
    "DynamicBatchAsyncGRPOTrainer": "hf_dynbsz.trainers",
    "DynamicBatchRewardTrainer": "hf_dynbsz.trainers",
    "DynamicBatchKTOTrainer": "hf_dynbsz.trainers",
}

__all__ = [*_LAZY, "check_trl_version", "TESTED_TRL_RANGE", "UntestedTRLVersionError", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_dynbsz' has no attribute {name!r}")

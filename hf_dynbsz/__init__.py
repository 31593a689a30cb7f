"""hf-dynbsz: token-budget micro-batches for TRL's GRPOTrainer, with exactly stock TRL's training math.

Layers, bottom up:

* planning core, no torch/trainer imports: :mod:`hf_dynbsz.env` (``DIFFU_*`` overrides),
  :mod:`hf_dynbsz.plan` (batch-size algebra), :mod:`hf_dynbsz.partition` (token-budget partitioner);
* configuration: :mod:`hf_dynbsz.config` (``DynamicBatchGRPOConfig``);
* torch layer: :mod:`hf_dynbsz.packing` (packing collator), :mod:`hf_dynbsz.loss` (partition-invariant loss);
* trainer layer: :mod:`hf_dynbsz.trainer` (``DynamicBatchGRPOTrainer``).

Heavy imports (torch, TRL) happen lazily, so ``import hf_dynbsz`` for the planning core stays cheap.
"""

from __future__ import annotations

import importlib
import warnings

__version__ = "0.1.0"

# TRL versions the test suite runs against. The trainer overrides private GRPOTrainer hooks
# (`training_step`, `_get_per_token_logps_and_entropies`) and mirrors `_compute_loss`; outside this range
# those may have changed.
TESTED_TRL_RANGE = ("1.16.0", "1.17.0")  # [lower, upper)

_LAZY = {
    "DynamicBatchGRPOConfig": "hf_dynbsz.config",
    "ensure_dynamic_batch_fields": "hf_dynbsz.config",
    "apply_env_overrides": "hf_dynbsz.env",
    "BatchSizePlan": "hf_dynbsz.plan",
    "partition_by_token_budget": "hf_dynbsz.partition",
    "WorkloadModel": "hf_dynbsz.partition",
    "OversizeSequenceError": "hf_dynbsz.partition",
    "DynamicBatchGRPOTrainer": "hf_dynbsz.trainer",
}

__all__ = [*_LAZY, "check_trl_version", "TESTED_TRL_RANGE", "__version__"]

_checked = False


def check_trl_version(version: str | None = None) -> bool:
    """Warn (once) when the installed TRL is outside :data:`TESTED_TRL_RANGE`; returns whether it is inside."""
    global _checked
    from packaging.version import Version

    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("trl")
    lower, upper = (Version(v) for v in TESTED_TRL_RANGE)
    inside = lower <= Version(version) < upper
    if not inside and not _checked:
        warnings.warn(
            f"hf_dynbsz was tested with trl>={lower},<{upper} but trl {version} is installed. "
            "DynamicBatchGRPOTrainer overrides private GRPOTrainer hooks that change between TRL releases: "
            "run the test suite (or compare against stock GRPOTrainer) before trusting results, or install "
            f"'trl>={lower},<{upper}'.",
            RuntimeWarning,
            stacklevel=2,
        )
    _checked = True
    return inside


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        if name == "DynamicBatchGRPOTrainer":
            check_trl_version()
        return getattr(module, name)
    raise AttributeError(f"module 'hf_dynbsz' has no attribute {name!r}")

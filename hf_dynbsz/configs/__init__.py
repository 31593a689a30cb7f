"""The plugin's configs, one module per trainer beside :mod:`hf_dynbsz.trainers`: TRL's config plus the plugin's
settings. ``shared.py`` holds the fields every config has; ``build.py`` the config as training builds it from a plain
TRL config, from nothing, or from ``hf-dynbsz plan``'s options. Every name is imported on first use:
``DynamicBatchAsyncGRPOConfig`` subclasses TRL's experimental package, which takes seconds to import and warns."""

from __future__ import annotations

import importlib

_LAZY = {
    "DynamicBatchFields": "hf_dynbsz.configs.shared",
    "default_ddp_backend": "hf_dynbsz.configs.shared",
    "DynamicBatchGRPOConfig": "hf_dynbsz.configs.grpo",
    "DynamicBatchRLOOConfig": "hf_dynbsz.configs.rloo",
    "DynamicBatchDistillationConfig": "hf_dynbsz.configs.distillation",
    "DynamicBatchDPOConfig": "hf_dynbsz.configs.dpo",
    "DynamicBatchRewardConfig": "hf_dynbsz.configs.reward",
    "DynamicBatchKTOConfig": "hf_dynbsz.configs.kto",
    "DynamicBatchAsyncGRPOConfig": "hf_dynbsz.configs.async_grpo",
    "check_as_training": "hf_dynbsz.configs.build",
    "ensure_dynamic_batch_fields": "hf_dynbsz.configs.build",
    "trainer_config": "hf_dynbsz.configs.build",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hf_dynbsz.configs' has no attribute {name!r}")

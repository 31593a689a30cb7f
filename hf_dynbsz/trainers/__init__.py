"""The plugin's trainers, one module per trainer over the shared hooks (:mod:`hf_dynbsz.trainers.hooks`): a new trainer
is a new module here and a line below. ``DynamicBatchAsyncGRPOTrainer`` is imported on first use: TRL's experimental
package it subclasses takes seconds to import and warns."""

from hf_dynbsz.trainers.distillation import DynamicBatchDistillationTrainer
from hf_dynbsz.trainers.dpo import DynamicBatchDPOTrainer
from hf_dynbsz.trainers.grpo import DynamicBatchGRPOTrainer
from hf_dynbsz.trainers.kto import DynamicBatchKTOTrainer
from hf_dynbsz.trainers.reward import DynamicBatchRewardTrainer
from hf_dynbsz.trainers.rloo import DynamicBatchRLOOTrainer

__all__ = [
    "DynamicBatchAsyncGRPOTrainer",
    "DynamicBatchDPOTrainer",
    "DynamicBatchDistillationTrainer",
    "DynamicBatchGRPOTrainer",
    "DynamicBatchKTOTrainer",
    "DynamicBatchRLOOTrainer",
    "DynamicBatchRewardTrainer",
]


def __getattr__(name: str):
    if name == "DynamicBatchAsyncGRPOTrainer":
        from hf_dynbsz.trainers.async_grpo import DynamicBatchAsyncGRPOTrainer

        return DynamicBatchAsyncGRPOTrainer
    raise AttributeError(f"module 'hf_dynbsz.trainers' has no attribute {name!r}")

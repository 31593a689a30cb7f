"""The plugin's trainers, one module per trainer over the shared hooks (:mod:`hf_dynbsz.trainers.hooks`): a new trainer
is a new module here and a line below."""

from hf_dynbsz.trainers.distillation import DynamicBatchDistillationTrainer
from hf_dynbsz.trainers.dpo import DynamicBatchDPOTrainer
from hf_dynbsz.trainers.grpo import DynamicBatchGRPOTrainer
from hf_dynbsz.trainers.rloo import DynamicBatchRLOOTrainer

__all__ = [
    "DynamicBatchDPOTrainer",
    "DynamicBatchDistillationTrainer",
    "DynamicBatchGRPOTrainer",
    "DynamicBatchRLOOTrainer",
]

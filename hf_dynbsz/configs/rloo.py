"""``DynamicBatchRLOOConfig``: TRL's ``RLOOConfig`` plus the plugin's settings, with GRPO's generation round
(:class:`~hf_dynbsz.configs.grpo.GenerationRoundFields`)."""

from __future__ import annotations

from dataclasses import dataclass

from trl import RLOOConfig

from hf_dynbsz.configs.grpo import GenerationRoundFields
from hf_dynbsz.configs.shared import config_doc

__all__ = ["DynamicBatchRLOOConfig"]


@dataclass
class DynamicBatchRLOOConfig(GenerationRoundFields, RLOOConfig):
    __doc__ = config_doc("RLOO")

"""``DynamicBatchRewardConfig``: TRL's ``RewardConfig`` plus the plugin's settings (the fields of
:class:`~hf_dynbsz.config.DynamicBatchFields`).

A reward model's run has no generation round and no reference: after the ``DIFFU_*`` environment only TRL's own
``RewardConfig.__post_init__`` and the plugin's fields apply (as a DPO run's, :class:`~hf_dynbsz.config.DPOFields`).
A module of its own beside :mod:`hf_dynbsz.config`, as :mod:`hf_dynbsz.async_config` is.
"""

from __future__ import annotations

from dataclasses import dataclass

from trl import RewardConfig

from hf_dynbsz.config import DynamicBatchFields, _config_doc, refuse_reward_settings
from hf_dynbsz.planning.validation import validate_dynamic_batch_fields

__all__ = ["DynamicBatchRewardConfig", "RewardFields"]


@dataclass
class RewardFields(DynamicBatchFields):
    """The plugin's fields of a reward model's run (:class:`~hf_dynbsz.config.DynamicBatchFields`) and their checks:
    no generation round and no GRPO settings, so after the environment only TRL's own ``RewardConfig.__post_init__``
    and the plugin's fields apply (``max_tokens_per_microbatch_logprob`` has nothing to size: no reference)."""

    def _dynbsz_check_and_derive(self) -> None:
        refuse_reward_settings(self)
        super(DynamicBatchFields, self).__post_init__()  # TRL's RewardConfig.__post_init__
        validate_dynamic_batch_fields(self)


@dataclass
class DynamicBatchRewardConfig(RewardFields, RewardConfig):
    pass


DynamicBatchRewardConfig.__doc__ = _config_doc("Reward")

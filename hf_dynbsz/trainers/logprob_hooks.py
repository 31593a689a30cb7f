"""The no-grad log-prob passes of GRPO and RLOO (old policy, reference) by the schedule: :class:`LogProbHooks`, the
shared hooks (:class:`~hf_dynbsz.trainers.hooks.TokenBudgetHooks`) and TRL's ``_get_per_token_logps_and_entropies``
overridden (grad calls and what the passes do not run go to stock). A distillation, a DPO run and the asynchronous
trainer do not have these calls."""

from __future__ import annotations

import torch

from hf_dynbsz.execution.multimodal import split_media
from hf_dynbsz.execution.packing import SequenceTable
from hf_dynbsz.trainers.hooks import TokenBudgetHooks

__all__ = ["LogProbHooks"]


class LogProbHooks(TokenBudgetHooks):
    """:class:`TokenBudgetHooks` and the no-grad log-prob passes of GRPO and RLOO (old policy, reference), which a
    distillation does not have."""

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        pixel_values=None,
        image_grid_thw=None,
        num_images=None,
        pixel_attention_mask=None,
        spatial_shapes=None,
        num_tiles=None,
        image_sizes=None,
        token_type_ids=None,
        mm_token_type_ids=None,
        image_position_ids=None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        # Override: run the no-grad log-prob passes (old policy, reference) by the schedule.
        media = dict(
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            num_images=num_images,
            pixel_attention_mask=pixel_attention_mask,
            spatial_shapes=spatial_shapes,
            num_tiles=num_tiles,
            image_sizes=image_sizes,
            image_position_ids=image_position_ids,
        )
        token_fields = {
            name: value
            for name, value in (("token_type_ids", token_type_ids), ("mm_token_type_ids", mm_token_type_ids))
            if value is not None
        }
        table = self._no_grad_table(
            model, input_ids, attention_mask, logits_to_keep, media, token_fields, compute_aux_loss
        )
        if table is None:
            with self._dynbsz.tiles():
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                    **media, **token_fields,
                )  # fmt: skip
        stock_tokens = (batch_size or input_ids.size(0)) * input_ids.size(1)
        logps, entropies, _ = self._dynbsz.no_grad_passes(model, table, logits_to_keep, compute_entropy, stock_tokens)
        return logps, entropies, None

    def _no_grad_table(self, model, input_ids, attention_mask, logits_to_keep, media, token_fields, compute_aux_loss):
        """The samples of a no-grad call as a table for the executor, or None where the call runs stock's."""
        executor = self._dynbsz
        stock = (
            not executor.enabled
            or torch.is_grad_enabled()
            or compute_aux_loss
            or executor.media.stock({**media, **token_fields})  # (the same answer on every process)
        )
        if stock:
            return None
        prompt_width = input_ids.size(1) - logits_to_keep
        table = SequenceTable.from_padded(
            input_ids[:, :prompt_width],
            attention_mask[:, :prompt_width],
            input_ids[:, prompt_width:],
            attention_mask[:, prompt_width:],
            media=split_media(media, input_ids.size(0)),
            token_fields=token_fields,
            long_rope=executor.capabilities.support.long_rope,  # stock's chunks are the call's width: its rope width
        )
        return table if executor.self_check(model, table) else None

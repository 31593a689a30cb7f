"""`DynamicBatchGRPOTrainer`: TRL's GRPOTrainer with token-budget micro-batches and the same math.

What changes against stock TRL 1.16, and nothing else:

* An optimizer step consumes exactly stock's samples (stock's ``_prepare_inputs`` still generates,
  shuffles and slices them), but instead of one forward/backward per fixed slice of
  ``per_device_train_batch_size`` rows padded to the generation batch's longest row, the step's samples
  are repacked into micro-batches of at most ``max_tokens_per_microbatch`` tokens, one backward each.
  Each sample keeps the loss weight it had in stock's slice (see :mod:`hf_dynbsz.loss`).
* Every rank runs the same number of passes per optimizer step (all-reduce MAX + exact-k partition +
  zero-weight dummy passes), and gradients are synchronised once, on the last pass.
* No-grad log-prob passes (old policy, reference model) use the same packing with
  ``max_tokens_per_microbatch_logprob``.

TRL hooks overridden (each private hook is a place TRL can change under us):
* ``training_step``: collect the optimizer step's slices and run the repacked passes on its last call.
* ``_get_per_token_logps_and_entropies``: pack the no-grad passes (grad-enabled calls go to stock).
* ``_generate_single_turn``: generate in chunks of ``per_device_generation_batch_size`` (transformers path).
The per-token loss mirrors ``_compute_loss`` (:mod:`hf_dynbsz.loss`); the tests compare against stock TRL.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType
from transformers import TrainerCallback
from trl import GRPOTrainer
from trl.trainer.utils import nanmax, nanmin

from . import check_trl_version
from .config import DynamicBatchGRPOConfig, default_ddp_backend, ensure_dynamic_batch_fields
from .loss import LossSettings, per_token_policy_loss, sample_weights
from .packing import SequenceTable, build_microbatch, dummy_microbatch
from .partition import (
    OversizeSequenceError,
    WorkloadModel,
    microbatch_tokens,
    min_num_microbatches,
    partition_by_token_budget,
)
from .plan import BatchSizePlan, resolve_packing_layout
from .tiling import lm_head_tiles

logger = logging.getLogger("hf_dynbsz")
check_trl_version()

# Keys of TRL's generation output that carry multimodal inputs: those windows run stock's math.
MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_attention_mask",
    "image_sizes",
    "spatial_shapes",
    "num_tiles",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
# Per-token (rows, completion width) fields of TRL's generation output, carried per sample.
PER_TOKEN_KEYS = ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps")
PARTITIONER_LAYOUT = {"padding_free": "packed", "padded": "padded"}  # our layout name -> partitioner's


def _pad_columns(tensor: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    if tensor.size(1) >= width:
        return tensor[:, :width]
    pad = tensor.new_full((tensor.size(0), width - tensor.size(1)), value)
    return torch.cat([tensor, pad], dim=1)


class _LogPlanAtTrainBegin(TrainerCallback):
    """Logs the batch-size plan once, from the main process, when training starts."""

    def __init__(self, trainer: DynamicBatchGRPOTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._log_batch_size_plan()


class DynamicBatchGRPOTrainer(GRPOTrainer):
    """Drop-in replacement for :class:`trl.GRPOTrainer` with token-budget micro-batches.

    Accepts a :class:`~hf_dynbsz.DynamicBatchGRPOConfig` or a plain ``GRPOConfig`` (the new fields then
    take their defaults and ``DIFFU_*`` environment overrides still apply).
    """

    def __init__(self, model, reward_funcs, args=None, *positional, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = DynamicBatchGRPOConfig(output_dir=f"{name.split('/')[-1]}-GRPO")
        ensure_dynamic_batch_fields(args)
        _check_deepspeed_backend(args)
        super().__init__(model, reward_funcs, args, *positional, **kwargs)

        reasons = self._stock_fallback_reasons()
        self._dynbsz_enabled = bool(args.dynamic_batching) and not reasons
        if args.dynamic_batching and reasons:
            logger.warning("hf_dynbsz: dynamic batching is off, stock GRPOTrainer math runs because %s.", "; ".join(reasons))
        unwrapped = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        attn = getattr(unwrapped.config, "_attn_implementation", None)
        self._dynbsz_layout = resolve_packing_layout(args.packing_layout, attn)
        attention = "varlen" if self._dynbsz_layout == "padding_free" and "flash" in (attn or "") else "dense"
        self._dynbsz_attention = attention
        self._dynbsz_workload = WorkloadModel.from_model_config(
            unwrapped.config.get_text_config(), layout=PARTITIONER_LAYOUT[self._dynbsz_layout], attention=attention
        )
        self._dynbsz_loss_settings = LossSettings.from_trainer(self)
        self._dynbsz_window: list[dict] = []
        self._dynbsz_warned_oversize = False
        if self._dynbsz_enabled:
            logger.info("hf_dynbsz: layout %s (attention implementation %s).", self._dynbsz_layout, attn)
        if args.per_device_generation_batch_size is not None and (self.use_vllm or self.use_transformers_continuous_batching):
            logger.info(
                "hf_dynbsz: per_device_generation_batch_size=%s does not apply: vLLM / continuous batching schedule "
                "their own generation batches.", args.per_device_generation_batch_size,
            )
        self.add_callback(_LogPlanAtTrainBegin(self))

    # ------------------------------------------------------------------ setup helpers
    def _stock_fallback_reasons(self) -> list[str]:
        """Features whose stock math depends on the fixed slice in ways we do not reproduce (yet)."""
        reasons = []
        if self.aux_loss_enabled:
            reasons.append("the MoE router aux loss is computed per micro-batch")
        return reasons

    def _log_batch_size_plan(self) -> None:
        if not self.accelerator.is_main_process:
            return
        zero_stage = None
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is not None:
            zero_stage = plugin.zero_stage
        plan = BatchSizePlan.from_args(
            self.args,
            num_processes=self.accelerator.num_processes,
            zero_stage=zero_stage,
            mixed_precision=str(self.accelerator.mixed_precision),
            layout=self._dynbsz_layout if self._dynbsz_enabled else "stock (dynamic batching off)",
        )
        logger.warning("hf_dynbsz batch-size plan:\n%s", plan.render())

    # ------------------------------------------------------------------ collectives
    def _all_reduce_max(self, values: list[int]) -> list[int]:
        """Element-wise MAX over ranks (identity on one process). Every rank must call it equally often."""
        if self.accelerator.num_processes == 1 or not dist.is_initialized():
            return values
        tensor = torch.tensor(values, dtype=torch.long, device=self.accelerator.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.tolist()

    def _plan_passes(self, table: SequenceTable, budget: int) -> tuple[list[list[int]], int]:
        """Partition this rank's sequences into the number of passes every rank agrees on.

        Returns the micro-batches (index lists, empty ones are dummy passes) and how many this rank alone
        would have needed.
        """
        lengths = table.lengths.tolist()
        layout = PARTITIONER_LAYOUT[self._dynbsz_layout]
        pad = self.args.pad_to_multiple_of
        oversize = [length for length in lengths if microbatch_tokens([length], layout, pad) > budget]
        local_count = min_num_microbatches(lengths, budget, layout=layout, pad_to_multiple_of=pad) if lengths else 0
        count, any_oversize = self._all_reduce_max([local_count, int(bool(oversize))])
        if any_oversize and self.args.oversize_policy == "error":
            longest = max(oversize) if oversize else None
            where = f"a sequence of {longest} tokens" if longest else "a sequence on another rank"
            raise OversizeSequenceError(
                f"max_tokens_per_microbatch={budget} is smaller than {where} and oversize_policy='error': "
                f"raise max_tokens_per_microbatch (DIFFU_MAX_TOKENS) to at least the longest prompt+completion, "
                f"or set oversize_policy='warn' to give such sequences a micro-batch of their own."
            )
        if oversize and not self._dynbsz_warned_oversize:
            self._dynbsz_warned_oversize = True
            warnings.warn(
                f"hf_dynbsz: {len(oversize)} sequence(s) longer than the token budget ({budget} tokens; longest "
                f"{max(oversize)}) each get a micro-batch of their own. Raise max_tokens_per_microbatch to avoid "
                "larger-than-budget passes. This warning is shown once.",
                stacklevel=2,
            )
        groups = partition_by_token_budget(
            lengths,
            budget,
            num_microbatches=max(count, 1),
            layout=layout,
            pad_to_multiple_of=pad,
            workload=self._dynbsz_workload,
            attention=self._dynbsz_attention,
            oversize_policy="warn",
        )
        return groups, local_count

    # ------------------------------------------------------------------ forward
    def _tiles(self):
        """TRL's fused LM head tiled by ``tensor_batch_size`` (stock's own tile with dynamic_batching off)."""
        return lm_head_tiles(self.args.tensor_batch_size if self.args.dynamic_batching else None)

    def _forward_microbatch(self, model, mb, compute_entropy: bool):
        with self.accelerator.autocast():
            outputs = model(**mb.model_inputs, shift_labels=mb.shift_labels, fused_lm_head=True)
        logps = outputs.log_probs
        entropy = outputs.entropy if compute_entropy else None
        return outputs, logps, entropy

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        # Override: pack the no-grad log-prob passes (old policy, reference) by the log-prob token budget.
        if (
            not self._dynbsz_enabled
            or torch.is_grad_enabled()
            or compute_aux_loss
            or any(value is not None for value in multimodal.values())
        ):
            with self._tiles():
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                    **multimodal,
                )
        prompt_width = input_ids.size(1) - logits_to_keep
        table = SequenceTable.from_padded(
            input_ids[:, :prompt_width], attention_mask[:, :prompt_width],
            input_ids[:, prompt_width:], attention_mask[:, prompt_width:],
        )
        stock_rows = batch_size or input_ids.size(0)
        logps, entropies = self._packed_no_grad_pass(
            model, table, logits_to_keep, compute_entropy, stock_microbatch_tokens=stock_rows * input_ids.size(1)
        )
        return logps, entropies, None

    @torch.no_grad()
    def _packed_no_grad_pass(self, model, table: SequenceTable, width: int, compute_entropy: bool,
                             stock_microbatch_tokens: int):
        """Completion log-probs (and entropies) of every sequence of ``table``, ``(N, width)``, in table order."""
        budget = self.args.max_tokens_per_microbatch_logprob or 2 * (
            self.args.max_tokens_per_microbatch or stock_microbatch_tokens
        )
        groups, _ = self._plan_passes(table, budget)
        device = self.accelerator.device
        logps = torch.zeros(len(table), width, device=device)
        entropies = torch.zeros_like(logps) if compute_entropy else None
        for group in groups:
            if not group:
                with self._tiles():
                    self._forward_microbatch(model, dummy_microbatch(self._pad_id, device), False)
                continue
            mb = build_microbatch(table, group, layout=self._dynbsz_layout, pad_token_id=self._pad_id,
                                  pad_to_multiple_of=self.args.pad_to_multiple_of, device=device)
            with self._tiles():
                _, mb_logps, mb_entropy = self._forward_microbatch(model, mb, compute_entropy)
            mb_width = min(mb.gather_index.size(1), width)
            logps[group, :mb_width] = mb.to_completion_layout(mb_logps).float()[:, :mb_width]
            if compute_entropy:
                entropies[group, :mb_width] = mb.to_completion_layout(mb_entropy).float()[:, :mb_width]
        return logps, entropies

    @property
    def _pad_id(self) -> int:
        return self.pad_token_id if getattr(self, "pad_token_id", None) is not None else self._tokenizer.pad_token_id

    # ------------------------------------------------------------------ generation
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # Override: bound generation memory by generating this device's samples in chunks.
        chunk = self.args.per_device_generation_batch_size
        if (
            chunk is None
            or not self.args.dynamic_batching
            or len(prompt_ids) <= chunk
            or self.use_vllm
            or self.use_transformers_continuous_batching
            or images is not None
            or multimodal_fields
        ):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        completion_ids = []
        for start in range(0, len(prompt_ids), chunk):
            chunk_ids, _ = super()._generate_single_turn(
                prompt_ids[start : start + chunk], None, multimodal_fields, num_generations, has_tool_images
            )
            completion_ids.extend(chunk_ids)
        return completion_ids, None

    # ------------------------------------------------------------------ training
    def training_step(self, model, inputs, num_items_in_batch=None):
        # Override: gather the optimizer step's stock slices; run the repacked passes on its last call.
        if not self._dynbsz_enabled:
            with self._tiles():
                return super().training_step(model, inputs, num_items_in_batch)
        time_before = time.perf_counter()
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        self._dynbsz_window.append(self._prepare_inputs(inputs))
        if self.accelerator.sync_gradients:
            window, self._dynbsz_window = self._dynbsz_window, []
            loss = self._train_window(model, window)
        else:
            loss = torch.zeros((), device=self.accelerator.device)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - time_before
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss

    def _backward(self, model, loss, last: bool) -> None:
        """One backward of a multi-pass optimizer step; gradients sync (and DeepSpeed steps) on the last only."""
        kwargs = {}
        is_deepspeed = self.accelerator.distributed_type == DistributedType.DEEPSPEED
        if is_deepspeed:
            kwargs["scale_wrt_gas"] = False
        self.accelerator.gradient_state._set_sync_gradients(last)
        try:
            context = contextlib.nullcontext() if last or is_deepspeed else self.accelerator.no_sync(model)
            with context:
                self.accelerator.backward(loss, **kwargs)
        finally:
            self.accelerator.gradient_state._set_sync_gradients(True)

    def _train_window(self, model, window: list[dict]) -> torch.Tensor:
        if any(window[0].get(key) is not None for key in MULTIMODAL_KEYS):
            return self._train_window_stock(model, window)
        device = self.accelerator.device
        fields = self._collect_window(window)
        table: SequenceTable = fields["table"]
        loss_mask = fields["loss_mask"]
        high_entropy = self._high_entropy_mask(model, fields) if self.top_entropy_quantile < 1.0 else None
        # tokens the entropy bonus (and the adaptive controller) acts on, as in stock's `effective_mask`
        bonus_mask = loss_mask if high_entropy is None else loss_mask * high_entropy
        budget = self.args.max_tokens_per_microbatch or fields["stock_microbatch_tokens"]
        groups, needed = self._plan_passes(table, budget)

        settings = self._dynbsz_loss_settings
        ga = self.current_gradient_accumulation_steps
        policy_w, entropy_w = sample_weights(
            settings,
            fields["loss_tokens"],
            fields["slice_ids"],
            fields["slice_rows"],
            fields["num_items"],
            gradient_accumulation_steps=ga,
            steps_per_generation=self.args.steps_per_generation,
            num_processes=self.accelerator.num_processes,
            entropy_tokens=bonus_mask.sum(dim=1).cpu(),
        )
        policy_w, entropy_w = policy_w.to(device), entropy_w.to(device)
        entropy_coef = 0.0
        if self._entropy_bonus_enabled:  # stock: the coefficient from the end of the previous optimizer step
            adaptive_off = self.use_adaptive_entropy and self._last_world_entropy > self.args.entropy_target
            entropy_coef = 0.0 if adaptive_off else self.entropy_coef
        slice_ids = fields["slice_ids"].to(device)
        slice_policy_loss = torch.zeros(len(window), device=device, dtype=torch.float64)
        bonus_stats = torch.zeros(2, device=device, dtype=torch.float64)  # sum of entropy, tokens

        sums = defaultdict(float)  # metric name -> sum of values over tokens (or sequences)
        counts = defaultdict(float)
        seq_low, seq_high = [], []
        total_loss = torch.zeros((), device=device)
        real_tokens = computed_tokens = dummies = 0
        mb_tokens = []
        with self.compute_loss_context_manager(), self._tiles():
            for position, group in enumerate(groups):
                last = position == len(groups) - 1
                if not group:
                    dummies += 1
                    _, logps, _ = self._forward_microbatch(model, dummy_microbatch(self._pad_id, device), False)
                    self._backward(model, logps.sum() * 0.0, last)
                    continue
                mb = build_microbatch(table, group, layout=self._dynbsz_layout, pad_token_id=self._pad_id,
                                      pad_to_multiple_of=self.args.pad_to_multiple_of, device=device)
                real_tokens += mb.real_tokens
                computed_tokens += mb.computed_tokens
                mb_tokens.append(mb.real_tokens)
                _, logps_flat, entropy_flat = self._forward_microbatch(model, mb, True)
                per_token_logps = mb.to_completion_layout(logps_flat)
                entropies = mb.to_completion_layout(entropy_flat)
                width = per_token_logps.size(1)
                rows = torch.tensor(group, device=device)
                mask = loss_mask[rows, :width]
                per_token = {key: (t[rows, :width] if t.size(1) > 1 else t[rows]) for key, t in fields["per_token"].items()}
                advantages = fields["advantages"][rows]
                if advantages.dim() == 2:
                    advantages = advantages[:, :width]
                per_token_loss, metrics = per_token_policy_loss(
                    settings,
                    per_token_logps,
                    mask,
                    advantages,
                    per_token.get("old_per_token_logps"),
                    per_token.get("ref_per_token_logps"),
                    per_token.get("sampling_per_token_logps"),
                    per_token.get("importance_sampling_ratio"),
                    entropy_mask=None if high_entropy is None else high_entropy[rows, :width],
                )
                per_sample_loss = (per_token_loss * mask).sum(dim=1) * policy_w[rows].to(per_token_logps.dtype)
                loss = per_sample_loss.sum()
                if self._entropy_bonus_enabled:
                    bonus = bonus_mask[rows, :width].to(entropies.dtype)
                    bonus_stats += torch.stack([(entropies.detach() * bonus).sum(), bonus.sum()]).double()
                    if entropy_coef:
                        loss = loss - entropy_coef * (entropies * bonus * entropy_w[rows].to(entropies.dtype).unsqueeze(1)).sum()
                    slice_policy_loss.index_add_(0, slice_ids[rows], per_sample_loss.detach().double())
                self._backward(model, loss, last)
                total_loss += loss.detach()
                self._accumulate_metrics(sums, counts, seq_low, seq_high, metrics, entropies.detach(), mask)
        if self._entropy_bonus_enabled:
            self._update_entropy_bonus(slice_policy_loss, bonus_stats, ga)
        self._log_window_metrics(sums, counts, seq_low, seq_high, fields, groups, needed, budget,
                                 real_tokens, computed_tokens, dummies, mb_tokens)
        return total_loss

    def _high_entropy_mask(self, model, fields) -> torch.Tensor:
        """``top_entropy_quantile``: stock's per-slice high-entropy mask, from a packed no-grad entropy pass.

        Stock takes the entropy quantile over each fixed slice (gathered across ranks) before its backward, so
        the mask must be known before our first pass: one extra no-grad forward over the window provides the
        entropies, and TRL's own ``get_high_entropy_mask`` is applied slice by slice (same collectives on every
        rank: one gather per slice).
        """
        loss_mask = fields["loss_mask"]
        _, entropies = self._packed_no_grad_pass(
            model, fields["table"], loss_mask.size(1), True, stock_microbatch_tokens=fields["stock_microbatch_tokens"]
        )
        high_entropy = torch.zeros_like(loss_mask)
        slice_ids = fields["slice_ids"].to(loss_mask.device)
        for slice_id in range(len(fields["slice_rows"])):
            rows = (slice_ids == slice_id).nonzero().flatten()
            selected = self.get_high_entropy_mask(entropies[rows], loss_mask[rows], 1 - self.top_entropy_quantile)
            high_entropy[rows] = selected.to(loss_mask.dtype)
        return high_entropy

    def _update_entropy_bonus(self, slice_policy_loss, bonus_stats, ga) -> None:
        """Stock's entropy-bonus bookkeeping at the optimizer-step boundary: metrics and the adaptive controller."""
        metrics = self._metrics["train"]
        # stock logs, per slice, its policy loss (before the /GA of sequence-normalised types) averaged over ranks
        scale = 1.0 if self.loss_type in ("dapo", "cispo", "vespo") else float(ga)
        for value in self.accelerator.gather((slice_policy_loss * scale).float()).view(-1, len(slice_policy_loss)).nanmean(0):
            metrics["policy_loss"].append(value.item())
        if self.use_adaptive_entropy:
            totals = self.accelerator.reduce(bonus_stats, reduction="sum")
            world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
            if world_entropy <= self.args.entropy_target:
                self.entropy_coef = min(self.entropy_coef + self.args.entropy_coef_delta, self.args.entropy_coef_max)
            else:
                self.entropy_coef = max(self.entropy_coef - self.args.entropy_coef_delta, self.args.entropy_coef_min)
            self._last_world_entropy = world_entropy
        metrics["entropy_coef"].append(self.entropy_coef)

    def _train_window_stock(self, model, window: list[dict]) -> torch.Tensor:
        """Stock math for a window we cannot repack (multimodal inputs): one pass per stock slice."""
        if not getattr(self, "_dynbsz_warned_multimodal", False):
            self._dynbsz_warned_multimodal = True
            logger.warning("hf_dynbsz: multimodal inputs found; this run uses stock micro-batches (no repacking).")
        total = torch.zeros((), device=self.accelerator.device)
        for position, inputs in enumerate(window):
            with self.compute_loss_context_manager(), self._tiles():
                loss = self.compute_loss(model, inputs)
            self._backward(model, loss, position == len(window) - 1)
            total += loss.detach()
        return total

    def _collect_window(self, window: list[dict]) -> dict:
        """Flatten the window's stock slices into per-sample tables on this device."""
        width = max(inputs["completion_ids"].size(1) for inputs in window)
        tables, loss_masks, advantages, slice_ids, num_items = [], [], [], [], []
        per_token = defaultdict(list)
        stock_microbatch_tokens = stock_computed_tokens = 0  # tokens of one stock slice (max), of all slices
        keys = [key for key in (*PER_TOKEN_KEYS, "importance_sampling_ratio") if window[0].get(key) is not None]
        for slice_id, inputs in enumerate(window):
            rows = inputs["completion_ids"].size(0)
            tables.append(SequenceTable.from_padded(
                inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"]
            ))
            mask = inputs["completion_mask"]
            if inputs.get("tool_mask") is not None:
                mask = mask * inputs["tool_mask"]
            loss_masks.append(_pad_columns(mask, width, 0))
            adv = inputs["advantages"]
            advantages.append(_pad_columns(adv, width) if adv.dim() == 2 else adv)
            for key in keys:
                tensor = inputs[key]
                per_token[key].append(tensor if tensor.size(1) == 1 else _pad_columns(tensor, width))
            slice_ids.append(torch.full((rows,), slice_id, dtype=torch.long))
            num_items.append(inputs["num_items_in_batch"].detach().float().cpu().expand(rows))
            slice_tokens = rows * (inputs["prompt_ids"].size(1) + inputs["completion_ids"].size(1))
            stock_microbatch_tokens = max(stock_microbatch_tokens, slice_tokens)
            stock_computed_tokens += slice_tokens
        table = SequenceTable(
            tokens=[t for tab in tables for t in tab.tokens],
            prompt_lengths=torch.cat([tab.prompt_lengths for tab in tables]),
            completion_lengths=torch.cat([tab.completion_lengths for tab in tables]),
        )
        loss_mask = torch.cat(loss_masks)
        return {
            "table": table,
            "loss_mask": loss_mask,
            "loss_tokens": loss_mask.sum(dim=1).cpu(),
            "advantages": torch.cat(advantages),
            "per_token": {key: torch.cat(values) for key, values in per_token.items()},
            "slice_ids": torch.cat(slice_ids),
            "slice_rows": torch.tensor([inputs["completion_ids"].size(0) for inputs in window]),
            "num_items": torch.cat(num_items),
            "stock_microbatch_tokens": stock_microbatch_tokens,
            "stock_computed_tokens": stock_computed_tokens,
        }

    # ------------------------------------------------------------------ metrics
    @staticmethod
    def _accumulate_metrics(sums, counts, seq_low, seq_high, metrics, entropies, mask):
        mask = mask.float()
        tokens = mask.sum().item()

        def add(name, values):
            if values.size(1) == 1:  # one value per sequence (importance_sampling_level="sequence", vespo phi)
                sums[name] += values.detach().float().sum().item()
                counts[name] += float(values.size(0))
            else:
                sums[name] += (values.detach().float() * mask).sum().item()
                counts[name] += tokens

        add("entropy", entropies)
        for name in ("kl", "vespo/phi_seq_mean", "cispo_clip_ratio"):
            if name in metrics:
                add(name, metrics[name])
        if "clip_ratio/low" in metrics:
            low, high = metrics["clip_ratio/low"], metrics["clip_ratio/high"]
            add("clip_ratio/low_mean", low)
            add("clip_ratio/high_mean", high)
            add("clip_ratio/region_mean", torch.maximum(low, high))

            def seq_mean(x):
                return x.squeeze(1) if x.size(1) == 1 else (x * mask).sum(-1) / mask.sum(-1)

            seq_low.append(seq_mean(low))
            seq_high.append(seq_mean(high))

    def _log_window_metrics(self, sums, counts, seq_low, seq_high, fields, groups, needed, budget,
                            real_tokens, computed_tokens, dummies, mb_tokens) -> None:
        """Exact token-weighted metrics over the optimizer step: one reduce (and two gathers) per step."""
        device = self.accelerator.device
        names = sorted(sums)
        local = [v for name in names for v in (sums[name], counts[name])]
        local += [real_tokens, computed_tokens, fields["stock_computed_tokens"]]
        totals = self.accelerator.reduce(torch.tensor(local, dtype=torch.float64, device=device), reduction="sum")
        totals = totals.tolist()
        metrics = self._metrics["train"]
        for position, name in enumerate(names):
            metrics[name].append(totals[2 * position] / max(totals[2 * position + 1], 1.0))
        if seq_low or self.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            for name, values, pick in (("clip_ratio/low_min", seq_low, nanmin), ("clip_ratio/high_max", seq_high, nanmax)):
                local_values = torch.cat(values) if values else torch.zeros(0, device=device)
                padded = self.accelerator.pad_across_processes(local_values.float(), dim=0, pad_index=float("nan"))
                gathered = self.accelerator.gather(padded)
                metrics[name].append(pick(gathered).item() if gathered.numel() else float("nan"))
        real_all, computed_all, stock_all = totals[-3:]
        used = mb_tokens
        metrics["dynbsz/microbatches"].append(float(len(used)))
        metrics["dynbsz/microbatches_needed"].append(float(needed))
        metrics["dynbsz/microbatches_max_over_ranks"].append(float(len(groups)))
        metrics["dynbsz/dummy_passes"].append(float(dummies))
        metrics["dynbsz/tokens_per_microbatch_mean"].append(sum(used) / max(len(used), 1))
        metrics["dynbsz/tokens_per_microbatch_max"].append(float(max(used, default=0)))
        metrics["dynbsz/budget_tokens"].append(float(budget))
        metrics["dynbsz/budget_utilization"].append(sum(used) / max(len(used) * budget, 1))
        metrics["dynbsz/padding_fraction"].append((computed_all - real_all) / max(computed_all, 1.0))
        metrics["dynbsz/computed_tokens"].append(computed_all)
        metrics["dynbsz/stock_computed_tokens"].append(stock_all)


def _check_deepspeed_backend(args) -> None:
    """DeepSpeed on CPU needs ``ddp_backend='gloo'`` set before the config builds its device state."""
    import os

    if default_ddp_backend(args.ddp_backend) != args.ddp_backend and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "DeepSpeed without a GPU needs ddp_backend='gloo' (ddp_backend=None now): stock TRL then fails with "
            "'train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size'. Use "
            "hf_dynbsz.DynamicBatchGRPOConfig (sets it for you) or pass ddp_backend='gloo'."
        )

"""``DynamicBatchAsyncGRPOTrainer``: TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``) with its optimizer
step packed into token-budget passes by the plugin's planner.

Stock's rollout worker, queue, staleness filter, weight sync, epoch stop and metrics stay stock's. Three things change.

The step is set by ``async_step``. With ``"stock"`` (the default) it is stock's own step: stock's ``TokenBudgetBatcher``
(when ``token_budget > 0``) or ``FixedCountBatcher`` runs over the queue, and ``gradient_accumulation_steps``
micro-batches make a step. With ``"samples"`` a step is ``per_device_train_batch_size x gradient_accumulation_steps x
processes`` samples, taken as stock's fixed-count mode takes them. Either way the step's micro-batches are joined into
one :class:`~hf_dynbsz.execution.batch.StepBatch` (:mod:`hf_dynbsz.execution.rollouts`), and the pass executor runs it
with everything it runs for the other trainers: token-budget passes, the prefix tree, cross-rank balancing, memory
budgets and out-of-memory recovery, on the model's own attention kernel instead of FlashAttention-3 only.

The loss is stock's clipped token loss (:mod:`hf_dynbsz.execution.async_loss`), each token weighted as stock weighs it
(the samples step: by the whole step's trained tokens).

The model loads with ``model_init_kwargs["attn_implementation"]`` (transformers' default when unset), not stock's FA3
tree kernel; stock's refusals of state-carrying layers and attention sinks do not apply (segment recurrence and sinks
run them exactly).

With ``dynamic_batching=False`` the trainer is stock's. Every TRL name this module touches is listed in
:mod:`hf_dynbsz._trl_compat`; the functions of stock's module replaced while its constructor runs are in
:mod:`hf_dynbsz.trainers.async_stock_patches`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import (
    FixedCountBatcher,
    RolloutQueueDataset,
    TokenBudgetBatcher,
    _EmptyIterableDataset,
)

from hf_dynbsz.configs.async_grpo import DynamicBatchAsyncGRPOConfig, async_trainer_config, samples_step
from hf_dynbsz.execution.async_loss import AsyncGRPOLoss
from hf_dynbsz.execution.metrics import StepResult
from hf_dynbsz.execution.rollouts import RolloutSliceCollator, rollout_step_batch
from hf_dynbsz.trainers.async_stock_patches import stock_construction, stock_throughput_blocker
from hf_dynbsz.trainers.hooks import TokenBudgetHooks

__all__ = ["DynamicBatchAsyncGRPOTrainer"]

logger = logging.getLogger("hf_dynbsz")


class DynamicBatchAsyncGRPOTrainer(
    TokenBudgetHooks, AsyncGRPOTrainer, config=DynamicBatchAsyncGRPOConfig, loss=AsyncGRPOLoss, algorithm="AsyncGRPO"
):
    """Drop-in replacement for TRL's ``AsyncGRPOTrainer``: stock's optimizer step (``async_step="stock"``, the default)
    or one defined by samples (``"samples"``), in token-budget passes (``rollout_worker`` and ``weight_transfer``
    taken as stock takes them)."""

    _dynbsz_refuses_small_datasets = False  # the rollout worker generates from the dataset continuously
    _dynbsz_trainer_name = "async_grpo"  # the plan's trainer (hf-dynbsz plan --trainer async_grpo)
    _dynbsz_dynamic = False  # dynamic_batching of the run (set from the config before stock's constructor)
    _dynbsz_attention: str | None = None  # the attention implementation the model loads with (None: transformers')
    _dynbsz_flop_tokens = 0.0  # tokens of the last step's passes, per process, for the Trainer's FLOP count
    _dynbsz_stock_throughput: str | None = None  # why stock's throughput figures cannot be computed (None: they can)

    # ------------------------------------------------------------------ construction
    def _dynbsz_config(self, args, model):
        """The run's config; the attention implementation the model loads with taken out of ``model_init_kwargs``
        (stock passes its own beside them)."""
        config = async_trainer_config(args, model)
        init_kwargs = config.model_init_kwargs if isinstance(config.model_init_kwargs, dict) else {}
        if config.dynamic_batching and "attn_implementation" in init_kwargs:
            config._dynbsz_attn_implementation = init_kwargs.pop("attn_implementation")
        self._dynbsz_dynamic = bool(config.dynamic_batching)
        self._dynbsz_attention = getattr(config, "_dynbsz_attn_implementation", None)
        return config

    def _dynbsz_construction(self):
        """The context stock's constructor runs in (:func:`~hf_dynbsz.trainers.async_stock_patches.stock_construction`:
        with dynamic batching, the model on the run's kernel and stock's refusals blind to what the plugin runs)."""
        if not self._dynbsz_dynamic:
            return contextlib.nullcontext()
        return stock_construction(self._dynbsz_attention)

    def _dynbsz_start(self) -> None:
        if self._dynbsz_dynamic and self.aux_loss_enabled and self.accelerator.num_processes > 1:
            self._dynbsz_keep_samples_home()
        super()._dynbsz_start()
        if not self._dynbsz_dynamic:
            return
        if not self._dynbsz.enabled:
            raise ValueError(
                "DynamicBatchAsyncGRPOTrainer cannot repack this model (the reasons are logged above) and has no "
                "stock fallback on the plugin's kernels: set dynamic_batching=False for stock AsyncGRPOTrainer "
                "(FlashAttention-3 tree attention)."
            )
        if samples_step(self.args):
            self._dynbsz_say_samples_step()
        self._dynbsz_stock_throughput = stock_throughput_blocker(self.model.config.get_text_config())
        if self._dynbsz_stock_throughput is not None:
            logger.warning(
                "hf_dynbsz: stock's perf/*_tok_s and MFU figures are not logged for this model: TRL's "
                "compute_flops_per_token cannot read its config (%s); dynbsz/tokens_per_second is.",
                self._dynbsz_stock_throughput,
            )

    def _dynbsz_say_samples_step(self) -> None:
        """Once, at start: what the opt-in samples-defined step (``async_step="samples"``) changes from stock."""
        args = self.args
        samples = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.accelerator.num_processes
        logger.warning(
            "hf_dynbsz: async_step='samples': each optimizer step trains per_device_train_batch_size x "
            "gradient_accumulation_steps x processes = %d samples normalised by the step's trained tokens, which "
            "differs from stock AsyncGRPOTrainer at this config (token_budget=%s; stock normalises each micro-batch "
            "by its own tokens, and with token_budget > 0 its budget decides the samples and drops longer ones); "
            "token_budget is the plugin's tokens per pass here. async_step='stock' (the default) trains stock's step.",
            samples,
            args.token_budget,
        )

    def _dynbsz_keep_samples_home(self) -> None:
        """An MoE model's router aux loss over an asynchronous step counts a position the process's samples share
        once, as stock's packed row does (:func:`~hf_dynbsz.execution.async_loss.position_shares`): each sample then
        trains on the process stock's planner dispatched it to (its attention-cost balancing stays), and the plugin's
        cross-rank balancing is not applied (one logged reason)."""
        if self.args.balance_across_ranks:
            self.args.balance_across_ranks = False
            logger.warning(
                "hf_dynbsz: balance_across_ranks is not applied: an MoE model's router aux loss counts a position the "
                "samples of a process share once (stock's packed row), so each sample trains on the process stock's "
                "fixed-count planner dispatched it to."
            )

    # ------------------------------------------------------------------ the samples of a step
    def get_train_dataloader(self) -> DataLoader:
        # Override: stock's queue and batchers, each micro-batch sent to the processes as per-sample rows (the plugin
        # packs them): stock's step (async_step="stock") through the batcher stock picks at this config, the plugin's
        # samples-defined step through stock's fixed-count batcher.
        if not self._dynbsz_dynamic:
            return super().get_train_dataloader()
        processes = self.accelerator.num_processes
        dataset: IterableDataset = _EmptyIterableDataset()  # (never read: the dispatcher sends the main's)
        if self.accelerator.is_main_process:
            source = RolloutQueueDataset(
                rollout_queue=self.rollout_queue,
                model_version_fn=lambda: self.model_version,
                check_health_fn=self.rollout_worker.check_health,
                stale_after_s=self.args.heartbeat_stale_after_s,
                metrics=self._metrics["train"],
                max_staleness=self.args.max_staleness,
                report_to=self.args.report_to,
            )
            self._rollout_dataset = source  # (stock's _log_step_metrics flushes its queue wait)
            dataset = self._batcher(source, processes)
        collator = RolloutSliceCollator(
            self.processing_class.pad_token_id,
            processes,
            groups_trained=self._trained_groups,
            metrics=self._metrics["train"],
            token_budget=self._stock_token_budget(),
        )
        return self.accelerator.prepare(DataLoader(dataset, batch_size=1, collate_fn=collator, num_workers=0))

    def _batcher(self, source: RolloutQueueDataset, processes: int) -> IterableDataset:
        """Stock's planner over the queue: its ``TokenBudgetBatcher`` for stock's step with ``token_budget > 0`` (an
        unset budget asks the vLLM server for ``max_model_len``, as stock does), else its ``FixedCountBatcher``."""
        if not samples_step(self.args) and self.args.token_budget is None:
            self.vllm_client.wait_for_server_ready()
            self.args.token_budget = self.vllm_client.get_max_model_len()
            logger.info("token_budget unset; defaulting to vLLM max_model_len=%d", self.args.token_budget)
        budget = self._stock_token_budget()
        if budget:
            return TokenBudgetBatcher(source, processes, budget, self._metrics["train"])
        return FixedCountBatcher(source, processes, self.args.per_device_train_batch_size * processes)

    def _stock_token_budget(self) -> int:
        """The budget of stock's ``TokenBudgetBatcher`` that decides the step's samples, 0 for a fixed count (always for
        the samples-defined step, where ``token_budget`` is the plugin's pass budget)."""
        if samples_step(self.args):
            return 0
        return max(self.args.token_budget or 0, 0)

    # ------------------------------------------------------------------ the step
    def training_step(self, model, inputs, num_items_in_batch):
        # Override: collect the optimizer step's slices; run the step's passes on its last call.
        if not self._dynbsz_dynamic:
            return super().training_step(model, inputs, num_items_in_batch)
        started = time.perf_counter()
        loss = self._dynbsz_window_call(model, inputs)
        self._current_train_step_time += time.perf_counter() - started
        return loss

    def _dynbsz_collect(self, inputs) -> dict:
        return inputs  # per-sample rows, already on the device (the queue waits in the dataloader)

    def _train_window(self, model, window: list[dict]) -> torch.Tensor:
        """One optimizer step from its slices: the step's samples through the pass executor."""
        executor, accelerator = self._dynbsz, self.accelerator
        batch = rollout_step_batch(
            window, accelerator.process_index, accelerator.num_processes, stock_slices=not samples_step(self.args)
        )
        if not executor.self_check(model, batch.table):
            raise RuntimeError(
                "DynamicBatchAsyncGRPOTrainer: no layout passed the self-check on this model (the log above says "
                "why), and the asynchronous trainer has no stock fallback on the plugin's kernels: set "
                "dynamic_batching=False for stock AsyncGRPOTrainer (FlashAttention-3 tree attention)."
            )
        result = executor.train_step(model, batch)
        self._account_step(window, result)
        return result.loss

    def _account_step(self, window: list[dict], result: StepResult) -> None:
        """Stock's step accounting (its ``batch/*_per_step`` and ``perf/*`` figures) as stock adds it up for the same
        micro-batches (``window``): forwarded and trained tokens, mean sequence length, samples, micro-batches; no
        forward time (``perf/fwd_s`` is not logged). ``result``: the Trainer's FLOP count."""
        for inputs in window:
            forwarded, mean_seq_len = float(inputs["global_forwarded_tokens"][0]), float(inputs["mean_seq_len"][0])
            self._step_forward_tokens += forwarded
            self._step_trained_tokens += float(inputs["global_trained_tokens"][0])
            self._step_seq_len_weighted += mean_seq_len * forwarded
            self._step_samples += forwarded / mean_seq_len
        self._step_microbatches += len(window)
        self._dynbsz_flop_tokens = result.computed_tokens / self.accelerator.num_processes

    def _log_step_metrics(self) -> None:
        # Override (stock's per-step flush of _account_step's figures): less perf/fwd_s (forward-only time; the passes'
        # is dynbsz/train_seconds), no throughput or MFU figures where TRL cannot read the model's FLOPs per token.
        if not self._dynbsz_dynamic:
            return super()._log_step_metrics()
        metrics, forwarded = self._metrics["train"], self._step_forward_tokens
        if self._dynbsz_stock_throughput is not None:
            self._step_forward_tokens = 0.0  # (stock derives those figures when it counted forwarded tokens)
        super()._log_step_metrics()
        metrics["batch/forwarded_tokens_per_step"][-1] = forwarded
        del metrics["perf/fwd_s"][-1]
        if not metrics["perf/fwd_s"]:
            del metrics["perf/fwd_s"]  # (an empty list would be logged as None)

    def floating_point_ops(self, inputs: dict[str, torch.Tensor | Any]) -> int:
        # Override (transformers' Trainer): the tokens the step's passes computed, counted on the step's last call
        # (summed over processes by store_flos), not the sizes of the per-sample rows the processes receive.
        if not self._dynbsz_dynamic:
            return super().floating_point_ops(inputs)
        tokens, self._dynbsz_flop_tokens = round(self._dynbsz_flop_tokens), 0.0
        if not tokens:
            return 0
        return super().floating_point_ops({self.model.main_input_name: torch.empty(tokens, dtype=torch.bool)})

"""``DynamicBatchAsyncGRPOTrainer``: TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``) with its optimizer
step packed into token-budget passes by the plugin's planner: stock's step at the user's config by default, or
(opt-in) a step defined by samples.

Stock's rollout worker, queue, staleness filter, weight sync, epoch stop and metrics stay stock's. What changes:

* the step (``async_step``): ``"stock"`` (the default) is stock's own, its ``TokenBudgetBatcher`` (``token_budget > 0``:
  the samples that fit the budget, longer ones dropped with stock's warning and counter) or ``FixedCountBatcher``
  (``per_device_train_batch_size x processes`` samples per micro-batch) run over the queue,
  ``gradient_accumulation_steps`` micro-batches per step; ``"samples"`` is ``per_device_train_batch_size x
  gradient_accumulation_steps x processes`` samples taken as stock's fixed-count mode takes them. Either way the step's
  micro-batches (each process's row of each) are collected into one :class:`~hf_dynbsz.execution.batch.StepBatch`
  (:mod:`hf_dynbsz.execution.rollouts`) and run by the pass executor: token-budget passes sized by
  ``max_tokens_per_microbatch`` or memory (``token_budget`` for the samples step), the prefix tree (a group's prompt, a
  tool block common to every prompt, a forked conversation's shared history), cross-rank balancing, lockstep pass
  counts, memory budgets and out-of-memory recovery, on the model's own attention kernel (sdpa, eager, flex, flash,
  torch's ``varlen_attn``) instead of FlashAttention-3 only;
* the loss: stock's clipped token loss (:mod:`hf_dynbsz.execution.async_loss`), each token weighted
  ``1 / (its micro-batch's trained tokens over all processes) / gradient_accumulation_steps`` as stock weighs it
  (a weight of the micro-batch, not of the process: samples move between processes freely); the samples step
  normalises by the step's trained tokens (stock's fixed-count mode with the step in one micro-batch, however the
  step is written: ``16 x 1`` or ``8 x 2``);
* the model loads with the attention implementation of ``model_init_kwargs["attn_implementation"]`` (transformers'
  default when unset), not stock's FA3 tree kernel, and stock's refusals of state-carrying layers and attention sinks
  do not apply: segment recurrence and the kernels' sinks run them exactly (:mod:`hf_dynbsz.planning.model_support`).

With ``dynamic_batching=False`` the trainer is stock's: FA3 tree attention, stock's batchers and ``compute_loss``.

TRL names this module touches (all in :mod:`hf_dynbsz._trl_compat`): ``__init__`` through
:func:`~hf_dynbsz.trainers.hooks.stock_constructor` (stock's signature), with three functions of stock's module replaced
while stock's constructor runs (:mod:`hf_dynbsz.trainers.async_stock_patches`: ``create_model_from_path``,
``add_fused_lm_head``, ``get_peak_flops_per_device``); ``get_train_dataloader`` and ``training_step`` (overridden);
stock's ``RolloutQueueDataset``, ``FixedCountBatcher``, ``TokenBudgetBatcher`` and ``DataCollatorForRollout`` (its
``_log_metrics``: stock's sample and packing metrics of each micro-batch); the trainer's ``_metrics``,
``_trained_groups``, ``_rollout_dataset``, ``vllm_client`` (an unset ``token_budget``, as stock asks it) and the step
accounting ``_log_step_metrics`` reads (``_step_forward_tokens`` and its kin).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo.async_grpo_trainer import (
    DataCollatorForRollout,
    FixedCountBatcher,
    RolloutQueueDataset,
    TokenBudgetBatcher,
)

from hf_dynbsz.configs.async_grpo import DynamicBatchAsyncGRPOConfig, async_trainer_config, samples_step
from hf_dynbsz.execution.async_loss import AsyncGRPOLoss
from hf_dynbsz.execution.rollouts import rollout_step_batch, slice_tensors
from hf_dynbsz.trainers.async_stock_patches import stock_construction, stock_throughput_blocker
from hf_dynbsz.trainers.hooks import TokenBudgetHooks, stock_constructor

__all__ = ["DynamicBatchAsyncGRPOTrainer"]

logger = logging.getLogger("hf_dynbsz")


class DynamicBatchAsyncGRPOTrainer(TokenBudgetHooks, AsyncGRPOTrainer):
    """Drop-in replacement for TRL's ``AsyncGRPOTrainer``: stock's optimizer step (``async_step="stock"``, the default)
    or one defined by samples (``"samples"``), in token-budget passes.

    Takes exactly stock's constructor arguments (``rollout_worker`` and ``weight_transfer`` included). Accepts a
    :class:`~hf_dynbsz.DynamicBatchAsyncGRPOConfig` or a plain ``AsyncGRPOConfig`` (the plugin's fields then take
    their defaults and ``DIFFU_*`` environment overrides still apply).
    """

    _dynbsz_config_class = DynamicBatchAsyncGRPOConfig
    _dynbsz_loss_class = AsyncGRPOLoss
    _dynbsz_algorithm = "AsyncGRPO"
    _dynbsz_trainer_name = "async_grpo"  # the plan's trainer (hf-dynbsz plan --trainer async_grpo)
    _dynbsz_dynamic = False  # dynamic_batching of the run (set from the config before stock's constructor)
    _dynbsz_attention: str | None = None  # the attention implementation the model loads with (None: transformers')
    _dynbsz_flop_tokens = 0.0  # tokens of the last step's passes, per process, for the Trainer's FLOP count
    _dynbsz_stock_throughput: str | None = None  # why stock's throughput figures cannot be computed (None: they can)

    __init__ = stock_constructor(AsyncGRPOTrainer)

    # ------------------------------------------------------------------ construction
    def _dynbsz_arguments(self, stock_init: inspect.Signature, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Stock's constructor arguments with the plugin's config; the attention implementation the model loads with
        taken out of ``model_init_kwargs`` (stock passes its own beside them)."""
        try:
            bound = stock_init.bind(self, *args, **kwargs)
        except TypeError:
            return args, kwargs  # a call stock does not accept: stock's own __init__ raises its TypeError
        config = async_trainer_config(bound.arguments.get("args"), bound.arguments["model"])
        bound.arguments["args"] = config
        init_kwargs = config.model_init_kwargs if isinstance(config.model_init_kwargs, dict) else {}
        if config.dynamic_batching and "attn_implementation" in init_kwargs:
            config._dynbsz_attn_implementation = init_kwargs.pop("attn_implementation")
        self._dynbsz_dynamic = bool(config.dynamic_batching)
        self._dynbsz_attention = getattr(config, "_dynbsz_attn_implementation", None)
        return bound.args[1:], bound.kwargs

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
        dataset: IterableDataset = _NoSamples()
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
        collator = _RolloutSliceCollator(
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
        self._dynbsz_training_call(model)
        self._dynbsz_window.append(inputs)
        loss = torch.zeros((), device=self.accelerator.device)
        if self.accelerator.sync_gradients:
            window, self._dynbsz_window = self._dynbsz_window, []
            loss = self._train_rollouts(model, window)
        self._current_train_step_time += time.perf_counter() - started
        return loss

    def _train_rollouts(self, model, window: list[dict]) -> torch.Tensor:
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
        loss = executor.train_step(model, batch)
        self._account_step(window)
        return loss

    def _account_step(self, window: list[dict]) -> None:
        """Stock's step accounting, which its ``_log_step_metrics`` turns into ``perf/*`` and ``batch/*`` figures,
        for the step the passes ran: tokens computed (over all processes), trained tokens, samples, passes, and the
        passes' time as the forward time."""
        store = self._metrics["train"]
        computed = float(store["dynbsz/computed_tokens"][-1])
        samples = sum(float(inputs["global_samples"][0]) for inputs in window)
        sequence_tokens = sum(float(inputs["global_sequence_tokens"][0]) for inputs in window)
        if self._dynbsz_stock_throughput is None:  # (stock's step metrics read the model's FLOPs per token off it)
            self._step_forward_tokens += computed
        self._step_trained_tokens += sum(float(inputs["global_trained_tokens"][0]) for inputs in window)
        self._step_samples += samples
        self._step_seq_len_weighted += sequence_tokens / max(samples, 1.0) * computed
        self._step_forward_s += float(store["dynbsz/train_seconds"][-1])
        self._step_microbatches += int(store["dynbsz/microbatches_max_over_ranks"][-1])
        self._dynbsz_flop_tokens = computed / self.accelerator.num_processes

    def floating_point_ops(self, inputs: dict[str, torch.Tensor | Any]) -> int:
        # Override (transformers' Trainer): the tokens the step's passes computed, counted on the step's last call
        # (summed over processes by store_flos), not the sizes of the per-sample rows the processes receive.
        if not self._dynbsz_dynamic:
            return super().floating_point_ops(inputs)
        tokens, self._dynbsz_flop_tokens = round(self._dynbsz_flop_tokens), 0.0
        if not tokens:
            return 0
        return super().floating_point_ops({self.model.main_input_name: torch.empty(tokens, dtype=torch.bool)})


class _NoSamples(IterableDataset):
    """The dataset of the processes other than the main one: accelerate's dispatcher sends them the main process's
    micro-batches, so it is never read."""

    def __iter__(self):
        return iter(())


@dataclasses.dataclass
class _RolloutSliceCollator(DataCollatorForRollout):
    """Stock's collator with the plugin's output: a micro-batch of stock's fixed-count batcher (one row of samples per
    process) as per-sample rows (:func:`~hf_dynbsz.execution.rollouts.slice_tensors`) with the micro-batch's sample
    count and tokens over all processes; stock's bookkeeping kept (the prompt groups trained, for the epoch stop, and
    the micro-batch's sample and packing metrics, ``_log_metrics``)."""

    def torch_call(self, examples):
        (rows,) = examples
        samples = [row.samples for row in rows]
        tensors = slice_tensors(samples, self.pad_token_id, [len(row.tokens) for row in rows])
        every = [sample for row in samples for sample in row]
        self.groups_trained.update(sample["group_id"] for sample in every)
        width = tensors["input_ids"].size(1)
        padded = (torch.arange(width).unsqueeze(0) < tensors["lengths"].unsqueeze(1)).long()
        self._log_metrics(rows=rows, all_examples=every, padded=padded)
        return tensors

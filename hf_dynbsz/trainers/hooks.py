"""TRL's hooks over the pass executor, shared by every trainer of the plugin (one module per trainer beside this one).

A trainer is TRL's class with these hooks placed before it (``class DynamicBatchGRPOTrainer(LogProbHooks,
GRPOTrainer)``), naming its config class, its loss (:mod:`hf_dynbsz.execution.step_loss`) and its algorithm, with its
constructor from :func:`stock_constructor`. An optimizer step consumes exactly stock's samples (stock's
``_prepare_inputs`` still generates, scores, shuffles and slices them). Instead of one forward/backward per fixed slice,
the hooks collect the step's slices into a :class:`~hf_dynbsz.execution.batch.StepBatch` and hand it to the pass
executor (:mod:`hf_dynbsz.execution.executor`), which plans and runs the step's passes with stock's per-sample loss
weights. Everything a run decides at start is decided once, in :func:`hf_dynbsz.execution.setup.build_executor`.

TRL hooks overridden here, and why (a trainer's module lists its own):

* ``__init__`` (:func:`stock_constructor`): stock's signature; the config gains the plugin's fields, and a dataset too
  small is refused early.
* ``training_step``: collect the optimizer step's stock slices; run the step's passes on its last call.
* ``_get_per_token_logps_and_entropies`` (:class:`LogProbHooks`: GRPO, RLOO): run no-grad log-prob passes by the
  schedule (grad calls go to stock).
* ``store_flos`` (transformers' ``Trainer``): the FLOP count's gather, the last collective of ``train()``, through the
  plugin's collectives (:mod:`hf_dynbsz.parallel.collectives`). transformers' drops the gathered tensors at once, and a
  gloo worker thread freeing them while a script that returned after ``train()`` finalized aborted the process.

Every other internal name of TRL, transformers or accelerate the plugin touches is listed, with its reason, in
:mod:`hf_dynbsz._trl_compat`.
"""

from __future__ import annotations

import contextlib
import inspect
import time

import torch
from transformers import TrainerCallback
from transformers.training_args import ParallelMode

from hf_dynbsz.configs.build import trainer_config
from hf_dynbsz.execution.batch import StepBatch
from hf_dynbsz.execution.multimodal import split_media
from hf_dynbsz.execution.packing import SequenceTable
from hf_dynbsz.execution.setup import build_executor, log_batch_size_plan
from hf_dynbsz.parallel.collectives import destroy_process_group_at_exit, gather_values
from hf_dynbsz.planning.validation import validate_train_dataset_size

#: Why an image step trains stock's micro-batches (logged once).
IMAGE_STEPS = "image inputs of a model family not repacked: its image steps use stock micro-batches"


def stock_constructor(stock_class: type):
    """The ``__init__`` of a trainer over TRL's ``stock_class``: stock's signature (``inspect`` reports it), the
    plugin's config fields filled in before TRL reads them, then the executor built after TRL's constructor."""
    stock_init = inspect.signature(stock_class.__init__)

    def __init__(self, *args, **kwargs):
        # Override: stock's arguments, with the plugin's config fields filled in before TRL reads them.
        args, kwargs = self._dynbsz_arguments(stock_init, args, kwargs)
        with self._dynbsz_construction():
            super(TokenBudgetHooks, self).__init__(*args, **kwargs)  # the next class after the hooks: TRL's trainer
        self._dynbsz_start()

    __init__.__signature__ = stock_init
    return __init__


class TokenBudgetHooks:
    """TRL's hooks over the pass executor, shared by the trainers (placed before TRL's trainer class:
    ``class DynamicBatchDistillationTrainer(TokenBudgetHooks, DistillationTrainer)``). A trainer class names its config
    class, loss and algorithm, and takes its constructor from :func:`stock_constructor`."""

    _dynbsz_config_class: type
    _dynbsz_loss_class: type
    _dynbsz_algorithm: str  # stock's default output directory is <model>-<algorithm>
    #: whether a dataset too small for one generation round is refused (a DPO run has none: stock trains any size)
    _dynbsz_refuses_small_datasets = True

    def _dynbsz_arguments(self, stock_init: inspect.Signature, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Stock's constructor arguments, with the plugin's config fields filled in before TRL reads them."""
        try:
            bound = stock_init.bind(self, *args, **kwargs)
        except TypeError:
            return args, kwargs  # a call stock does not accept: stock's own __init__ raises its TypeError
        bound.arguments["args"] = trainer_config(
            bound.arguments.get("args"), bound.arguments["model"], self._dynbsz_config_class, self._dynbsz_algorithm
        )
        if self._dynbsz_refuses_small_datasets and hasattr(bound.arguments.get("train_dataset"), "__len__"):
            validate_train_dataset_size(len(bound.arguments["train_dataset"]), bound.arguments["args"])
        return bound.args[1:], bound.kwargs

    def _dynbsz_construction(self):
        """Around TRL's constructor (a trainer's own: the asynchronous trainer loads its model there); nothing here."""
        return contextlib.nullcontext()

    def _dynbsz_start(self) -> None:
        """After TRL's constructor: the executor with the trainer's loss, and the plan logged at the first step."""
        self._dynbsz = build_executor(self, self._dynbsz_loss_class)
        self._dynbsz_window: list[dict] = []  # the optimizer step's stock slices, collected call by call
        self.add_callback(_LogPlanAtTrainBegin(self))
        destroy_process_group_at_exit()  # a script without trainer.end() must exit cleanly (final barrier, holds)

    def training_step(self, model, inputs, num_items_in_batch):
        # Override: collect the optimizer step's stock slices; run the step's passes on its last call.
        executor = self._dynbsz
        if not executor.enabled and not self._dynbsz_window:  # (a window begun before the run turned to stock math
            with executor.tiles():  # ends on this path: _train_window runs its slices as stock's)
                return super().training_step(model, inputs, num_items_in_batch)
        time_before = time.perf_counter()
        self._dynbsz_training_call(model)
        with executor.meters.clock.phase("generation"):  # TRL's rollout (generation every steps_per_generation)
            self._dynbsz_window.append(self._prepare_inputs(inputs))
        loss = torch.zeros((), device=self.accelerator.device)
        if self.accelerator.sync_gradients:
            window, self._dynbsz_window = self._dynbsz_window, []
            loss = self._train_window(model, window)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - time_before
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss

    def _dynbsz_training_call(self, model) -> None:
        """The start of each training call, as stock's ``training_step`` starts (the model and a schedule-free
        optimizer in training mode), and of each optimizer step, the step's meters."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        if not self._dynbsz_window:
            self._dynbsz.meters.start()

    def _train_window(self, model, window: list[dict]) -> torch.Tensor:
        """One optimizer step from its stock slices: repacked, or stock's slices where the run cannot repack them."""
        executor, accelerator = self._dynbsz, self.accelerator
        if executor.media.stock(*window):
            return executor.train_step_stock(model, window, IMAGE_STEPS)
        long_rope = executor.capabilities.support.long_rope
        batch = StepBatch.from_slices(window, accelerator.process_index, accelerator.num_processes, long_rope)
        if executor.self_check(model, batch.table):
            return executor.train_step(model, batch)
        return executor.train_step_stock(model, window)  # (the self-check's log line says why)

    def store_flos(self) -> None:
        # Override: transformers' sum of every process's FLOP count (distributed_broadcast_scalars: an all-gather of
        # float32 scalars, summed), through the plugin's collectives, which hold the tensors (see the module).
        if self.args.parallel_mode != ParallelMode.DISTRIBUTED:
            return super().store_flos()
        flos = torch.tensor([self.current_flos], device=self.args.device)
        self.state.total_flos += torch.cat(gather_values(flos)).sum().item()
        self.current_flos = 0

    def _generation_chunks(self, prompt_ids, images, multimodal_fields) -> list | None:
        """This device's prompts in chunks of ``per_device_generation_batch_size``, or None where generation runs as
        stock's (no chunk size, fewer prompts, vLLM or continuous batching, images)."""
        chunk = self.args.per_device_generation_batch_size
        if (
            chunk is None
            or not self.args.dynamic_batching
            or len(prompt_ids) <= chunk
            or self.use_vllm
            or getattr(self, "use_transformers_continuous_batching", False)  # (a distillation has none)
            or images is not None
            or multimodal_fields
        ):
            return None
        return [prompt_ids[start : start + chunk] for start in range(0, len(prompt_ids), chunk)]


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


class _LogPlanAtTrainBegin(TrainerCallback):
    """Logs the batch-size plan once, from the main process, when training starts."""

    def __init__(self, trainer: TokenBudgetHooks):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        log_batch_size_plan(self.trainer, self.trainer._dynbsz)

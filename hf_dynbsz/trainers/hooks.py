"""TRL's hooks over the pass executor, shared by every trainer of the plugin (one module per trainer beside this one).

A trainer is TRL's class with these hooks placed before it (``class DynamicBatchDPOTrainer(TokenBudgetHooks,
DPOTrainer)``), naming its config class, its loss (:mod:`hf_dynbsz.execution.step_loss`) and its algorithm, with its
constructor from :func:`stock_constructor`. An optimizer step consumes exactly stock's samples (stock's
``_prepare_inputs`` still generates, scores, shuffles and slices them). Instead of one forward/backward per fixed slice,
the hooks collect the step's slices into a :class:`~hf_dynbsz.execution.batch.StepBatch` and hand it to the pass
executor (:mod:`hf_dynbsz.execution.executor`), which plans and runs the step's passes with stock's per-sample loss
weights. Everything a run decides at start is decided once, in :func:`hf_dynbsz.execution.setup.build_executor`.

TRL hooks overridden here, and why (a trainer's module lists its own):

* ``__init__`` (:func:`stock_constructor`): stock's signature; the config gains the plugin's fields, and a dataset too
  small is refused early.
* ``training_step``: collect the optimizer step's stock slices; run the step's passes on its last call. The window
  loop is :meth:`TokenBudgetHooks._dynbsz_window_call`, every trainer's, inside the pieces of transformers'
  ``Trainer.training_step`` (training mode first, ``torch_empty_cache_steps`` last): a trainer supplies what it keeps
  of a call's inputs (``_dynbsz_collect``) and how a step's window trains (``_train_window``).
* ``_get_per_token_logps_and_entropies`` (:class:`~hf_dynbsz.trainers.logprob_hooks.LogProbHooks`: GRPO, RLOO): run
  no-grad log-prob passes by the schedule (grad calls go to stock).
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
from accelerate.utils.memory import clear_device_cache
from transformers import TrainerCallback
from transformers.training_args import ParallelMode

from hf_dynbsz.configs.build import trainer_config
from hf_dynbsz.execution.batch import StepBatch
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


def empty_cache_as_trainer(args, global_step: int) -> None:
    """What transformers' ``Trainer.training_step`` does after each training call's loss: with
    ``torch_empty_cache_steps`` set, at every call of an optimizer step whose number (``global_step``, the steps done)
    is a multiple of it, the device's cache emptied (accelerate's ``clear_device_cache``, as the Trainer calls it,
    and MPS's graph cache)."""
    every = args.torch_empty_cache_steps
    if every is not None and global_step % every == 0:
        clear_device_cache()
        if torch.backends.mps.is_available() and hasattr(torch.mps, "clear_graph_cache"):
            torch.mps.clear_graph_cache()


class TokenBudgetHooks:
    """TRL's hooks over the pass executor, shared by the trainers, placed before TRL's trainer class. A trainer class
    names its config class, loss and algorithm as keywords of its bases (:meth:`__init_subclass__`):
    ``class DynamicBatchDPOTrainer(TokenBudgetHooks, DPOTrainer, config=DynamicBatchDPOConfig, loss=DPOLoss,
    algorithm="DPO")``. Each trainer takes exactly stock's constructor arguments and accepts its plugin config or a
    plain TRL config (the plugin's fields then take their defaults and ``DIFFU_*`` environment overrides still
    apply)."""

    _dynbsz_config_class: type
    _dynbsz_loss_class: type
    _dynbsz_algorithm: str  # stock's default output directory is <model>-<algorithm>

    def __init_subclass__(cls, *, config: type | None = None, loss: type | None = None, algorithm: str = "", **kwargs):
        """A trainer's parts, from its bases' keywords: its config class, its loss (a
        :class:`~hf_dynbsz.execution.step_loss.StepLoss`) and its algorithm, and stock's constructor signature
        (:func:`stock_constructor`) over the first of its bases that is TRL's. A subclass without them inherits
        its parent's."""
        super().__init_subclass__(**kwargs)
        if config is None:
            return
        cls._dynbsz_config_class, cls._dynbsz_loss_class, cls._dynbsz_algorithm = config, loss, algorithm
        cls.__init__ = stock_constructor(next(base for base in cls.__mro__ if not issubclass(base, TokenBudgetHooks)))

    #: whether a dataset too small for one generation round is refused (a DPO run has none: stock trains any size)
    _dynbsz_refuses_small_datasets = True

    def _dynbsz_arguments(self, stock_init: inspect.Signature, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Stock's constructor arguments, with the plugin's config fields filled in before TRL reads them."""
        try:
            bound = stock_init.bind(self, *args, **kwargs)
        except TypeError:
            return args, kwargs  # a call stock does not accept: stock's own __init__ raises its TypeError
        bound.arguments["args"] = self._dynbsz_config(bound.arguments.get("args"), bound.arguments["model"])
        if self._dynbsz_refuses_small_datasets and hasattr(bound.arguments.get("train_dataset"), "__len__"):
            validate_train_dataset_size(len(bound.arguments["train_dataset"]), bound.arguments["args"])
        return bound.args[1:], bound.kwargs

    def _dynbsz_config(self, args, model):
        """The run's config: ``args`` (None: stock's default) with the plugin's fields in place."""
        return trainer_config(args, model, self._dynbsz_config_class, self._dynbsz_algorithm)

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
        loss = self._dynbsz_window_call(model, inputs)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - time_before
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss

    def _dynbsz_window_call(self, model, inputs) -> torch.Tensor:
        """One training call of an optimizer step, the window loop every trainer runs, inside the pieces of
        transformers' ``Trainer.training_step``: first the model and a schedule-free optimizer in training mode, last
        the device cache emptied every ``torch_empty_cache_steps`` steps (:func:`empty_cache_as_trainer`). In
        between, the step's meters started at its first call, the call's inputs kept (:meth:`_dynbsz_collect`), and
        at the step's last call its passes (:meth:`_train_window`); before the last call the loss is zero. Stock's
        other pieces are refused at config time: context parallelism (its input sharding) and a LOMO optimizer (the
        learning rate it takes in each backward: :mod:`hf_dynbsz.planning.validation`)."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        if not self._dynbsz_window:
            self._dynbsz.meters.start()
        self._dynbsz_window.append(self._dynbsz_collect(inputs))
        if self.accelerator.sync_gradients:
            window, self._dynbsz_window = self._dynbsz_window, []
            loss = self._train_window(model, window)
        else:
            loss = torch.zeros((), device=self.accelerator.device)
        empty_cache_as_trainer(self.args, self.state.global_step)
        return loss

    def _dynbsz_collect(self, inputs) -> dict:
        """A training call's inputs as the window keeps them: TRL's rollout (generation every ``steps_per_generation``
        calls), timed as the step's generation."""
        with self._dynbsz.meters.clock.phase("generation"):
            return self._prepare_inputs(inputs)

    def _train_window(self, model, window: list[dict]) -> torch.Tensor:
        """One optimizer step from its stock slices: repacked, or stock's slices where the run cannot repack them."""
        executor, accelerator = self._dynbsz, self.accelerator
        if executor.media.stock(*window):
            return executor.train_step_stock(model, window, IMAGE_STEPS)
        long_rope = executor.capabilities.support.long_rope
        batch = StepBatch.from_slices(window, accelerator.process_index, accelerator.num_processes, long_rope)
        if executor.self_check(model, batch.table):
            return executor.train_step(model, batch).loss
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


class _LogPlanAtTrainBegin(TrainerCallback):
    """Logs the batch-size plan once, from the main process, when training starts."""

    def __init__(self, trainer: TokenBudgetHooks):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        log_batch_size_plan(self.trainer, self.trainer._dynbsz)

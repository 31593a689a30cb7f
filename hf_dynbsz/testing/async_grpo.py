"""Offline stand-ins for TRL's ``AsyncGRPOTrainer`` (``trl.experimental.async_grpo``), through TRL's own protocols.

Stock's trainer generates on a vLLM server and trains through FlashAttention-3; neither runs here. TRL's extension
points let both be replaced without touching its code:

* :class:`StandInRolloutWorker`: TRL's ``RolloutWorkerProtocol`` (the ``rollout_worker=`` argument) over scripted
  ``RolloutSample`` s (:class:`RolloutScript`: prompts, completions, multi-turn tool results, forked rows, old
  log-probs, advantages, group ids), tagged with the model version of the last weight sync; filled at each sync, or
  produced by a thread at a set rate (``generation_seconds`` per sample, for the benchmark);
* :class:`NoWeightTransfer`: TRL's ``WeightTransferProtocol`` (``weight_transfer=``) that drains the weights and
  counts the syncs;
* :func:`reference_tree_attention`: stock's FA3 tree kernel (``flash_attn_varlen_func`` over keys gathered along each
  segment's root-to-node path, causal aligned bottom-right, optional sliding window) in plain torch, so
  stock's own tree attention runs on CPU as the comparison; :func:`async_grpo_on_cpu` installs it and lets stock's
  constructor read no CUDA device name (it only feeds an MFU figure);
* :func:`async_grpo_run`: a run of stock's trainer or the plugin's from a saved model on these stand-ins, with the
  comparison runs' schedule (:data:`ASYNC_COMPARISON_FIELDS`);
* :func:`reference_async_grpo_steps`: stock's fixed-count step computed sample by sample on the model's own forward,
  the reference where stock refuses the model.

torch, numpy and TRL are imported inside the functions (importing :mod:`hf_dynbsz.testing` stays cheap).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Iterable, Iterator

__all__ = [
    "ASYNC_COMPARISON_FIELDS",
    "ASYNC_UNCOMPARED",
    "AsyncRun",
    "NoWeightTransfer",
    "RolloutScript",
    "STOCK_BUDGET_STEP",
    "STOCK_STEP_SCRIPT",
    "ScriptRolloutFunc",
    "StandInRolloutWorker",
    "async_grpo_on_cpu",
    "async_grpo_run",
    "async_grpo_stock_cut",
    "perf_token_counts",
    "reference_async_grpo_steps",
    "reference_flash_attn_varlen_func",
    "reference_tree_attention",
]


# --------------------------------------------------------------------------------------------------------------
# Scripted rollout samples
# --------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RolloutScript:
    """Scripted ``RolloutSample`` s, group by group, as TRL's rollout worker enqueues them.

    Each group is ``num_generations`` conversations of one prompt (``prompt_lengths`` tokens, after a block of
    ``shared_prefix`` tokens every prompt begins with: a tool schema). A conversation is ``tool_turns`` model turns,
    each followed by a tool result (context: ``completion_mask`` 0), then a final model turn; model turns are
    ``completion_lengths`` tokens long in total (uniform in the range, or the named length mix ``mix`` of
    :mod:`hf_dynbsz.testing.mixes` at ``max_completion_length``). A fraction ``forks`` of the conversations is also
    trained as a second row, as stock's reconciler forks a rewritten history: the first answer's opening, then
    ``fork_context`` rewritten tokens (context), then a further answer; both rows carry the conversation's group id
    and advantage. Old log-probs are ``old_log_prob`` plus Gaussian noise of ``noise`` on trained tokens, 0 elsewhere
    (as TRL zero-fills context); advantages are each group's rewards normalised. A fraction ``untrained`` of the rows
    trains no token (its completion mask all 0, as a truncated or tool-only turn). Token ids are drawn from
    ``token_range`` (the test tokenizer's characters by default). Everything is drawn from ``seed`` (``untrained``
    0 draws nothing more).
    """

    num_generations: int = 4
    prompt_lengths: tuple[int, int] = (4, 16)
    completion_lengths: tuple[int, int] = (2, 48)
    mix: str | None = None
    max_completion_length: int = 48
    shared_prefix: int = 0
    tool_turns: int = 0
    tool_lengths: tuple[int, int] = (2, 6)
    forks: float = 0.0
    fork_context: tuple[int, int] = (2, 6)
    token_range: tuple[int, int] = (3, 7)
    old_log_prob: float = -1.95
    noise: float = 0.2
    seed: int = 0
    untrained: float = 0.0

    def samples(self) -> Iterator:
        """``RolloutSample`` s forever, group after group (group ids 0, 1, ...), ``model_version`` 0."""
        import numpy as np

        rng = np.random.default_rng(self.seed)
        shared = self._tokens(rng, self.shared_prefix)
        group_id = 0
        while True:
            yield from self._group(rng, shared, group_id)
            group_id += 1

    def take(self, count: int) -> list:
        """The first ``count`` samples."""
        iterator = self.samples()
        return [next(iterator) for _ in range(count)]

    def _tokens(self, rng, count: int) -> list[int]:
        return rng.integers(*self.token_range, count).tolist()

    def _completion_length(self, rng) -> int:
        if self.mix is None:
            return int(rng.integers(self.completion_lengths[0], self.completion_lengths[1] + 1))
        from hf_dynbsz.testing.mixes import completion_lengths

        return int(completion_lengths(self.mix, 1, self.max_completion_length, rng)[0])

    def _group(self, rng, shared: list[int], group_id: int) -> list:
        prompt = shared + self._tokens(rng, int(rng.integers(self.prompt_lengths[0], self.prompt_lengths[1] + 1)))
        rows = [self._conversation(rng, prompt) for _ in range(self.num_generations)]
        rewards = rng.normal(0.0, 1.0, len(rows))
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        samples = []
        for (conversation_rows, reward), advantage in zip(zip(rows, rewards), advantages):
            for ids, mask in conversation_rows:
                if self.untrained and rng.random() < self.untrained:
                    mask = [0] * len(mask)
                metrics = {"reward": float(reward), "reward_std": float(rewards.std())}
                samples.append(self._sample(rng, ids, mask, float(advantage), group_id, metrics))
        return samples

    def _conversation(self, rng, prompt: list[int]) -> list[tuple[list[int], list[int]]]:
        """A conversation's training rows, each ``(input_ids, completion_mask)``."""
        import numpy as np

        total = max(self._completion_length(rng), self.tool_turns + 1)
        cuts = (
            sorted(rng.choice(np.arange(1, total), self.tool_turns, replace=False).tolist()) if self.tool_turns else []
        )
        ids, mask = list(prompt), [0] * len(prompt)
        for start, end in zip([0, *cuts], [*cuts, total]):
            if start:  # a tool result before every model turn but the first
                tool = self._tokens(rng, int(rng.integers(self.tool_lengths[0], self.tool_lengths[1] + 1)))
                ids, mask = ids + tool, mask + [0] * len(tool)
            ids, mask = ids + self._tokens(rng, end - start), mask + [1] * (end - start)
        rows = [(ids, mask)]
        if self.forks and rng.random() < self.forks:
            answer = len(ids) - len(prompt)
            kept = len(prompt) + int(rng.integers(0, answer))
            context = self._tokens(rng, int(rng.integers(self.fork_context[0], self.fork_context[1] + 1)))
            further = self._tokens(rng, int(rng.integers(1, max(2, answer // 2 + 1))))
            fork_ids = ids[:kept] + context + further
            rows.append((fork_ids, [0] * (kept + len(context)) + [1] * len(further)))
        return rows

    def _sample(self, rng, ids: list[int], mask: list[int], advantage: float, group_id: int, metrics: dict):
        import numpy as np
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        mask_array = np.asarray(mask, dtype=np.int64)
        noise = rng.normal(self.old_log_prob, self.noise, len(ids)).astype(np.float32)
        return RolloutSample(
            prompt=[],
            completion=[],
            input_ids=np.asarray(ids, dtype=np.int64),
            completion_mask=mask_array,
            old_log_probs=np.where(mask_array == 1, noise, np.float32(0.0)).astype(np.float32),
            advantage=advantage,
            model_version=0,
            group_id=group_id,
            metrics=metrics,
        )


class ScriptRolloutFunc:
    """A synchronous trainer's ``rollout_func`` (``GRPOTrainer``'s) over a :class:`RolloutScript`'s samples, in queue
    order: each sample's tokens before its first trained one as the prompt, the rest as the completion, so a
    synchronous run trains the samples an asynchronous one takes from the queue (a script without tool turns or
    forks: one row per prompt repeat). ``generation_seconds``: sleeps that long per sample, a generation server's
    time."""

    def __init__(self, script: RolloutScript, generation_seconds: float = 0.0) -> None:
        self.samples, self.generation_seconds = script.samples(), generation_seconds

    def __call__(self, prompts, trainer) -> dict:
        prompt_ids, completion_ids = [], []
        for _ in prompts:
            sample = next(self.samples)
            ids, mask = sample.input_ids.tolist(), sample.completion_mask.tolist()
            first = 1 + mask[1:].index(1)
            prompt_ids.append(ids[:first])
            completion_ids.append(ids[first:])
        time.sleep(self.generation_seconds * len(prompts))
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


# --------------------------------------------------------------------------------------------------------------
# The rollout worker and the weight transfer, TRL's protocols
# --------------------------------------------------------------------------------------------------------------


class StandInRolloutWorker:
    """TRL's ``RolloutWorkerProtocol`` over scripted samples (``samples``: an iterable of ``RolloutSample`` s, e.g.
    :meth:`RolloutScript.samples`).

    Each sample is enqueued tagged with the model version of the last weight sync (``update_model_version``), as
    TRL's worker tags what it generated with the policy it generated under. With ``generation_seconds`` 0 (the
    comparisons) the queue is filled without a thread: ``prefill`` samples at ``start()`` (default: two syncs' worth;
    accelerate's dispatcher reads a micro-batch ahead of the one being trained) and ``samples_per_sync`` at every
    later sync, so two trainers given the same samples consume them in the same order and none goes stale. With
    ``generation_seconds`` > 0 a thread produces one sample every ``generation_seconds`` into a queue of at most
    ``queue_maxsize`` samples (the rate of a generation server). ``syncs`` counts the versions seen.
    """

    def __init__(
        self,
        samples: Iterable,
        *,
        samples_per_sync: int = 64,
        prefill: int | None = None,
        generation_seconds: float = 0.0,
        queue_maxsize: int = 0,
    ) -> None:
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=queue_maxsize)
        self.metrics_queue: queue.Queue = queue.Queue()
        self._samples = iter(samples)
        self.samples_per_sync = samples_per_sync
        self.prefill = 2 * samples_per_sync if prefill is None else prefill
        self.generation_seconds = generation_seconds
        self.model_version = 0
        self.syncs = 0
        self.produced = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _tagged(self):
        return dataclasses.replace(next(self._samples), model_version=self.model_version, enqueued_at=time.time())

    def _fill(self, count: int) -> None:
        for _ in range(count):
            self.rollout_buffer.put(self._tagged())
            self.produced += 1

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                time.sleep(self.generation_seconds)
                sample = self._tagged()
                while not self._stop.is_set():
                    try:
                        self.rollout_buffer.put(sample, timeout=0.1)
                        self.produced += 1
                        break
                    except queue.Full:
                        continue
        except BaseException as error:  # noqa: BLE001 - reported by check_health on the trainer's thread
            self._error = error

    def start(self) -> None:
        if self.generation_seconds > 0:
            self._thread = threading.Thread(target=self._produce, name="stand-in-rollout-worker", daemon=True)
            self._thread.start()
        else:
            self._fill(self.prefill)

    def update_model_version(self, model_version: int) -> None:
        self.model_version = model_version
        self.syncs += 1
        if self.generation_seconds <= 0 and self._thread is None and self.syncs > 1:
            self._fill(self.samples_per_sync)  # (the first sync precedes start(), which prefills)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def check_health(self, stale_after_s: float) -> None:
        if self._error is not None:
            raise RuntimeError(f"the stand-in rollout worker failed: {self._error!r}") from self._error


class NoWeightTransfer:
    """TRL's ``WeightTransferProtocol`` without a server: drains each sync's parameter stream (as TRL's client does:
    under FSDP the stream's gathers are collectives) and counts syncs and tensors."""

    def __init__(self) -> None:
        self.syncs = 0
        self.tensors = 0
        self.initialised = self.destroyed = False

    def init_weight_transfer(self) -> None:
        self.initialised = True

    def pause(self) -> None:
        return None

    def send_weights(self, iterator) -> None:
        self.syncs += 1
        for _ in iterator:
            self.tensors += 1

    def resume(self) -> None:
        return None

    def destroy(self) -> None:
        self.destroyed = True


# --------------------------------------------------------------------------------------------------------------
# Stock's tree kernel in plain torch
# --------------------------------------------------------------------------------------------------------------


def reference_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=True,
    window_size=(-1, -1),
    softcap=0.0,
):
    """FlashAttention's ``flash_attn_varlen_func`` as stock's tree attention calls it, in plain torch (through
    :func:`hf_dynbsz.testing.oracles.reference_varlen_attn`): ``q`` ``(Tq, H, D)``, ``k``/``v`` ``(Tk, Hk, D)``
    (grouped-query heads), span ``s`` of the queries attends to span ``s`` of the keys, causally aligned bottom-right,
    within ``window_size[0]`` keys to the left when that is not negative. A logit soft cap is not drawn (no model of
    these tests has one)."""
    from hf_dynbsz.testing.oracles import reference_varlen_attn

    if softcap:
        raise NotImplementedError("the reference tree kernel draws no logit soft cap")
    return reference_varlen_attn(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        int(max_seqlen_q),
        int(max_seqlen_k),
        scale=softmax_scale,
        window_size=(window_size[0], 0 if causal else window_size[1]),
        enable_gqa=True,
    )


@contextlib.contextmanager
def reference_tree_attention():
    """Stock's tree attention through :func:`reference_flash_attn_varlen_func` instead of the FA3 kernel it fetches
    from the Hub (``trl.experimental.async_grpo.packing._flash_attn``), for the context."""
    import types

    from trl.experimental.async_grpo import packing

    kernel = types.SimpleNamespace(flash_attn_varlen_func=reference_flash_attn_varlen_func)
    original = packing._flash_attn
    packing._flash_attn = lambda: kernel
    try:
        yield
    finally:
        packing._flash_attn = original


@contextlib.contextmanager
def async_grpo_on_cpu():
    """Stock ``AsyncGRPOTrainer`` constructed and trained on CPU, for the context: its tree attention through
    :func:`reference_tree_attention`, and no peak FLOPs looked up (TRL asks CUDA for the device's name; the value
    only feeds an MFU figure)."""
    from trl.experimental.async_grpo import async_grpo_trainer

    original = async_grpo_trainer.get_peak_flops_per_device
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
    try:
        with reference_tree_attention():
            yield
    finally:
        async_grpo_trainer.get_peak_flops_per_device = original


# --------------------------------------------------------------------------------------------------------------
# A run of stock's trainer or the plugin's, on CPU
# --------------------------------------------------------------------------------------------------------------

#: The comparison runs' schedule and optimizer: 3 optimizer steps, groups of 4, SGD at a constant, large rate (a
#: mis-weighted sample shows in the parameters), no gradient checkpointing (stock's default is on; it changes nothing
#: but the time), every step logged. Stock's fixed-count mode (``token_budget=0``) unless a run says otherwise.
ASYNC_COMPARISON_FIELDS = dict(max_steps=3, num_generations=4, seed=0, token_budget=0, gradient_checkpointing=False)
ASYNC_COMPARISON_FIELDS.update(learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", max_grad_norm=1e9)
ASYNC_COMPARISON_FIELDS.update(
    report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True, use_cpu=True, bf16=False
)

#: The default step's comparisons with stock at the same config (``tests/test_async_grpo_stock_step.py``,
#: ``benchmarks/exactness.py``): scripted samples of which a tenth train no token (a truncated or tool-only turn), and
#: stock's token-budget mode at 400 tokens per row, two micro-batches per optimizer step (16 samples per device only
#: sizes the stand-in worker's refills: stock's budget decides the samples).
STOCK_STEP_SCRIPT = RolloutScript(seed=1, untrained=0.1)
STOCK_BUDGET_STEP = dict(token_budget=400, per_device_train_batch_size=16, gradient_accumulation_steps=2)

#: Logged names left out of the comparisons of logged metrics (with :data:`hf_dynbsz.testing.oracles.TIMINGS`): timing
#: (``perf/*``: their token counts are compared apart, :func:`perf_token_counts`) and the queue's state at a moment,
#: not what a step trained, and the Trainer's FLOP count (of the tokens the plugin's passes computed; its other
#: figures of the passes are its ``dynbsz/*``).
ASYNC_UNCOMPARED = ("perf/", "sample/time_in_queue_s", "sample/rollout_queue_size", "total_flos")


@dataclasses.dataclass
class AsyncRun:
    """What a run of :func:`async_grpo_run` leaves: the parameters before and after, the log history, the trainer,
    the stand-in worker and weight transfer (their counters)."""

    initial: dict
    final: dict
    history: list[dict]
    trainer: object
    worker: StandInRolloutWorker
    transfer: NoWeightTransfer


def async_grpo_run(
    trainer: str,
    model_dir: str,
    output_dir: str,
    script: RolloutScript | None = None,
    *,
    num_processes: int = 1,
    train: bool = True,
    generation_seconds: float = 0.0,
    queue_steps: int = 2,
    stock_kernel: str = "reference",
    trainer_kwargs: dict | None = None,
    worker_kwargs: dict | None = None,
    peak_flops: float | None = None,
    **fields,
) -> AsyncRun:
    """Build (and with ``train``, train) ``trainer`` ("async_grpo_stock" or "async_grpo_dynamic", see
    :data:`hf_dynbsz.testing.harness.TRAINERS`) from the model saved at ``model_dir`` with
    :data:`ASYNC_COMPARISON_FIELDS` (``fields`` override them) on ``script``'s samples (default:
    ``RolloutScript(seed=1)``), through :class:`StandInRolloutWorker` (one step's samples per sync) and
    :class:`NoWeightTransfer`, stock's tree attention through :func:`async_grpo_on_cpu`. ``num_processes``: the
    processes of the launch, for the samples a step takes; ``generation_seconds``: the worker's thread produces one
    sample every that many seconds (a queue of at most ``queue_steps`` steps' samples) instead of filling the queue at
    each sync. ``stock_kernel``: "reference" (stock's tree attention in plain torch, :func:`async_grpo_on_cpu`) or
    "fa3" (stock's own FlashAttention-3 Hub kernel, on a Hopper GPU with the ``kernels`` package). ``worker_kwargs``
    override the worker's (``samples_per_sync``, ``prefill``: more samples than a step takes, for runs that drop stale
    samples or sync less often). ``peak_flops``: the device's peak FLOP/s stock's MFU figures divide by (stock asks
    CUDA for it; on CPU none, and no MFU is logged)."""
    from hf_dynbsz.testing.fixtures import load_tokenizer, prompt_dataset
    from hf_dynbsz.testing.harness import snapshot_parameters, trainer_classes

    trainer_class, config_class = trainer_classes(trainer)
    config = config_class(output_dir=output_dir, **{**ASYNC_COMPARISON_FIELDS, **fields})
    per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps * num_processes
    worker_settings = dict(
        samples_per_sync=per_step,
        generation_seconds=generation_seconds,
        queue_maxsize=queue_steps * per_step if generation_seconds else 0,
    )
    worker = StandInRolloutWorker(
        (script or RolloutScript(seed=1)).samples(), **{**worker_settings, **(worker_kwargs or {})}
    )
    transfer = NoWeightTransfer()
    with async_grpo_on_cpu() if stock_kernel == "reference" else contextlib.nullcontext():
        built = trainer_class(
            model=model_dir,
            args=config,
            train_dataset=prompt_dataset(),
            processing_class=load_tokenizer(model_dir),
            rollout_worker=worker,
            weight_transfer=transfer,
            **(trainer_kwargs or {}),
        )
        initial = snapshot_parameters(built.model)
        if peak_flops is not None:
            built._peak_flops_per_device = peak_flops
        if train:
            built.train()
    return AsyncRun(initial, snapshot_parameters(built.model), built.state.log_history, built, worker, transfer)


def perf_token_counts(history: list[dict], peak_flops: float | None = None, processes: int = 1) -> list[dict]:
    """What stock's ``perf/*`` throughput figures count, apart from time, per logged step (one step a log): the
    ``perf/*`` names logged, the forwarded tokens (``perf/forwarded_tok_s_fwd_bwd`` x ``perf/fwd_bwd_s``) and, with
    the ``peak_flops`` the run was given (:func:`async_grpo_run`), the FLOPs per token its MFU counted
    (``perf/mfu_fwd_bwd`` over that throughput: TRL's ``compute_flops_per_token`` at the step's mean sequence
    length)."""
    counts = []
    for entry in history:
        if "perf/fwd_bwd_s" not in entry:
            continue
        throughput = entry["perf/forwarded_tok_s_fwd_bwd"]
        found = {"names": {name for name in entry if name.startswith("perf/")}}
        found["forwarded"] = round(throughput * entry["perf/fwd_bwd_s"])
        if peak_flops is not None:
            found["flops_per_token"] = round(entry["perf/mfu_fwd_bwd"] / 100 / throughput * peak_flops * processes)
        counts.append(found)
    return counts


def reference_async_grpo_steps(
    model,
    steps: list[list],
    *,
    learning_rate: float,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    temperature: float = 1.0,
    router_aux_loss_coef: float = 0.0,
) -> dict:
    """Stock AsyncGRPOTrainer's fixed-count step with the step in one micro-batch (one process), computed the plainest
    way, as the reference where stock cannot run (a hybrid, attention sinks): each sample of ``steps`` (a list per
    optimizer step of ``RolloutSample`` s, in queue order) alone through the model's own forward, its trained tokens'
    clipped PPO terms summed and divided by the step's trained tokens, then one SGD step of ``learning_rate`` (stock's
    optimizer in these runs: ``optim="sgd"``, a constant rate, no clipping). With ``router_aux_loss_coef`` (an MoE
    model), stock's load-balancing loss over its packed row, each position the step's samples share once (keyed as
    ``TreeRow`` keys them: a token and the next), written out: ``E x sum_e (assignments_e / (L n)) x
    (probability_e / (L n))`` over the ``L`` router layers and the ``n`` positions. ``model`` is trained in place;
    returns its parameters."""
    import torch

    from hf_dynbsz.testing.harness import snapshot_parameters

    model.train()
    for samples in steps:
        model.zero_grad(set_to_none=True)
        trained = sum(int(sample.completion_mask[1:].sum()) for sample in samples)
        loss, routed = torch.zeros(()), []
        for sample in samples:
            ids = torch.as_tensor(sample.input_ids).unsqueeze(0)
            router = {"output_router_logits": True} if router_aux_loss_coef else {}
            outputs = model(input_ids=ids, use_cache=False, **router)
            logits = outputs.logits[0, :-1].float() / temperature
            log_probs = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
            mask = torch.as_tensor(sample.completion_mask[1:]).bool()
            ratio = torch.exp(log_probs - torch.as_tensor(sample.old_log_probs[1:]))[mask]
            advantage = torch.tensor(sample.advantage, dtype=torch.float32)
            clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
            loss = loss - torch.min(ratio * advantage, clipped * advantage).sum() / trained
            if router_aux_loss_coef:
                routed.append(outputs.router_logits)
        if router_aux_loss_coef:
            loss = loss + router_aux_loss_coef * _packed_row_load_balancing(model.config, samples, routed)
        loss.backward()
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.grad is not None:
                    parameter -= learning_rate * parameter.grad
    return snapshot_parameters(model)


def _packed_row_load_balancing(config, samples: list, routed: list):
    """The load-balancing loss of ``samples`` as one packed row (each shared position once) from each sample's own
    per-layer router logits (``routed``)."""
    import torch

    first: list[tuple[int, int]] = []  # (sample, position) of each position of the row, where it first appears
    roots: dict = {}
    for index, sample in enumerate(samples):
        ids = [int(token) for token in sample.input_ids]
        children = roots
        for position, key in enumerate(zip(ids, [*ids[1:], None])):
            if key not in children:
                children[key] = {}
                first.append((index, position))
            children = children[key]
    text = config.get_text_config()
    experts, top_k = getattr(text, "num_experts", None) or text.num_local_experts, text.num_experts_per_tok
    gates = torch.cat(
        [torch.stack([routed[index][layer][position] for index, position in first]) for layer in range(len(routed[0]))]
    )
    probabilities = torch.softmax(gates.float(), dim=-1)
    chosen = torch.nn.functional.one_hot(torch.topk(probabilities, top_k, dim=-1).indices, experts).float()
    return experts * (chosen.mean(dim=0) * probabilities.mean(dim=0).unsqueeze(0)).sum()


def async_grpo_stock_cut(model_dir: str, output_dir: str, script: RolloutScript | None = None) -> AsyncRun:
    """Stock's fixed-count mode at a cut of 8 samples x 2 accumulation steps (:func:`async_grpo_run`)."""
    return async_grpo_run(
        "async_grpo_stock", model_dir, output_dir, script, per_device_train_batch_size=8, gradient_accumulation_steps=2
    )

"""Every private or internal name of TRL, transformers and accelerate the plugin touches, in one list.

TRL's private ``GRPOTrainer``, ``RLOOTrainer``, ``DistillationTrainer`` and ``DPOTrainer`` hooks change between
releases. The plugin keeps its overrides few, and this module lists each name it overrides, calls, reads or writes that
is not public API, with the reason. The test suite (``tests/test_trl_compat.py``) checks that every name still exists in
the installed versions (and that each method still takes the parameters we pass), so a TRL upgrade fails one clear test
instead of a deep traceback; it also checks that the plugin's code touches no private name missing from this list. For
the hooks the plugin overrides, :func:`override_drift` and :func:`unpacked_lengths` compare the override with stock's
signature and with the tuple stock's callers unpack, the two ways these hooks changed between TRL releases
(``docs/trl-compatibility.md``).

:data:`TESTED_TRL_RANGE` is the TRL range the test suite runs against. ``import hf_dynbsz`` calls
:func:`check_trl_version`, which raises :class:`UntestedTRLVersionError` when the installed TRL is outside it, unless
the environment variable ``HF_DYNBSZ_ALLOW_UNTESTED_TRL=1`` (:data:`ALLOW_UNTESTED_TRL_ENV`) is set: then it warns
once and goes on. :func:`trl_version_decision` is that decision, a pure function of the version string and the
environment. Pure Python: importing this module imports neither torch nor TRL (the installed TRL's version is read
from its distribution's metadata).
"""

from __future__ import annotations

import ast
import inspect
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ALLOW_UNTESTED_TRL_ENV",
    "INTERNAL_NAMES",
    "InternalName",
    "TESTED_TRL_RANGE",
    "UntestedTRLVersionError",
    "check_trl_version",
    "override_drift",
    "trl_version_decision",
    "unpacked_lengths",
    "untested_trl_message",
]

#: TRL versions the test suite runs against: [lower, upper) (``tests/trl_range.sh VERSION ...`` runs the
#: TRL-dependent tests on a release in an environment of its own). TRL 1.15 cannot be tested on a machine without
#: Triton: its fused LM head has no PyTorch fallback, so stock GRPOTrainer itself does not train there.
TESTED_TRL_RANGE = ("1.16.0", "1.17.0")

_MULTIMODAL_PARAMETERS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


@dataclass(frozen=True)
class InternalName:
    """One internal name: where it lives, what the plugin does with it and why.

    ``owner`` is an import path (``"trl.GRPOTrainer"``, ``"trl.kernels.chunked_logprob"``) or ``"GRPOTrainer
    instance"`` (``"RLOOTrainer instance"``, ``"DistillationTrainer instance"``) for attributes the trainer's
    ``__init__`` sets. ``use`` is one of
    "overrides", "calls", "reads", "writes", "passes" (a keyword argument of a forward). ``parameters`` are the
    parameters of a method the plugin relies on, checked against the installed signature. ``returns``, for an
    override, is the length of the tuple it returns, which stock's callers must unpack (None: one value, not a tuple).
    """

    owner: str
    name: str
    use: str
    why: str
    parameters: tuple[str, ...] = ()
    returns: int | None = None


#: The parameters of both trainers' ``_get_per_token_logps_and_entropies``, which the plugin overrides.
_LOGPS_PARAMETERS = (
    "model",
    "input_ids",
    "attention_mask",
    "logits_to_keep",
    "batch_size",
    "compute_entropy",
    "compute_aux_loss",
    *_MULTIMODAL_PARAMETERS,
)

#: The trainer state the plugin's step uses as stock's ``training_step`` does, on every trainer that has it: name ->
#: (use, why).
_STEP_STATE = {
    "_metrics": ("writes", "logs the step's metrics where TRL logs its own"),
    "_step": ("writes", "counts accumulation steps, as stock training_step does"),
    "_current_train_step_time": ("writes", "the step_time metric, as stock training_step keeps it"),
    "_tokenizer": ("reads", "the pad token id of packed rows"),
    "aux_loss_enabled": (
        "reads",
        "whether TRL trains the MoE router aux loss, which the plugin then repacks per sample",
    ),
}


def _logps_hook(owner: str) -> InternalName:
    """``owner``'s ``_get_per_token_logps_and_entropies``, which the GRPO and RLOO trainers override alike."""
    return InternalName(
        owner,
        "_get_per_token_logps_and_entropies",
        "overrides",
        "packs the no-grad log-prob passes (old policy, reference) by the log-prob token budget",
        _LOGPS_PARAMETERS,
        returns=3,  # (log-probs, entropies, aux loss) since TRL 1.7; (log-probs, entropies) before
    )


def _step_state(owner: str, *names: str) -> tuple[InternalName, ...]:
    """The entries of :data:`_STEP_STATE`'s ``names`` on ``owner``."""
    return tuple(InternalName(owner, name, *_STEP_STATE[name]) for name in names)


INTERNAL_NAMES: tuple[InternalName, ...] = (
    # ---- GRPOTrainer hooks the trainer overrides
    _logps_hook("trl.GRPOTrainer"),
    InternalName(
        "trl.GRPOTrainer",
        "_generate_single_turn",
        "overrides",
        "generates a device's samples in chunks of per_device_generation_batch_size",
        ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
        returns=2,  # (completion ids, log-probs)
    ),
    # ---- GRPOTrainer methods and state the trainer uses
    InternalName(
        "trl.GRPOTrainer",
        "_prepare_inputs",
        "calls",
        "stock generation, scoring, shuffling and slicing of each accumulation step",
        ("generation_batch",),
    ),
    *_step_state("GRPOTrainer instance", "_metrics", "_step", "_current_train_step_time"),
    InternalName("GRPOTrainer instance", "_entropy_bonus_enabled", "reads", "whether stock adds the entropy bonus"),
    InternalName(
        "GRPOTrainer instance",
        "_last_world_entropy",
        "writes",
        "the adaptive entropy controller's state, updated at the optimizer-step boundary as stock does",
    ),
    *_step_state("GRPOTrainer instance", "_tokenizer", "aux_loss_enabled"),
    # ---- RLOOTrainer: the same hooks (DynamicBatchRLOOTrainer shares the GRPO trainer's), its own generation signature
    _logps_hook("trl.RLOOTrainer"),
    InternalName(
        "trl.RLOOTrainer",
        "_generate_single_turn",
        "overrides",
        "generates a device's samples in chunks of per_device_generation_batch_size",
        ("prompt_ids", "images", "multimodal_fields"),
        returns=None,  # the completion ids (RLOO has no generation log-probs)
    ),
    InternalName(
        "trl.RLOOTrainer",
        "_prepare_inputs",
        "calls",
        "stock generation, scoring (summed old log-probs), shuffling and slicing of each accumulation step",
        ("generation_batch",),
    ),
    *_step_state("RLOOTrainer instance", *_STEP_STATE),
    # ---- DistillationTrainer: the generation and step hooks; no log-prob passes (the teacher's are the plugin's)
    InternalName(
        "trl.DistillationTrainer",
        "_generate_single_turn",
        "overrides",
        "generates a device's samples in chunks of per_device_generation_batch_size",
        ("prompt_ids", "images", "multimodal_fields", "has_tool_images"),
        returns=None,  # the completion ids
    ),
    InternalName(
        "trl.DistillationTrainer",
        "_prepare_inputs",
        "calls",
        "stock generation (once per optimizer step), num_items_in_batch, shuffling and slicing of each accumulation "
        "step",
        ("generation_batch",),
    ),
    InternalName(
        "DistillationTrainer instance",
        "_forward_redirection",
        "calls",
        "the student's passes (backbone and divergence) and the teacher's passes run inside their wrappers' forward, "
        "as stock's compute_loss runs them (DDP's prepare_for_backward, ZeRO-3's parameter gathers)",
    ),
    *_step_state("DistillationTrainer instance", "_metrics", "_step", "_current_train_step_time", "_tokenizer"),
    InternalName(
        "trl.kernels.chunked_divergence",
        "ChunkedDivergenceFunction",
        "calls",
        "each pass's per-token divergence and student entropy, stock's own kernel on the pass's loss tokens",
    ),
    InternalName(
        "trl.kernels.chunked_divergence",
        "TOKEN_CHUNK_SIZE",
        "writes",
        "tensor_batch_size: tokens per tile of the distillation divergence",
    ),
    InternalName(
        "trl.kernels.chunked_divergence",
        "VOCAB_CHUNK_SIZE",
        "writes",
        "tensor_batch_size: vocabulary columns per tile of the distillation divergence",
    ),
    # ---- DPOTrainer: the step hook (training_step, public) and what its loss and metrics read and write
    InternalName(
        "trl.DPOTrainer",
        "_prepare_inputs",
        "calls",
        "each collated micro-batch moved to the device (transformers' Trainer's), as stock training_step does",
    ),
    *_step_state("trl.DPOTrainer instance", "_tokenizer", "_metrics"),
    InternalName(
        "trl.DPOTrainer instance",
        "_total_train_tokens",
        "writes",
        "the num_tokens metric: every process's real tokens of the step added once per step, as stock adds them",
    ),
    InternalName("trl.DPOTrainer instance", "_tp_size", "reads", "num_tokens counts a token once per TP group"),
    InternalName(
        "trl.DPOTrainer instance",
        "_is_vision_dataset",
        "reads",
        "vision-language pairs train stock's micro-batches (their image inputs are not repacked for DPO)",
    ),
    # ---- RewardTrainer: the step hook (training_step, public) and what its loss and metrics read and write
    InternalName(
        "trl.RewardTrainer",
        "_prepare_inputs",
        "calls",
        "each collated micro-batch moved to the device (transformers' Trainer's), as stock training_step does",
    ),
    *_step_state("trl.RewardTrainer instance", "_metrics"),
    InternalName(
        "trl.RewardTrainer instance",
        "_total_train_tokens",
        "writes",
        "the num_tokens metric: every process's attention-mask tokens of the step added once per step",
    ),
    InternalName("trl.RewardTrainer instance", "_tp_size", "reads", "num_tokens counts a token once per TP group"),
    # ---- KTOTrainer: the step hook (training_step, public) and what its loss and metrics read and write
    InternalName(
        "trl.KTOTrainer",
        "_prepare_inputs",
        "calls",
        "each collated micro-batch moved to the device (transformers' Trainer's), as stock training_step does",
    ),
    *_step_state("trl.KTOTrainer instance", "_metrics"),
    InternalName(
        "trl.KTOTrainer instance",
        "_total_train_tokens",
        "writes",
        "the num_tokens metric: the tokens of the step's samples stock counts, added once per step",
    ),
    InternalName("trl.KTOTrainer instance", "_tp_size", "reads", "num_tokens counts a token once per TP group"),
    InternalName(
        "trl.KTOTrainer instance",
        "_is_vision_dataset",
        "reads",
        "vision-language samples train stock's micro-batches (their image inputs are not repacked for KTO)",
    ),
    # ---- AsyncGRPOTrainer (trl.experimental.async_grpo): hf_dynbsz/trainers/async_grpo.py and, for the three
    # functions replaced while stock's constructor runs, hf_dynbsz/trainers/async_stock_patches.py
    InternalName(
        "trl.experimental.async_grpo.async_grpo_trainer",
        "create_model_from_path",
        "writes",
        "replaced while stock's constructor runs: the model loads with the run's attention kernel, not stock's FA3 "
        "tree kernel, and stock's refusals of state-carrying layers and attention sinks do not see them",
        ("model_id",),
    ),
    InternalName(
        "trl.experimental.async_grpo.async_grpo_trainer",
        "add_fused_lm_head",
        "writes",
        "replaced while stock's constructor runs: stock's next call after its refusals, where the model's layer kinds "
        "and sinks are put back before stock's own call",
        ("model", "temperature", "outputs"),
    ),
    InternalName(
        "trl.experimental.async_grpo.async_grpo_trainer",
        "get_peak_flops_per_device",
        "writes",
        "replaced while stock's constructor runs: None on a device without CUDA (stock asks CUDA for the device's "
        "name; the value only feeds an MFU figure)",
        ("accelerator", "dtype"),
    ),
    InternalName(
        "trl.experimental.async_grpo.async_grpo_trainer",
        "RolloutQueueDataset",
        "calls",
        "stock's rollout queue with its staleness filter, read by the plugin's dataloader",
        ("rollout_queue", "model_version_fn", "check_health_fn", "stale_after_s", "metrics", "max_staleness"),
    ),
    InternalName(
        "trl.experimental.async_grpo.async_grpo_trainer",
        "_EmptyIterableDataset",
        "calls",
        "stock's dataset of the processes other than the main one (accelerate's dispatcher sends them the main "
        "process's micro-batches, so it is never read), used as stock uses it",
    ),
    InternalName(
        "trl.experimental.async_grpo.async_grpo_trainer",
        "FixedCountBatcher",
        "calls",
        "stock's fixed-count planner: per_device_train_batch_size x processes samples per micro-batch, one row per "
        "process",
        ("dataset", "num_processes", "microbatch_size"),
    ),
    InternalName(
        "trl.experimental.async_grpo.async_grpo_trainer",
        "TokenBudgetBatcher",
        "calls",
        "stock's token-budget planner, which decides the samples of stock's step (async_step='stock', token_budget > "
        "0): as many samples per micro-batch as fit one row per process, longer ones dropped with its warning and "
        "counter",
        ("dataset", "num_processes", "token_budget", "metrics"),
    ),
    InternalName(
        "trl.experimental.async_grpo.async_grpo_trainer.DataCollatorForRollout",
        "_log_metrics",
        "calls",
        "stock's sample, reward and packing metrics of each micro-batch, from the plugin's collator (a subclass)",
        ("rows", "all_examples", "padded"),
    ),
    InternalName(
        "trl.experimental.async_grpo.AsyncGRPOTrainer instance",
        "_metrics",
        "writes",
        "logs the step's metrics where stock logs its own",
    ),
    InternalName(
        "trl.experimental.async_grpo.AsyncGRPOTrainer instance",
        "_trained_groups",
        "reads",
        "the prompt groups trained, which the collator adds to (stock's epoch stop)",
    ),
    InternalName(
        "trl.experimental.async_grpo.AsyncGRPOTrainer instance",
        "_rollout_dataset",
        "writes",
        "the queue whose wait stock's _log_step_metrics flushes at each optimizer step",
    ),
    InternalName(
        "trl.experimental.async_grpo.AsyncGRPOTrainer instance",
        "vllm_client",
        "reads",
        "asked for the server's max_model_len when token_budget is unset (stock's step), as stock's "
        "get_train_dataloader asks it",
    ),
    InternalName(
        "trl.experimental.async_grpo.AsyncGRPOTrainer instance",
        "_current_train_step_time",
        "writes",
        "perf/fwd_bwd_s, as stock's training_step keeps it",
    ),
    *(
        InternalName(
            "trl.experimental.async_grpo.AsyncGRPOTrainer instance",
            name,
            "writes",
            "the step accounting stock's compute_loss and training_step keep and _log_step_metrics logs (perf/*, "
            "batch/*_per_step), added up as stock adds it for the same micro-batches",
        )
        for name in (
            "_step_forward_tokens",
            "_step_trained_tokens",
            "_step_samples",
            "_step_seq_len_weighted",
            "_step_forward_s",
            "_step_microbatches",
        )
    ),
    InternalName(
        "trl.experimental.async_grpo.AsyncGRPOTrainer",
        "_log_step_metrics",
        "overrides",
        "stock's per-step flush of that accounting, called as stock calls it; perf/fwd_s (forward-only time, which "
        "the passes do not measure) taken back out, batch/forwarded_tokens_per_step kept where stock's FLOPs reader "
        "fails",
    ),
    InternalName(
        "trl.experimental.async_grpo.AsyncGRPOTrainer instance",
        "_peak_flops_per_device",
        "writes",
        "hf_dynbsz.testing.async_grpo_run (tests only): a peak set on CPU so stock's MFU figures are logged and "
        "compared",
    ),
    InternalName(
        "trl.experimental.async_grpo.packing",
        "_flash_attn",
        "writes",
        "hf_dynbsz.testing.reference_tree_attention (tests only): stock's FA3 kernel in plain torch, so stock runs on "
        "CPU as the comparison",
    ),
    # ---- torch
    InternalName(
        "torch.Tensor",
        "_use_count",
        "calls",
        "parallel.collectives releases a collective's held tensors once no C++ holder but the tensor's Python object "
        "and the holds is left: the work object a gloo or NCCL worker thread drops is one",
    ),
    InternalName(
        "torch.nn.parallel.DistributedDataParallel instance",
        "require_forward_param_sync",
        "writes",
        "execution.recovery settles it after a pass that raised in its forward (DDP sets it at a forward's end and "
        "broadcasts the buffers in the next forward when True): as the other processes' completed passes left it",
    ),
    # ---- transformers
    InternalName(
        "transformers.PreTrainedModel",
        "_no_split_modules",
        "reads",
        "accelerate's FSDP transformer wrap shards these classes on their own by default, so each of their calls "
        "gathers parameters (parallel.distributed.fsdp_units)",
    ),
    InternalName(
        "transformers.PretrainedConfig instance",
        "_attn_implementation",
        "writes",
        "read: the attention implementation decides the layout; switched to segment attention around the "
        "plugin's padding-free passes (hf_dynbsz.execution.attention.segment_attention)",
    ),
    InternalName(
        "transformers.PreTrainedModel",
        "_supports_attention_backend",
        "reads",
        "segment attention runs only models whose attention dispatches through AttentionInterface",
    ),
    InternalName(
        "transformers.modeling_flash_attention_utils",
        "_flash_attention_forward",
        "calls",
        "the flash-attention varlen kernel of segment attention (the base implementation's own)",
        (
            "query_states",
            "key_states",
            "value_states",
            "attention_mask",
            "query_length",
            "is_causal",
            "dropout",
            "softmax_scale",
            "cu_seq_lens_q",
            "cu_seq_lens_k",
            "max_length_q",
            "max_length_k",
            "target_dtype",
            "attn_implementation",
            "sliding_window",
            "softcap",
        ),
    ),  # s_aux: through **kwargs
    InternalName(
        "transformers.integrations.sdpa_attention",
        "sdpa_attention_forward",
        "calls",
        "segment attention runs each span of a padding-free row through transformers' own sdpa function",
        ("module", "query", "key", "value", "attention_mask", "dropout", "scaling", "is_causal"),
    ),
    InternalName(
        "transformers.models.llama.modeling_llama",
        "eager_attention_forward",
        "calls",
        "segment attention runs each span through the model's own eager function, found next to its attention "
        "module (Llama's checked here; every model of the zoo test exercises its own)",
        ("module", "query", "key", "value", "attention_mask", "scaling", "dropout"),
    ),
    InternalName(
        "transformers.modeling_rope_utils",
        "dynamic_rope_update",
        "reads",
        "execution.rope: a LongRoPE module's forward is this decorator's wrapper, which sets the frequencies of a "
        "forward by its widest position; the plugin calls it for the short and the long width, and the plain forward "
        "it wraps (__wrapped__), to give each sample the factors of stock's micro-batch",
    ),
    InternalName(
        "transformers.integrations.flash_attention",
        "get_target_dtype",
        "calls",
        "the dtype flash-attention needs when PEFT left the activations in fp32",
        ("query", "module"),
    ),
    # ---- accelerate
    InternalName(
        "accelerate.state.GradientState",
        "_set_sync_gradients",
        "calls",
        "gradients sync (and DeepSpeed steps) on the last pass of an optimizer step only",
        ("sync_gradients",),
    ),
    InternalName(
        "accelerate.state.PartialState",
        "_shared_state",
        "writes",
        "hf_dynbsz.testing.fsdp_on_cpu (tests only): FSDP's distributed type on CPU processes, written where "
        "AcceleratorState's own last step writes it",
    ),
    # ---- TRL's vLLM generation (the test stand-in of hf_dynbsz.testing.vllm_standin, not the trainer)
    InternalName(
        "trl.generation.vllm_generation.VLLMGeneration instance",
        "_llm_weights_sleeping",
        "writes",
        "the vLLM stand-in's _init_vllm sets it as TRL's does in colocate mode (whether the engine's weights sleep "
        "until the first sync)",
    ),
    # ---- TRL's fused LM head
    InternalName(
        "trl.kernels.chunked_logprob",
        "TOKEN_CHUNK_SIZE",
        "writes",
        "tensor_batch_size: tokens per tile of the fused LM head",
    ),
    InternalName(
        "trl.trainer.utils",
        "_CHUNKED_LOGPROB_CHUNK_SIZE",
        "writes",
        "tensor_batch_size: vocabulary columns per tile of the fused LM head",
    ),
    InternalName(
        "trl.trainer.utils.add_fused_lm_head",
        "fused_lm_head",
        "passes",
        "log-probs and entropies of a packed row without full logits",
        ("fused_lm_head", "shift_labels"),
    ),
    # ---- DeepSpeed Ulysses (sequence parallelism, hf_dynbsz/execution/sequence_parallel.py)
    InternalName(
        "deepspeed.runtime.sequence_parallel.parallel_state_sp",
        "_release_sequence_parallel_groups",
        "calls",
        "a second trainer in one process forms DeepSpeed's sequence-parallel groups anew (they are global)",
    ),
)


def override_drift(stock: inspect.Signature, override: inspect.Signature) -> list[str]:
    """How an override's signature fails stock's callers, one sentence a problem (empty: it fits).

    Stock's callers pass the parameters of stock's signature, by position or by name, so the override must take each
    of them at the same position (``self`` is position 0) under the same name, and must not require a parameter stock
    does not have. TRL grew ``_generate_single_turn`` from ``(prompt_ids, images, multimodal_fields)`` (1.0 to 1.9) to
    ``(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False)`` (1.16): either form against
    the other is drift.
    """
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    stock_parameters = [p for p in stock.parameters.values() if p.kind not in variadic]
    override_parameters = dict(override.parameters)
    takes_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in override_parameters.values())
    override_positional = [p.name for p in override_parameters.values() if p.kind in positional]
    problems = []
    for index, parameter in enumerate(stock_parameters):
        if parameter.name not in override_parameters and not takes_any_keyword:
            problems.append(f"stock passes {parameter.name!r}, which the override does not take")
        elif parameter.kind in positional and (
            index >= len(override_positional) or override_positional[index] != parameter.name
        ):
            problems.append(f"stock's positional parameter {index} is {parameter.name!r}, the override's is not")
    stock_names = {p.name for p in stock_parameters}
    for parameter in override_parameters.values():
        if parameter.kind not in variadic and parameter.default is inspect.Parameter.empty:
            if parameter.name not in stock_names:
                problems.append(f"the override requires {parameter.name!r}, which stock's callers do not pass")
    return problems


def unpacked_lengths(source: str, method: str) -> set[int]:
    """Lengths of the tuples that ``x, y, ... = self.<method>(...)`` unpacks in ``source`` (a module's code)."""
    lengths = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            function = node.value.func
            if isinstance(function, ast.Attribute) and function.attr == method:
                lengths |= {len(target.elts) for target in node.targets if isinstance(target, ast.Tuple)}
    return lengths


#: The environment variable that lets ``import hf_dynbsz`` go on with a TRL outside :data:`TESTED_TRL_RANGE`: ``1``
#: (or ``true``, ``yes``, ``on``) turns the :class:`UntestedTRLVersionError` into one ``RuntimeWarning``.
ALLOW_UNTESTED_TRL_ENV = "HF_DYNBSZ_ALLOW_UNTESTED_TRL"

_ALLOW_VALUES = ("1", "true", "yes", "on")


class UntestedTRLVersionError(ImportError):
    """The installed TRL is outside :data:`TESTED_TRL_RANGE` and ``HF_DYNBSZ_ALLOW_UNTESTED_TRL`` is not set."""


def _tested_specifier() -> str:
    """:data:`TESTED_TRL_RANGE` as a requirement specifier: ``">=1.16.0,<1.17.0"``."""
    lower, upper = TESTED_TRL_RANGE
    return f">={lower},<{upper}"


def _inside_tested_range(version: str) -> bool:
    """Whether ``version`` satisfies :data:`TESTED_TRL_RANGE` as pip reads the same specifier: a pre-release of the
    upper bound (``1.17.0.dev0``, TRL's main branch after 1.16) is outside, as is a string that is no version."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    return SpecifierSet(_tested_specifier()).contains(parsed, prereleases=True)


def trl_version_decision(version: str, environ: Mapping[str, str] | None = None) -> str:
    """What ``import hf_dynbsz`` does with TRL ``version``: ``"ok"`` inside :data:`TESTED_TRL_RANGE`; outside it,
    ``"warn"`` where ``environ`` (default ``os.environ``) sets :data:`ALLOW_UNTESTED_TRL_ENV` to ``1`` (or ``true``,
    ``yes``, ``on``), else ``"stop"``."""
    if _inside_tested_range(version):
        return "ok"
    environ = os.environ if environ is None else environ
    allowed = environ.get(ALLOW_UNTESTED_TRL_ENV, "").strip().lower() in _ALLOW_VALUES
    return "warn" if allowed else "stop"


def untested_trl_message(version: str, allowed: bool) -> str:
    """The one message of an untested TRL: the installed version, the tested range, the fix and the variable."""
    lower, upper = TESTED_TRL_RANGE
    stem = (
        f"hf_dynbsz was tested with trl{_tested_specifier()} but trl {version} is installed. "
        "DynamicBatchGRPOTrainer, DynamicBatchRLOOTrainer, DynamicBatchDistillationTrainer, DynamicBatchDPOTrainer and "
        "DynamicBatchAsyncGRPOTrainer override private GRPOTrainer hooks, RLOOTrainer hooks and DistillationTrainer "
        "hooks (and use DPOTrainer's and AsyncGRPOTrainer's internals) that change between TRL releases, listed in "
        "hf_dynbsz._trl_compat.INTERNAL_NAMES and docs/trl-compatibility.md."
    )
    if allowed:
        return (
            f"{stem} Going on because {ALLOW_UNTESTED_TRL_ENV} is set: run the test suite (tests/trl_range.sh "
            f"{version}) or compare against stock TRL before trusting results."
        )
    return (
        f"{stem} Fix: pip install 'trl>={lower},<{upper}'. To go on at your own risk with trl {version}, set "
        f"{ALLOW_UNTESTED_TRL_ENV}=1 (one warning instead of this error)."
    )


_warned = False


def check_trl_version(version: str | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Stop, or warn once, when TRL is outside :data:`TESTED_TRL_RANGE`; return whether it is inside.

    ``version`` defaults to the installed TRL's, read from its distribution metadata (TRL is not imported); where TRL
    is not installed there is nothing to check (False, no error: the trainers then fail at their own ``import trl``).
    Raises :class:`UntestedTRLVersionError` where :func:`trl_version_decision` says ``"stop"``; warns
    (``RuntimeWarning``, once per process) where it says ``"warn"``.
    """
    global _warned
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version("trl")
        except PackageNotFoundError:
            return False
    decision = trl_version_decision(version, environ)
    if decision == "stop":
        raise UntestedTRLVersionError(untested_trl_message(version, allowed=False))
    if decision == "warn" and not _warned:
        _warned = True
        warnings.warn(untested_trl_message(version, allowed=True), RuntimeWarning, stacklevel=2)
    return decision == "ok"

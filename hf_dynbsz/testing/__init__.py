"""Offline building blocks shared by the tests, the benchmarks and the example (as accelerate's ``test_utils``).

Nothing here downloads anything, and importing the package is cheap (torch, transformers, TRL and datasets are
imported inside the functions). The modules:

* :mod:`~hf_dynbsz.testing.fixtures`: a character-level tokenizer and tiny causal LMs built from a config (random
  weights), prompt datasets, rewards, scripted rollouts (``rollout_func``), an environment, the comparison runs'
  config and training run;
* :mod:`~hf_dynbsz.testing.vision`: tiny vision-language models, image prompt datasets, a rollout for image prompts;
* :mod:`~hf_dynbsz.testing.oracles`: reference computations the results are checked against (stock's log-probs,
  first-fit-decreasing packing, attention masks, parameter differences);
* :mod:`~hf_dynbsz.testing.passes`: one pass of a bare model as the executor runs it (collator, segment attention,
  segment recurrence);
* :mod:`~hf_dynbsz.testing.processes`: a subprocess runner with a timeout, a run's whole-process peak memory;
* :mod:`~hf_dynbsz.testing.fsdp`: accelerate's FSDP on CPU processes (accelerate turns it on for accelerator devices
  only);
* :mod:`~hf_dynbsz.testing.engines`: what a multi-process run's engine did with the parameters (recorded by the
  worker: sharded or whole, per process) against what its accelerate config asks for, and a model's whole parameters;
* :mod:`~hf_dynbsz.testing.layouts`: padding-free rows written by hand (shared prompts' segments, nodes) as planning's
  prefix tree, and a segment layout's nodes read back;
* :mod:`~hf_dynbsz.testing.mixes`: the benchmarks' named length mixes (completion and prompt lengths);
* :mod:`~hf_dynbsz.testing.preference`: preference pairs (lengths from ranges or a long tail, a system block shared
  across pairs, several pairs per prompt) and one DPO run of stock's trainer or the plugin's;
* :mod:`~hf_dynbsz.testing.prefixes`: samples with prefix structure beyond prompt groups (a block every prompt
  begins with, tree-search rollouts' trunks and branches);
* :mod:`~hf_dynbsz.testing.harness`: one builder of a run (model shape, scripted rollout of a mix, stock's or the
  plugin's config with the CPU run's fields, the trainer, a step clock) and the commands that launch workers;
* :mod:`~hf_dynbsz.testing.async_grpo`: TRL's ``AsyncGRPOTrainer`` offline: a rollout worker and a weight transfer
  through TRL's protocols over scripted samples, stock's FA3 tree kernel in plain torch, a run of either trainer;
* :mod:`~hf_dynbsz.testing.vllm_standin`: a stand-in for vLLM behind TRL's own ``VLLMGeneration`` (server and colocate
  mode: completions sampled from the synced weights, log-probs with fixed noise), installed by ``vllm_standin()``;
* :mod:`~hf_dynbsz.testing.zoo`: tiny models of every causal-LM architecture of transformers (imports torch).

Every public name but the zoo's is re-exported here: ``from hf_dynbsz.testing import X``.
"""

from __future__ import annotations

from hf_dynbsz.testing.async_grpo import (
    ASYNC_COMPARISON_FIELDS,
    ASYNC_UNCOMPARED,
    AsyncRun,
    NoWeightTransfer,
    RolloutScript,
    ScriptRolloutFunc,
    StandInRolloutWorker,
    async_grpo_on_cpu,
    async_grpo_run,
    reference_async_grpo_steps,
    reference_flash_attn_varlen_func,
    reference_tree_attention,
)
from hf_dynbsz.testing.engines import engine_mismatches, engine_record, expected_engine, gathered_parameters
from hf_dynbsz.testing.fixtures import (
    CHAT_SPECIAL_TOKENS,
    COMPARISON_FIELDS,
    DEFAULT_ALPHABET,
    TEST_ALPHABET,
    CountingEnvironment,
    MultiTurnRollout,
    RecordingReward,
    ScriptedRollout,
    base_config_kwargs,
    build_char_tokenizer,
    build_chat_tokenizer,
    build_tiny_causal_lm,
    build_tiny_hybrid_lm,
    build_tiny_moe_lm,
    build_tiny_rope_lm,
    build_tiny_teacher,
    checkpointing_field,
    load_tokenizer,
    prompt_dataset,
    run_training,
    save_tiny_model,
    save_tiny_teacher,
    unique_tokens,
)
from hf_dynbsz.testing.fsdp import fsdp_on_cpu
from hf_dynbsz.testing.harness import (
    CPU_RUN_FIELDS,
    TRAINERS,
    ModelShape,
    accelerate_command,
    build_trainer,
    construction_arguments,
    construction_error,
    distillation_config,
    distillation_trainer,
    flag_arguments,
    grpo_worker_command,
    length_reward,
    mix_rollout,
    numbered_prompts,
    positional_trainer,
    quiet_worker,
    run_config,
    run_distillation,
    run_script_worker,
    saved_model_trainer,
    scripted_run,
    snapshot_parameters,
    step_clock,
    tokenizer_rollout,
    trainer_classes,
    training_mode_trainer,
)
from hf_dynbsz.testing.layouts import Segment, node_tree, row_nodes, segment_tree
from hf_dynbsz.testing.mixes import (
    MIX_LABELS,
    MIXES,
    PREFIX_MIXES,
    PROMPT_HEAVY_RANGE,
    PROMPT_RANGE,
    UNIFORM_PROMPT,
    completion_lengths,
    longest_prompt,
    prompt_lengths,
    sequence_lengths,
)
from hf_dynbsz.testing.oracles import (
    first_fit_decreasing,
    grpo_batch,
    logged_metrics,
    logps_alone,
    metric_mismatches,
    reference_varlen_attention,
    reference_varlen_attn,
    relative_difference,
    segment_mask,
    stock_logps,
    tree_mask,
    update_difference,
)
from hf_dynbsz.testing.passes import bare_check_passes, packed_logps, packed_pass, random_passes
from hf_dynbsz.testing.preference import DPO_COMPARISON_FIELDS, DPO_PLUGIN_FIELDS, dpo_config, dpo_run, preference_pairs
from hf_dynbsz.testing.prefixes import (
    PREFIX_STRUCTURES,
    PrefixRollout,
    comparison_prefix_rollout,
    prefix_batch,
    tree_completion,
)
from hf_dynbsz.testing.processes import (
    REPO_ROOT,
    ResidentSetSampler,
    loaded_by_import,
    run_peak_mib,
    run_together,
    run_with_timeout,
)
from hf_dynbsz.testing.vision import (
    VISION_LANGUAGE_FAMILIES,
    ToolImageGeneration,
    ToolImageRollout,
    VisionScriptedRollout,
    build_tiny_vision_language_model,
    image_prompt_dataset,
)
from hf_dynbsz.testing.vllm_standin import StandInEngine, VLLMStandIn, vllm_standin

__all__ = [
    "ASYNC_COMPARISON_FIELDS",
    "ASYNC_UNCOMPARED",
    "AsyncRun",
    "NoWeightTransfer",
    "RolloutScript",
    "ScriptRolloutFunc",
    "StandInRolloutWorker",
    "async_grpo_on_cpu",
    "async_grpo_run",
    "reference_async_grpo_steps",
    "reference_flash_attn_varlen_func",
    "reference_tree_attention",
    "Segment",
    "node_tree",
    "row_nodes",
    "segment_tree",
    "DPO_COMPARISON_FIELDS",
    "DPO_PLUGIN_FIELDS",
    "dpo_config",
    "dpo_run",
    "preference_pairs",
    "unique_tokens",
    "PREFIX_STRUCTURES",
    "PrefixRollout",
    "comparison_prefix_rollout",
    "prefix_batch",
    "tree_completion",
    "CHAT_SPECIAL_TOKENS",
    "COMPARISON_FIELDS",
    "CPU_RUN_FIELDS",
    "CountingEnvironment",
    "DEFAULT_ALPHABET",
    "MIXES",
    "PREFIX_MIXES",
    "MIX_LABELS",
    "ModelShape",
    "MultiTurnRollout",
    "PROMPT_HEAVY_RANGE",
    "PROMPT_RANGE",
    "REPO_ROOT",
    "RecordingReward",
    "ResidentSetSampler",
    "ScriptedRollout",
    "TEST_ALPHABET",
    "TRAINERS",
    "UNIFORM_PROMPT",
    "StandInEngine",
    "VISION_LANGUAGE_FAMILIES",
    "VLLMStandIn",
    "ToolImageGeneration",
    "ToolImageRollout",
    "VisionScriptedRollout",
    "accelerate_command",
    "bare_check_passes",
    "base_config_kwargs",
    "build_char_tokenizer",
    "build_chat_tokenizer",
    "build_tiny_causal_lm",
    "build_tiny_hybrid_lm",
    "build_tiny_moe_lm",
    "build_tiny_rope_lm",
    "build_tiny_teacher",
    "build_tiny_vision_language_model",
    "build_trainer",
    "checkpointing_field",
    "completion_lengths",
    "construction_arguments",
    "construction_error",
    "distillation_config",
    "distillation_trainer",
    "first_fit_decreasing",
    "flag_arguments",
    "grpo_batch",
    "grpo_worker_command",
    "image_prompt_dataset",
    "length_reward",
    "load_tokenizer",
    "loaded_by_import",
    "logged_metrics",
    "logps_alone",
    "longest_prompt",
    "metric_mismatches",
    "mix_rollout",
    "numbered_prompts",
    "packed_logps",
    "packed_pass",
    "positional_trainer",
    "prompt_dataset",
    "prompt_lengths",
    "quiet_worker",
    "random_passes",
    "reference_varlen_attention",
    "reference_varlen_attn",
    "relative_difference",
    "run_config",
    "run_distillation",
    "run_peak_mib",
    "run_script_worker",
    "run_training",
    "run_together",
    "run_with_timeout",
    "engine_mismatches",
    "engine_record",
    "expected_engine",
    "fsdp_on_cpu",
    "gathered_parameters",
    "save_tiny_model",
    "save_tiny_teacher",
    "saved_model_trainer",
    "scripted_run",
    "segment_mask",
    "tree_mask",
    "sequence_lengths",
    "snapshot_parameters",
    "step_clock",
    "stock_logps",
    "tokenizer_rollout",
    "trainer_classes",
    "training_mode_trainer",
    "update_difference",
    "vllm_standin",
]

"""Every causal-LM architecture of the installed transformers, trained by stock TRL and by the plugin.

Each architecture is built tiny from its default config (:mod:`hf_dynbsz.testing.zoo`: random weights, offline, its own
features kept on: sliding windows of 8, multi-head latent attention, sinks, soft-capping, MoE routers, recurrent
and state-space layers) and trained for two optimizer steps with default settings by stock ``GRPOTrainer`` and by
``DynamicBatchGRPOTrainer`` on the same scripted long-tailed rollouts. What is checked, per architecture:

* **equal to stock**: with prompts of equal token length (no left padding: stock's padded forward is then per-sample
  exact for every causal model) the parameters after two steps equal stock's within 1e-5 (relative); with prompts of
  varied length too, unless stock's own result depends on its padding (:data:`STOCK_DEPENDS_ON_PADDING`);
* **per-sample exact**: the plugin's log-probs of a step with varied prompt lengths and prompt groups, in the layout
  it trains with, equal each sample computed alone (what generation computed) within 1e-4;
* **the decision**: the layout the run trains with after the self-check is the one recorded in
  :data:`ARCHITECTURES` (a change of what the plugin does for a model shows here);
* **every architecture is classified**: one transformers adds fails :func:`test_every_architecture_is_classified`
  until it has an entry in :data:`ARCHITECTURES` or :data:`EXCLUDED`.

By default a representative subset (:data:`REPRESENTATIVE`) runs; ``python -m pytest -m zoo tests/test_model_zoo.py``
runs every architecture (about 5-6 minutes on 2 cores). The architecture table of
``docs/compatibility.md`` is generated from this file (``python tests/test_model_zoo.py docs/compatibility.md``
rewrites it; :func:`test_docs_table_is_the_generated_one` fails when it differs).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: python tests/test_model_zoo.py docs/compatibility.md
    sys.path.insert(0, str(ROOT))

from hf_dynbsz.planning.settings import readme_block, with_readme_block  # noqa: E402
from hf_dynbsz.testing import checkpointing_field  # noqa: E402
from hf_dynbsz.testing.zoo import TinyConfigUnavailable, causal_lm_types, tiny_causal_lm_config  # noqa: E402

PARAM_TOLERANCE = 1e-5
LOGPROB_TOLERANCE = 1e-4


def _transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int(minor)


#: The installed transformers release (major, minor): architectures it lacks are not run, and an architecture whose
#: layout changed between releases is expected to train as that release makes it (:data:`EARLIER`).
TRANSFORMERS = _transformers_version()

#: What the plugin trains each architecture with after the self-check (``Layout.describe()`` of the layout, or
#: "stock math"), with default settings and the model's default attention implementation.
SHARED = "padding_free, prefix tree, segment attention (sdpa)"
SHARED_EAGER = "padding_free, prefix tree, segment attention (eager)"
#: hybrid and state-space models: their sequence mixers run per sequence (hf_dynbsz.execution.recurrence)
SHARED_RECURRENT = "padding_free, prefix tree, segment attention (sdpa), segment recurrence"
SHARED_RECURRENT_EAGER = "padding_free, prefix tree, segment attention (eager), segment recurrence"
PADDED = "padded"
MASKED = "padded, attention mask"
STOCK = "stock math"


@dataclasses.dataclass(frozen=True)
class Expect:
    """``layout``: what the run trains with; ``why``: why not a faster one (empty for padding-free rows)."""

    layout: str
    why: str = ""


# Why an architecture trains in a slower layout (read off the model by hf_dynbsz.planning.model_support, or found by the
# self-check); the table of docs/compatibility.md shows them.
_NO_BACKEND = "attention not dispatched through transformers' AttentionInterface"
_NO_POSITIONS = "its forward takes no position ids (positions would run on along a padding-free row)"
_STATE = "layers that carry state along a row outside a sequence mixer segment recurrence runs per sequence"
_RELATIVE = "self-check: its relative-position logits span the whole row, which segment attention does not cut"
_BIDIRECTIONAL = "attention looks in both directions: padding needs a mask"
_BLT = "self-check: byte n-gram hashes and entropy patches cross sequences in a padding-free row"
_NONE_EXACT = "self-check: no layout gives each sample's own log-probs"
_INDEXED = "indexed sparse attention: a sample's log-probs depend on its padded width, in stock too"
_INDEXED_ANY = (
    "indexed sparse attention, which the plugin leaves to stock math by its layer type; this one counts sinks, local "
    "keys and pool blocks from each query's first visible key, so stock's log-probs do not depend on the padded width"
)
# Why an architecture is not trained by the test
_MULTIMODAL = "multimodal: a vision / audio model (the vision-language tests cover Qwen2-VL, Qwen2.5-VL, LLaVA)"
_DRAFTER = "speculative-decoding drafter: its forward needs the target model's embeddings and key/value states"
_TRL_AUX_LOSS = "stock GRPOTrainer fails with default settings: TRL's router aux loss reads config.num_experts"

#: Every architecture trained by the test, and what the plugin trains it with.
ARCHITECTURES: dict[str, Expect] = {
    "afmoe": Expect(SHARED),
    "apertus": Expect(SHARED),
    "apertus1p5_text": Expect(SHARED),
    "arcee": Expect(SHARED),
    "aria_text": Expect(SHARED),
    "axk1": Expect(SHARED),
    "axk2": Expect(STOCK, _INDEXED),
    "bailing_hybrid": Expect(SHARED_RECURRENT),
    "bamba": Expect(SHARED_RECURRENT),
    "bart": Expect(PADDED, _NO_POSITIONS),
    "beam": Expect(SHARED),
    "bert": Expect(SHARED),
    "bert-generation": Expect(SHARED),
    "big_bird": Expect(PADDED, _NO_BACKEND),
    "bigbird_pegasus": Expect(MASKED, _BIDIRECTIONAL),
    "biogpt": Expect(SHARED),
    "bitnet": Expect(SHARED),
    "blenderbot": Expect(PADDED, _NO_POSITIONS),
    "blenderbot-small": Expect(PADDED, _NO_POSITIONS),
    "bloom": Expect(PADDED, _NO_POSITIONS),
    "blt": Expect(PADDED, _BLT),
    "camembert": Expect(SHARED),
    "codegen": Expect(SHARED),
    "cohere": Expect(SHARED),
    "cohere2": Expect(SHARED),
    "cohere2_moe": Expect(SHARED),
    "cohere_compass_text": Expect(SHARED),
    "cpmant": Expect(STOCK, _NONE_EXACT),
    "ctrl": Expect(SHARED),
    "cwm": Expect(SHARED),
    "data2vec-text": Expect(SHARED),
    "dbrx": Expect(SHARED),
    "deepseek_v2": Expect(SHARED),
    "deepseek_v3": Expect(SHARED),
    "deepseek_v32": Expect(STOCK, _INDEXED),
    "diffllama": Expect(SHARED),
    "dory": Expect(SHARED),
    "dots1": Expect(SHARED),
    "dots3_note_text": Expect(STOCK, _INDEXED),
    "electra": Expect(SHARED),
    "ergo": Expect(SHARED),
    "ernie": Expect(SHARED),
    "ernie4_5": Expect(SHARED),
    "ernie4_5_moe": Expect(SHARED),
    "exaone": Expect(SHARED),
    "exaone4": Expect(SHARED),
    "exaone_moe": Expect(SHARED),
    "falcon": Expect(SHARED),
    "falcon_h1": Expect(SHARED_RECURRENT),
    "falcon_mamba": Expect(SHARED_RECURRENT_EAGER),
    "flex_olmo": Expect(SHARED),
    "flint": Expect(SHARED_EAGER),
    "gemma": Expect(SHARED),
    "gemma2": Expect(SHARED_EAGER),
    "gemma3_text": Expect(SHARED),
    "gemma3n_text": Expect(SHARED),
    "gemma4_text": Expect(SHARED),
    "gemma4_unified_text": Expect(SHARED),
    "glm": Expect(SHARED),
    "glm4": Expect(SHARED),
    "glm4_moe": Expect(SHARED),
    "glm4_moe_lite": Expect(SHARED),
    "glm_moe_dsa": Expect(STOCK, _INDEXED),
    "gpt-sw3": Expect(SHARED),
    "gpt2": Expect(SHARED),
    "gpt_bigcode": Expect(SHARED),
    "gpt_neo": Expect(PADDED, _NO_BACKEND),
    "gpt_neox": Expect(SHARED),
    "gpt_neox_japanese": Expect(PADDED, _NO_BACKEND),
    "gpt_oss": Expect(SHARED_EAGER),
    "gptj": Expect(SHARED),
    "granite": Expect(SHARED),
    "granite_swa": Expect(SHARED_EAGER),
    "helium": Expect(SHARED),
    "hrm_text": Expect(SHARED),
    "hunyuan_v1_dense": Expect(SHARED),
    "hunyuan_v1_moe": Expect(SHARED),
    "hy_v3": Expect(SHARED),
    "hy_v4": Expect(STOCK, _INDEXED),
    "hyperclovax": Expect(SHARED),
    "inkling2_loop_text": Expect(PADDED, _RELATIVE),
    "inkling2_text": Expect(PADDED, _RELATIVE),
    "inkling_text": Expect(PADDED, _RELATIVE),
    "internlm3": Expect(SHARED),
    "iquestcoder": Expect(SHARED),
    "jais2": Expect(SHARED),
    "jamba": Expect(SHARED_RECURRENT),
    "jetmoe": Expect(SHARED),
    "kimi_linear": Expect(SHARED_RECURRENT),
    "kolibri1": Expect(SHARED),
    "kolibri1_1": Expect(STOCK, _INDEXED_ANY),
    "laguna": Expect(SHARED),
    "lara_mini": Expect(SHARED_RECURRENT),
    "lfm2": Expect(SHARED_RECURRENT),
    "lfm2_moe": Expect(SHARED_RECURRENT),
    "lfm3": Expect(SHARED_RECURRENT),
    "llama": Expect(SHARED),
    "longcat_flash": Expect(SHARED),
    "mamba": Expect(SHARED_RECURRENT_EAGER),
    "mamba2": Expect(SHARED_RECURRENT_EAGER),
    "marian": Expect(PADDED, _NO_POSITIONS),
    "mbart": Expect(PADDED, _NO_POSITIONS),
    "megatron-bert": Expect(PADDED, _NO_BACKEND),
    "mellum": Expect(SHARED),
    "mimo_v2_flash": Expect(SHARED_EAGER),
    "minicpm3": Expect(SHARED),
    "minicpm5_moe": Expect(SHARED),
    "minimax": Expect(SHARED_RECURRENT),
    "minimax_m2": Expect(SHARED),
    "minimax_m3_vl_text": Expect(PADDED, _STATE),
    "ministral": Expect(SHARED),
    "ministral3": Expect(SHARED),
    "mistral": Expect(SHARED),
    "mixtral": Expect(SHARED),
    "modernbert-decoder": Expect(SHARED),
    "moshi": Expect(SHARED),
    "mpt": Expect(PADDED, _NO_POSITIONS),
    "mvp": Expect(PADDED, _NO_POSITIONS),
    "nanochat": Expect(SHARED),
    "nemotron": Expect(SHARED),
    "nemotron_h": Expect(SHARED_RECURRENT),
    "olmo": Expect(SHARED),
    "olmo2": Expect(SHARED),
    "olmo3": Expect(SHARED),
    "olmo_hybrid": Expect(SHARED_RECURRENT),
    "olmoe": Expect(SHARED),
    "openai-gpt": Expect(PADDED, _NO_BACKEND),
    "opt": Expect(SHARED),
    "param2moe": Expect(SHARED),
    "pegasus": Expect(PADDED, _NO_POSITIONS),
    "persimmon": Expect(SHARED),
    "phi": Expect(SHARED),
    "phi3": Expect(SHARED),
    "plbart": Expect(PADDED, _NO_POSITIONS),
    "prophetnet": Expect(PADDED, _NO_POSITIONS),
    "qwen2": Expect(SHARED),
    "qwen2_moe": Expect(SHARED),
    "qwen3": Expect(SHARED),
    "qwen3_5_moe_text": Expect(SHARED_RECURRENT),
    "qwen3_5_text": Expect(SHARED_RECURRENT),
    "qwen3_moe": Expect(SHARED),
    "qwen3_next": Expect(SHARED_RECURRENT),
    "qwen4_exp_text": Expect(STOCK, _INDEXED),
    "recurrent_gemma": Expect(SHARED_RECURRENT),
    "rembert": Expect(PADDED, _NO_BACKEND),
    "roberta": Expect(SHARED),
    "roberta-prelayernorm": Expect(SHARED),
    "roc_bert": Expect(SHARED),
    "roformer": Expect(PADDED, _NO_POSITIONS),
    "rwkv": Expect(PADDED, _STATE),
    "sarvam_mla": Expect(SHARED),
    "sarvam_moe": Expect(SHARED),
    "seed_oss": Expect(SHARED),
    "smollm3": Expect(SHARED),
    "solar_open": Expect(SHARED),
    "stablelm": Expect(SHARED),
    "starcoder2": Expect(SHARED),
    "trocr": Expect(PADDED, _NO_POSITIONS),
    "vaultgemma": Expect(SHARED_EAGER),
    "whisper": Expect(PADDED, _NO_POSITIONS),
    "xglm": Expect(PADDED, _NO_BACKEND),
    "xlm": Expect(PADDED, _NO_BACKEND),
    "xlm-roberta": Expect(SHARED),
    "xlm-roberta-xl": Expect(SHARED),
    "xlnet": Expect(MASKED, _BIDIRECTIONAL),
    "xlstm": Expect(PADDED, _STATE),
    "xmod": Expect(SHARED),
    "youtu": Expect(SHARED),
    "zamba": Expect(SHARED_RECURRENT),
    "zamba2": Expect(SHARED_RECURRENT),
    "zaya": Expect(PADDED, _STATE),
}

#: Architectures whose layout changed in a transformers release: (release, what earlier releases train it with).
EARLIER: dict[str, tuple[tuple[int, int], Expect]] = {
    # transformers 5.24 moved CodeGen's and GPT-J's attention onto the AttentionInterface
    "codegen": ((5, 24), Expect(PADDED, _NO_BACKEND)),
    "gptj": ((5, 24), Expect(PADDED, _NO_BACKEND)),
    # transformers 5.25 moved Falcon's attention onto the AttentionInterface
    "falcon": ((5, 25), Expect(PADDED, _NO_BACKEND)),
}

#: Architectures that a transformers release added after the oldest one this package supports (major, minor): with an
#: older release installed they are not run, and their entries are not stale.
SINCE: dict[str, tuple[int, int]] = {
    **dict.fromkeys(
        ("apertus1p5_text", "dory", "exaone", "inkling2_loop_text", "lara_mini", "sarvam_mla", "sarvam_moe"), (5, 24)
    ),
    **dict.fromkeys(("ergo", "kolibri1_1", "minicpm5_moe", "param2moe"), (5, 25)),
}


def expected(model_type: str) -> Expect:
    """What the installed transformers release trains ``model_type`` with (:data:`ARCHITECTURES`, or :data:`EARLIER`
    for a release before the change)."""
    if model_type in EARLIER and TRANSFORMERS < EARLIER[model_type][0]:
        return EARLIER[model_type][1]
    return ARCHITECTURES[model_type]


#: Architectures not trained by the test, with the reason.
EXCLUDED: dict[str, str] = {
    "deepseek_v4": _TRL_AUX_LOSS,
    "doge": "stock GRPOTrainer fails with default settings: IndexError: tuple index out of range",
    "dots3_note": _MULTIMODAL,
    "emu3": _MULTIMODAL,
    "fuyu": _MULTIMODAL,
    "gemma3": _MULTIMODAL,
    "gemma3n": _MULTIMODAL,
    "gemma4": _MULTIMODAL,
    "gemma4_assistant": _DRAFTER,
    "gemma4_unified": _MULTIMODAL,
    "gemma4_unified_assistant": _DRAFTER,
    "git": _MULTIMODAL,
    "got_ocr2": _MULTIMODAL,
    "granitemoe": _TRL_AUX_LOSS,
    "granitemoe_swa": _TRL_AUX_LOSS,
    "granitemoehybrid": _TRL_AUX_LOSS,
    "granitemoeshared": _TRL_AUX_LOSS,
    "llama4": _MULTIMODAL,
    "llama4_text": "stock GRPOTrainer fails with default settings: AttributeError: 'MoeCausalLMOutputWithPast' object "
    "has no attribute 'last_hidden_state'",
    "mllama": _MULTIMODAL,
    "moss_transcribe_diarize": _MULTIMODAL,
    "musicgen": _MULTIMODAL,
    "musicgen_melody": _MULTIMODAL,
    "phi4_multimodal": _MULTIMODAL,
    "phimoe": _TRL_AUX_LOSS,
    "qwen3_5": _MULTIMODAL,
    "qwen3_5_moe": _MULTIMODAL,
    "qwen4_exp": _MULTIMODAL,
    "reformer": "stock GRPOTrainer fails with default settings: ValueError: If training, sequence length 19 has to be "
    "a multiple of least common multiple chunk_length 4",
}

#: Architectures whose stock result depends on the left padding of its prompts: positions not derived from the
#: attention mask (GPT-2 and its kin, BERT-style decoders, BART-style decoders: a left-padded sample's positions are
#: shifted in stock's training forward, while generation computed them from the mask), state carried through the
#: pads (RWKV, xLSTM, RecurrentGemma), stock's padded forward giving NaN (Gemma-3n), or queries scaled per channel
#: after RoPE (Dory's nGPT ``sqk``: once trained unevenly, attention depends on absolute positions, which stock's
#: left padding shifts). With prompts of equal length stock is per-sample exact and the plugin equals it; with varied
#: lengths the plugin keeps each sample's own log-probs (checked against the per-sample reference) and stock does not,
#: so the two are not compared there.
STOCK_DEPENDS_ON_PADDING: frozenset[str] = frozenset(
    {
        "bart",
        "bert",
        "bert-generation",
        "big_bird",
        "bigbird_pegasus",
        "biogpt",
        "blenderbot",
        "blenderbot-small",
        "blt",
        "ctrl",
        "dory",
        "electra",
        "ernie",
        "gemma3n_text",
        "gpt-sw3",
        "gpt2",
        "gpt_bigcode",
        "gpt_neo",
        "hunyuan_v1_dense",
        "hunyuan_v1_moe",
        "marian",
        "mbart",
        "megatron-bert",
        "minimax_m3_vl_text",
        "mvp",
        "openai-gpt",
        "pegasus",
        "plbart",
        "prophetnet",
        "recurrent_gemma",
        "rembert",
        "roc_bert",
        "rwkv",
        "trocr",
        "whisper",
        "xglm",
        "xlm",
        "xlstm",
    }
)

#: The subset the default test run trains: one architecture of each kind the decision module tells apart.
REPRESENTATIVE = (
    "llama",
    "mistral",
    "gemma2",
    "gemma3_text",
    "deepseek_v3",
    "nemotron",
    "roberta",
    "gpt2",
    "bart",
    "xlnet",
    "rwkv",
    "qwen3_5_text",
    "deepseek_v32",
    "qwen3_moe",
    "blt",
    "cpmant",
    "codegen",
    "gpt_oss",
)


# ---------------------------------------------------------------------------------------------------------------
# Running one architecture
# ---------------------------------------------------------------------------------------------------------------
def _rollout(equal_prompts: bool, across_groups: bool = True):
    """Prompts of 3 tokens of their own (or 1-10). ``across_groups``: every prompt begins with the same 3 tokens (a
    block shared across prompts) and a prompt's completions share their first 2 tokens, so that the default prefix tree
    shares beyond prompt groups; otherwise prompts share nothing beyond their group, and a prompt's completions begin
    with one of two tokens (each pair of them agrees on its first token only: a fork of one token below the prompt, what
    two completions of a model that begin alike make)."""
    from hf_dynbsz.testing import PrefixRollout

    prompt_length = (lambda rng: 3) if equal_prompts else (lambda rng: rng.integers(1, 11))
    lengths = lambda rng, n, rank: rng.geometric(0.12, n)  # noqa: E731
    structure = dict(shared=3, trunk=2) if across_groups else dict(branches=2, branch=1)
    return PrefixRollout(lengths, prompt_length, max_completion_length=24, seed=0, token_high=60, **structure)


def train(
    model_type: str,
    trainer_cls,
    config_cls,
    output_dir: str,
    equal_prompts: bool,
    layer_pattern: str = "one_per_kind",
    across_groups: bool = True,
    **settings,
):
    """Two optimizer steps of ``trainer_cls`` on the tiny ``model_type`` (``layer_pattern``: see
    :func:`~hf_dynbsz.testing.zoo.tiny_causal_lm_config`): :func:`train_model`, ``(initial, final parameters,
    trainer)``."""
    from hf_dynbsz.testing.zoo import build_tiny_causal_lm_of_type

    model = build_tiny_causal_lm_of_type(model_type, seed=0, layer_pattern=layer_pattern)
    return train_model(model, trainer_cls, config_cls, output_dir, equal_prompts, across_groups, **settings)


def train_model(model, trainer_cls, config_cls, output_dir: str, equal_prompts: bool, across_groups: bool, **settings):
    """Two optimizer steps of ``trainer_cls`` on ``model`` (``equal_prompts``, ``across_groups``: see
    :func:`_rollout`; ``settings``: GRPOConfig fields): ``(initial, final parameters, trainer)``. Also
    ``benchmarks/gemma3n_residual.py``'s run."""
    from hf_dynbsz.testing import (
        RecordingReward,
        base_config_kwargs,
        build_char_tokenizer,
        build_trainer,
        prompt_dataset,
        snapshot_parameters,
    )

    # TRL turns gradient checkpointing on by default; a model that does not support it trains without, in both
    overrides = {} if model.supports_gradient_checkpointing else {checkpointing_field(): False}
    args = config_cls(**base_config_kwargs(output_dir, **{**settings, **overrides}))
    dataset, reward, rollout = prompt_dataset(), RecordingReward(), _rollout(equal_prompts, across_groups)
    trainer = build_trainer(
        args, model, build_char_tokenizer(), dataset=dataset, reward=reward, rollout=rollout, trainer_cls=trainer_cls
    )
    initial = snapshot_parameters(model)
    trainer.train()
    return initial, snapshot_parameters(trainer.model), trainer


def trained_layout(trainer) -> str:
    """What ``trainer`` trained with: its scheduler's layout, or "stock math"."""
    if not trainer._dynbsz.enabled:
        return STOCK
    return trainer._dynbsz.scheduler.describe()


def tree_really_ran(trainer, layout: str) -> bool:
    """Whether a run whose ``layout`` names a prefix tree saved tokens beyond prompt groups at every repacked step (the
    rollout's block shared across prompts, or its completions' forks after their first token; a tree layout kept but
    sharing only prompts would not); True for other layouts."""
    steps = [entry for entry in trainer.state.log_history if "dynbsz/microbatches" in entry]
    return "prefix tree" not in layout or bool(steps) and all(s.get("dynbsz/tree_tokens_saved", 0) > 0 for s in steps)


def per_sample_error(trainer) -> float:
    """Largest difference between the plugin's log-probs of a step (a 5-token block every prompt begins with, varied
    prompt lengths, prompt groups of 3 whose completions share a trunk, then one of two branches; the trainer's
    layout and schedule) and each sample computed alone; 0 for stock math."""
    import torch

    from hf_dynbsz.execution.packing import SequenceTable
    from hf_dynbsz.testing import logps_alone, prefix_batch

    if not trainer._dynbsz.enabled:
        return 0.0
    leaves = (1, 20, 7, 3, 14, 9, 24, 2, 11, 5, 17, 8)
    batch = prefix_batch((3, 9, 5, 12), leaves, (3, 3, 3, 3), shared=5, trunk=3, branches=2, branch=2, seed=5,
                         token_high=60)  # fmt: skip
    table = SequenceTable.from_padded(*batch)
    model = trainer.model
    model.eval()
    with torch.no_grad():
        logps, _, _ = trainer._dynbsz.no_grad_passes(model, table, batch[2].size(1), False, stock_tokens=40)
        error = 0.0
        for i, c in enumerate(table.completion_lengths.tolist()):  # alone: no padding, no position ids
            error = max(error, float((logps[i, :c] - logps_alone(model, table, i)).abs().max()))
    return error


def run_architecture(model_type: str, directory: Path) -> dict:
    """Everything the test checks for one architecture, measured: differences from stock, the per-sample error and
    the layout trained with."""
    from trl import GRPOConfig, GRPOTrainer

    from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
    from hf_dynbsz.testing import relative_difference

    result = {}
    for name, equal in (("equal_prompts", True), ("varied_prompts", False)):
        initial, stock, _ = train(model_type, GRPOTrainer, GRPOConfig, str(directory / f"stock-{name}"), equal)
        initial_ours, ours, trainer = train(
            model_type, DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig, str(directory / f"ours-{name}"), equal
        )
        assert relative_difference(initial_ours, initial) == 0.0, "both trainers start from the same weights"
        result[name] = relative_difference(ours, stock)
        if equal:
            result["layout"] = trained_layout(trainer)
            result["tree_ran"] = tree_really_ran(trainer, result["layout"])
        else:
            result["per_sample_error"] = per_sample_error(trainer)
    return result


# ---------------------------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------------------------
def test_every_architecture_is_classified():
    types = set(causal_lm_types())
    unclassified = sorted(types - set(ARCHITECTURES) - set(EXCLUDED))
    assert not unclassified, (
        f"architectures new to transformers: {unclassified}; run them through "
        "run_architecture and add each to ARCHITECTURES or EXCLUDED"
    )
    assert not (set(ARCHITECTURES) & set(EXCLUDED))
    stale = (set(ARCHITECTURES) | set(EXCLUDED)) - types - {t for t, since in SINCE.items() if TRANSFORMERS < since}
    assert not stale, f"entries for architectures transformers no longer has: {sorted(stale)}"
    assert set(SINCE) <= set(ARCHITECTURES) | set(EXCLUDED)
    assert not {t for t, since in SINCE.items() if TRANSFORMERS >= since} - types, "SINCE names the wrong release"


def test_excluded_architectures_cannot_be_built_or_trained_by_stock():
    """An exclusion is data with a reason: tiny configs that cannot be built say so themselves."""
    for model_type, reason in EXCLUDED.items():
        assert reason
        if reason.startswith("multimodal") or reason.startswith("speculative"):
            with pytest.raises(TinyConfigUnavailable):
                tiny_causal_lm_config(model_type)


def test_layer_selection_keeps_the_layers_read_and_renumbers_them():
    """A layer reading another layer's keys and values (``kv_source_layers``, Kolibri-1.1's layout: indexed layers every
    5th, indexers among them, two leading dense-MLP layers) keeps its source when the zoo cuts the layers, and every
    index list names the new layer numbers."""
    from hf_dynbsz.testing.zoo import _select_layers

    layer_types = ["indexed_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(20)]
    sources = [4 if i in (9, 14) else i for i in range(20)]
    fields = dict(layer_types=layer_types, index_layers=[4, 14], kv_source_layers=sources, mlp_only_layers=[0, 1])
    chosen, lists = _select_layers(fields, 20)
    assert chosen == [0, 4, 14]  # 14 covers "reads another layer", and brings 4, the layer it reads
    assert lists == {
        "layer_types": ["sliding_attention", "indexed_attention", "indexed_attention"],
        "index_layers": [1, 2],
        "mlp_only_layers": [0],
        "kv_source_layers": [0, 1, 1],
    }


def _params():
    """Every architecture (marker ``zoo``); the representative ones also run by default (see tests/conftest.py)."""
    installed = set(causal_lm_types())
    for model_type in sorted(ARCHITECTURES):
        marks = [pytest.mark.zoo] + ([pytest.mark.representative] if model_type in REPRESENTATIVE else [])
        if model_type not in installed:  # an older transformers release than the table's (SINCE, or earlier)
            release = ".".join(map(str, TRANSFORMERS))
            marks.append(pytest.mark.skip(reason=f"{model_type} is not in the installed transformers {release}"))
        yield pytest.param(model_type, marks=marks, id=model_type)


@pytest.fixture
def one_thread():
    """Tiny models: one thread is many times faster than two on a loaded 2-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_type", list(_params()))
def test_architecture_trains_as_stock(model_type, tmp_path, one_thread, caplog):
    expected_layout = expected(model_type).layout
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        result = run_architecture(model_type, tmp_path)
    assert result["layout"] == expected_layout, caplog.text[-3000:]
    assert result["tree_ran"], result
    assert result["equal_prompts"] <= PARAM_TOLERANCE, result
    if model_type not in STOCK_DEPENDS_ON_PADDING:
        assert result["varied_prompts"] <= PARAM_TOLERANCE, result
    assert result["per_sample_error"] <= LOGPROB_TOLERANCE, result


#: Loss types the hybrid and state-space architectures (segment recurrence) also train under, with num_iterations 2.
RECURRENT_LOSS_TYPES = ("grpo", "dapo", "bnpo")


def _recurrent_params():
    """Every architecture trained through segment recurrence, under each of :data:`RECURRENT_LOSS_TYPES` (marker
    ``zoo``; the representative ones also run by default)."""
    for param in _params():
        (model_type,) = param.values
        if "segment recurrence" in expected(model_type).layout:
            for loss_type in RECURRENT_LOSS_TYPES:
                yield pytest.param(model_type, loss_type, marks=param.marks, id=f"{model_type}-{loss_type}")


@pytest.mark.parametrize(("model_type", "loss_type"), list(_recurrent_params()))
def test_recurrent_architecture_trains_as_stock_under_each_loss_type(model_type, loss_type, tmp_path, one_thread):
    """Padding-free rows with a prefix tree through segment recurrence, old-policy log-probs from a packed no-grad
    pass (num_iterations 2): the parameters equal stock's (prompts of equal length: stock's own forward is then
    per-sample exact)."""
    from trl import GRPOConfig, GRPOTrainer

    from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
    from hf_dynbsz.testing import relative_difference

    settings = dict(loss_type=loss_type, num_iterations=2)
    _, stock, _ = train(model_type, GRPOTrainer, GRPOConfig, str(tmp_path / "stock"), True, **settings)
    _, ours, trainer = train(
        model_type, DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig, str(tmp_path / "ours"), True, **settings
    )
    assert trained_layout(trainer) == expected(model_type).layout
    assert tree_really_ran(trainer, trained_layout(trainer))
    assert relative_difference(ours, stock) <= PARAM_TOLERANCE


def test_the_segment_recurrence_families_are_the_tables():
    from hf_dynbsz.testing.zoo import SEGMENT_RECURRENCE_FAMILIES

    recurrent = {model_type for model_type, expect in ARCHITECTURES.items() if "segment recurrence" in expect.layout}
    assert set(SEGMENT_RECURRENCE_FAMILIES) == recurrent


#: The runs of each segment-recurrence family from its defaults' layer pattern: (prompt lengths equal, prompts share
#: a block across groups (else nothing beyond their group: :func:`_rollout`), the prefix tree on, gradient
#: checkpointing on (TRL's default)). A prefix tree over prompts sharing nothing beyond their group has inner nodes of
#: one token below a root (a fork of a prompt's completions after their first token): a Mamba-2 mixer ran them through
#: its decoding path, whose in-place state update raised in the backward (and, recomputed under checkpointing, gave
#: gradients 1e-4 off in the updates, 4e-6 in the parameters), in Mamba-2, Bamba, Falcon-H1, Nemotron-H, Zamba, Zamba2.
DEFAULT_PATTERN_RUNS = {
    "equal-across": (True, True, True, True),
    "varied-across": (False, True, True, True),
    "equal-within": (True, False, True, True),
    "varied-within": (False, False, True, True),
    "varied-within-no-checkpointing": (False, False, True, False),
    "unshared": (True, True, False, True),
}
#: The (family, run) of :data:`DEFAULT_PATTERN_RUNS` that also run by default: a Jamba (four Mamba layers in a row, MoE
#: between them, attention last), and a Mamba-2 over prompts sharing nothing beyond their group.
DEFAULT_PATTERN_REPRESENTATIVE = {
    ("jamba", "equal-across"),
    ("jamba", "unshared"),
    ("mamba2", "varied-within-no-checkpointing"),
}


def _default_pattern_params():
    """Every segment-recurrence family under each of :data:`DEFAULT_PATTERN_RUNS` (marker ``zoo``; those of
    :data:`DEFAULT_PATTERN_REPRESENTATIVE` also run by default)."""
    for param in _params():
        (model_type,) = param.values
        if "segment recurrence" not in expected(model_type).layout:
            continue
        for run in DEFAULT_PATTERN_RUNS:
            marks = [mark for mark in param.marks if mark.name != "representative"]
            if (model_type, run) in DEFAULT_PATTERN_REPRESENTATIVE:
                marks.append(pytest.mark.representative)
            yield pytest.param(model_type, run, marks=marks, id=f"{model_type}-{run}")


@pytest.mark.parametrize(("model_type", "run"), list(_default_pattern_params()))
def test_recurrent_family_from_its_defaults_layer_pattern_trains_as_stock(model_type, run, tmp_path, one_thread):
    """Each hybrid and state-space family from its config class's defaults, reduced in size only
    (``layer_pattern="default"``: its real pattern of layers, several recurrent ones in a row, MoE between them where it
    has MoE), trains as stock (:data:`DEFAULT_PATTERN_RUNS`): prompts of equal and of different lengths, sharing a
    block across groups or nothing beyond their group, the prefix tree on and off, gradient checkpointing on and off.
    The one-layer-of-each-kind models of the table above hid a Jamba whose blocks ignored their prefix's recurrent
    state (A_log 68% off stock); prompts sharing a block across groups hid the Mamba-2 mixers' one-token forks. Where
    stock's result depends on its prompts' padding, prompts of different lengths are checked per sample instead."""
    from trl import GRPOConfig, GRPOTrainer

    from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
    from hf_dynbsz.testing import relative_difference

    equal, across, share, checkpointing = DEFAULT_PATTERN_RUNS[run]
    runs = dict(layer_pattern="default", across_groups=across, **{checkpointing_field(): checkpointing})
    _, stock, _ = train(model_type, GRPOTrainer, GRPOConfig, str(tmp_path / "stock"), equal, **runs)
    _, ours, trainer = train(
        model_type, DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig, str(tmp_path / "ours"), equal, **runs,
        share_prompt_prefix=share,
    )  # fmt: skip
    layout = expected(model_type).layout
    assert trained_layout(trainer) == (layout if share else layout.replace("prefix tree, ", ""))
    assert tree_really_ran(trainer, trained_layout(trainer))
    if equal or model_type not in STOCK_DEPENDS_ON_PADDING:
        assert relative_difference(ours, stock) <= PARAM_TOLERANCE
    else:
        assert per_sample_error(trainer) <= LOGPROB_TOLERANCE


# ---------------------------------------------------------------------------------------------------------------
# The architecture table of docs/compatibility.md
# ---------------------------------------------------------------------------------------------------------------
def compatibility_table() -> str:
    """docs/compatibility.md's table: one row per architecture (trained ones first), generated from the data above."""
    rows = ["| architecture | trains with | equal to stock | why |", "|---|---|---|---|"]
    for model_type in sorted(ARCHITECTURES):
        expect = ARCHITECTURES[model_type]
        if expect.layout == STOCK:
            equal = "yes (stock math)"
        elif model_type in STOCK_DEPENDS_ON_PADDING:
            equal = "equal-length prompts; per sample otherwise"
        else:
            equal = "yes"
        subset = " (CI)" if model_type in REPRESENTATIVE else ""
        why = [expect.why]
        if model_type in SINCE:
            why.append(f"new in transformers {'.'.join(map(str, SINCE[model_type]))}")
        if model_type in EARLIER:
            release, before = EARLIER[model_type]
            why.append(f"transformers < {'.'.join(map(str, release))}: {before.layout} ({before.why})")
        rows.append(f"| `{model_type}`{subset} | {expect.layout} | {equal} | {'; '.join(filter(None, why))} |")
    for model_type in sorted(EXCLUDED):
        rows.append(f"| `{model_type}` | not tested | - | {EXCLUDED[model_type]} |")
    return "\n".join(rows)


def counts() -> dict[str, int]:
    """Architectures per layout trained with (docs/compatibility.md quotes them)."""
    totals: dict[str, int] = {}
    for expect in ARCHITECTURES.values():
        totals[expect.layout] = totals.get(expect.layout, 0) + 1
    return totals


def test_docs_table_is_the_generated_one():
    document = (ROOT / "docs" / "compatibility.md").read_text(encoding="utf-8")
    assert readme_block(document, "model-zoo-table") == compatibility_table(), (
        "docs/compatibility.md's model-zoo table is stale: run python tests/test_model_zoo.py docs/compatibility.md"
    )


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".md"):
        path = Path(sys.argv[1])
        path.write_text(
            with_readme_block(path.read_text(encoding="utf-8"), "model-zoo-table", compatibility_table()),
            encoding="utf-8",
        )
    else:  # python tests/test_model_zoo.py TYPE...: measure architectures (one JSON line each)
        import json
        import tempfile

        import torch

        torch.set_num_threads(1)
        logging.basicConfig(level=logging.WARNING)
        for model_type in sys.argv[1:] or causal_lm_types():
            with tempfile.TemporaryDirectory() as directory:
                try:
                    print(json.dumps({"type": model_type, **run_architecture(model_type, Path(directory))}), flush=True)
                except Exception as error:  # noqa: BLE001 - reported, to classify
                    print(
                        json.dumps({"type": model_type, "error": f"{type(error).__name__}: {error}"[:300]}), flush=True
                    )

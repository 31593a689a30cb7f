"""Offline fixtures: a character tokenizer, tiny random-weight models, prompt datasets, rewards, scripted rollouts,
an environment, and the configuration and training run of the stock-against-dynamic comparisons.

Nothing here downloads anything; torch, transformers, TRL and datasets are imported inside the functions, so
importing this module is cheap. Vision-language fixtures are in :mod:`hf_dynbsz.testing.vision`.
"""

from __future__ import annotations

import string
import zlib
from collections.abc import Callable

__all__ = [
    "CHAT_SPECIAL_TOKENS",
    "CountingEnvironment",
    "DEFAULT_ALPHABET",
    "MultiTurnRollout",
    "RecordingReward",
    "ScriptedRollout",
    "TEST_ALPHABET",
    "CPU_RUN_FIELDS",
    "COMPARISON_FIELDS",
    "base_config_kwargs",
    "checkpointing_field",
    "build_char_tokenizer",
    "build_chat_tokenizer",
    "build_tiny_causal_lm",
    "build_tiny_hybrid_lm",
    "build_tiny_moe_lm",
    "build_tiny_reward_model",
    "build_tiny_rope_lm",
    "build_tiny_teacher",
    "load_tokenizer",
    "plan_document",
    "prompt_dataset",
    "run_training",
    "save_tiny_model",
    "save_tiny_teacher",
    "seeded_model",
    "TEACHER_SHAPE",
    "unique_tokens",
]

DEFAULT_ALPHABET = string.ascii_lowercase + string.digits + " .,:;!?+-*/=()"
#: The alphabet of the test model: 4 characters + 3 special tokens, so random completions end at <eos> soon.
TEST_ALPHABET = "abcd"


# --------------------------------------------------------------------------------------------------------------
# Tokenizer and models
# --------------------------------------------------------------------------------------------------------------


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET):
    """A character-level `PreTrainedTokenizerFast` (one token per character, left padding).

    Special tokens: ``<pad>`` (id 0), ``<eos>`` (id 1), ``<unk>`` (id 2); characters follow in ``alphabet`` order.
    Plain-string prompts need no chat template.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for char in alphabet:
        if char not in vocab:
            vocab[char] = len(vocab)
    backend = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()  # decode "abc", not "a b c"
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


#: Special tokens of the chat template of :func:`build_chat_tokenizer` (TRL's Qwen3 template).
CHAT_SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)


def build_chat_tokenizer(alphabet: str = DEFAULT_ALPHABET + '{}[]"_<>|\n'):
    """:func:`build_char_tokenizer` with TRL's own Qwen3 chat template and its special tokens: conversational
    prompts, tools and environments work offline (TRL recognises the template to parse tool calls)."""
    from importlib.resources import files

    tokenizer = build_char_tokenizer(alphabet)
    tokenizer.add_special_tokens({"additional_special_tokens": list(CHAT_SPECIAL_TOKENS)})
    tokenizer.chat_template = (files("trl") / "chat_templates" / "qwen3.jinja").read_text()
    return tokenizer


def build_tiny_causal_lm(
    tokenizer,
    *,
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    max_position_embeddings: int = 2048,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    dtype=None,
):
    """A Qwen2-style causal LM with random weights (fp32 unless ``dtype`` is given).

    ``vocab_size`` defaults to the tokenizer's size; a larger value (e.g. 151,936) gives a realistic
    vocabulary-sized LM head for memory measurements while the tokenizer only uses the first ids.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        **_token_fields(tokenizer),
    )
    config._attn_implementation = attn_implementation
    model = seeded_model(Qwen2ForCausalLM, config, tokenizer, seed)
    return model.to(dtype) if dtype is not None else model


def _token_fields(tokenizer) -> dict:
    """The config fields every test model takes from the tokenizer: its vocabulary's pad and eos ids, no bos, an
    untied LM head."""
    return dict(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )


def seeded_model(model_class, config, tokenizer, seed: int):
    """``model_class(config)`` with weights from ``seed`` and the tokenizer's pad/eos ids for generation."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def build_tiny_reward_model(tokenizer, *, seed: int = 0):
    """A Qwen2 sequence classifier of one label with random weights from ``seed`` (hidden 16, 1 layer of 2 heads on 1
    key/value head) on ``tokenizer``'s vocabulary and pad id: a reward model of TRL's tests."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    sizes = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    torch.manual_seed(seed)
    return Qwen2ForSequenceClassification(
        Qwen2Config(vocab_size=len(tokenizer), **sizes, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    )


def _small_config_fields(tokenizer) -> dict:
    """The sizes of the tiny hybrid and MoE models (hidden 32, 2 layers of 4 heads on 2 key/value heads of 8) and the
    tokenizer's vocabulary and ids."""
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    return dict(vocab_size=len(tokenizer), **sizes, **heads, **_token_fields(tokenizer))


def build_tiny_hybrid_lm(tokenizer, *, seed: int = 0):
    """A Qwen3-Next-style causal LM with random weights: a linear-attention (gated delta net) layer, whose state
    runs along the row, then a full-attention layer; dense MLPs (no router). Set ``router_aux_loss_coef=0`` in
    the GRPO config: the config still has ``output_router_logits``, which makes TRL train a router aux loss."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **_small_config_fields(tokenizer),
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        mlp_only_layers=[0, 1],
    )
    return seeded_model(Qwen3NextForCausalLM, config, tokenizer, seed)


#: The standard deviation of :func:`build_tiny_rope_lm`'s weights: at the configs' default (0.02) a model this small
#: attends almost uniformly, where the rotary factors hardly move a log-prob (a run that gave a crossing round the
#: wrong LongRoPE factors ended 1.8e-5 from stock's parameters, 3.5e-4 at this range).
ROPE_INITIALIZER_RANGE = 0.1
#: The rotary types :func:`build_tiny_rope_lm` builds, and its families.
ROPE_TYPES = ("longrope", "dynamic")
ROPE_FAMILIES = ("llama", "phi3")


def build_tiny_rope_lm(
    tokenizer, *, family: str = "llama", rope_type: str = "longrope", original: int = 64, seed: int = 0
):
    """A tiny causal LM of ``family`` ("llama" or "phi3", its config's defaults but the sizes) whose rotary embedding
    depends on the forward's width: ``rope_type`` "longrope" (short factors 1, long factors 1 to 16 over the head's
    frequencies, as Phi-3 long-context models) or "dynamic" (dynamic NTK, factor 4; Llama only: Phi-3's config takes
    LongRoPE alone), from ``original`` positions (``original_max_position_embeddings``) of 4 x ``original``; weights
    drawn at :data:`ROPE_INITIALIZER_RANGE`."""
    import transformers

    if rope_type not in ROPE_TYPES or family not in ROPE_FAMILIES or (family, rope_type) == ("phi3", "dynamic"):
        raise ValueError(f"rope_type must be one of {ROPE_TYPES} and family of {ROPE_FAMILIES} (phi3: longrope)")
    fields = _small_config_fields(tokenizer)
    fields.pop("head_dim")  # (Phi-3 has none: hidden / heads = 8 either way)
    frequencies = fields["hidden_size"] // fields["num_attention_heads"] // 2
    if rope_type == "longrope":
        rope = dict(
            short_factor=[1.0] * frequencies, long_factor=[16.0 ** (k / frequencies) for k in range(frequencies)]
        )
    else:
        rope = dict(factor=4.0)
    rope.update(rope_type=rope_type, rope_theta=10000.0, original_max_position_embeddings=original)
    name = {"llama": "Llama", "phi3": "Phi3"}[family]
    if family == "phi3":  # its config keeps the original length at the top, and standardizes its rope from there
        fields["original_max_position_embeddings"] = original
    config = getattr(transformers, f"{name}Config")(
        **fields, max_position_embeddings=4 * original, rope_parameters=rope, initializer_range=ROPE_INITIALIZER_RANGE
    )
    return seeded_model(getattr(transformers, f"{name}ForCausalLM"), config, tokenizer, seed)


def build_tiny_moe_lm(tokenizer, *, seed: int = 0):
    """A Qwen3-MoE-style causal LM with random weights: 2 layers of 4 experts, 2 routed per token. TRL trains its
    router aux loss unless ``router_aux_loss_coef=0``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **_small_config_fields(tokenizer), moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2
    )
    return seeded_model(Qwen3MoeForCausalLM, config, tokenizer, seed)


def save_tiny_model(
    directory: str, *, attn_implementation: str = "sdpa", seed: int = 0, chat: bool = False, architecture: str = "qwen2"
) -> str:
    """The test model, saved to ``directory`` with its tokenizer; returns ``directory``.

    Its LM head is shrunk so the next-token distribution is close to uniform over the 7-token vocabulary:
    completions end at <eos> after a geometric number of tokens, so lengths vary widely (the situation dynamic
    batching is for) and some hit ``max_completion_length`` (truncated). ``chat=True``: the tokenizer of
    :func:`build_chat_tokenizer` (a wider vocabulary with a chat template, for conversational prompts and tools).
    ``architecture``: "qwen2" (:func:`build_tiny_causal_lm`), "qwen3_next" (:func:`build_tiny_hybrid_lm`, linear
    attention), "qwen3_moe" (:func:`build_tiny_moe_lm`) or one of :data:`ROPE_ARCHITECTURES`
    (:func:`build_tiny_rope_lm`).
    """
    import torch

    tokenizer = build_chat_tokenizer() if chat else build_char_tokenizer(TEST_ALPHABET)
    if architecture == "qwen3_next":
        model = build_tiny_hybrid_lm(tokenizer, seed=seed)
    elif architecture == "qwen3_moe":
        model = build_tiny_moe_lm(tokenizer, seed=seed)
    elif architecture == "qwen2":
        model = build_tiny_causal_lm(tokenizer, attn_implementation=attn_implementation, seed=seed)
    elif architecture in ROPE_ARCHITECTURES:
        family, rope_type, original = ROPE_ARCHITECTURES[architecture]
        model = build_tiny_rope_lm(tokenizer, family=family, rope_type=rope_type, original=original, seed=seed)
    else:
        raise ValueError(
            f"architecture must be 'qwen2', 'qwen3_next', 'qwen3_moe' or one of {sorted(ROPE_ARCHITECTURES)}, got "
            f"{architecture!r}"
        )
    with torch.no_grad():
        model.lm_head.weight.mul_(0.05)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


#: :func:`save_tiny_model`'s architectures of :func:`build_tiny_rope_lm`: (family, rope type, original positions).
ROPE_ARCHITECTURES = {
    "llama_longrope": ("llama", "longrope", 64),
    "phi3_longrope": ("phi3", "longrope", 48),
    "llama_dynamic": ("llama", "dynamic", 64),
    "llama_longrope_20": ("llama", "longrope", 20),  # the multi-process runs' lopsided rollout: one process crosses
}


#: The distillation runs' teacher: the test model's architecture and vocabulary, 3.4x its parameters (hidden 48, 3
#: layers, an MLP of 96, against the student's 32, 2 and 64).
TEACHER_SHAPE = dict(
    hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96
)


def build_tiny_teacher(tokenizer=None, *, seed: int = 1, **shape):
    """The distillation runs' teacher (:data:`TEACHER_SHAPE`, ``shape`` overriding it; random weights from ``seed``)
    on ``tokenizer``'s vocabulary (default: the test tokenizer, :data:`TEST_ALPHABET`), fp32."""
    tokenizer = tokenizer or build_char_tokenizer(TEST_ALPHABET)
    return build_tiny_causal_lm(tokenizer, seed=seed, **{**TEACHER_SHAPE, **shape})


def save_tiny_teacher(directory: str, *, seed: int = 1, chat: bool = False) -> str:
    """:func:`build_tiny_teacher` saved to ``directory`` with its tokenizer (``chat``: that of
    :func:`build_chat_tokenizer`, as :func:`save_tiny_model`'s); returns ``directory``."""
    tokenizer = build_chat_tokenizer() if chat else build_char_tokenizer(TEST_ALPHABET)
    build_tiny_teacher(tokenizer, seed=seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def load_tokenizer(directory: str):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(directory)


# --------------------------------------------------------------------------------------------------------------
# Data, rewards, rollouts
# --------------------------------------------------------------------------------------------------------------


def prompt_dataset(num_prompts: int = 16, seed: int = 0, alphabet: str = TEST_ALPHABET):
    """Prompts of varied length (3 to 18 characters) so prompt padding varies too."""
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(num_prompts):
        length = int(torch.randint(3, 19, (1,), generator=generator))
        chars = torch.randint(0, len(alphabet), (length,), generator=generator).tolist()
        prompts.append("".join(alphabet[c] for c in chars))
    return Dataset.from_dict({"prompt": prompts})


class RecordingReward:
    """Reward = fraction of 'a' in the completion minus a small length term; records every completion (the text of
    the last message for conversational completions)."""

    __name__ = "recording_reward"

    def __init__(self):
        self.completions: list[str] = []

    def __call__(self, prompts, completions, **kwargs):
        completions = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        self.completions.extend(completions)
        return [c.count("a") / max(len(c), 1) - 0.01 * len(c) for c in completions]


def unique_tokens(sequences: list[list[int]]) -> int:
    """The positions one pass of ``sequences`` (token ids) computes once each, counted by brute force: a position is
    its sample's tokens up to and including the next one (the last position's next token -1), and positions with equal
    such prefixes are one. Independent of the plugin's prefix tree; what one pass of them computes by default.

    The set holds the prefixes interned (a prefix as the number of the prefix one token shorter and its last token,
    numbered on first sight), so that it grows with the tokens, not with their square: the same set of token-prefix
    tuples."""
    numbers: dict[tuple[int, int], int] = {}
    positions = set()
    for ids in sequences:
        ids = [int(token) for token in ids]
        if not ids:
            continue
        prefix = numbers.setdefault((-1, ids[0]), len(numbers))
        for following in ids[1:] + [-1]:  # position i: tokens[: i + 1] and the next token
            prefix = numbers.setdefault((prefix, following), len(numbers))
            positions.add(prefix)
    return len(positions)


class ScriptedRollout:
    """A TRL ``rollout_func`` returning scripted token ids: every trainer sees exactly the same completions.

    Round ``r`` draws its completion lengths with ``completion_lengths(rng, n, rank)`` (``rank``: the calling
    process, so a test can give one process all the long completions) and its tokens from
    ``numpy.random.default_rng([seed, r])``; a prompt's ids depend only on the prompt string (``prompt_length(rng)``
    tokens, seeded by the string). Token ids are drawn from ``[token_low, token_high)``; a completion shorter than
    ``max_completion_length`` ends with ``eos_id`` (finished), one at the cap does not (truncated). ``rounds``
    records, per round, the sample count, real tokens, the sorted lengths (a fingerprint to compare runs) and each
    sample's ``(prompt, completion)`` lengths. The token defaults are the test tokenizer's
    (``build_char_tokenizer(TEST_ALPHABET)``: its characters, eos id 1).
    """

    def __init__(
        self,
        completion_lengths: Callable,
        prompt_length: Callable,
        *,
        max_completion_length: int,
        seed: int,
        token_low: int = 3,
        token_high: int = 3 + len(TEST_ALPHABET),
        eos_id: int = 1,
    ):
        self.completion_lengths, self.prompt_length = completion_lengths, prompt_length
        self.max_len, self.seed = max_completion_length, seed
        self.token_low, self.token_high, self.eos_id = token_low, token_high, eos_id
        self.rounds: list[dict] = []
        self._prompt_cache: dict[str, list[int]] = {}

    def prompt_ids(self, prompt: str) -> list[int]:
        import numpy as np

        if prompt not in self._prompt_cache:
            rng = np.random.default_rng([self.seed, 1_000_003, zlib.crc32(prompt.encode())])
            length = int(self.prompt_length(rng))
            self._prompt_cache[prompt] = rng.integers(self.token_low, self.token_high, length).tolist()
        return self._prompt_cache[prompt]

    def __call__(self, prompts, trainer):
        import numpy as np

        rng = np.random.default_rng([self.seed, len(self.rounds)])
        rank = trainer.accelerator.process_index
        lengths = [min(max(int(v), 1), self.max_len) for v in self.completion_lengths(rng, len(prompts), rank)]
        prompt_ids = [self.prompt_ids(p) for p in prompts]
        completion_ids = []
        for length in lengths:
            ids = rng.integers(self.token_low, self.token_high, length).tolist()
            if length < self.max_len:
                ids[-1] = self.eos_id
            completion_ids.append(ids)
        self.rounds.append(
            {
                "samples": len(prompts),
                "real_tokens": int(sum(len(p) for p in prompt_ids) + sum(lengths)),
                "fingerprint": [sorted(len(p) for p in prompt_ids), sorted(lengths)],
                "lengths": [(len(p), c) for p, c in zip(prompt_ids, lengths)],  # (prompt, completion) per sample
                "unique_tokens": unique_tokens([p + c for p, c in zip(prompt_ids, completion_ids)]),
            }
        )
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


class MultiTurnRollout(ScriptedRollout):
    """A scripted multi-turn ``rollout_func``: completions alternate model turns and environment turns, with TRL's
    ``env_mask`` (1 for a model token, 0 for an environment token, which the loss must ignore).

    Each completion has 1-3 model turns of ``turn_lengths(rng)`` tokens with an environment turn of ``env_lengths(rng)``
    tokens between consecutive ones; the last model turn ends with ``eos_id``.
    """

    def __init__(self, turn_lengths: Callable, env_lengths: Callable, prompt_length: Callable, **kwargs):
        super().__init__(lambda rng, n, rank: [0] * n, prompt_length, **kwargs)
        self.turn_lengths, self.env_lengths = turn_lengths, env_lengths

    def __call__(self, prompts, trainer):
        import numpy as np

        rng = np.random.default_rng([self.seed, len(self.rounds)])
        completion_ids, env_masks = [], []
        for _ in prompts:
            ids, mask = [], []
            turns = int(rng.integers(1, 4))
            for turn in range(turns):
                if turn:
                    env = int(self.env_lengths(rng))
                    ids += rng.integers(self.token_low, self.token_high, env).tolist()
                    mask += [0] * env
                length = max(1, int(self.turn_lengths(rng)))
                ids += rng.integers(self.token_low, self.token_high, length).tolist()
                mask += [1] * length
            ids, mask = ids[: self.max_len], mask[: self.max_len]
            if len(ids) < self.max_len:
                ids[-1], mask[-1] = self.eos_id, 1
            completion_ids.append(ids)
            env_masks.append(mask)
        prompt_ids = [self.prompt_ids(p) for p in prompts]
        self.rounds.append(
            {
                "samples": len(prompts),
                "real_tokens": sum(map(len, prompt_ids)) + sum(map(len, completion_ids)),
                "fingerprint": [sorted(map(len, prompt_ids)), sorted(map(len, completion_ids))],
            }
        )
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None, "env_mask": env_masks}


class CountingEnvironment:
    """A TRL ``environment_factory`` environment that owns the prompt (``reset``) and the reward (``get_reward``).

    Every reset draws the next number of a counter shared by the class (reset it with :meth:`restart` before a run):
    the prompt is that many letters and the reward a fixed function of the number, so the completions of one group
    get different rewards and every run sees the same ones. ``double`` is its tool.
    """

    resets = 0

    @classmethod
    def restart(cls) -> None:
        cls.resets = 0

    def reset(self, **kwargs) -> str:
        type(self).resets += 1
        self.number = type(self).resets
        return "abcd"[self.number % 4] * (2 + self.number % 5)

    def double(self, value: int) -> int:
        """Double a number.

        Args:
            value: The number to double.

        Returns:
            Twice the number.
        """
        return 2 * value

    def get_reward(self) -> float:
        return (self.number * 0.37) % 1.0


# --------------------------------------------------------------------------------------------------------------
# Training runs
# --------------------------------------------------------------------------------------------------------------


def checkpointing_field() -> str:
    """The config field of gradient checkpointing: transformers 5 renamed ``gradient_checkpointing`` to
    ``activation_checkpointing`` in a minor release."""
    import dataclasses

    from trl import GRPOConfig

    names = {field.name for field in dataclasses.fields(GRPOConfig)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


#: The fields every CPU run sets: no reporting or saving, a log entry per step, fp32 on the CPU, no progress bar.
CPU_RUN_FIELDS = dict(report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True)
CPU_RUN_FIELDS.update(use_cpu=True, bf16=False, dataloader_num_workers=0)
#: The comparison runs' schedule (2 steps of 8 samples, 4 completions per prompt, up to 24 tokens each) and optimizer:
#: SGD at a constant, large rate so that a mis-weighted sample shows.
COMPARISON_FIELDS = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4)
COMPARISON_FIELDS.update(max_completion_length=24, max_steps=2, seed=0)
COMPARISON_FIELDS.update(learning_rate=0.5, optim="sgd", lr_scheduler_type="constant", max_grad_norm=1e9)


def base_config_kwargs(output_dir: str, **overrides) -> dict:
    """Config of the comparison runs (:data:`COMPARISON_FIELDS` on a CPU run), ``overrides`` on top."""
    return {"output_dir": output_dir, **COMPARISON_FIELDS, **CPU_RUN_FIELDS, **overrides}


def run_training(
    trainer_cls, config_cls, model_dir: str, output_dir: str, dataset=None, trainer_kwargs=None, **overrides
):
    """Train from ``model_dir`` and return (initial params, final params, completions, log history).

    ``trainer_kwargs`` go to the trainer's constructor (``rollout_func``, ``reward_funcs``, ...); the reward is a
    :class:`RecordingReward` unless they give one.
    """
    import torch
    from transformers import AutoModelForCausalLM

    args = config_cls(**base_config_kwargs(output_dir, **overrides))
    reward = RecordingReward()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    kwargs = dict(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=dataset if dataset is not None else prompt_dataset(),
        processing_class=load_tokenizer(model_dir),
    )
    kwargs.update(trainer_kwargs or {})
    trainer = trainer_cls(**kwargs)
    trainer.train()
    final = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return initial, final, reward.completions, trainer.state.log_history


def plan_document(tmp_path, capsys, trainer: str, lengths: str, budget: int) -> tuple[list[str], dict]:
    """``hf-dynbsz plan --trainer <trainer>`` in process (2 samples per device, 2 accumulation steps) on the lengths
    ``lengths`` (a ``--lengths`` file's text, written under ``tmp_path``) with ``max_tokens_per_microbatch`` ``budget``
    and ``--json``, its exit status 0 and the plan's trainer asserted (``capsys``: pytest's fixture, reading its
    output). Returns ``(the command's common arguments, the plan's JSON document)``."""
    import json

    from hf_dynbsz.cli import main

    path = tmp_path / "lengths.txt"
    path.write_text(lengths)
    common = ["plan", "--trainer", trainer, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    assert main([*common, "--max_tokens_per_microbatch", str(budget), "--lengths", str(path), "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["plan"]["trainer"] == trainer
    return common, document

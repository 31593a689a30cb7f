"""Offline building blocks shared by the tests, the benchmarks and the example (as accelerate's ``test_utils``).

Nothing here downloads anything: a character-level tokenizer and tiny causal LMs built from a config (random
weights), prompt datasets, a scripted ``rollout_func`` that gives every trainer the same completions, the
stock-against-dynamic parameter comparison and a subprocess runner with a timeout. torch, transformers, TRL and
datasets are imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import os
import signal
import string
import subprocess
import zlib
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "CountingEnvironment",
    "DEFAULT_ALPHABET",
    "MultiTurnRollout",
    "build_chat_tokenizer",
    "RecordingReward",
    "TEST_ALPHABET",
    "ScriptedRollout",
    "VISION_LANGUAGE_FAMILIES",
    "VisionScriptedRollout",
    "base_config_kwargs",
    "build_char_tokenizer",
    "build_tiny_causal_lm",
    "build_tiny_hybrid_lm",
    "build_tiny_moe_lm",
    "build_tiny_vision_language_model",
    "first_fit_decreasing",
    "grpo_batch",
    "image_prompt_dataset",
    "load_tokenizer",
    "prompt_dataset",
    "relative_difference",
    "run_training",
    "run_with_timeout",
    "reference_varlen_attention",
    "save_tiny_model",
    "segment_mask",
    "stock_logps",
    "update_difference",
]

DEFAULT_ALPHABET = string.ascii_lowercase + string.digits + " .,:;!?+-*/=()"
#: The alphabet of the test model: 4 characters + 3 special tokens, so random completions end at <eos> soon.
TEST_ALPHABET = "abcd"
REPO_ROOT = Path(__file__).resolve().parents[1]


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
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    config._attn_implementation = attn_implementation
    model = _seeded_model(Qwen2ForCausalLM, config, tokenizer, seed)
    return model.to(dtype) if dtype is not None else model


def _seeded_model(model_class, config, tokenizer, seed: int):
    """``model_class(config)`` with weights from ``seed`` and the tokenizer's pad/eos ids for generation."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def build_tiny_hybrid_lm(tokenizer, *, seed: int = 0):
    """A Qwen3-Next-style causal LM with random weights: a linear-attention (gated delta net) layer, whose state
    runs along the row, then a full-attention layer; dense MLPs (no router). Set ``router_aux_loss_coef=0`` in
    the GRPO config: the config still has ``output_router_logits``, which makes TRL train a router aux loss."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        mlp_only_layers=[0, 1],
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return _seeded_model(Qwen3NextForCausalLM, config, tokenizer, seed)


def build_tiny_moe_lm(tokenizer, *, seed: int = 0):
    """A Qwen3-MoE-style causal LM with random weights: 2 layers of 4 experts, 2 routed per token. TRL trains its
    router aux loss unless ``router_aux_loss_coef=0``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    return _seeded_model(Qwen3MoeForCausalLM, config, tokenizer, seed)


def save_tiny_model(
    directory: str, *, attn_implementation: str = "sdpa", seed: int = 0, chat: bool = False, architecture: str = "qwen2"
) -> str:
    """The test model, saved to ``directory`` with its tokenizer; returns ``directory``.

    Its LM head is shrunk so the next-token distribution is close to uniform over the 7-token vocabulary:
    completions end at <eos> after a geometric number of tokens, so lengths vary widely (the situation dynamic
    batching is for) and some hit ``max_completion_length`` (truncated). ``chat=True``: the tokenizer of
    :func:`build_chat_tokenizer` (a wider vocabulary with a chat template, for conversational prompts and tools).
    ``architecture``: "qwen2" (:func:`build_tiny_causal_lm`), "qwen3_next" (:func:`build_tiny_hybrid_lm`, linear
    attention) or "qwen3_moe" (:func:`build_tiny_moe_lm`).
    """
    import torch

    tokenizer = build_chat_tokenizer() if chat else build_char_tokenizer(TEST_ALPHABET)
    if architecture == "qwen3_next":
        model = build_tiny_hybrid_lm(tokenizer, seed=seed)
    elif architecture == "qwen3_moe":
        model = build_tiny_moe_lm(tokenizer, seed=seed)
    elif architecture == "qwen2":
        model = build_tiny_causal_lm(tokenizer, attn_implementation=attn_implementation, seed=seed)
    else:
        raise ValueError(f"architecture must be 'qwen2', 'qwen3_next' or 'qwen3_moe', got {architecture!r}")
    with torch.no_grad():
        model.lm_head.weight.mul_(0.05)
    model.save_pretrained(directory)
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


class ScriptedRollout:
    """A TRL ``rollout_func`` returning scripted token ids: every trainer sees exactly the same completions.

    Round ``r`` draws its completion lengths with ``completion_lengths(rng, n, rank)`` (``rank``: the calling
    process, so a test can give one process all the long completions) and its tokens from
    ``numpy.random.default_rng([seed, r])``; a prompt's ids depend only on the prompt string (``prompt_length(rng)``
    tokens, seeded by the string). Token ids are drawn from ``[token_low, token_high)``; a completion shorter than
    ``max_completion_length`` ends with ``eos_id`` (finished), one at the cap does not (truncated). ``rounds``
    records, per round, the sample count, real tokens, the sorted lengths (a fingerprint to compare runs) and each
    sample's ``(prompt, completion)`` lengths.
    """

    def __init__(
        self,
        completion_lengths: Callable,
        prompt_length: Callable,
        *,
        max_completion_length: int,
        seed: int,
        token_low: int,
        token_high: int,
        eos_id: int,
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
# Training and comparing with stock
# --------------------------------------------------------------------------------------------------------------


#: The vision-language families :func:`build_tiny_vision_language_model` builds (image-token layout: flattened
#: patches with a grid for the Qwen-VL ones, one ``pixel_values`` entry per image for LLaVA).
VISION_LANGUAGE_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava")

_VL_SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<image>",
)
# A small ChatML template with Qwen-VL's image placeholders (LLaVA's processor expands "<image>").
_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "IMAGE{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _image_only(processor_class):
    """``processor_class`` (a Qwen-VL processor) without its video processor, which needs torchvision."""
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyProcessor(processor_class):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    ImageOnlyProcessor.__name__ = f"ImageOnly{processor_class.__name__}"
    return ImageOnlyProcessor


def build_tiny_vision_language_model(
    family: str = "qwen2_vl",
    *,
    seed: int = 0,
    hidden_size: int = 32,
    num_hidden_layers: int = 2,
    vocab_size: int | None = None,
    max_image_side: int = 112,
):
    """A tiny vision-language model of ``family`` (:data:`VISION_LANGUAGE_FAMILIES`) with random weights, and its
    processor (character tokenizer, ChatML template): ``(model, processor)``, built offline.

    ``hidden_size``/``num_hidden_layers``/``vocab_size`` (default: the tokenizer's) size the language model; the
    vision tower stays tiny. Qwen2-VL / Qwen2.5-VL take images of 28 to ``max_image_side`` pixels a side (one image
    token per 28 x 28 pixels); LLaVA resizes every image to 28 x 28 (4 image tokens).
    """
    import transformers

    if family not in VISION_LANGUAGE_FAMILIES:
        raise ValueError(f"family must be one of {', '.join(VISION_LANGUAGE_FAMILIES)}, got {family!r}")
    tokenizer = build_char_tokenizer(DEFAULT_ALPHABET + "\n")
    tokenizer.add_special_tokens({"additional_special_tokens": list(_VL_SPECIAL_TOKENS)})
    text = dict(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=max(4, hidden_size // 32),
        num_key_value_heads=2,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    if family == "llava":
        template = _VL_CHAT_TEMPLATE.replace("IMAGE", "<image>")
        vision = transformers.CLIPVisionConfig(
            image_size=28,
            patch_size=14,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            projection_dim=32,
        )
        config = transformers.LlavaConfig(
            vision_config=vision,
            text_config=transformers.Qwen2Config(**text),
            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
            tie_word_embeddings=False,
        )
        image_processor = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
        )
        processor = transformers.LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            patch_size=14,
            vision_feature_select_strategy="default",
            chat_template=template,
            image_token="<image>",
            num_additional_image_tokens=1,
        )
        model_class = transformers.LlavaForConditionalGeneration
    else:
        template = _VL_CHAT_TEMPLATE.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>")
        names = {
            "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLProcessor", "Qwen2VLForConditionalGeneration"),
            "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLProcessor", "Qwen2_5_VLForConditionalGeneration"),
        }
        config_name, processor_name, model_name = names[family]
        half = hidden_size // text["num_attention_heads"] // 2  # rotary frequencies per head: temporal, height, width
        sections = [half // 2, half // 4, half - half // 2 - half // 4]
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": sections, "rope_theta": 10000.0}
        vision = dict(depth=1, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
        if family == "qwen2_vl":  # width 32 inside the tower; its merger projects to the language model's width
            vision.update(embed_dim=32, mlp_ratio=2, hidden_size=hidden_size)
        else:
            vision.update(
                hidden_size=32,
                intermediate_size=64,
                out_hidden_size=hidden_size,
                window_size=56,
                fullatt_block_indexes=[0],
            )
        config = getattr(transformers, config_name)(
            text_config=text,
            vision_config=vision,
            image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
            video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
            vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
            tie_word_embeddings=False,
        )
        image_processor = transformers.Qwen2VLImageProcessorPil(
            min_pixels=28 * 28, max_pixels=max_image_side**2, patch_size=14, merge_size=2, temporal_patch_size=2
        )
        processor = _image_only(getattr(transformers, processor_name))(
            image_processor=image_processor, tokenizer=tokenizer, chat_template=template
        )
        model_class = getattr(transformers, model_name)
    tokenizer.chat_template = template
    return _seeded_model(model_class, config, tokenizer, seed), processor


def image_prompt_dataset(image_counts, *, seed: int = 0, sizes=(28, 56, 84, 112), same_text: bool = False):
    """Conversational prompts with an ``images`` column: prompt ``i`` has ``image_counts[i]`` random RGB images, each
    square with a side drawn from ``sizes`` (pixels). Keep each generation batch either all without images or all
    with at least one: TRL's processor cannot batch a prompt without images with prompts that have some.
    ``same_text``: every prompt has the same text (prompts of equal image sizes then differ in their pixels only)."""
    import numpy as np
    from datasets import Dataset
    from PIL import Image

    rng = np.random.default_rng(seed)
    rows = []
    for i, count in enumerate(image_counts):
        images = []
        for _ in range(count):
            side = int(rng.choice(sizes))
            images.append(Image.fromarray((rng.random((side, side, 3)) * 255).astype("uint8")))
        text = "".join(rng.choice(list(TEST_ALPHABET), size=1 + i % 6)) if not same_text else "abc"
        rows.append({"prompt": [{"role": "user", "content": text}], "images": images})
    return Dataset.from_list(rows)


class VisionScriptedRollout(ScriptedRollout):
    """:class:`ScriptedRollout` for image prompts: the prompt ids are the processor's (chat template applied, image
    tokens expanded, as TRL computes them for generation), so TRL's own image inputs line up with them."""

    def __init__(self, processor, completion_lengths: Callable, **kwargs):
        super().__init__(completion_lengths, lambda rng: 0, **kwargs)
        self.processor = processor

    def __call__(self, prompts, trainer):
        result = super().__call__([str(index) for index in range(len(prompts))], trainer)
        result["prompt_ids"] = []
        for prompt in prompts:
            images = [
                item["image"]
                for message in prompt
                for item in message["content"]
                if isinstance(item, dict) and item.get("type") == "image"
            ]
            text = self.processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            encoded = self.processor(text=[text], images=images or None, return_tensors="pt")
            result["prompt_ids"].append(encoded["input_ids"][0].tolist())
        record = self.rounds[-1]  # the round's record, with the prompts' real lengths
        completions = [len(ids) for ids in result["completion_ids"]]
        prompts = [len(ids) for ids in result["prompt_ids"]]
        record.update(
            real_tokens=sum(prompts) + sum(completions),
            fingerprint=[sorted(prompts), sorted(completions)],
            lengths=list(zip(prompts, completions)),
        )
        return result


def base_config_kwargs(output_dir: str, **overrides) -> dict:
    """Config of the comparison runs: SGD at a constant, large rate so that a mis-weighted sample shows."""
    kwargs = dict(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=24,
        max_steps=2,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=1e9,
        seed=0,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    kwargs.update(overrides)
    return kwargs


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


def stock_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Completion log-probs and entropies as TRL 1.16's ``_get_per_token_logps_and_entropies`` computes one chunk:
    the padded samples as separate sequences under their attention mask (``model`` has TRL's fused LM head)."""
    import torch

    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits_to_keep = completion_ids.size(1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -logits_to_keep:], out.entropy[:, -logits_to_keep:]


def grpo_batch(prompt_lengths, completion_lengths, repeats, *, seed: int = 0, token_high: int = 40, pad_id: int = 0):
    """TRL-style tensors of a generation batch: ``(prompt_ids, prompt_mask, completion_ids, completion_mask)``,
    prompts left-padded and completions right-padded; prompt ``k`` (of ``prompt_lengths[k]`` random tokens) repeated
    ``repeats[k]`` times, one completion of each of ``completion_lengths``; token ids in ``[3, token_high)``."""
    import torch
    from trl.trainer.utils import pad

    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for length, count in zip(prompt_lengths, repeats):
        prompts += [torch.randint(3, token_high, (int(length),), generator=generator)] * count
    completions = [torch.randint(3, token_high, (int(n),), generator=generator) for n in completion_lengths]
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts (repeats) for {len(completions)} completions")
    return (
        pad(prompts, padding_value=pad_id, padding_side="left"),
        pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left"),
        pad(completions, padding_value=pad_id, padding_side="right"),
        pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right"),
    )


def first_fit_decreasing(lengths, max_tokens: int, layout: str = "padding_free", pad_to_multiple_of: int | None = None):
    """Baseline for tests and benchmarks: first-fit-decreasing bin packing under the token budget, what fixes the
    pass count of :func:`hf_dynbsz.planning.partition.partition_by_token_budget` (its count is
    :func:`~hf_dynbsz.planning.partition.min_num_microbatches`).

    Sequences are visited longest first (ties by index) and each goes into the first micro-batch (in opening order)
    where it fits; a sequence over the budget gets a micro-batch of its own. Returns lists of indices, ordered like
    ``partition_by_token_budget``'s output (ascending inside, micro-batches by smallest index).
    """
    from hf_dynbsz.planning.partition import (
        _contiguous_runs_to_bins,
        _fewest_padded_runs,
        _first_fit_decreasing_sorted,
        _Problem,
    )

    problem = _Problem.build(lengths, max_tokens, layout, pad_to_multiple_of)
    if problem.layout == "padding_free":
        bin_of_sorted, num_bins = _first_fit_decreasing_sorted(problem.sorted_sizes, problem.capacity)
    else:
        bin_of_sorted, num_bins = _contiguous_runs_to_bins(_fewest_padded_runs(problem.sorted_sizes, problem.capacity))
    return problem.assemble(bin_of_sorted, num_bins)


def segment_mask(prefix: int, blocks: tuple[int, ...]):
    """The rule of a shared segment written as a dense ``(L, L)`` bool mask (True = may attend): prefix causal, each
    block on the prefix and causally on itself. A test oracle for :mod:`hf_dynbsz.execution.attention`."""
    import torch

    length = prefix + sum(blocks)
    owner = torch.full((length,), -1, dtype=torch.long)  # -1: prefix, j: block j
    offset = prefix
    for number, block in enumerate(blocks):
        owner[offset : offset + block] = number
        offset += block
    position = torch.arange(length)
    causal = position.unsqueeze(1) >= position.unsqueeze(0)
    key_owner, query_owner = owner.unsqueeze(0), owner.unsqueeze(1)
    return causal & ((key_owner == -1) | (key_owner == query_owner))


def reference_varlen_attention(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    scale: float | None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
):
    """What a causal flash-attention varlen kernel computes, in plain PyTorch (CPU tests stand it in for the kernel).

    ``query`` ``(total_q, heads, d)``, ``key``/``value`` ``(total_k, kv_heads, d)``; span ``i`` of the queries attends
    to span ``i`` of the keys, causally aligned bottom-right (query ``t`` of a span of ``q`` sees keys ``0 ..
    t + k - q``), and to the last ``sliding_window`` of those when given. Returns ``(total_q, heads, d)``.
    """
    import torch
    import torch.nn.functional as F

    outputs = []
    for i in range(len(cu_seqlens_q) - 1):
        q = query[cu_seqlens_q[i] : cu_seqlens_q[i + 1]].transpose(0, 1).unsqueeze(0)
        k = key[cu_seqlens_k[i] : cu_seqlens_k[i + 1]].transpose(0, 1).unsqueeze(0)
        v = value[cu_seqlens_k[i] : cu_seqlens_k[i + 1]].transpose(0, 1).unsqueeze(0)
        q_len, k_len = q.size(2), k.size(2)
        last = torch.arange(q_len, device=q.device).unsqueeze(1) + k_len - q_len  # the last key each query sees
        keys = torch.arange(k_len, device=q.device).unsqueeze(0)
        mask = keys <= last
        if sliding_window is not None:
            mask &= keys > last - sliding_window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=True)
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs)


def relative_difference(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over all parameters."""
    import torch

    num = torch.sqrt(sum(((a[k] - b[k]).double() ** 2).sum() for k in a))
    den = torch.sqrt(sum((b[k].double() ** 2).sum() for k in b))
    return float(num / den)


def update_difference(initial: dict, ours: dict, stock: dict) -> float:
    """Relative difference of the parameter UPDATES (far more sensitive than comparing parameters)."""
    import torch

    num = torch.sqrt(sum(((ours[k] - stock[k]).double() ** 2).sum() for k in ours))
    den = torch.sqrt(sum(((stock[k] - initial[k]).double() ** 2).sum() for k in stock))
    return float(num / den)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from ``/proc``), whatever its session."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as handle:
                    parent = int(handle.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def run_with_timeout(
    command: list[str], cwd, timeout: float, what: str, env: dict | None = None, expect_failure: bool = False
) -> str:
    """Run ``command`` in its own process group with the repo importable and offline; return stdout + stderr.

    Raises :class:`AssertionError` on a non-zero exit, and on timeout kills the whole group (every rank) and raises.
    ``DIFFU_*`` variables of the caller are not passed on; ``env`` adds variables. ``expect_failure``: the command
    must exit non-zero (the whole output is returned then; exiting 0 raises).
    """
    environ = {
        **os.environ,
        "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    environ = {key: value for key, value in environ.items() if not key.startswith("DIFFU_")}
    environ.update(env or {})
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        ranks = _descendants(process.pid)  # torch's launcher starts each rank in a session of its own
        os.killpg(process.pid, signal.SIGKILL)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            output = "(no output: a process kept the pipe open after the kill)"
        raise AssertionError(f"{what} did not finish in {timeout} s (hang?):\n{output[-4000:]}") from None
    if expect_failure:
        if process.returncode == 0:
            raise AssertionError(f"{what} was expected to fail and exited 0:\n{output[-6000:]}")
        return output
    if process.returncode != 0:
        raise AssertionError(f"{what} failed ({process.returncode}):\n{output[-6000:]}")
    return output


class ResidentSetSampler:
    """The process's peak resident set (MiB), sampled every ``interval`` seconds in a thread: independent of
    ``/proc/self/clear_refs`` resets (which the trainer makes before each pass when a memory limit is set, so that
    ``VmHWM`` at the end of a run is not the run's peak). Use as a context manager; :attr:`peak_mib` after."""

    def __init__(self, interval: float = 0.002):
        import threading

        self.interval, self.peak_mib = interval, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from hf_dynbsz.execution.device_memory import status_mib

        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, status_mib("VmRSS") or 0.0)
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        from hf_dynbsz.execution.device_memory import status_mib

        self._stop.set()
        self._thread.join()
        self.peak_mib = max(self.peak_mib, status_mib("VmRSS") or 0.0)


def run_peak_mib(log_history: list[dict], sampler: ResidentSetSampler | None = None) -> float:
    """A run's whole-process peak (MiB): the largest of the sampled resident set, every logged step peak
    (``dynbsz/peak_memory_mib``, carried across the trainer's per-pass resets) and ``VmHWM`` now."""
    from hf_dynbsz.execution.device_memory import status_mib

    hwm = status_mib("VmHWM") or 0.0
    logged = [entry["dynbsz/peak_memory_mib"] for entry in log_history if "dynbsz/peak_memory_mib" in entry]
    return max([hwm, *logged, sampler.peak_mib if sampler is not None else 0.0])

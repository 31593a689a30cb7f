"""Offline vision-language fixtures: tiny random-weight Qwen2-VL, Qwen2.5-VL and LLaVA models with their
processors, image prompt datasets and a scripted rollout for image prompts. Heavy libraries are imported inside the
functions."""

from __future__ import annotations

from collections.abc import Callable

from hf_dynbsz.testing.fixtures import (
    DEFAULT_ALPHABET,
    TEST_ALPHABET,
    ScriptedRollout,
    build_char_tokenizer,
    seeded_model,
)

__all__ = [
    "VISION_LANGUAGE_FAMILIES",
    "ToolImageGeneration",
    "ToolImageRollout",
    "VisionScriptedRollout",
    "build_tiny_vision_language_model",
    "image_prompt_dataset",
]

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
        config, processor, model_class = _llava_parts(tokenizer, text, template)
    else:
        template = _VL_CHAT_TEMPLATE.replace("IMAGE", "<|vision_start|><|image_pad|><|vision_end|>")
        config, processor, model_class = _qwen_vl_parts(family, tokenizer, text, template, hidden_size, max_image_side)
    tokenizer.chat_template = template
    return seeded_model(model_class, config, tokenizer, seed), processor


#: The width of the CLIP and Qwen2.5-VL vision towers: 32, an MLP of 64.
_TOWER_WIDTH = dict(hidden_size=32, intermediate_size=64)


def _llava_parts(tokenizer, text: dict, template: str):
    """LLaVA's ``(config, processor, model class)``: a CLIP tower of 28 x 28 pixels, the language model ``text``."""
    import transformers

    tower = dict(num_hidden_layers=1, num_attention_heads=2, projection_dim=32, **_TOWER_WIDTH)
    vision = transformers.CLIPVisionConfig(image_size=28, patch_size=14, **tower)
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
    return config, processor, transformers.LlavaForConditionalGeneration


def _qwen_vl_parts(family: str, tokenizer, text: dict, template: str, hidden_size: int, max_image_side: int):
    """Qwen2-VL's or Qwen2.5-VL's ``(config, processor, model class)``: M-RoPE sections for the language model
    ``text`` (updated in place), a one-block vision tower, images of 28 to ``max_image_side`` pixels a side."""
    import transformers

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
        vision.update(**_TOWER_WIDTH, out_hidden_size=hidden_size, window_size=56, fullatt_block_indexes=[0])
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
    return config, processor, getattr(transformers, model_name)


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


def prompt_ids_of(processor, prompt) -> tuple[list[int], list]:
    """The token ids of a conversational image ``prompt`` as TRL computes them for generation (chat template
    applied, image tokens expanded by ``processor``), and its pictures."""
    pictures = [
        item["image"]
        for message in prompt
        for item in message["content"]
        if isinstance(item, dict) and item.get("type") == "image"
    ]
    text = processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    encoded = processor(text=[text], images=pictures or None, return_tensors="pt")
    return encoded["input_ids"][0].tolist(), pictures


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
            result["prompt_ids"].append(prompt_ids_of(self.processor, prompt)[0])
        record = self.rounds[-1]  # the round's record, with the prompts' real lengths
        completions = [len(ids) for ids in result["completion_ids"]]
        prompts = [len(ids) for ids in result["prompt_ids"]]
        record.update(
            real_tokens=sum(prompts) + sum(completions),
            fingerprint=[sorted(prompts), sorted(completions)],
            lengths=list(zip(prompts, completions)),
        )
        return result


class ToolImageRollout:
    """TRL's generation as its tool loop returns it for a vision-language model, scripted: each completion is a trunk
    its prompt's completions share (``trunk`` tokens), tokens of its own (a fork from its siblings), then, for three
    completions in four, a tool's response holding ``tool_image`` (``<|vision_start|>``, its image tokens,
    ``<|vision_end|>``: tool-mask 0) and a last few tokens of its own. :meth:`generate` returns what TRL's
    ``GRPOTrainer._generate`` returns (the prompt's and the tool's images per sample among them); a trainer class that
    takes :class:`ToolImageGeneration` first generates with it. Qwen-VL processors (the image token
    ``<|image_pad|>``) only."""

    def __init__(
        self, processor, tool_image, *, trunk: int = 4, seed: int = 0, token_low: int = 3, token_high: int = 30
    ):
        self.processor, self.tool_image, self.trunk, self.seed = processor, tool_image, trunk, seed
        self.token_low, self.token_high, self.calls = token_low, token_high, 0
        tokenizer = processor.tokenizer
        grid = processor.image_processor(images=[tool_image], return_tensors="pt")["image_grid_thw"][0]
        merge = getattr(processor.image_processor, "merge_size", 2)
        image = [tokenizer.convert_tokens_to_ids("<|image_pad|>")] * (int(grid.prod()) // merge**2)
        self.response = [tokenizer.convert_tokens_to_ids("<|vision_start|>"), *image]
        self.response.append(tokenizer.convert_tokens_to_ids("<|vision_end|>"))

    def generate(self, prompts):
        import numpy as np

        rng = np.random.default_rng([self.seed, self.calls])
        self.calls += 1
        prompt_ids, completion_ids, tool_masks, images, tool_images = [], [], [], [], []
        trunks: dict[str, list[int]] = {}
        for index, prompt in enumerate(prompts):
            ids, pictures = prompt_ids_of(self.processor, prompt)
            prompt_ids.append(ids)
            trunk = trunks.setdefault(str(ids), rng.integers(self.token_low, self.token_high, self.trunk).tolist())
            own = rng.integers(self.token_low, self.token_high, int(rng.integers(1, 6))).tolist()
            tool = index % 4 != 3
            response = self.response if tool else []
            tail = rng.integers(self.token_low, self.token_high, int(rng.integers(1, 4))).tolist()
            completion = trunk + own + response + tail + [self.processor.tokenizer.eos_token_id]
            completion_ids.append(completion)
            mask = [1] * len(trunk + own) + [0] * len(response) + [1] * (len(tail) + 1)
            tool_masks.append(mask)
            tool_images.append([self.tool_image] if tool else [])
            images.append(pictures + tool_images[-1])
        decoded = self.processor.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": content}] for content in decoded]
        return prompt_ids, completion_ids, tool_masks, completions, None, {}, images, tool_images


def _look(picture: str) -> str:
    """Look at a picture.

    Args:
        picture: its name.
    """
    return picture


class ToolImageGeneration:
    """Place before a GRPO trainer class (stock's or the plugin's): it generates with ``tool_image_rollout`` (a
    :class:`ToolImageRollout` set on the instance) instead of the model, as TRL's tool loop would have, and holds a
    tool so that TRL builds the step's image inputs the way it does for tool images."""

    tool_image_rollout: ToolImageRollout

    def _generate(self, prompts):
        self.tools = self.tools or [_look]  # (read by TRL after _generate: image inputs of tool images)
        return self.tool_image_rollout.generate(prompts)

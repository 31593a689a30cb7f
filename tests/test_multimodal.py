"""Vision-language rollouts: each sample's image inputs travel with it into its micro-batch.

Specification of :mod:`hf_dynbsz.execution.multimodal` (splitting TRL's flattened image inputs per sample and joining
them per micro-batch, by the slicing rules of TRL's own ``_get_per_token_logps_and_entropies``; telling images apart;
each sample's M-RoPE positions), of padding-free rows of image samples (a shared prompt's images once), and of the
trainer on tiny vision-language models of each repacked family: parameters after training equal stock GRPOTrainer's,
with samples of 0, 1 and 2 images and long-tailed completions, in padding-free rows with shared prompts and in padded
rows, while the vision tower encodes a shared prompt's images once per pass.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from trl import GRPOConfig, GRPOTrainer
from trl.data_utils import prepare_multimodal_messages

from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
from hf_dynbsz.execution.multimodal import join_media, media_digest, rope_positions, split_media
from hf_dynbsz.execution.packing import SequenceTable, build_microbatch
from hf_dynbsz.planning import model_support
from hf_dynbsz.testing import (
    VISION_LANGUAGE_FAMILIES,
    RecordingReward,
    ToolImageGeneration,
    ToolImageRollout,
    VisionScriptedRollout,
    base_config_kwargs,
    build_tiny_vision_language_model,
    image_prompt_dataset,
    relative_difference,
    row_nodes,
    update_difference,
)

# Images per prompt. Each generation batch (2 prompts x 4 completions, or 4 prompts with steps_per_generation=4) holds
# prompts with images only or without any: TRL's processor cannot batch the two kinds together.
IMAGE_COUNTS = [1, 2, 1, 2, 0, 0, 0, 0, 2, 1, 2, 2, 1, 1, 2, 1]


# ---------------------------------------------------------------------------------------------- split and join
def trl_chunk(inputs: dict, start: int, end: int) -> dict:
    """The image inputs stock TRL passes the model for samples ``start:end`` (its slicing rules, restated)."""
    num_images = inputs["num_images"]
    images = np.cumsum([0, *num_images])
    chunk = {}
    if "image_grid_thw" in inputs:
        rows = np.cumsum([0, *[int(g.prod(dim=-1).sum()) for g in inputs["image_grid_thw"].split(num_images)]])
        chunk["pixel_values"] = inputs["pixel_values"][rows[start] : rows[end]]
        chunk["image_grid_thw"] = inputs["image_grid_thw"][images[start] : images[end]]
    elif "num_tiles" in inputs:
        tiles = np.cumsum([0, *inputs["num_tiles"]])
        for key in ("pixel_values", "pixel_attention_mask", "spatial_shapes"):
            if key in inputs:
                chunk[key] = inputs[key][tiles[start] : tiles[end]]
    elif inputs["pixel_values"].size(0) == sum(num_images):
        chunk["pixel_values"] = inputs["pixel_values"][images[start] : images[end]]
    else:
        chunk["pixel_values"] = inputs["pixel_values"][start:end]
        if "pixel_attention_mask" in inputs:
            chunk["pixel_attention_mask"] = inputs["pixel_attention_mask"][start:end]
    if "image_sizes" in inputs:
        chunk["image_sizes"] = inputs["image_sizes"][images[start] : images[end]]
    return chunk


def grid_inputs(num_images):
    grids = torch.tensor([[1, 2 * (1 + k % 3), 2 * (1 + k % 2)] for k in range(sum(num_images))])
    return {
        "pixel_values": torch.randn(int(grids.prod(dim=-1).sum()), 6),
        "image_grid_thw": grids,
        "num_images": num_images,
    }


def per_image_inputs(num_images):
    total = sum(num_images)
    return {
        "pixel_values": torch.randn(total, 3, 4, 4),
        "image_sizes": torch.randint(1, 9, (total, 2)),
        "num_images": num_images,
    }


def per_sample_inputs(num_images):
    most = max(num_images)
    pixels = torch.zeros(len(num_images), most, 3, 4, 4)
    mask = torch.zeros(len(num_images), most, 4, 4, dtype=torch.bool)
    for i, n in enumerate(num_images):
        pixels[i, :n] = torch.randn(n, 3, 4, 4)
        mask[i, :n] = True
    return {"pixel_values": pixels, "pixel_attention_mask": mask, "num_images": num_images}


def tile_inputs(num_images):
    tiles = [1 + i % 3 for i in range(len(num_images))]
    total = sum(tiles)
    return {
        "pixel_values": torch.randn(total, 5, 4),
        "pixel_attention_mask": torch.ones(total, 5, dtype=torch.bool),
        "spatial_shapes": torch.randint(1, 4, (total, 2)),
        "num_tiles": tiles,
        "num_images": num_images,
    }


LAYOUTS = {
    "grid (Qwen2-VL)": grid_inputs,
    "per image (LLaVA)": per_image_inputs,
    "per sample (Idefics3)": per_sample_inputs,
    "tiles (LFM2-VL)": tile_inputs,
}


@pytest.mark.parametrize("make_inputs", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("num_images", [[1, 2, 1, 2, 1, 1], [2, 2, 1, 2]])
def test_joining_a_contiguous_run_of_samples_gives_stock_trl_chunk(make_inputs, num_images):
    torch.manual_seed(0)
    inputs = make_inputs(num_images)
    pieces = split_media(inputs, len(num_images))
    for start in range(len(num_images)):
        for end in range(start + 1, len(num_images) + 1):
            joined, expected = join_media(pieces[start:end]), trl_chunk(inputs, start, end)
            assert joined.keys() == expected.keys()
            for key in expected:
                torch.testing.assert_close(joined[key], expected[key], rtol=0, atol=0)


def test_samples_joined_in_any_order_carry_their_own_images():
    inputs = grid_inputs([1, 2, 1])
    pieces = split_media(inputs, 3)
    joined = join_media([pieces[2], pieces[0]])
    rows = inputs["image_grid_thw"].prod(dim=-1).tolist()  # patch rows per image: 4, 8, 4, 4
    assert torch.equal(
        joined["pixel_values"], torch.cat([inputs["pixel_values"][sum(rows[:3]) :], inputs["pixel_values"][: rows[0]]])
    )
    assert torch.equal(joined["image_grid_thw"], inputs["image_grid_thw"][[3, 0]])


def test_a_micro_batch_of_samples_without_images_gets_no_image_inputs():
    pieces = split_media(grid_inputs([0, 1, 0]), 3)
    assert join_media([pieces[0], pieces[2]]) == {}
    # a sample of a text-only slice (no image fields at all) first, then one with an image: the image is kept
    assert torch.equal(join_media([{}, pieces[1]])["image_grid_thw"], pieces[1]["image_grid_thw"])
    assert split_media({"input_ids": torch.ones(2, 3)}, 2) is None


def image_table(prompt_ids, completion_ids, media, fields):
    """The table of padded prompts and completions (id 0: padding) with images ``media`` and token type ids."""
    masks = (prompt_ids > 0).long(), (completion_ids > 0).long()
    return SequenceTable.from_padded(
        prompt_ids, masks[0], completion_ids, masks[1], media=media, token_fields={"mm_token_type_ids": fields}
    )


def test_vision_language_micro_batches_are_padded_rows_with_mask_token_fields_and_images():
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    completion_ids = torch.tensor([[3, 4, 0], [3, 0, 0]])
    media = split_media(grid_inputs([1, 1]), 2)
    fields = torch.tensor([[0, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    table = image_table(prompt_ids, completion_ids, media, fields)
    assert table.multimodal
    mb = build_microbatch(table, [1, 0], layout="padded", pad_token_id=0)
    assert mb.model_inputs["input_ids"].tolist() == [[7, 8, 9, 3], [5, 6, 3, 4]]
    assert mb.model_inputs["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert mb.model_inputs["mm_token_type_ids"].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]
    assert "position_ids" not in mb.model_inputs
    assert torch.equal(
        mb.model_inputs["image_grid_thw"], torch.cat([media[1]["image_grid_thw"], media[0]["image_grid_thw"]])
    )


def test_a_padding_free_row_holds_a_shared_prompts_images_once_and_each_samples_own_positions():
    # Samples 0, 1: one prompt [image, image, text] and one picture; sample 2: the same tokens, another picture.
    prompt_ids = torch.tensor([[5, 5, 6]] * 3)
    completion_ids = torch.tensor([[3, 4, 0], [7, 0, 0], [8, 9, 2]])
    inputs = grid_inputs([1, 1, 1])
    inputs["image_grid_thw"] = torch.tensor([[1, 2, 2]] * 3)
    inputs["pixel_values"] = torch.cat([torch.ones(4, 6), torch.ones(4, 6), torch.zeros(4, 6)])
    media = split_media(inputs, 3)
    fields = torch.tensor([[1, 1, 0, 0, 0, 0]] * 3)
    table = SequenceTable.from_padded(
        prompt_ids,
        torch.ones_like(prompt_ids),
        completion_ids,
        (completion_ids > 0).long(),
        media=media,
        token_fields={"mm_token_type_ids": fields},
    )
    assert table.prompt_groups() == [0, 0, 1]  # equal tokens, another picture: not the same prompt
    table.positions = [torch.arange(n).expand(3, -1) * (i + 1) for i, n in enumerate(table.lengths.tolist())]
    mb = build_microbatch(
        table,
        [0, 1, 2],
        layout="padding_free",
        pad_token_id=0,
        attention="sdpa",
        groups=table.prompt_groups(),
        pad_to_multiple_of=4,
    )
    # [5 5 | 6 3 4 | 6 7] then sample 2 alone [5 5 6 8 9 2], then 3 rounding pads (20 positions)
    assert mb.model_inputs["input_ids"].tolist() == [[5, 5, 6, 3, 4, 6, 7, 5, 5, 6, 8, 9, 2, 0, 0, 0]]
    assert mb.model_inputs["mm_token_type_ids"].tolist() == [[1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]]
    positions = mb.model_inputs["position_ids"]
    assert positions.shape == (4, 1, 16)
    assert positions[0, 0].tolist() == [0, 1, 2, 3, 4, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2]  # text positions
    assert positions[1, 0].tolist() == [0, 1, 2, 3, 4, 4, 6, 0, 3, 6, 9, 12, 15, 0, 1, 2]  # each sample's own
    assert torch.equal(mb.model_inputs["pixel_values"], inputs["pixel_values"][[0, 1, 2, 3, 8, 9, 10, 11]])
    assert mb.model_inputs["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]  # one per prompt shown
    assert mb.computed_tokens == 16 and mb.real_tokens == 13


def test_a_tree_row_shares_text_before_the_images_across_prompts_and_each_prompts_images_once():
    """Samples 0, 1: a prompt [6 7 image image 8] with one picture; sample 2: the same tokens, another picture. The
    tree shares the first token with sample 2 (the token before the first image token is keyed on the picture), and
    samples 0 and 1 share the prompt and their completions' first token; each picture is in the row once, with the
    image tokens of the node that holds it."""
    prompt_ids = torch.tensor([[6, 7, 5, 5, 8]] * 3)
    completion_ids = torch.tensor([[3, 4], [3, 9], [3, 4]])
    inputs = grid_inputs([1, 1, 1])
    inputs["image_grid_thw"] = torch.tensor([[1, 2, 2]] * 3)
    inputs["pixel_values"] = torch.cat([torch.ones(4, 6), torch.ones(4, 6), torch.zeros(4, 6)])
    fields = torch.tensor([[0, 0, 1, 1, 0, 0, 0]] * 3)
    table = SequenceTable.from_padded(
        prompt_ids,
        torch.ones_like(prompt_ids),
        completion_ids,
        torch.ones_like(completion_ids),
        media=split_media(inputs, 3),
        token_fields={"mm_token_type_ids": fields},
    )
    assert table.first_media_positions() == [2, 2, 2]
    table.positions = [torch.arange(7).expand(3, -1) * (i + 1) for i in range(3)]
    mb = build_microbatch(table, [0, 1, 2], layout="padding_free", pad_token_id=0, attention="sdpa",
                          keys=table.prefix_keys("tree"))  # fmt: skip
    # [6 | 7 5 5 8 | 3 4 | 3 9 | 7 5 5 8 3 4]: the first token once, then each picture's prompt
    assert mb.model_inputs["input_ids"].tolist() == [[6, 7, 5, 5, 8, 3, 4, 3, 9, 7, 5, 5, 8, 3, 4]]
    assert row_nodes(mb.segments) == [
        (0, 1, -1), (1, 4, 0), (5, 2, 1), (7, 2, 1), (9, 6, 0),
    ]  # fmt: skip
    assert mb.model_inputs["mm_token_type_ids"].tolist() == [[0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0]]
    positions = mb.model_inputs["position_ids"]
    assert positions[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 5, 6, 1, 2, 3, 4, 5, 6]  # depths
    # each node's source sample's (synthetic here: sample i's positions x (i + 1)): 0, 0, 0, 1, 2
    assert positions[1, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 10, 12, 3, 6, 9, 12, 15, 18]
    assert torch.equal(mb.model_inputs["pixel_values"], inputs["pixel_values"][[0, 1, 2, 3, 8, 9, 10, 11]])
    assert mb.model_inputs["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]
    assert mb.real_tokens == table.prefix_tree("tree").tokens() == 15


def test_a_prompt_ending_in_an_image_token_is_never_shared():
    prompt_ids = torch.tensor([[6, 5], [6, 5]])
    completion_ids = torch.tensor([[3], [4]])
    media = split_media(
        grid_inputs([1, 1]) | {"pixel_values": torch.ones(8, 6), "image_grid_thw": torch.tensor([[1, 2, 2]] * 2)}, 2
    )
    table = SequenceTable.from_padded(
        prompt_ids,
        torch.ones_like(prompt_ids),
        completion_ids,
        torch.ones_like(completion_ids),
        media=media,
        token_fields={"mm_token_type_ids": torch.tensor([[0, 1, 0]] * 2)},
    )
    assert table.prompt_groups() == [0, 1]


def tool_image_table(completions=None) -> SequenceTable:
    """Samples 0 and 1: the prompt [6 7 image image 8] with one picture, completions [3 4] then a fork (9 / 10), then
    the same tool image [5 5] and [11]: their pictures (prompt and tool) are equal. Sample 2: the same prompt and
    completion as sample 0, no tool image. ``completions``: samples 0 and 1's own (6 or 7 tokens, the tool image at
    completion positions 3 and 4)."""
    completions = completions or [[3, 4, 9, 5, 5, 11], [3, 4, 10, 5, 5, 11]]
    width = max(len(ids) for ids in completions)
    prompt_ids = torch.tensor([[6, 7, 5, 5, 8]] * 3)
    padded = [ids + [0] * (width - len(ids)) for ids in completions] + [[3, 4, 9] + [0] * (width - 3)]
    completion_ids = torch.tensor(padded)
    completion_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in completions + [[3, 4, 9]]])
    inputs = grid_inputs([2, 2, 1])
    inputs["image_grid_thw"] = torch.tensor([[1, 2, 2]] * 5)
    inputs["pixel_values"] = torch.cat([torch.full((4, 6), value) for value in (1.0, 2.0, 1.0, 2.0, 1.0)])
    tool = [0, 0, 1, 1, 0, 0, 0, 0, 1, 1] + [0] * (width - 5)
    fields = torch.tensor([tool, tool, [0, 0, 1, 1] + [0] * (width + 1)])
    return SequenceTable.from_padded(
        prompt_ids, torch.ones_like(prompt_ids), completion_ids, completion_mask,
        media=split_media(inputs, 3), token_fields={"mm_token_type_ids": fields},
    )  # fmt: skip


def images_in_row_order(mb) -> list[float]:
    """The pictures (their pixel value) of a row's image tokens, two tokens per picture, in row order, as the model
    would place the row's image features: the row's images must match its image tokens one for one."""
    tokens = int(mb.model_inputs["mm_token_type_ids"].sum())
    grid = mb.model_inputs["image_grid_thw"]
    assert tokens == 2 * grid.size(0), f"{tokens} image tokens, {grid.size(0)} images"
    return mb.model_inputs["pixel_values"][::4, 0].tolist()


@pytest.mark.parametrize("sharing", ["tree", "groups"])
def test_a_tool_image_in_a_completion_after_a_fork_is_in_the_row_with_its_own_node(sharing):
    """The node that holds a sample's first image brings all its images: a sample whose images span a fork from a
    sibling (a prompt image, then a tool image after their completions part) shares nothing with it from the token
    before its first image (tree), and its prompt with no one (groups); a sibling without the tool image still shares
    with the samples of its own prompt and pictures."""
    table = tool_image_table()
    assert table.media_ends() == [10, 10, 4]
    assert table.prompt_groups() == [0, 1, 2]  # the images of 0 and 1 reach past their prompt's last token
    mb = build_microbatch(
        table, [0, 1, 2], layout="padding_free", pad_token_id=0, attention="sdpa",
        keys=table.prefix_keys(sharing) if sharing == "tree" else None,
        groups=table.prompt_groups() if sharing == "groups" else None,
    )  # fmt: skip
    assert images_in_row_order(mb) == [1.0, 2.0, 1.0, 2.0, 1.0]  # each sample's pictures once, in row order
    if sharing == "tree":  # [6] shared by all, then each sample's own
        assert row_nodes(mb.segments)[0] == (0, 1, -1)
        assert mb.real_tokens == 1 + 10 + 10 + 7


def test_siblings_whose_images_end_before_they_part_share_them():
    """Samples 0 and 1 equal through the token after the tool image, parting after it: one node holds both pictures
    of both (the vision tower encodes them once)."""
    table = tool_image_table([[3, 4, 9, 5, 5, 11, 13], [3, 4, 9, 5, 5, 11, 12]])
    mb = build_microbatch(
        table, [0, 1], layout="padding_free", pad_token_id=0, attention="sdpa", keys=table.prefix_keys("tree")
    )
    assert images_in_row_order(mb) == [1.0, 2.0]
    assert mb.real_tokens == 10 + 2 + 2  # positions 0-9 once (a key is a token and the next), then each own


def test_media_digest_tells_images_apart():
    inputs = grid_inputs([1, 1])
    first, second = split_media(inputs, 2)
    assert media_digest(first) == media_digest({key: value.clone() for key, value in first.items()})
    assert media_digest(first) != media_digest(second)
    assert media_digest(first) != media_digest({**first, "pixel_values": first["pixel_values"].double()})


@pytest.mark.parametrize("make_inputs", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_samples_images_and_token_fields_survive_the_trip_to_another_process(make_inputs):
    """What cross-rank balancing sends: one float64 record per sample, read back bit for bit, dtypes included."""
    inputs = make_inputs([1, 0, 2])
    inputs["pixel_values"] = (
        inputs["pixel_values"].to(torch.bfloat16) if "image_sizes" in inputs else inputs["pixel_values"]
    )
    media = split_media(inputs, 3)
    prompt_ids, completion_ids = torch.tensor([[0, 5, 6], [7, 8, 9], [4, 4, 4]]), torch.tensor([[3, 0], [3, 2], [1, 0]])
    fields = torch.tensor([[0, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    table = image_table(prompt_ids, completion_ids, media, fields)
    records = table.media_records()
    assert all(record.dtype == torch.float64 and record.dim() == 1 for record in records)
    bare = SequenceTable(
        tokens=table.tokens, prompt_lengths=table.prompt_lengths, completion_lengths=table.completion_lengths
    )
    moved = bare.with_media_records(records[::-1][::-1])
    for before, after in zip(table.media, moved.media):
        assert before.keys() == after.keys()
        for key in before:
            assert before[key].dtype == after[key].dtype and torch.equal(before[key], after[key]), key
    for before, after in zip(table.token_fields["mm_token_type_ids"], moved.token_fields["mm_token_type_ids"]):
        assert torch.equal(before, after)
    text_only = SequenceTable(
        tokens=table.tokens, prompt_lengths=table.prompt_lengths, completion_lengths=table.completion_lengths
    )
    assert bare.with_media_records(text_only.media_records()).multimodal is False


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_rope_positions_are_what_the_model_computes_for_the_padded_batch(family):
    """Each sample's M-RoPE positions, computed alone, equal those get_rope_index gives it in stock's padded batch."""
    model, processor = build_tiny_vision_language_model(family)
    dataset = image_prompt_dataset([1, 2, 1])
    texts = [
        processor.apply_chat_template(
            prepare_multimodal_messages(row["prompt"], row["images"]), tokenize=False, add_generation_prompt=True
        )
        for row in dataset
    ]
    batch = processor(
        text=texts, images=[row["images"] for row in dataset], return_tensors="pt", padding=True, padding_side="left"
    )
    expected, _ = model.model.get_rope_index(
        batch["input_ids"],
        batch["mm_token_type_ids"],
        image_grid_thw=batch["image_grid_thw"],
        attention_mask=batch["attention_mask"],
    )
    mask = batch["attention_mask"].bool()
    tokens = [ids[row] for ids, row in zip(batch["input_ids"], mask)]
    fields = {"mm_token_type_ids": [types[row] for types, row in zip(batch["mm_token_type_ids"], mask)]}
    media = split_media({**batch, "num_images": [1, 2, 1]}, 3)
    for i, positions in enumerate(rope_positions(model, tokens, fields, media)):
        assert torch.equal(positions, expected[:, i, mask[i]])
    assert torch.equal(rope_positions(model, tokens[:1], None, None)[0], torch.arange(len(tokens[0])).expand(3, -1))


# ---------------------------------------------------------------------------------------------- against stock TRL
def long_tailed_rollout(processor):
    """Completions of geometric length (mean ~7 tokens) capped at 40: most short, a few long."""
    return VisionScriptedRollout(
        processor,
        lambda rng, n, rank: rng.geometric(0.15, n),
        max_completion_length=40,
        seed=0,
        token_low=3,
        token_high=30,
        eos_id=processor.tokenizer.eos_token_id,
    )


def vision_tower(model):
    return getattr(model.model, "visual", None) or model.model.vision_tower


def count_encoded_images(model) -> list[int]:
    """Images the vision tower of ``model`` encodes, one entry per call (Qwen-VL towers take ``grid_thw``, one row per
    image; CLIP takes one pixel tensor per image)."""
    calls = []

    def hook(module, args, kwargs, output):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        calls.append(
            int(grid.size(0)) if grid is not None else int((args[0] if args else kwargs["pixel_values"]).size(0))
        )

    vision_tower(model).register_forward_hook(hook, with_kwargs=True)
    return calls


def train(trainer_cls, config_cls, family, tmp_path, scripted=True, dataset=None, encoded=None, **overrides):
    model, processor = build_tiny_vision_language_model(family)
    if encoded is not None:
        encoded.extend([count_encoded_images(model)])
    if overrides.get("beta"):  # TRL loads the reference model from the policy's directory
        model.save_pretrained(tmp_path / "model")
        model = str(tmp_path / "model")
    kwargs = {"rollout_func": long_tailed_rollout(processor)} if scripted else {}
    reward = RecordingReward()
    settings = base_config_kwargs(
        str(tmp_path / trainer_cls.__name__),
        shuffle_dataset=False,
        max_steps=4,
        max_completion_length=40 if scripted else 16,
    )
    settings.update(overrides)
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward,
        args=config_cls(**settings),
        train_dataset=dataset or image_prompt_dataset(IMAGE_COUNTS),
        processing_class=processor,
        **kwargs,
    )
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    final = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return initial, final, reward.completions, trainer.state.log_history


def compare(family, tmp_path, scripted=True, budget=60, dataset=None, ours_settings=None, **overrides):
    initial, stock, stock_completions, _ = train(
        GRPOTrainer, GRPOConfig, family, tmp_path / "stock", scripted, dataset, **overrides
    )
    _, ours, completions, history = train(
        DynamicBatchGRPOTrainer,
        DynamicBatchGRPOConfig,
        family,
        tmp_path / "ours",
        scripted,
        dataset,
        max_tokens_per_microbatch=budget,
        **(ours_settings or {}),
        **overrides,
    )
    assert completions == stock_completions
    assert relative_difference(ours, stock) <= 1e-5
    assert update_difference(initial, ours, stock) <= 1e-3
    return history


def repacked_steps(history):
    return [entry for entry in history if "dynbsz/microbatches" in entry]


@pytest.mark.parametrize("family", VISION_LANGUAGE_FAMILIES)
def test_image_rollouts_train_as_stock_in_padding_free_rows_with_shared_prompts(family, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hf_dynbsz"):
        history = compare(family, tmp_path, num_iterations=2, steps_per_generation=4)
    steps = repacked_steps(history)
    assert len(steps) == 4  # every optimizer step, image steps included, ran repacked micro-batches...
    assert max(step["dynbsz/microbatches"] for step in steps) > 2  # ...more of them than stock's 2 slices
    assert all(step["dynbsz/padding_fraction"] == 0 for step in steps)  # ...padding-free...
    assert all(step["dynbsz/shared_tokens_saved"] > 0 for step in steps)  # ...each image prompt computed once
    assert "self-check passed: padding_free, prefix tree, segment attention" in caplog.text  # the default rule
    assert "stock micro-batches" not in caplog.text
    assert "image inputs" in caplog.text and "repacked" in caplog.text  # the plan table's row


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_image_rollouts_train_as_stock_in_padded_rows(family, tmp_path):
    history = compare(family, tmp_path, ours_settings={"packing_layout": "padded"})
    assert all(step["dynbsz/shared_tokens_saved"] == 0 for step in repacked_steps(history))


@pytest.mark.parametrize(
    "family, loss_type", [("qwen2_vl", "dapo"), ("qwen2_vl", "bnpo"), ("qwen2_5_vl", "grpo"), ("llava", "dapo")]
)
def test_image_rollouts_match_stock_for_other_loss_types(tmp_path, family, loss_type):
    compare(family, tmp_path, loss_type=loss_type, beta=0.1 if family == "qwen2_5_vl" else 0.0)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_generated_image_rollouts_with_a_reference_model_match_stock(family, tmp_path):
    """The model's own generations (TRL's generate path with images) and reference log-probs by the schedule."""
    history = compare(family, tmp_path, scripted=False, budget=100, beta=0.1, num_iterations=2)
    assert repacked_steps(history)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_prompts_of_equal_text_and_other_pictures_are_not_shared(family, tmp_path):
    """Every prompt has the same text and image size, only the pixels differ: a completion that saw another prompt's
    image features (prompts shared by their tokens alone) would move the parameters away from stock's."""
    history = compare(family, tmp_path, dataset=image_prompt_dataset([1] * 8, sizes=(56,), same_text=True), budget=400)
    assert all(step["dynbsz/shared_tokens_saved"] > 0 for step in repacked_steps(history))


@pytest.mark.parametrize("family", VISION_LANGUAGE_FAMILIES)
def test_image_rollouts_train_as_stock_in_a_prefix_tree(family, tmp_path):
    """share_prompt_prefix="tree", trusted (no self-check): the text before each prompt's first image token shared
    across prompts, each prompt's pictures in the row once, completions sharing what they begin with; and prompts of
    equal text whose pictures differ share no position past the text before the image."""
    tree = {"share_prompt_prefix": "tree", "self_check": False}
    history = compare(family, tmp_path / "a", budget=400, ours_settings=tree, num_iterations=2, steps_per_generation=4)
    assert any(step["dynbsz/tree_tokens_saved"] > 0 for step in repacked_steps(history))  # beyond prompt groups
    same_text = image_prompt_dataset([1] * 8, sizes=(56,), same_text=True)
    compare(family, tmp_path / "b", dataset=same_text, budget=400, ours_settings=tree)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_the_vision_tower_encodes_a_shared_prompts_images_once_per_pass(family, tmp_path):
    """One pass per step (a budget every step fits in): the tower encodes each distinct prompt's images once, where
    stock encodes them once per completion (num_generations = 4 times)."""
    stock_calls, our_calls = [], []  # one list of per-call counts each
    counts = [1, 2, 2, 1, 1, 1, 2, 2]
    dataset = image_prompt_dataset(counts)
    train(GRPOTrainer, GRPOConfig, family, tmp_path / "stock", dataset=dataset, encoded=stock_calls)
    _, _, _, history = train(
        DynamicBatchGRPOTrainer,
        DynamicBatchGRPOConfig,
        family,
        tmp_path / "ours",
        dataset=dataset,
        encoded=our_calls,
        max_tokens_per_microbatch=4000,
    )
    assert [step["dynbsz/microbatches"] for step in repacked_steps(history)] == [1, 1, 1, 1]
    per_step = [counts[2 * step] + counts[2 * step + 1] for step in range(4)]  # 2 prompts per step
    assert our_calls[0][-4:] == per_step  # (before them: the self-check's passes, at the first step)
    assert sum(stock_calls[0]) == 4 * sum(per_step)


def train_with_tool_images(trainer_cls, config_cls, tmp_path, **overrides):
    """``trainer_cls`` (GRPO, stock's or the plugin's) on a tiny Qwen2-VL whose completions hold a tool's image after
    a fork from their siblings (:class:`~hf_dynbsz.testing.ToolImageRollout`): initial and final parameters, the
    completions and the log history."""
    from PIL import Image

    model, processor = build_tiny_vision_language_model("qwen2_vl")
    pixels = np.random.default_rng(7).random((56, 56, 3))
    rollout = ToolImageRollout(processor, Image.fromarray((pixels * 255).astype("uint8")))
    reward = RecordingReward()
    settings = base_config_kwargs(
        str(tmp_path / trainer_cls.__name__), shuffle_dataset=False, max_steps=4, max_completion_length=40
    )
    trainer = type(f"ToolImage{trainer_cls.__name__}", (ToolImageGeneration, trainer_cls), {})(
        model=model,
        reward_funcs=reward,
        args=config_cls(**settings, **overrides),
        train_dataset=image_prompt_dataset(IMAGE_COUNTS),
        processing_class=processor,
    )
    trainer.tool_image_rollout = rollout
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    final = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return initial, final, reward.completions, trainer.state.log_history


@pytest.mark.parametrize(
    "settings",
    [{}, {"share_prompt_prefix": "tree", "self_check": False}, {"share_prompt_prefix": "groups"}],
    ids=["checked tree", "trusted tree", "prompt groups"],
)
def test_a_tool_image_in_a_completion_after_a_fork_trains_as_stock(tmp_path, caplog, settings):
    """Completions that share a trunk, part, then hold a tool's image (the same picture for every sibling, after a
    prompt with 0-2 pictures of its own): each sample's images are in the row once, in the node of its first image,
    whatever the sharing rule; the self-check keeps the prefix tree, and the parameters are stock's."""
    initial, stock, stock_completions, _ = train_with_tool_images(GRPOTrainer, GRPOConfig, tmp_path / "stock")
    with caplog.at_level(logging.INFO, logger="hf_dynbsz"):
        _, ours, completions, history = train_with_tool_images(
            DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig, tmp_path / "ours", max_tokens_per_microbatch=200,
            **settings,
        )  # fmt: skip
    assert completions == stock_completions
    assert relative_difference(ours, stock) <= 1e-5
    assert update_difference(initial, ours, stock) <= 1e-3
    steps = repacked_steps(history)
    saved = [step["dynbsz/shared_tokens_saved"] > 0 for step in steps]
    # prompt groups: a sample whose images reach past its prompt shares it with no one (the first two steps' image
    # prompts); the text-only prompts of the last two steps share theirs, the tool image in each completion's own block
    assert len(steps) == 4 and (
        all(saved) if settings.get("share_prompt_prefix") != "groups" else saved[2:] == [True, True]
    )
    if not settings:
        assert "self-check passed: padding_free, prefix tree, segment attention" in caplog.text


def test_unrepacked_families_run_their_image_steps_with_stock_micro_batches(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(model_support, "REPACKED_VISION_MODEL_TYPES", ())  # as for a family outside the list
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        history = compare("qwen2_vl", tmp_path)
    assert "image steps of this qwen2_vl model run stock TRL micro-batches" in caplog.text
    assert "image inputs" in caplog.text and "stock" in caplog.text
    # the 4 steps take 2 prompts each: prompts 1-4 have images (stock micro-batches), prompts 5-8 none (repacked)
    assert len(repacked_steps(history)) == 2


def test_a_step_whose_later_slice_has_images_runs_stock_for_an_unrepacked_family(tmp_path, monkeypatch):
    """One prompt per slice (steps_per_generation 1), two slices per step: every step's first slice is text-only and
    its second has images, so every step must keep stock's slices (deciding on the first slice repacked them all)."""
    monkeypatch.setattr(model_support, "REPACKED_VISION_MODEL_TYPES", ())
    history = compare(
        "qwen2_vl", tmp_path, dataset=image_prompt_dataset([0, 1, 0, 2, 0, 1, 0, 1]), steps_per_generation=1
    )
    assert repacked_steps(history) == []


def test_padding_free_layout_is_refused_for_vision_language_models_outside_the_repacked_families(tmp_path, monkeypatch):
    monkeypatch.setattr(model_support, "REPACKED_VISION_MODEL_TYPES", ())
    model, processor = build_tiny_vision_language_model("qwen2_vl")
    args = DynamicBatchGRPOConfig(**base_config_kwargs(str(tmp_path), packing_layout="padding_free"))
    with pytest.raises(
        ValueError,
        match="packing_layout='padding_free' cannot train this model exactly: a vision-language model computes its own",
    ):
        DynamicBatchGRPOTrainer(
            model=model,
            reward_funcs=RecordingReward(),
            args=args,
            train_dataset=image_prompt_dataset(IMAGE_COUNTS),
            processing_class=processor,
        )

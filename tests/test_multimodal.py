"""Vision-language rollouts: each sample's image inputs travel with it into its micro-batch.

Specification of :mod:`hf_dynbsz.multimodal` (splitting TRL's flattened image inputs per sample and joining them per
micro-batch, by the slicing rules of TRL's own ``_get_per_token_logps_and_entropies``), and of the trainer on tiny
vision-language models of each repacked family: parameters after training equal stock GRPOTrainer's, with samples of
0, 1 and 2 images and long-tailed completions, while the steps run repacked micro-batches.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer, model_support
from hf_dynbsz.multimodal import join_media, split_media
from hf_dynbsz.packing import SequenceTable, build_microbatch
from hf_dynbsz.testing import (
    VISION_LANGUAGE_FAMILIES,
    RecordingReward,
    VisionScriptedRollout,
    base_config_kwargs,
    build_tiny_vision_language_model,
    image_prompt_dataset,
    relative_difference,
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
    return {"pixel_values": torch.randn(int(grids.prod(dim=-1).sum()), 6), "image_grid_thw": grids,
            "num_images": num_images}


def per_image_inputs(num_images):
    total = sum(num_images)
    return {"pixel_values": torch.randn(total, 3, 4, 4), "image_sizes": torch.randint(1, 9, (total, 2)),
            "num_images": num_images}


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
    return {"pixel_values": torch.randn(total, 5, 4), "pixel_attention_mask": torch.ones(total, 5, dtype=torch.bool),
            "spatial_shapes": torch.randint(1, 4, (total, 2)), "num_tiles": tiles, "num_images": num_images}


LAYOUTS = {"grid (Qwen2-VL)": grid_inputs, "per image (LLaVA)": per_image_inputs,
           "per sample (Idefics3)": per_sample_inputs, "tiles (LFM2-VL)": tile_inputs}


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
    assert torch.equal(joined["pixel_values"], torch.cat([inputs["pixel_values"][sum(rows[:3]):],
                                                          inputs["pixel_values"][: rows[0]]]))
    assert torch.equal(joined["image_grid_thw"], inputs["image_grid_thw"][[3, 0]])


def test_a_micro_batch_of_samples_without_images_gets_no_image_inputs():
    pieces = split_media(grid_inputs([0, 1, 0]), 3)
    assert join_media([pieces[0], pieces[2]]) == {}
    assert split_media({"input_ids": torch.ones(2, 3)}, 2) is None


def test_vision_language_micro_batches_are_padded_rows_with_mask_token_fields_and_images():
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    completion_ids = torch.tensor([[3, 4, 0], [3, 0, 0]])
    media = split_media(grid_inputs([1, 1]), 2)
    fields = torch.tensor([[0, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]])
    table = SequenceTable.from_padded(prompt_ids, (prompt_ids > 0).long(), completion_ids, (completion_ids > 0).long(),
                                      media=media, token_fields={"mm_token_type_ids": fields})
    assert table.multimodal
    mb = build_microbatch(table, [1, 0], layout="padded", pad_token_id=0)
    assert mb.model_inputs["input_ids"].tolist() == [[7, 8, 9, 3], [5, 6, 3, 4]]
    assert mb.model_inputs["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert mb.model_inputs["mm_token_type_ids"].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0]]
    assert "position_ids" not in mb.model_inputs
    assert torch.equal(mb.model_inputs["image_grid_thw"], torch.cat([media[1]["image_grid_thw"],
                                                                     media[0]["image_grid_thw"]]))
    with pytest.raises(ValueError, match="padded layout"):
        build_microbatch(table, [0], layout="padding_free", pad_token_id=0)


# ---------------------------------------------------------------------------------------------- against stock TRL
def long_tailed_rollout(processor):
    """Completions of geometric length (mean ~7 tokens) capped at 40: most short, a few long."""
    return VisionScriptedRollout(processor, lambda rng, n, rank: rng.geometric(0.15, n), max_completion_length=40,
                                 seed=0, token_low=3, token_high=30, eos_id=processor.tokenizer.eos_token_id)


def train(trainer_cls, config_cls, family, tmp_path, scripted=True, **overrides):
    model, processor = build_tiny_vision_language_model(family)
    if overrides.get("beta"):  # TRL loads the reference model from the policy's directory
        model.save_pretrained(tmp_path / "model")
        model = str(tmp_path / "model")
    kwargs = {"rollout_func": long_tailed_rollout(processor)} if scripted else {}
    reward = RecordingReward()
    settings = base_config_kwargs(str(tmp_path / trainer_cls.__name__), shuffle_dataset=False, max_steps=4,
                                  max_completion_length=40 if scripted else 16)
    settings.update(overrides)
    trainer = trainer_cls(model=model, reward_funcs=reward, args=config_cls(**settings),
                          train_dataset=image_prompt_dataset(IMAGE_COUNTS), processing_class=processor, **kwargs)
    initial = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    final = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return initial, final, reward.completions, trainer.state.log_history


def compare(family, tmp_path, scripted=True, budget=60, **overrides):
    initial, stock, stock_completions, _ = train(GRPOTrainer, GRPOConfig, family, tmp_path / "stock", scripted,
                                                 **overrides)
    _, ours, completions, history = train(DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig, family, tmp_path / "ours",
                                          scripted, max_tokens_per_microbatch=budget, **overrides)
    assert completions == stock_completions
    assert relative_difference(ours, stock) <= 1e-5
    assert update_difference(initial, ours, stock) <= 1e-3
    return history


def repacked_steps(history):
    return [entry for entry in history if "dynbsz/microbatches" in entry]


@pytest.mark.parametrize("family", VISION_LANGUAGE_FAMILIES)
def test_image_rollouts_are_repacked_and_train_as_stock(family, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        history = compare(family, tmp_path, num_iterations=2, steps_per_generation=4)
    steps = repacked_steps(history)
    assert len(steps) == 4  # every optimizer step, image steps included, ran repacked micro-batches...
    assert max(step["dynbsz/microbatches"] for step in steps) > 2  # ...more of them than stock's 2 slices
    assert "stock micro-batches" not in caplog.text
    assert "image inputs" in caplog.text and "repacked" in caplog.text  # the plan table's row


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_image_rollouts_match_stock_for_other_loss_types(tmp_path, loss_type):
    compare("qwen2_vl", tmp_path, loss_type=loss_type)


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_generated_image_rollouts_with_a_reference_model_match_stock(family, tmp_path):
    """The model's own generations (TRL's generate path with images) and reference log-probs by the schedule."""
    history = compare(family, tmp_path, scripted=False, budget=100, beta=0.1, num_iterations=2)
    assert repacked_steps(history)


def test_unrepacked_families_run_their_image_steps_with_stock_micro_batches(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(model_support, "REPACKED_VISION_MODEL_TYPES", ())  # as for a family outside the list
    with caplog.at_level(logging.WARNING, logger="hf_dynbsz"):
        history = compare("qwen2_vl", tmp_path)
    assert "image steps of this qwen2_vl model run stock GRPOTrainer micro-batches" in caplog.text
    assert "image inputs" in caplog.text and "stock" in caplog.text
    # the 4 steps take 2 prompts each: prompts 1-4 have images (stock micro-batches), prompts 5-8 none (repacked)
    assert len(repacked_steps(history)) == 2


def test_padding_free_layout_is_refused_for_vision_language_models(tmp_path):
    model, processor = build_tiny_vision_language_model("qwen2_vl")
    args = DynamicBatchGRPOConfig(**base_config_kwargs(str(tmp_path), packing_layout="padding_free"))
    with pytest.raises(ValueError, match="packing_layout='padding_free' cannot train this model exactly: a "
                                         "vision-language model computes its own"):
        DynamicBatchGRPOTrainer(model=model, reward_funcs=RecordingReward(), args=args,
                                train_dataset=image_prompt_dataset(IMAGE_COUNTS), processing_class=processor)

"""Specification of hf_dynbsz.execution.batch: a step's stock slices flattened per sample, and each sample's record
(what travels with it to another process under cross-rank balancing)."""

from __future__ import annotations

import torch

from hf_dynbsz.execution.batch import StepBatch


def distillation_slice(prompts: list[list[int]], completions: list[list[int]], items: int) -> dict:
    """A distillation slice as stock's ``_prepare_inputs`` hands it: padded ids and masks, ``num_items_in_batch``,
    no advantages."""
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    return {
        "prompt_ids": torch.tensor([[0] * (width_p - len(p)) + p for p in prompts]),
        "prompt_mask": torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.tensor([c + [0] * (width_c - len(c)) for c in completions]),
        "completion_mask": torch.tensor([[1] * len(c) + [0] * (width_c - len(c)) for c in completions]),
        "num_items_in_batch": torch.tensor(items),
    }


def test_a_distillation_step_flattens_without_advantages_and_its_records_carry_the_teachers_hidden_states():
    """A sample's record holds its tokens, masks, slice, weights and, for a distillation, the teacher's hidden states
    at its completion tokens: read back, every field is the sample's own (exact: float64 records)."""
    window = [
        distillation_slice([[3, 4], [5, 6, 7]], [[4, 1], [5, 6, 4, 1]], items=9),
        distillation_slice([[3], [4, 5, 6, 7]], [[6, 6, 1], []], items=9),
    ]
    batch = StepBatch.from_slices(window, rank=0, num_processes=2)
    assert batch.advantages.tolist() == [0.0] * 4 and batch.slice_ids.tolist() == [0, 0, 1, 1]
    assert batch.slice_rows.tolist() == [2, 2, 0, 0] and batch.num_items.tolist() == [9.0] * 4
    batch.policy_weights, batch.entropy_weights = torch.full((4,), 2 / 9, dtype=torch.float64), torch.zeros(4)
    generator = torch.Generator().manual_seed(0)
    completions = batch.table.completion_lengths.tolist()
    batch.teacher_hidden = [torch.randn(c, 5, generator=generator).to(torch.bfloat16) for c in completions]
    batch.teacher_hidden_size = 5
    shapes = list(zip(batch.table.prompt_lengths.tolist(), completions))
    records = batch.records()
    assert [record.numel() for record in records] == [batch.record_size(*shape) for shape in shapes]
    order = [3, 1, 0, 2]
    back = batch.from_records([records[i] for i in order], [shapes[i] for i in order])
    assert [t.tolist() for t in back.table.tokens] == [batch.table.tokens[i].tolist() for i in order]
    assert back.slice_ids.tolist() == [batch.slice_ids[i] for i in order]
    assert back.policy_weights.tolist() == [2 / 9] * 4
    for i, rows in zip(order, back.teacher_hidden):
        assert rows.dtype == torch.bfloat16 and torch.equal(rows, batch.teacher_hidden[i])
    assert torch.equal(back.loss_mask[:, :4], batch.loss_mask[order][:, :4])

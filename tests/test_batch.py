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


def test_a_distillation_step_flattens_without_advantages_and_its_records_leave_the_teachers_states_apart():
    """A sample's record holds its tokens, masks, slice and weights: read back, every field is the sample's own
    (exact: float64 records). A distillation's teacher hidden states are not in it (they travel apart, in their own
    dtype): read back beside the records, they are the sample's own, in that dtype."""
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
    plain = StepBatch.from_slices(window, rank=0, num_processes=2)
    plain.policy_weights, plain.entropy_weights = batch.policy_weights, batch.entropy_weights
    assert [record.numel() for record in records] == [record.numel() for record in plain.records()]  # no states
    order = [3, 1, 0, 2]
    hidden = [batch.teacher_hidden[i] for i in order]
    back = batch.from_records([records[i] for i in order], [shapes[i] for i in order], hidden)
    assert [t.tolist() for t in back.table.tokens] == [batch.table.tokens[i].tolist() for i in order]
    assert back.slice_ids.tolist() == [batch.slice_ids[i] for i in order]
    assert back.policy_weights.tolist() == [2 / 9] * 4
    for i, rows in zip(order, back.teacher_hidden):
        assert rows.dtype == torch.bfloat16 and torch.equal(rows, batch.teacher_hidden[i])
    assert torch.equal(back.loss_mask[:, :4], batch.loss_mask[order][:, :4])


#: Per process, its three samples' prompts and completions (token ids) in the moving test.
MOVING_PROMPTS = [[[3, 4], [5, 6, 7], [3]], [[4, 5], [6], [7, 3, 4]]]
MOVING_COMPLETIONS = [[[4, 1], [5, 6, 4, 1], [6, 6, 1]], [[5, 1, 2], [7, 1], [4, 4, 4, 1]]]


def _moving_worker(rank: int, port: int, results) -> None:
    """Process ``rank`` of 2 (gloo): its distillation batch of 3 samples with bfloat16 teacher states, moved under an
    exchange that sends its last sample to the other process, then the states sent back to their owners; every
    all-to-all's dtype and values sent recorded."""
    import os
    from types import SimpleNamespace

    import torch.distributed as dist

    from hf_dynbsz.parallel import distributed
    from hf_dynbsz.parallel.distributed import ProcessGroup
    from hf_dynbsz.planning.schedule import Exchange

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sent, real = [], distributed.all_to_all_single

    def recording(received, send, receive_splits, send_splits, group=None):  # the real collective, observed
        sent.append((str(send.dtype), int(send.numel())))
        return real(received, send, receive_splits, send_splits, group=group)

    distributed.all_to_all_single = recording
    try:
        prompts, completions = MOVING_PROMPTS[rank], MOVING_COMPLETIONS[rank]
        batch = StepBatch.from_slices([distillation_slice(prompts, completions, items=9)], rank, num_processes=2)
        batch.policy_weights, batch.entropy_weights = torch.full((3,), 0.5, dtype=torch.float64), torch.zeros(3)
        generator = torch.Generator().manual_seed(rank)
        batch.teacher_hidden = [torch.randn(len(c), 5, generator=generator).to(torch.bfloat16) for c in completions]
        batch.teacher_hidden_size = 5
        shapes = [[(len(p), len(c)) for p, c in zip(*pair)] for pair in zip(MOVING_PROMPTS, MOVING_COMPLETIONS)]
        exchange = Exchange(rank, shapes, [[0, 0, 1], [1, 1, 0]])  # each process's last sample runs on the other
        group = ProcessGroup(SimpleNamespace(num_processes=2, process_index=rank, device=torch.device("cpu")))
        moved = batch.moved(group, exchange)
        back = group.send_to_owners(
            [rows.reshape(-1) for rows in moved.teacher_hidden], exchange, lambda p, c: 5 * c, dtype=torch.bfloat16
        )
        results[rank] = {
            "sent": sent,
            "moved": [rows.float().tolist() for rows in moved.teacher_hidden],
            "dtypes": sorted({str(rows.dtype) for rows in moved.teacher_hidden}),
            "own": [rows.float().tolist() for rows in batch.teacher_hidden],
            "stayed_uncopied": [
                moved.teacher_hidden[j].data_ptr() == batch.teacher_hidden[i].data_ptr()
                for j, (origin, i) in enumerate(exchange.incoming)
                if origin == rank
            ],
            "back": [rows.view(-1, 5).float().tolist() for rows in back],
            "incoming": exchange.incoming,
            "moved_record": batch.record_size(*shapes[rank][2]),
        }
    finally:
        distributed.all_to_all_single = real
        dist.destroy_process_group()


def test_moved_teacher_states_keep_their_dtype_and_only_moved_samples_travel():
    """Two gloo processes, each moving one of its three samples to the other (a distillation's balancing): the teacher
    states that arrive are the sender's, in bfloat16; the only bfloat16 values sent are the moved sample's states (its
    completion x hidden size), none travel as float64 records, and the samples that stay keep their states uncopied.
    Sent back to their owners (the teacher's passes' return), the states are the owners' own again, in bfloat16."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = mp.Manager().dict()
    mp.start_processes(_moving_worker, args=(port, results), nprocs=2, join=True, start_method="spawn")
    moved_completion = {0: 3, 1: 4}  # each process's last sample: 3 and 4 completion tokens
    for rank in range(2):
        result, other = results[rank], results[1 - rank]
        assert result["dtypes"] == ["torch.bfloat16"]
        for j, (origin, i) in enumerate(result["incoming"]):
            assert result["moved"][j] == results[origin]["own"][i]
        assert result["stayed_uncopied"] == [True, True]
        bfloat16 = [numel for dtype, numel in result["sent"] if dtype == "torch.bfloat16"]
        assert bfloat16 == [moved_completion[rank] * 5, moved_completion[1 - rank] * 5]  # moved, then sent back
        float64 = [numel for dtype, numel in result["sent"] if dtype == "torch.float64"]
        assert float64 == [result["moved_record"]]  # the moved sample's record alone, without its states
        assert result["back"] == result["own"] and other["back"] == other["own"]

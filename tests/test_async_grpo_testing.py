"""The offline stand-ins of TRL's asynchronous GRPO (:mod:`hf_dynbsz.testing.async_grpo`) and the conversion of rollout
samples into a step (:mod:`hf_dynbsz.execution.rollouts`), :func:`~hf_dynbsz.execution.async_loss.position_shares`."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from hf_dynbsz.execution.async_loss import position_shares
from hf_dynbsz.execution.packing import SequenceTable
from hf_dynbsz.execution.rollouts import rollout_step_batch, slice_tensors
from hf_dynbsz.testing import (
    NoWeightTransfer,
    RolloutScript,
    StandInRolloutWorker,
    reference_flash_attn_varlen_func,
)


def test_a_script_yields_groups_with_forks_tool_results_and_old_log_probs():
    script = RolloutScript(num_generations=4, shared_prefix=5, tool_turns=2, forks=1.0, seed=2)
    samples = script.take(16)
    first_group = [sample for sample in samples if sample.group_id == 0]
    assert len(first_group) == 8  # every conversation forked into a second row
    shared = first_group[0].input_ids[:5].tolist()
    assert all(sample.input_ids[:5].tolist() == shared for sample in samples)  # the block every prompt begins with
    for conversation, fork in zip(first_group[::2], first_group[1::2]):
        assert conversation.advantage == fork.advantage
        kept = int(np.argmax(fork.completion_mask))  # the fork trains only its further answer
        assert fork.completion_mask[kept:].all() and not fork.completion_mask[:kept].any()
    for sample in samples:
        trained = sample.completion_mask == 1
        assert (sample.old_log_probs[~trained] == 0).all() and (sample.old_log_probs[trained] != 0).all()
        tool = np.flatnonzero(np.diff(sample.completion_mask) == -1)  # a model turn followed by a tool result
        assert sample is not first_group[0] or len(tool) == 2


def test_the_worker_fills_at_start_and_each_sync_and_tags_the_version():
    worker = StandInRolloutWorker(RolloutScript(seed=0).samples(), samples_per_sync=6)
    worker.update_model_version(1)  # stock's first sync comes before start()
    worker.start()
    assert worker.rollout_buffer.qsize() == 12  # two syncs' worth: the dispatcher reads ahead
    worker.update_model_version(2)
    assert worker.rollout_buffer.qsize() == 18
    versions = [worker.rollout_buffer.get().model_version for _ in range(18)]
    assert versions == [1] * 12 + [2] * 6


def test_the_worker_thread_produces_at_its_rate_and_reports_a_failure():
    worker = StandInRolloutWorker(RolloutScript(seed=0).samples(), generation_seconds=0.02, queue_maxsize=4)
    worker.start()
    time.sleep(0.5)
    assert worker.rollout_buffer.qsize() == 4  # bounded: the producer waits for the trainer
    worker.stop()
    broken = StandInRolloutWorker(iter(()), generation_seconds=0.01)
    broken.start()
    time.sleep(0.2)
    with pytest.raises(RuntimeError, match="stand-in rollout worker failed"):
        broken.check_health(300.0)
    broken.stop()


def test_the_weight_transfer_drains_each_sync():
    transfer = NoWeightTransfer()
    transfer.init_weight_transfer()
    transfer.send_weights(iter([("a", torch.zeros(1)), ("b", torch.zeros(2))]))
    transfer.destroy()
    assert (transfer.syncs, transfer.tensors, transfer.initialised, transfer.destroyed) == (1, 2, True, True)


def dense_attention(q, k, v, allowed):
    """Attention of ``q`` (Lq, H, D) over ``k``/``v`` (Lk, Hk, D) under the boolean ``allowed`` (Lq, Lk)."""
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * q.size(-1) ** -0.5
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1), v)


@pytest.mark.parametrize("window", [(-1, -1), (2, 0)], ids=["causal", "window-2"])
def test_the_reference_tree_kernel_is_flash_attentions_contract(window):
    """Segment s of the queries sees segment s of the keys, bottom-right causal (a node's path ends with itself)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(length, heads, 8, generator=generator) for length, heads in ((5, 4), (9, 2), (9, 2)))
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    out = reference_flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 5, causal=True, window_size=window)
    for (q0, q1), (k0, k1) in (((0, 2), (0, 4)), ((2, 5), (4, 9))):
        i = torch.arange(q1 - q0).unsqueeze(1) + (k1 - k0) - (q1 - q0)
        j = torch.arange(k1 - k0).unsqueeze(0)
        allowed = (j <= i) & ((j >= i - window[0]) if window[0] >= 0 else True)
        torch.testing.assert_close(out[q0:q1], dense_attention(q[q0:q1], k[k0:k1], v[k0:k1], allowed))


def test_position_shares_count_a_shared_position_once():
    tokens = [torch.tensor([3, 4, 5, 6]), torch.tensor([3, 4, 5, 7]), torch.tensor([9, 4])]
    table = SequenceTable(tokens, torch.tensor([2, 2, 1]), torch.tensor([2, 2, 1]))
    shares = position_shares(table)
    # (3, 4) and (4, 5) are shared by the first two samples (keyed by a token and the next); (5, 6) and (5, 7) differ
    assert shares[0].tolist() == [0.5, 0.5, 1.0, 1.0] and shares[1].tolist() == [0.5, 0.5, 1.0, 1.0]
    assert shares[2].tolist() == [1.0, 1.0]
    assert sum(float(share.sum()) for share in shares) == table.prefix_tree("tree").tokens()


def test_a_step_splits_each_sample_at_its_first_trained_token():
    def sample(ids, mask, advantage, group):
        return {
            "input_ids": np.array(ids),
            "completion_mask": np.array(mask),
            "old_log_probs": np.where(np.array(mask) == 1, -1.5, 0.0).astype(np.float32),
            "advantage": advantage,
            "group_id": group,
        }

    rows = [
        [sample([3, 4, 5, 6, 7], [0, 0, 1, 0, 1], 1.0, 0)],  # a tool result inside the completion
        [sample([3, 4, 8], [1, 0, 1], -1.0, 0), sample([9, 9], [0, 1], 0.5, 1)],  # stock never trains token 0
    ]
    tensors = slice_tensors(rows, pad_token_id=0, stock_row_tokens=[5, 4])
    assert tensors["input_ids"].shape == (4, 5) and tensors["lengths"].tolist() == [5, 0, 3, 2]
    assert tensors["global_trained_tokens"][0] == 2 + 1 + 1
    process_1 = {key: value[2:] for key, value in tensors.items()}
    batch = rollout_step_batch([process_1], rank=1, num_processes=2)
    assert batch.table.prompt_lengths.tolist() == [2, 1] and batch.table.completion_lengths.tolist() == [1, 1]
    assert batch.loss_mask.tolist() == [[1], [1]]
    assert batch.slice_ids.tolist() == [1, 1] and batch.slice_rows.tolist() == [0, 2]
    assert batch.num_items.tolist() == [4.0, 4.0] and batch.stock_microbatch_tokens == 4
    process_0 = rollout_step_batch([{key: value[:2] for key, value in tensors.items()}], rank=0, num_processes=2)
    assert process_0.table.prompt_lengths.tolist() == [2] and process_0.loss_mask.tolist() == [[1, 0, 1]]
    assert process_0.per_token["old_per_token_logps"].tolist() == [[-1.5, 0.0, -1.5]]

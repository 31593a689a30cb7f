"""Specification: nothing in a pass's forward, loss, backward or metrics reads a value on the host, makes a shape that
depends on values, or copies host data to the device (the pass's inputs and index tensors are built on the host and
moved once, with :func:`hf_dynbsz.execution.packing.to_device_once`); so the count does not grow with the layers or the
sequences. On a GPU each such call is a wait of the host for the device (the GPU check counts those with
``torch.cuda.set_sync_debug_mode``); a CPU has none to count, so :class:`hf_dynbsz.testing.HostReads` counts the calls
themselves, made from the plugin's own code, in every real training and no-grad pass of real training runs (building
the pass, host work by design, left out)."""

from __future__ import annotations

import functools

import pytest
import torch

from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer
from hf_dynbsz.execution import attention, packing, setup
from hf_dynbsz.execution.executor import PassExecutor
from hf_dynbsz.execution.packing import SequenceTable, build_microbatch, to_device_once
from hf_dynbsz.planning.model_support import DeviceFacts
from hf_dynbsz.testing import (
    TEST_ALPHABET,
    build_char_tokenizer,
    build_tiny_causal_lm,
    grpo_batch,
    reference_varlen_attn,
    run_training,
)
from hf_dynbsz.testing.host_reads import HostReads

CAPABLE = DeviceFacts("cuda", (9, 0), (2, 13), varlen_attn=True, varlen_window=True, compute_dtype="bfloat16")


def model_dir(tmp_path, layers: int) -> str:
    tokenizer = build_char_tokenizer(TEST_ALPHABET)
    model = build_tiny_causal_lm(tokenizer, num_hidden_layers=layers, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.05)  # near-uniform next tokens: completions of many lengths
    directory = str(tmp_path / f"model-{layers}")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def reads_per_pass(monkeypatch, directory, output_dir, owners=("/hf_dynbsz/",), **settings) -> tuple[HostReads, int]:
    """The plugin's host reads in the real passes of a 2-step run (old-policy and reference passes included)."""
    reads, passes = HostReads(owners), [0]
    run_pass, microbatch = PassExecutor._run_pass, PassExecutor.microbatch

    def counted(self, *args, **kwargs):
        passes[0] += 1
        with reads:
            return run_pass(self, *args, **kwargs)

    def built_on_the_host(self, *args, **kwargs):
        with reads.paused():
            return microbatch(self, *args, **kwargs)

    monkeypatch.setattr(PassExecutor, "_run_pass", counted)
    monkeypatch.setattr(PassExecutor, "microbatch", built_on_the_host)
    run_training(
        DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig, directory, output_dir, beta=0.05, num_iterations=2,
        max_tokens_per_microbatch=40, **settings,
    )  # fmt: skip
    return reads, passes[0]


@pytest.fixture
def varlen_on_this_cpu(monkeypatch):
    """The layout a capable GPU gets on sdpa, with the reference kernel of varlen_attn's contract."""
    monkeypatch.setattr(setup, "device_facts", lambda *args: CAPABLE)
    # a new function with the reference's signature: wrapping the reference in itself made it its own __wrapped__ (a
    # wrapper loop for every later inspect.signature of a kernel wrapping it: tests/test_trainer.py's varlen run)
    kernel = functools.wraps(reference_varlen_attn)(lambda *args, **kwargs: reference_varlen_attn(*args, **kwargs))
    monkeypatch.setattr(attention, "VARLEN_ATTN_KERNEL", kernel)


@pytest.mark.parametrize("layout", ["varlen_attn", "sdpa spans", "padded"])
def test_no_host_read_in_a_pass_whatever_the_layers_and_sequences(tmp_path, monkeypatch, request, layout):
    settings = {"packing_layout": "padded"} if layout == "padded" else {}
    if layout == "varlen_attn":
        request.getfixturevalue("varlen_on_this_cpu")
    else:  # several span shapes sharing padded calls, as on CUDA
        monkeypatch.setitem(attention.SPAN_CALLS_PER_LAYER, "cpu", 2)
    counts = {}
    for layers, samples in ((1, 8), (3, 16)):
        reads, passes = reads_per_pass(
            monkeypatch, model_dir(tmp_path, layers), str(tmp_path / f"run-{layers}-{samples}"),
            per_device_train_batch_size=samples // 2, **settings,
        )  # fmt: skip
        assert passes > 4
        counts[(layers, samples)] = dict(reads.found)
    assert counts == {(1, 8): {}, (3, 16): {}}, counts


def test_the_count_sees_a_host_read_in_a_pass(tmp_path, monkeypatch):
    """The counter is not blind: a metric read with .item() in every pass (what the step metrics did before)."""
    from hf_dynbsz.execution import metrics

    add_pass = metrics.StepMetrics.add_pass

    def reading(self, real_tokens, computed_tokens, loss_metrics, entropies, mask, slice_ids):
        mask.float().sum().item()
        return add_pass(self, real_tokens, computed_tokens, loss_metrics, entropies, mask, slice_ids)

    monkeypatch.setattr(metrics.StepMetrics, "add_pass", reading)
    directory, owners = model_dir(tmp_path, 1), ("/hf_dynbsz/", "/tests/test_host_reads.py")
    reads, passes = reads_per_pass(monkeypatch, directory, str(tmp_path / "run"), owners)
    training_passes = passes - 4  # (each step's old-policy and reference passes: no metrics)
    assert list(reads.found) == [("item", f"tests/test_host_reads.py:{reading.__code__.co_firstlineno + 1}")]
    assert reads.total >= training_passes > 0


def test_a_pass_moves_its_inputs_and_index_tensors_in_one_copy(monkeypatch):
    """build_microbatch hands every integer tensor of a pass (inputs, labels, gather index, the segment layout's
    spans) to one to_device_once call; the layers then find their index tensors already there."""
    moved = []

    def recording(tensors, device):
        moved.append(sorted(tensors))
        return to_device_once(tensors, device)

    monkeypatch.setattr(packing, "to_device_once", recording)
    table = SequenceTable.from_padded(*grpo_batch([9, 4], [6, 1, 11, 3], [2, 2]))
    mb = build_microbatch(
        table, [0, 1, 2, 3], layout="padding_free", pad_token_id=0, attention="varlen_attn",
        groups=table.prompt_groups(), pad_to_multiple_of=8,
    )  # fmt: skip
    assert len(moved) == 1
    assert {"input_ids", "position_ids", "shift_labels", "gather_index", "sample_index"} <= set(moved[0])
    assert {"varlen/cu_q", "varlen/cu_k", "varlen/key_index"} <= set(moved[0])
    assert mb.segments._cache[("varlen", torch.device("cpu"))][0] is not None


def test_to_device_once_keeps_values_shapes_and_dtypes():
    tensors = {
        "ids": torch.tensor([[3, 4, 5]]),
        "cu": torch.tensor([0, 2, 3], dtype=torch.int32),
        "mask": torch.tensor([True, False]),
    }
    moved = packing._one_copy(tensors, torch.device("cpu"))  # the copy a GPU gets, on this CPU
    for name, tensor in tensors.items():
        assert torch.equal(moved[name], tensor) and moved[name].dtype == tensor.dtype
    assert len({t.untyped_storage().data_ptr() for t in moved.values() if t.dtype == torch.int64}) == 1  # one buffer
    assert to_device_once(tensors, "cpu") == tensors  # on a CPU: the tensors themselves

"""What a multi-process test checks of its engine (hf_dynbsz/testing/engines.py): the records of the processes against
their accelerate config. A launch that fell back to plain data parallelism trains the same parameters as a sharded
one, so only these records tell them apart; here, records written as each case would write them."""

from __future__ import annotations

import pytest
import torch

from hf_dynbsz.testing import engine_mismatches, engine_record, expected_engine, gathered_parameters


def record(distributed_type="MULTI_CPU", parameters=4, dtensors=0, sharded_dtensors=0, zero3=0, numel=100, local=100):
    return {"engine": dict(distributed_type=distributed_type, parameters=parameters, dtensors=dtensors,
                           sharded_dtensors=sharded_dtensors, zero3=zero3, numel=numel, local_numel=local)}  # fmt: skip


FSDP2 = record("FSDP", dtensors=4, sharded_dtensors=4, local=50)
ZERO3 = record("DEEPSPEED", zero3=4, local=52)  # each partition padded to a whole share


def test_the_configs_say_which_engine_and_sharding():
    assert expected_engine("cpu_ddp.yaml") == ("MULTI_CPU", None)
    assert expected_engine("cpu_zero1.yaml") == ("DEEPSPEED", None)
    assert expected_engine("cpu_zero3.yaml") == ("DEEPSPEED", "zero3")
    assert expected_engine("cpu_fsdp2.yaml") == ("FSDP", "fsdp2")


def test_sharded_records_pass_under_their_config():
    assert engine_mismatches([FSDP2, FSDP2], "cpu_fsdp2.yaml") == []
    assert engine_mismatches([ZERO3, ZERO3], "cpu_zero3.yaml") == []
    assert engine_mismatches([record(), record()], "cpu_ddp.yaml") == []
    assert engine_mismatches([record("DEEPSPEED")] * 2, "cpu_zero2.yaml") == []


@pytest.mark.parametrize(
    ("records", "config", "found"),
    [
        # accelerate fell back to DDP under the FSDP2 config: whole parameters, no DTensor
        ([record(), record()], "cpu_fsdp2.yaml", "distributed_type MULTI_CPU, not FSDP"),
        ([record("FSDP"), record("FSDP")], "cpu_fsdp2.yaml", "0 of 4 parameters sharded (fsdp2)"),
        # DTensors replicated on every process: each holds the whole
        ([record("FSDP", dtensors=4, sharded_dtensors=4)] * 2, "cpu_fsdp2.yaml", "holds 100 of 100 elements"),
        ([FSDP2, record("FSDP", dtensors=4, sharded_dtensors=3, local=50)], "cpu_fsdp2.yaml", "rank 1: 3 of 4"),
        # ZeRO-2 where ZeRO-3 was asked for: nothing partitioned
        ([record("DEEPSPEED")] * 2, "cpu_zero3.yaml", "0 of 4 parameters sharded (zero3)"),
        ([record("DEEPSPEED", zero3=4, local=100)] * 2, "cpu_zero3.yaml", "replicated, not sharded"),
        # sharded where the config keeps every parameter whole
        ([FSDP2, FSDP2], "cpu_ddp.yaml", "where the config keeps them whole"),
    ],
)
def test_an_engine_that_did_not_shard_as_asked_is_named(records, config, found):
    mismatches = engine_mismatches(records, config)
    assert any(found in mismatch for mismatch in mismatches), mismatches


def test_a_model_outside_any_engine_is_recorded_whole_and_gathered_as_it_is():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    accelerator = type("Accelerator", (), {"distributed_type": type("Kind", (), {"value": "NO"})()})()
    assert engine_record(accelerator, model) == dict(distributed_type="NO", parameters=4, dtensors=0,
                                                     sharded_dtensors=0, zero3=0, numel=12, local_numel=12)  # fmt: skip
    gathered = gathered_parameters(model)
    assert list(gathered) == [name for name, _ in model.named_parameters()]
    assert all(torch.equal(gathered[name], p) for name, p in model.named_parameters())

"""Every trainer's loss gives the executor everything :class:`~hf_dynbsz.execution.step_loss.StepLoss` asks for.

The executor calls these members on whichever loss its trainer names; a loss missing one fails only when a step
reaches that call (a new member added for one trainer, e.g. the memory cap's ``reserved_mib``, once crashed every
DPO step)."""

from __future__ import annotations

import importlib
import inspect

import pytest

from hf_dynbsz.execution.step_loss import StepLoss

#: every trainer's loss, in the module of that trainer's loss code
LOSSES = {
    "GRPOLoss": "hf_dynbsz.execution.loss",
    "RLOOLoss": "hf_dynbsz.execution.rloo_loss",
    "AsyncGRPOLoss": "hf_dynbsz.execution.async_loss",
    "DistillationLoss": "hf_dynbsz.execution.distillation_loss",
    "DPOLoss": "hf_dynbsz.execution.dpo_loss",
    "RewardLoss": "hf_dynbsz.execution.reward_loss",
    "KTOLoss": "hf_dynbsz.execution.kto_loss",
}

PROTOCOL_METHODS = sorted(
    name for name, member in vars(StepLoss).items() if inspect.isfunction(member) and not name.startswith("_")
)
PROTOCOL_ATTRIBUTES = sorted(name for name in StepLoss.__annotations__)

#: members the executor never calls on a loss, each with why
NEVER_CALLED = {
    # stock DistillationTrainer trains no MoE router aux loss: setup passes aux_loss=False, so the executor's
    # router_aux capability is off and router_weighting is not reached
    "DistillationLoss": ("router_weighting",),
}


def _call_shape(function) -> list[tuple[str, object]]:
    """How the executor can call ``function``: positional parameters by kind (their names may differ), keyword-only
    ones by name, each with its default."""
    shape = []
    for parameter in inspect.signature(function).parameters.values():
        named = parameter.name if parameter.kind is inspect.Parameter.KEYWORD_ONLY else parameter.kind.name
        shape.append((named, parameter.default))
    return shape


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_has_every_member_the_executor_calls(name):
    loss_class = getattr(importlib.import_module(LOSSES[name]), name)
    called = [member for member in PROTOCOL_METHODS if member not in NEVER_CALLED.get(name, ())]
    missing = [member for member in called if not callable(getattr(loss_class, member, None))]
    assert not missing, f"{name} lacks {missing}"
    for method in called:
        expected = _call_shape(getattr(StepLoss, method))
        got = _call_shape(getattr(loss_class, method))
        assert got == expected, f"{name}.{method} takes {got}, StepLoss's {expected}"


def test_the_protocol_lists_the_members_the_executor_reads():
    assert {"reserved_mib", "weigh", "prepare", "forward", "pass_loss", "dummy_pass"} <= set(PROTOCOL_METHODS)
    assert {"entropy_bonus", "needs_step_entropies", "phases"} <= set(PROTOCOL_ATTRIBUTES)  # set per instance

"""DynamicBatchAsyncGRPOTrainer's default step (``async_step="stock"``) against stock TRL AsyncGRPOTrainer in the
scenarios a run meets beyond the plain step: stale samples dropped, the epoch stop, weight syncs every few steps, a
run resumed from a checkpoint, LoRA, a sampling temperature, ``epsilon_high``, gradient checkpointing, samples that
train no token, and the attention kernels that run on a CPU. Each runs stock and the plugin at the very same config
on the same scripted rollouts (one process, CPU, :mod:`hf_dynbsz.testing.async_grpo`) and asserts the parameters
within 1e-5 (relative) and the update within 1e-3 of stock's (:func:`assert_equals_stock`), plus the scenario's own
observable equal to stock's. Stock's constructor under the plugin's replacements
(:mod:`hf_dynbsz.trainers.async_stock_patches`) is checked last.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from test_async_grpo_trainer import UPDATE_TOLERANCE
from test_async_grpo_trainer import assert_equals_stock as _assert_equals_stock

from hf_dynbsz.testing import AsyncRun, RolloutScript, async_grpo_run, relative_difference, update_difference

#: Rows of which a tenth trains no token; stock's fixed-count step 8 x 2 (each micro-batch normalised by its own
#: tokens, so a mis-weighted micro-batch shows).
SCRIPT = RolloutScript(seed=1, untrained=0.1)
CUT = dict(per_device_train_batch_size=8, gradient_accumulation_steps=2)


def assert_equals_stock(ours: AsyncRun, stock: AsyncRun) -> None:
    """:func:`test_async_grpo_trainer.assert_equals_stock`, the two figures printed (``-s`` shows them)."""
    parameters = relative_difference(ours.final, stock.final)
    update = update_difference(stock.initial, ours.final, stock.final)
    print(f"against stock: parameters {parameters:.2g}, update {update:.2g}")
    _assert_equals_stock(ours, stock)


def run_pair(tmp_path, model_dir, script=SCRIPT, **fields) -> tuple[AsyncRun, AsyncRun]:
    """Stock's run and the plugin's at the same config on the same samples."""
    fields = {**CUT, **fields}
    stock = async_grpo_run("async_grpo_stock", model_dir, str(tmp_path / "stock"), script, **fields)
    ours = async_grpo_run("async_grpo_dynamic", model_dir, str(tmp_path / "ours"), script, **fields)
    return stock, ours


def logged(run: AsyncRun, name: str) -> list:
    """``name`` of every optimizer step's log entry (None where the step did not log it)."""
    return [entry.get(name) for entry in run.history if "loss" in entry]


@pytest.fixture(scope="module")
def stock_cut(model_dir, tmp_path_factory):
    """Stock at ``CUT`` with the comparison defaults: the control the scenarios that change the math differ from."""
    return async_grpo_run("async_grpo_stock", model_dir, str(tmp_path_factory.mktemp("stock-cut")), SCRIPT, **CUT)


# ---- the queue, the stop and the weight syncs: stock's, around the plugin's step --------------------------------


def test_stale_samples_are_dropped_as_stock_drops_them(model_dir, tmp_path):
    """``max_staleness=0``: every sample generated before the last weight sync is dropped when read (the worker
    refills two steps' worth at each sync, so each step reads some of the previous version's)."""
    stock, ours = run_pair(tmp_path, model_dir, max_staleness=0, worker_kwargs=dict(samples_per_sync=32))
    assert_equals_stock(ours, stock)
    dropped = logged(stock, "sample/dropped_stale_total")
    assert sum(value or 0 for value in dropped) > 0
    assert logged(ours, "sample/dropped_stale_total") == dropped
    assert logged(ours, "sample/staleness_max") == logged(stock, "sample/staleness_max")


def test_the_epoch_stop_ends_both_at_the_same_step(model_dir, tmp_path):
    """No ``max_steps``: stock stops after ``num_train_epochs`` passes over the 16 prompts, counted in prompt groups
    collated (0.6 epochs: 10 groups, reached in the second step; ``max_steps`` is only stock's safety ceiling)."""
    stock, ours = run_pair(tmp_path, model_dir, max_steps=-1, num_train_epochs=0.6)
    assert_equals_stock(ours, stock)
    assert ours.trainer.state.global_step == stock.trainer.state.global_step == 2
    assert ours.trainer.args.max_steps == stock.trainer.args.max_steps > 2
    assert len(ours.trainer._trained_groups) == len(stock.trainer._trained_groups) >= 10
    assert logged(ours, "batch/groups_per_step") == logged(stock, "batch/groups_per_step")


def test_weights_synced_every_second_step_as_stock(model_dir, tmp_path):
    """``weight_sync_steps=2``: the syncs (at the start and after step 2) and the staleness of what each step reads."""
    stock, ours = run_pair(tmp_path, model_dir, weight_sync_steps=2, worker_kwargs=dict(samples_per_sync=32))
    assert_equals_stock(ours, stock)
    assert ours.transfer.syncs == stock.transfer.syncs == 2
    assert ours.worker.syncs == stock.worker.syncs == 2
    staleness = logged(stock, "sample/staleness_max")
    assert max(staleness) > 0 and logged(ours, "sample/staleness_max") == staleness


class _ParametersAtStart:
    """A callback keeping the parameters ``train()`` starts from (a resumed run's: the checkpoint's)."""

    def __init__(self) -> None:
        self.parameters: dict = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from hf_dynbsz.testing import snapshot_parameters

        self.parameters = snapshot_parameters(model)


def resumed(trainer: str, model_dir: str, output_dir: str, checkpoint: str, **fields) -> AsyncRun:
    """``trainer`` built afresh from ``model_dir`` and trained from ``checkpoint`` (its parameters, optimizer state,
    step) on ``SCRIPT``'s samples; ``initial``: the checkpoint's parameters."""
    from transformers import TrainerCallback

    from hf_dynbsz.testing import async_grpo_on_cpu, snapshot_parameters

    start = type("ParametersAtStart", (_ParametersAtStart, TrainerCallback), {})()
    with async_grpo_on_cpu():
        run = async_grpo_run(
            trainer, model_dir, output_dir, SCRIPT, train=False, trainer_kwargs=dict(callbacks=[start]), **fields
        )
        run.trainer.train(resume_from_checkpoint=checkpoint)
    final = snapshot_parameters(run.trainer.model)
    history = run.trainer.state.log_history  # (the checkpoint's state, loaded by train())
    return dataclasses.replace(run, initial=start.parameters, final=final, history=history)


def test_a_run_resumed_from_a_checkpoint_equals_stocks_resumed_run(model_dir, tmp_path):
    """SGD with momentum (optimizer state in the checkpoint): 3 steps saved every 2, then a fresh trainer resumed from
    step 2's checkpoint trains step 3; the plugin's resume, from its own checkpoint, equals stock's from stock's."""
    import os

    fields = dict(CUT, optim_args="momentum=0.9", save_strategy="steps", save_steps=2, learning_rate=0.2)
    stock, ours = run_pair(tmp_path, model_dir, **fields)
    assert_equals_stock(ours, stock)
    runs = {}
    for name, trainer in (("stock", "async_grpo_stock"), ("ours", "async_grpo_dynamic")):
        checkpoint = str(tmp_path / name / "checkpoint-2")
        assert os.path.isfile(os.path.join(checkpoint, "optimizer.pt"))
        runs[name] = resumed(trainer, model_dir, str(tmp_path / f"{name}-resumed"), checkpoint, **fields)
    for run in runs.values():
        assert run.trainer.state.global_step == 3
        assert [entry["step"] for entry in run.history if "loss" in entry] == [1, 2, 3]  # (1, 2: the checkpoint's)
    assert_equals_stock(runs["ours"], runs["stock"])


# ---- what changes the math: each equals stock's, and differs from stock's default ---------------------------------


def adapters(run: AsyncRun) -> AsyncRun:
    """``run`` with its LoRA adapters' parameters only (the base ones do not train)."""
    keep = [name for name in run.final if "lora_" in name]
    return dataclasses.replace(run, initial={k: run.initial[k] for k in keep}, final={k: run.final[k] for k in keep})


def test_lora_adapters_and_their_update_equal_stocks(model_dir, tmp_path):
    """LoRA with gradient checkpointing on (stock's default: stock then makes the inputs require gradients)."""
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "gate_proj"])
    stock, ours = run_pair(tmp_path, model_dir, gradient_checkpointing=True, trainer_kwargs=dict(peft_config=lora))
    assert stock.trainer.model.is_gradient_checkpointing and ours.trainer.model.is_gradient_checkpointing
    stock_adapters, our_adapters = adapters(stock), adapters(ours)
    assert len(stock_adapters.final) > 0 and stock_adapters.final.keys() == our_adapters.final.keys()
    trained_b = [name for name in stock_adapters.final if "lora_B" in name]
    assert all(float(stock_adapters.initial[name].abs().max()) == 0.0 for name in trained_b)  # B starts at 0
    assert all(float(stock_adapters.final[name].abs().max()) > 0.0 for name in trained_b)
    assert_equals_stock(our_adapters, stock_adapters)


@pytest.mark.parametrize(
    "fields",
    [dict(temperature=0.7), dict(epsilon_high=0.28), dict(gradient_checkpointing=True)],
    ids=["temperature-0.7", "epsilon_high-0.28", "gradient-checkpointing"],
)
def test_a_setting_of_the_loss_or_the_backward_equals_stock(model_dir, tmp_path, stock_cut, fields):
    """The temperature (stock's fused head divides the logits by it), ``epsilon_high`` (the upper clip), gradient
    checkpointing (stock's default; the comparisons' fixtures turn it off): each moves stock away from its default
    run (gradient checkpointing does not) and the plugin with it."""
    stock, ours = run_pair(tmp_path, model_dir, **fields)
    assert_equals_stock(ours, stock)
    moved = update_difference(stock_cut.initial, stock.final, stock_cut.final)
    if "gradient_checkpointing" in fields:
        assert stock.trainer.model.is_gradient_checkpointing and ours.trainer.model.is_gradient_checkpointing
        assert moved < UPDATE_TOLERANCE
    else:
        assert moved > 20 * UPDATE_TOLERANCE, moved
    if "epsilon_high" in fields:
        high = logged(stock, "clip_ratio/high_mean")
        assert high != logged(stock_cut, "clip_ratio/high_mean")
        assert logged(ours, "clip_ratio/high_mean") == pytest.approx(high, rel=1e-5, abs=1e-9)


#: Half the rows train no token; with 4 x 4 a micro-batch is one prompt group, normalised by its own trained tokens
#: (as few as 13: a mis-weighted row shows).
UNTRAINED = RolloutScript(seed=6, untrained=0.5)
ONE_GROUP = dict(per_device_train_batch_size=4, gradient_accumulation_steps=4)


def test_samples_that_train_no_token_weigh_as_stock(model_dir, tmp_path):
    samples = UNTRAINED.take(48)
    trained = [sum(int(s.completion_mask[1:].sum()) for s in samples[i : i + 4]) for i in range(0, 48, 4)]
    assert sum(not any(s.completion_mask) for s in samples) >= 16 and min(trained) > 0, trained
    stock, ours = run_pair(tmp_path, model_dir, UNTRAINED, **ONE_GROUP)
    assert_equals_stock(ours, stock)
    tokens = logged(stock, "batch/trained_tokens_per_step")
    assert tokens == [sum(trained[i : i + 4]) for i in range(0, 12, 4)]
    assert logged(ours, "batch/trained_tokens_per_step") == tokens


@dataclasses.dataclass(frozen=True)
class EditedGroup:
    """``script``'s samples with group ``group`` training no token (``untrained``: completion masks and old
    log-probs 0) or trained with advantage 0 (else)."""

    script: RolloutScript
    group: int
    untrained: bool

    def samples(self):
        import numpy as np

        for sample in self.script.samples():
            if sample.group_id == self.group and self.untrained:
                zeros = dict(completion_mask=np.zeros_like(sample.completion_mask))
                sample = dataclasses.replace(sample, old_log_probs=np.zeros_like(sample.old_log_probs), **zeros)
            elif sample.group_id == self.group:
                sample = dataclasses.replace(sample, advantage=0.0)
            yield sample


def test_a_micro_batch_that_trains_no_token_trains_stocks_parameters(model_dir, tmp_path):
    """A whole micro-batch without a trained token (group 1 at 4 x 4): stock TRL 1.16 raises in its compute_loss
    (``segment_id.max()`` of an empty selection); its loss there is 0 by its own formula (the count clamped to 1), so
    the reference is stock with the group's advantages 0 instead: every other micro-batch keeps its own
    normalisation, the step's divisor stays 4, and the parameters are the same."""
    script = RolloutScript(seed=6)
    stock = async_grpo_run(
        "async_grpo_stock", model_dir, str(tmp_path / "stock"), EditedGroup(script, 1, untrained=False), **ONE_GROUP
    )
    ours = async_grpo_run(
        "async_grpo_dynamic", model_dir, str(tmp_path / "ours"), EditedGroup(script, 1, untrained=True), **ONE_GROUP
    )
    parameters = relative_difference(ours.final, stock.final)
    update = update_difference(stock.initial, ours.final, stock.final)
    print(f"against stock, advantages 0: parameters {parameters:.2g}, update {update:.2g}")
    assert parameters < 1e-5 and update < UPDATE_TOLERANCE, (parameters, update)
    tokens = logged(ours, "batch/trained_tokens_per_step")
    assert (
        tokens[1:] == logged(stock, "batch/trained_tokens_per_step")[1:]
        and tokens[0] < logged(stock, "batch/trained_tokens_per_step")[0]
    )


# ---- the kernels a CPU runs -------------------------------------------------------------------------------------


def test_varlen_attn_rows_equal_stock(model_dir, tmp_path, stock_cut, monkeypatch):
    """The run a capable GPU gets on sdpa (torch's varlen_attn, one call per layer), on this CPU with the reference
    kernel of varlen_attn's contract standing in for torch's."""
    from hf_dynbsz.testing import varlen_attn_standin

    calls = varlen_attn_standin(monkeypatch)
    ours = async_grpo_run("async_grpo_dynamic", model_dir, str(tmp_path), SCRIPT, **CUT)
    assert_equals_stock(ours, stock_cut)
    assert calls and all(call["enable_gqa"] and call["window_size"] == (-1, 0) for call in calls)


def flex_backward_on_cpu() -> str | None:
    """Why flex_attention cannot train on this CPU (None: it can)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    query = torch.randn(1, 1, 16, 8, requires_grad=True)
    try:
        flex_attention(query, query, query).sum().backward()
    except NotImplementedError as error:
        return f"{type(error).__name__}: {error}".splitlines()[0]
    return None


def test_flex_attention_equals_stock(model_dir, tmp_path, request, monkeypatch):
    why = flex_backward_on_cpu()
    if why is not None:  # (before stock's run: the skip costs nothing)
        pytest.skip(f"flex_attention has no backward on CPU in this torch ({why}); these runs are on CPU")
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")  # torch's reference flex: no C++ build of each kernel on a CPU
    ours = async_grpo_run(
        "async_grpo_dynamic",
        model_dir,
        str(tmp_path),
        SCRIPT,
        model_init_kwargs={"attn_implementation": "flex_attention"},
        **CUT,
    )
    assert ours.trainer.model.config._attn_implementation != "tree_fa3"
    assert_equals_stock(ours, request.getfixturevalue("stock_cut"))


# ---- stock's constructor under the plugin's replacements ---------------------------------------------------------

REPLACED = ("create_model_from_path", "add_fused_lm_head", "get_peak_flops_per_device")


def test_stocks_constructor_runs_under_each_replacement(model_dir, tmp_path, monkeypatch):
    """Each of the three functions of stock's module the plugin replaces while stock's constructor runs is called
    (counted on the replacements themselves), stock's originals get what the replacements pass on (the model's
    loader no ``tree_fa3``; no peak FLOPs asked for on a CPU), and every original is back afterwards."""
    from trl.experimental.async_grpo import async_grpo_trainer as stock_module

    from hf_dynbsz import DynamicBatchAsyncGRPOTrainer

    originals = {name: getattr(stock_module, name) for name in REPLACED}
    reached: dict[str, list] = {name: [] for name in REPLACED}
    for name, function in originals.items():

        def original(*args, _name=name, _function=function, **kwargs):
            reached[_name].append(kwargs)
            return _function(*args, **kwargs)

        monkeypatch.setattr(stock_module, name, original)
    spies = {name: getattr(stock_module, name) for name in REPLACED}
    called: dict[str, int] = dict.fromkeys(REPLACED, 0)
    construction = DynamicBatchAsyncGRPOTrainer._dynbsz_construction

    @contextlib.contextmanager
    def counted(self):
        with construction(self):
            replacements = {name: getattr(stock_module, name) for name in REPLACED}
            assert all(replacements[name] is not spies[name] for name in REPLACED)  # each one replaced
            for name, function in replacements.items():

                def replacement(*args, _name=name, _function=function, **kwargs):
                    called[_name] += 1
                    return _function(*args, **kwargs)

                setattr(stock_module, name, replacement)
            try:
                yield
            finally:
                for name, function in replacements.items():
                    setattr(stock_module, name, function)

    monkeypatch.setattr(DynamicBatchAsyncGRPOTrainer, "_dynbsz_construction", counted)
    run = async_grpo_run(
        "async_grpo_dynamic", model_dir, str(tmp_path), SCRIPT, train=False, stock_kernel="fa3", **CUT
    )  # (no stand-in for stock's peak FLOPs: the replacement must not ask CUDA)
    assert called == dict.fromkeys(REPLACED, 1)
    assert [kwargs.get("attn_implementation") for kwargs in reached["create_model_from_path"]] == [None]
    assert len(reached["add_fused_lm_head"]) == 1 and reached["get_peak_flops_per_device"] == []
    assert run.trainer.model.config._attn_implementation not in ("tree_fa3", None)
    assert all(getattr(stock_module, name) is spies[name] for name in REPLACED)  # put back

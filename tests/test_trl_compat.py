"""Every internal name of TRL / transformers / accelerate the plugin touches still exists, and none is unlisted.

``hf_dynbsz._trl_compat.INTERNAL_NAMES`` is the one list. A TRL upgrade that renames a hook or changes the
parameters we pass fails here, by name, instead of deep inside a training step; so does one that adds a parameter
to a hook the plugin overrides or changes the tuple it returns (``docs/trl-compatibility.md``).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import re
import textwrap
import tokenize
from pathlib import Path

import pytest
import torch

from hf_dynbsz._trl_compat import INTERNAL_NAMES, override_drift, unpacked_lengths
from hf_dynbsz.testing import (
    RecordingReward,
    base_config_kwargs,
    distillation_trainer,
    load_tokenizer,
    prompt_dataset,
)

PACKAGE = Path(__file__).resolve().parents[1] / "hf_dynbsz"
COMPATIBILITY_DOC = PACKAGE.parent / "docs" / "trl-compatibility.md"
OVERRIDES = [entry for entry in INTERNAL_NAMES if entry.use == "overrides"]


def resolve(path: str):
    module, _, attribute = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError):
        return importlib.import_module(path)


def trainer_pair(owner: str):
    """``(stock class, ours)`` of an owner ``"trl.GRPOTrainer"`` / ``"trl.RLOOTrainer"`` /
    ``"trl.DistillationTrainer"`` / ``"trl.experimental.async_grpo.AsyncGRPOTrainer"`` (or its instance)."""
    from trl import DistillationTrainer, GRPOTrainer, RLOOTrainer

    from hf_dynbsz import DynamicBatchDistillationTrainer, DynamicBatchGRPOTrainer, DynamicBatchRLOOTrainer

    if "AsyncGRPOTrainer" in owner:
        from trl.experimental.async_grpo import AsyncGRPOTrainer

        from hf_dynbsz import DynamicBatchAsyncGRPOTrainer

        return AsyncGRPOTrainer, DynamicBatchAsyncGRPOTrainer
    if "RLOOTrainer" in owner:
        return RLOOTrainer, DynamicBatchRLOOTrainer
    if "DistillationTrainer" in owner:
        return DistillationTrainer, DynamicBatchDistillationTrainer
    return GRPOTrainer, DynamicBatchGRPOTrainer


@pytest.fixture(scope="module")
def stock_trainers(model_dir, tmp_path_factory):
    """A stock trainer of each kind, by the owner name of its instance attributes."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, RLOOConfig

    trainers = {}
    for owner, config in (("GRPOTrainer instance", GRPOConfig), ("RLOOTrainer instance", RLOOConfig)):
        stock, _ = trainer_pair(owner)
        trainers[owner] = stock(
            model=AutoModelForCausalLM.from_pretrained(model_dir),
            reward_funcs=RecordingReward(),
            args=config(**base_config_kwargs(str(tmp_path_factory.mktemp("out")), beta=0.0)),
            train_dataset=prompt_dataset(),
            processing_class=load_tokenizer(model_dir),
        )
    trainers["DistillationTrainer instance"] = distillation_trainer(
        "distillation_stock", str(tmp_path_factory.mktemp("distillation")), model_dir=model_dir
    )
    return trainers


@pytest.mark.parametrize("entry", INTERNAL_NAMES, ids=lambda entry: f"{entry.owner}.{entry.name}")
def test_internal_name_exists_in_the_installed_versions(entry, stock_trainers):
    stock_trainer = stock_trainers["GRPOTrainer instance"]
    if entry.owner in stock_trainers:
        trainer = stock_trainers[entry.owner]
        assert hasattr(trainer, entry.name), f"{type(trainer).__name__} no longer sets {entry.name} ({entry.why})"
        return
    if entry.owner == "torch.nn.parallel.DistributedDataParallel instance":  # set in DDP's __init__ and forward
        from torch.nn.parallel import DistributedDataParallel

        assert f"self.{entry.name} = " in inspect.getsource(DistributedDataParallel), entry.why
        return
    if entry.owner == "transformers.PretrainedConfig instance":
        assert hasattr(stock_trainer.model.config, entry.name)
        return
    if entry.owner.endswith(" instance"):  # an attribute another TRL class sets on itself: its source assigns it
        source = inspect.getsource(resolve(entry.owner.removesuffix(" instance")))
        assert re.search(rf"self\.{entry.name}\s*[:=]", source), (
            f"{entry.owner} no longer sets {entry.name} ({entry.why})"
        )
        return
    if entry.use == "passes":  # keyword arguments of the forward that TRL's fused LM head adds
        from trl.trainer.utils import add_fused_lm_head

        assert add_fused_lm_head is resolve(entry.owner)
        model = stock_trainer.model  # GRPOTrainer added the fused head
        input_ids = torch.tensor([[3, 4, 5, 6]])
        labels = torch.tensor([[4, 5, 6, -100]])
        outputs = model(input_ids=input_ids, **{"shift_labels": labels, entry.name: True})
        assert outputs.log_probs.shape == (1, 4) and outputs.entropy.shape == (1, 4)
        return
    owner = resolve(entry.owner)
    assert hasattr(owner, entry.name), f"{entry.owner} no longer has {entry.name} ({entry.why})"
    if entry.parameters:
        parameters = inspect.signature(getattr(owner, entry.name)).parameters
        missing = [name for name in entry.parameters if name not in parameters]
        assert not missing, f"{entry.owner}.{entry.name} no longer takes {missing}"


def private_names_used(path: Path) -> set[str]:
    """Attribute names starting with one underscore, as ``x._name`` or as a string literal (getattr & co)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    used = set()
    importing = False  # inside the names of a `from module import ...` statement
    for before, token in zip(tokens, tokens[1:]):
        if token.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            importing = False
        elif token.string == "import" and any(t.string == "from" and t.start[0] == token.start[0] for t in tokens):
            importing = True
        elif importing and token.type == tokenize.NAME and before.string in ("import", ",", "("):
            used.add(token.string)
        elif before.string == "." and token.type == tokenize.NAME:
            used.add(token.string)
        elif token.type == tokenize.STRING:
            match = re.fullmatch(r"[rbuRBU]?(['\"])(_\w+)\1", token.string)
            if match:
                used.add(match.group(2))
    return {name for name in used if name.startswith("_") and not name.startswith("__")}


def names_defined_by_the_plugin() -> set[str]:
    defined = {path.stem for path in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        defined |= set(re.findall(r"^\s*(?:def|class)\s+(_\w+)", text, re.MULTILINE))
        defined |= set(re.findall(r"^(_\w+)\s*[:=]", text, re.MULTILINE))
        if path.parent.name != "trainers":  # the trainers' own attributes are _dynbsz_*; their other writes are TRL's
            defined |= set(re.findall(r"self\.(_\w+)\s*[:=]", text))
    return defined


#: Names with a leading underscore that are documented public API of the standard library, not TRL's internals.
STANDARD_LIBRARY_NAMES = {"_exit"}  # os._exit: leave without interpreter finalization (testing.leave_worker)


def test_every_internal_name_the_plugin_touches_is_listed():
    listed = {entry.name for entry in INTERNAL_NAMES} | STANDARD_LIBRARY_NAMES
    defined = names_defined_by_the_plugin()
    unlisted = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in private_names_used(path) - defined - listed:
            if not name.startswith("_dynbsz") and not name.startswith("_hf_dynbsz"):
                unlisted.setdefault(name, []).append(path.name)
    assert not unlisted, f"internal names used but not in hf_dynbsz._trl_compat.INTERNAL_NAMES: {unlisted}"


def test_the_listing_check_would_see_an_unlisted_name(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from trl.trainer import _secret\nx = trainer._buffered_inputs\ny = getattr(model, '_hidden', None)\n"
    )
    assert private_names_used(sample) == {"_secret", "_buffered_inputs", "_hidden"}


def returned_lengths(function) -> set[int]:
    """Lengths of the tuple literals a function returns (a returned call, e.g. stock's result, is not counted)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    return {
        len(node.value.elts)
        for node in ast.walk(tree)
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Tuple)
    }


@pytest.mark.parametrize("entry", OVERRIDES, ids=lambda entry: entry.name)
def test_each_override_fits_stock_callers(entry):
    """Stock's callers can call the override (same parameters, same order) and unpack what it returns (a tuple of
    ``entry.returns`` values; one value, not a tuple, where it is None)."""
    stock_class, ours = trainer_pair(entry.owner)
    stock, override = getattr(stock_class, entry.name), getattr(ours, entry.name)
    assert override is not stock
    assert override_drift(inspect.signature(stock), inspect.signature(override)) == []
    stock_module = inspect.getsource(inspect.getmodule(stock_class))
    expected = set() if entry.returns is None else {entry.returns}
    assert unpacked_lengths(stock_module, entry.name) == expected, f"stock unpacks {entry.name} differently"
    assert returned_lengths(override) == expected


# TRL v1.9.0's _generate_single_turn, signature as in its trl/trainer/grpo_trainer.py (the body is not needed)
def generate_single_turn_v1_9(self, prompt_ids, images, multimodal_fields): ...


def test_override_drift_names_each_mismatch():
    from trl import GRPOTrainer

    from hf_dynbsz import DynamicBatchGRPOTrainer

    stock_1_16 = inspect.signature(GRPOTrainer._generate_single_turn)
    override_1_16 = inspect.signature(DynamicBatchGRPOTrainer._generate_single_turn)
    stock_1_9 = inspect.signature(generate_single_turn_v1_9)
    # the 1.16 override under 1.9's callers: it requires num_generations, which they do not pass
    assert override_drift(stock_1_9, override_1_16) == [
        "the override requires 'num_generations', which stock's callers do not pass"
    ]
    # a 1.9-form override under 1.16's callers: it does not take the two parameters 1.16 added
    assert override_drift(stock_1_16, stock_1_9) == [
        "stock passes 'num_generations', which the override does not take",
        "stock passes 'has_tool_images', which the override does not take",
    ]

    def reordered(self, prompt_ids, multimodal_fields, images, num_generations, has_tool_images=False): ...

    def taking_any_keyword(self, prompt_ids, images, multimodal_fields, **new): ...

    assert override_drift(stock_1_16, inspect.signature(reordered)) == [
        "stock's positional parameter 2 is 'images', the override's is not",
        "stock's positional parameter 3 is 'multimodal_fields', the override's is not",
    ]
    # **kwargs takes a parameter stock's callers pass by name, not one they may pass by position (1.16 passes
    # num_generations by position)
    assert override_drift(stock_1_16, inspect.signature(taking_any_keyword)) == [
        "stock's positional parameter 4 is 'num_generations', the override's is not",
        "stock's positional parameter 5 is 'has_tool_images', the override's is not",
    ]

    def stock_with_keyword_only(self, prompt_ids, images, multimodal_fields, *, trace=None): ...

    assert override_drift(inspect.signature(stock_with_keyword_only), inspect.signature(taking_any_keyword)) == []


def test_unpacked_lengths_reads_each_call_site():
    from trl import GRPOTrainer

    stock_module = inspect.getsource(inspect.getmodule(GRPOTrainer))
    assert unpacked_lengths(stock_module, "_get_per_token_logps_and_entropies") == {3}
    before_1_7 = "logps, entropies = self._get_per_token_logps_and_entropies(model, ids)\nx = self.other(y)\n"
    assert unpacked_lengths(before_1_7, "_get_per_token_logps_and_entropies") == {2}
    assert unpacked_lengths(before_1_7, "_generate_single_turn") == set()


def test_the_compatibility_doc_has_a_row_for_every_internal_name():
    rows = [line for line in COMPATIBILITY_DOC.read_text().splitlines() if line.startswith("|")]
    missing = [e.name for e in INTERNAL_NAMES if not any(re.search(rf"(?<!\w){e.name}(?!\w)", row) for row in rows)]
    assert not missing, f"docs/trl-compatibility.md has no row for {missing}"

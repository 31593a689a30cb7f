"""Specification of hf_dynbsz.planning.settings: every setting written once, and everything else derived from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hf_dynbsz.planning.env import read_env_overrides
from hf_dynbsz.planning.settings import DEFAULTS, SETTINGS, defaults_of, markdown_tables, readme_block, setting

CONFIGURATION_DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


@pytest.mark.parametrize("marker", list(markdown_tables()))
def test_configuration_doc_tables_are_the_generated_ones(marker):
    expected = markdown_tables()[marker]
    assert readme_block(CONFIGURATION_DOC.read_text(encoding="utf-8"), marker) == expected, (
        f"docs/configuration.md's {marker} differs from hf_dynbsz.planning.settings: "
        "run `python -m hf_dynbsz.planning.settings docs/configuration.md`"
    )


def test_every_setting_is_fully_described():
    for spec in SETTINGS:
        assert spec.unit and spec.summary and spec.help, spec.name
        if spec.kind == "count":
            assert spec.expected.startswith("a positive integer number of"), spec.name
        if spec.kind == "choice":
            assert spec.default in spec.choices and spec.fix, spec.name


CONFIG_CLASSES = {
    "grpo": "DynamicBatchGRPOConfig",
    "rloo": "DynamicBatchRLOOConfig",
    "distillation": "DynamicBatchDistillationConfig",
}


@pytest.mark.parametrize("trainer", list(CONFIG_CLASSES))
def test_config_fields_come_from_the_table(trainer):
    """Each trainer's config has the settings that apply to it (a distillation's teacher budget only there)."""
    from hf_dynbsz import configs

    config_class = getattr(configs, CONFIG_CLASSES[trainer])
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    assert set(defaults_of(trainer)) <= set(fields)
    assert set(DEFAULTS) - set(defaults_of(trainer)) == set(DEFAULTS) - set(fields)
    for name, default in defaults_of(trainer).items():
        spec = setting(name)
        assert fields[name].default == default
        assert fields[name].metadata["help"].startswith(spec.help)
        if spec.env:
            assert spec.env in fields[name].metadata["help"]
        if spec.choices and spec.kind == "choice":  # a sharing rule takes true and false besides its names
            assert fields[name].metadata["choices"] == list(spec.choices)
        assert f"{name} (`{spec.type}`" in config_class.__doc__


def test_environment_variables_come_from_the_table():
    environ = {s.env: "tree" if s.kind == "sharing" else "3" for s in SETTINGS if s.env}
    assert {field: variable for field, (variable, _) in read_env_overrides(environ).items()} == {
        s.name: s.env for s in SETTINGS if s.env
    }


@pytest.mark.parametrize("trainer", ["grpo", "distillation"])
def test_command_line_help_is_the_settings_help(capsys, trainer):
    from hf_dynbsz.cli import _plan_parser

    text = "".join(_plan_parser(trainer).format_help().split())  # argparse re-wraps lines (also after hyphens)
    for name in defaults_of(trainer):
        assert f"--{name}" in text
        assert "".join(setting(name).help.split()) in text


def test_plan_table_meaning_column_is_the_summary():
    from hf_dynbsz.planning.plan import BatchSizePlan

    rows = {
        row[0]: row[3]
        for row in BatchSizePlan.from_args(
            dataclasses.make_dataclass(
                "Args", [("per_device_train_batch_size", int, 4), ("num_generations", int, 4)]
            )(),
            num_processes=1,
        ).rows()
    }
    for name in ("tensor_batch_size", "per_device_generation_batch_size", "oversize_policy", "dynamic_batching"):
        assert rows[name] == setting(name).summary

"""``hf-dynbsz plan``'s inputs: the files and flags it reads besides the config's own options (an accelerate YAML, a
DeepSpeed JSON, a model's config, ``--num_processes``, ``--shared_prefix``), each checked with a message that names the
flag or file, its value and the fix (:class:`UsageError`, exit status 2)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from hf_dynbsz.planning.coerce import parse_int

__all__ = [
    "UsageError",
    "attn_implementation_of",
    "checked_shared_prefix",
    "planned_num_processes",
    "read_accelerate_config",
    "read_model_config",
    "zero_stage_from_deepspeed_json",
]


class UsageError(ValueError):
    """A problem with the user's input (file, setting): reported on stderr with exit status 2."""


def read_accelerate_config(path: str) -> dict[str, Any]:
    """``num_processes``, ``num_machines``, ``mixed_precision`` and the DeepSpeed ``zero_stage`` of an ``accelerate``
    YAML file.

    Keys absent from the file are absent from the result. ``num_processes`` is accelerate's total over all
    machines. The ZeRO stage comes from ``deepspeed_config.zero_stage``, or from the ``zero_optimization.stage`` of
    the JSON file named by ``deepspeed_config.deepspeed_config_file``.
    """
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except OSError as error:
        raise UsageError(f"cannot read --config_file {path!r}: {error.strerror or error}") from None
    except yaml.YAMLError as error:
        raise UsageError(f"--config_file {path!r} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config_file {path!r} must be a YAML mapping (an accelerate config file).")
    result: dict[str, Any] = {}
    for key in ("num_processes", "num_machines"):
        if data.get(key) is not None:
            result[key] = data[key]
    if data.get("mixed_precision") is not None:
        precision = data["mixed_precision"]
        result["mixed_precision"] = "no" if precision is False else str(precision)  # YAML 1.1 reads `no` as False
    deepspeed = data.get("deepspeed_config") or {}
    if isinstance(deepspeed, dict):
        if deepspeed.get("zero_stage") is not None:
            result["zero_stage"] = deepspeed["zero_stage"]
        elif deepspeed.get("deepspeed_config_file"):
            stage = zero_stage_from_deepspeed_json(deepspeed["deepspeed_config_file"])
            if stage is not None:
                result["zero_stage"] = stage
    return result


def zero_stage_from_deepspeed_json(path: str) -> int | None:
    """The ``zero_optimization.stage`` of a DeepSpeed JSON file, or None where it names none."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as error:
        raise UsageError(f"cannot read DeepSpeed config {path!r}: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise UsageError(f"DeepSpeed config {path!r} is not valid JSON: {error}") from None
    stage = (data.get("zero_optimization") or {}).get("stage") if isinstance(data, dict) else None
    return stage if isinstance(stage, int) else None


def attn_implementation_of(namespace: argparse.Namespace) -> str | None:
    """``--attn_implementation``, else ``model_init_kwargs``' ``attn_implementation``, else None."""
    if namespace.attn_implementation:
        return namespace.attn_implementation
    kwargs = getattr(namespace, "model_init_kwargs", None)
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError:
            return None
    if isinstance(kwargs, dict):
        return kwargs.get("attn_implementation")
    return None


def read_model_config(path: str):
    """The transformers config of a model directory or ``config.json`` file (workload model, layout, images)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise UsageError(f"--model_config {path!r}: not a model directory or config.json file ({error}).") from None


def planned_num_processes(namespace: argparse.Namespace, launcher: dict[str, Any]) -> int:
    """The world size to plan for: ``--num_processes``, else the accelerate file's (all machines), else 1."""
    if namespace.num_processes is not None:
        value, where = namespace.num_processes, "--num_processes"
    elif launcher.get("num_processes") is not None:
        value, where = launcher["num_processes"], f"num_processes of --config_file {namespace.config_file!r}"
    else:
        return 1
    if parse_int(value, strings=False) is None or value < 1:
        raise UsageError(
            f"{where} must be a positive integer (data-parallel processes over all machines), got "
            f"{value!r}: give the number of devices the run uses, e.g. 8 for one node of 8 GPUs."
        )
    machines = launcher.get("num_machines", 1)
    if namespace.num_processes is None and (not isinstance(machines, int) or machines < 1 or value % machines):
        raise UsageError(
            f"num_processes={value} of --config_file {namespace.config_file!r} is not a multiple of its "
            f"num_machines={machines!r}: accelerate's num_processes counts every process on every "
            "machine (e.g. 2 machines x 8 GPUs = 16)."
        )
    return value


def checked_shared_prefix(namespace, lengths) -> int:
    """``--shared_prefix``, checked against the lengths: a block of tokens shorter than every prompt given."""
    shared = namespace.shared_prefix
    shortest = min((prompt for _, prompt, _ in lengths if prompt is not None), default=None)
    if shared < 0 or (shared and (shortest is None or shortest < shared)):
        raise UsageError(
            f"--shared_prefix must be a number of tokens every prompt begins with, at most the shortest prompt of "
            f"--lengths ({shortest if shortest is not None else 'none given: use PROMPT COMPLETION lines'}), got "
            f"{shared}."
        )
    return shared

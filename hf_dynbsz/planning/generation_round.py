"""TRL's generation round: how many samples one round of generation makes (``generation_batch_size``, global) and how
many training steps it serves (``steps_per_generation``), with the divisibility checks TRL and DeepSpeed need.

:func:`resolve_generation_round` derives one from the other exactly as TRL 1.16 does, for any number of processes,
with errors that name the values and the nearest valid ones; :func:`user_generation_settings` reads back what the
user asked for from a config TRL already post-initialised for another world size.

Pure Python (no torch, no TRL).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["USER_BATCH_SETTINGS_ATTR", "resolve_generation_round", "user_generation_settings"]

#: Name of the attribute where ``DynamicBatchGRPOConfig`` records the ``generation_batch_size`` and
#: ``steps_per_generation`` the user gave, before TRL derives one from the other for its world size.
USER_BATCH_SETTINGS_ATTR = "_hf_dynbsz_user_batch_settings"


def _nearest_multiples(value: int, step: int) -> list[int]:
    """The positive multiples of ``step`` just below and just above ``value``."""
    below = (value // step) * step
    above = below + step
    return [m for m in (below, above) if m > 0 and m != value]


def _either(values: list[int]) -> str:
    return " or ".join(str(v) for v in values)


def resolve_generation_round(
    *,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    num_processes: int,
    num_generations: int,
    generation_batch_size: int | None,
    steps_per_generation: int | None,
) -> tuple[int, int, str]:
    """TRL 1.16's derivation of the generation round, with the divisibility checks and helpful errors.

    ``generation_batch_size`` is GLOBAL (samples per generation round, all processes);
    ``steps_per_generation`` is the number of training steps (slices of ``per_device_train_batch_size``
    samples per device) one generation round serves. At most one of them may be given; with neither,
    ``steps_per_generation = gradient_accumulation_steps``.

    Returns ``(generation_batch_size, steps_per_generation, source)`` where ``source`` names the setting the
    round was derived from: "generation_batch_size", "steps_per_generation" or "gradient_accumulation_steps".
    """
    global_micro = per_device_train_batch_size * num_processes
    micro_text = (
        f"per_device_train_batch_size x num_processes "
        f"({per_device_train_batch_size} x {num_processes} = {global_micro})"
    )
    if generation_batch_size is not None and steps_per_generation is not None:
        raise ValueError(
            f"generation_batch_size ({generation_batch_size}) and steps_per_generation ({steps_per_generation}) "
            "cannot both be set: generation_batch_size = per_device_train_batch_size x num_processes x "
            "steps_per_generation. Set only one of them."
        )
    if generation_batch_size is not None:
        valid_step = math.lcm(global_micro, num_generations)
        if generation_batch_size % global_micro != 0:
            raise ValueError(
                f"generation_batch_size ({generation_batch_size}, global samples per generation round) must be "
                f"divisible by {micro_text}: use {_either(_nearest_multiples(generation_batch_size, valid_step))} "
                f"(multiples of both {global_micro} and num_generations {num_generations})."
            )
        if generation_batch_size % num_generations != 0:
            raise ValueError(
                f"generation_batch_size ({generation_batch_size}) must be divisible by num_generations "
                f"({num_generations}): use {_either(_nearest_multiples(generation_batch_size, valid_step))}."
            )
        return generation_batch_size, generation_batch_size // global_micro, "generation_batch_size"

    if steps_per_generation is not None:
        source = "steps_per_generation"
    else:
        steps_per_generation = gradient_accumulation_steps
        source = "gradient_accumulation_steps"
    generation_batch_size = global_micro * steps_per_generation
    if generation_batch_size % num_generations != 0:
        step_multiple = num_generations // math.gcd(global_micro, num_generations)
        valid_steps = _nearest_multiples(steps_per_generation, step_multiple)
        hint = ""
        if source == "gradient_accumulation_steps":
            hint = (
                " (steps_per_generation defaults to gradient_accumulation_steps: set steps_per_generation or "
                "change gradient_accumulation_steps)"
            )
        raise ValueError(
            f"generation_batch_size ({generation_batch_size} = per_device_train_batch_size x num_processes x "
            f"steps_per_generation = {per_device_train_batch_size} x {num_processes} x {steps_per_generation}) "
            f"must be divisible by "
            f"num_generations ({num_generations}): use steps_per_generation {_either(valid_steps)} "
            f"(generation_batch_size {_either([s * global_micro for s in valid_steps])}){hint}, or change "
            f"per_device_train_batch_size or num_generations."
        )
    return generation_batch_size, steps_per_generation, source


def user_generation_settings(args: Any) -> tuple[int | None, int | None]:
    """The ``(generation_batch_size, steps_per_generation)`` the user asked for, before any world-size derivation.

    1. A ``DynamicBatchGRPOConfig`` recorded them before TRL's ``__post_init__`` (:data:`USER_BATCH_SETTINGS_ATTR`).
    2. A post-initialised plain ``GRPOConfig`` (recognised by its ``world_size`` attribute) has both set, one of
       them derived by TRL for ``args.world_size`` processes, and does not say which. We keep
       ``steps_per_generation`` (TRL's default cadence, which does not depend on the world size) and re-derive the
       global ``generation_batch_size``; for the world size the config was built for this gives back TRL's value.
    3. Anything else (an ``argparse.Namespace`` of raw values, as the command line passes) is taken as given.
    """
    recorded = getattr(args, USER_BATCH_SETTINGS_ATTR, None)
    if recorded is not None:
        return recorded.get("generation_batch_size"), recorded.get("steps_per_generation")
    generation_batch_size = getattr(args, "generation_batch_size", None)
    steps_per_generation = getattr(args, "steps_per_generation", None)
    if generation_batch_size is not None and steps_per_generation is not None and hasattr(args, "world_size"):
        return None, steps_per_generation
    return generation_batch_size, steps_per_generation

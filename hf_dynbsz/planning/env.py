"""Environment-variable overrides for batch-size sweeps.

A sweep driver can change batch sizes without editing the training script by
exporting ``DIFFU_*`` variables. Each variable overrides one configuration
field; the precedence is **environment over arguments over defaults**. The
variables and their fields are listed once, in :data:`hf_dynbsz.planning.settings.SETTINGS`
(``python -m hf_dynbsz.planning.settings`` prints the table).

This module is pure Python (no torch, no TRL) so that the command-line planner
and the configuration share one implementation.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from hf_dynbsz.planning.coerce import coerce_sharing, finite_number, parse_int
from hf_dynbsz.planning.settings import ENV_SETTINGS, Setting

__all__ = [
    "apply_env_overrides",
    "env_sources",
    "read_env_overrides",
    "with_env_sources",
]

logger = logging.getLogger("hf_dynbsz")

# (variable, value, field) triples already logged in this process: a sweep applies the same override to
# several objects (config, trainer), and the log should say it once.
_LOGGED: set[tuple[str, Any, str]] = set()


def _parse(spec: Setting, raw: str) -> Any:
    """The value of ``spec``'s variable: a positive integer (:func:`hf_dynbsz.planning.coerce.parse_int`), a positive
    finite number for a ``"number"`` setting (a fraction such as 0.9), or for a sharing rule what
    :func:`~hf_dynbsz.planning.coerce.coerce_sharing` reads; an error naming the variable. The setting's own checks
    (a fraction at most 1) run where the config is validated."""
    value = None
    if spec.kind == "sharing":
        try:
            return coerce_sharing(spec, raw)
        except ValueError:
            pass
    elif spec.kind == "number":
        value = finite_number(raw)
    else:
        value = parse_int(raw)
    if value is None or value <= 0:
        raise ValueError(
            f"{spec.env}={raw!r} is not valid: expected {spec.expected} "
            f"(it overrides {spec.name}). Unset the variable to keep the configured value."
        )
    return value


def read_env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, tuple[str, Any]]:
    """Read the ``DIFFU_*`` variables that are set.

    Returns a mapping ``field name -> (variable name, value)``; variables that are not set are absent.
    Raises :class:`ValueError` naming the variable, its value and what is expected when a set variable is
    empty, not an integer, zero or negative (or, for ``share_prompt_prefix``, not a rule or a boolean).
    """
    if environ is None:
        environ = os.environ
    overrides: dict[str, tuple[str, Any]] = {}
    for spec in ENV_SETTINGS:
        if spec.env in environ:
            overrides[spec.name] = (spec.env, _parse(spec, environ[spec.env]))
    return overrides


#: Attribute where :func:`apply_env_overrides` records which fields a DIFFU_* variable set: {field: variable}.
ENV_SOURCES_ATTR = "_hf_dynbsz_env_sources"


def _main_process(environ: Mapping[str, str]) -> bool:
    """Whether this is the main process of a launch (``RANK`` 0 or unset): only it logs overrides visibly."""
    return environ.get("RANK", "0") in ("", "0")


def apply_env_overrides(args: Any, environ: Mapping[str, str] | None = None) -> list[str]:
    """Set the fields of ``args`` named by the ``DIFFU_*`` variables found in ``environ``.

    ``args`` is any object with attributes (a ``GRPOConfig``, an ``argparse.Namespace``...). Returns one
    human-readable message per applied override, e.g.
    ``"DIFFU_TRAIN_BATCH_SIZE=2 overrides per_device_train_batch_size=4"`` (the value it replaced). Each
    override is logged once per process, as a WARNING on the main process (so it shows by default) and at INFO on
    the others, and is recorded on ``args`` (see :func:`env_sources`) so that errors and the plan table can name
    the variable. Bad values raise :class:`ValueError` before anything is changed.
    """
    if environ is None:
        environ = os.environ
    overrides = read_env_overrides(environ)
    messages = []
    sources = dict(env_sources(args))
    for field_name, (variable, value) in overrides.items():
        previous = getattr(args, field_name, None)
        setattr(args, field_name, value)
        sources[field_name] = f"{variable}={value}"
        message = f"{variable}={value} overrides {field_name}={previous}"
        messages.append(message)
        key = (variable, value, field_name)
        if key not in _LOGGED:
            _LOGGED.add(key)
            logger.log(logging.WARNING if _main_process(environ) else logging.INFO, message)
    if sources:
        setattr(args, ENV_SOURCES_ATTR, sources)
    return messages


def env_sources(args: Any) -> Mapping[str, str]:
    """``{field: "DIFFU_X=value"}`` for the fields of ``args`` a ``DIFFU_*`` variable set (empty when none did)."""
    return getattr(args, ENV_SOURCES_ATTR, None) or {}


def with_env_sources(error: ValueError, args: Any) -> ValueError:
    """``error`` with the ``DIFFU_*`` variables that set values of ``args`` named, so the user can find the cause."""
    sources = env_sources(args)
    if not sources:
        return error
    named = ", ".join(f"{field} from {source}" for field, source in sources.items())
    return type(error)(f"{error} (Set by the environment: {named}; change or unset the variable to change it.)")

"""Stock AsyncGRPOTrainer's module functions replaced while its constructor runs (every patch of TRL's async code in
one module, each listed in :mod:`hf_dynbsz._trl_compat`).

Stock's ``__init__`` loads the model on its FlashAttention-3 tree kernel and refuses layer kinds other than full and
sliding attention and parameters named ``*.sinks`` before any hook a subclass can override; the plugin trains all of
them exactly on the model's own kernels (segment recurrence, the kernels' sinks). Rather than copy the constructor,
:func:`stock_construction` replaces three functions of stock's module for its duration: ``create_model_from_path``
(the run's kernel; layer kinds and sinks hidden from the refusals), ``add_fused_lm_head`` (both put back before
stock's own call) and ``get_peak_flops_per_device`` (nothing looked up without CUDA: stock asks CUDA for the device's
name, for an MFU figure only).
"""

from __future__ import annotations

import contextlib

from trl.experimental.async_grpo import async_grpo_trainer as stock_module

__all__ = ["stock_construction", "stock_throughput_blocker"]

#: The layer kinds stock's tree attention trains (anything else it refuses).
_STOCK_LAYER_TYPES = {"full_attention", "sliding_attention"}


@contextlib.contextmanager
def stock_construction(attention: str | None):
    """The context stock's constructor runs in: the model loads with ``attention`` (the run's attention
    implementation; None: transformers' default), stock's refusals of state-carrying layers and attention sinks see
    neither (the plugin runs both exactly; they are back before stock's ``add_fused_lm_head``, and after the context),
    and a device without CUDA looks up no peak FLOPs."""
    restore: list = []
    originals = {
        name: getattr(stock_module, name)
        for name in ("create_model_from_path", "add_fused_lm_head", "get_peak_flops_per_device")
    }

    def create_model_from_path(model_id, *args, **kwargs):
        kwargs.pop("attn_implementation", None)
        if attention is not None:
            kwargs["attn_implementation"] = attention
        model = originals["create_model_from_path"](model_id, *args, **kwargs)
        restore.append(_hide_from_stock_refusals(model))
        return model

    def add_fused_lm_head(model, *args, **kwargs):
        while restore:
            restore.pop()()
        return originals["add_fused_lm_head"](model, *args, **kwargs)

    def get_peak_flops_per_device(accelerator, dtype):
        if accelerator.device.type != "cuda":
            return None
        return originals["get_peak_flops_per_device"](accelerator, dtype)

    replacements = dict(
        create_model_from_path=create_model_from_path,
        add_fused_lm_head=add_fused_lm_head,
        get_peak_flops_per_device=get_peak_flops_per_device,
    )
    for name, function in replacements.items():
        setattr(stock_module, name, function)
    try:
        yield
    finally:
        while restore:
            restore.pop()()
        for name, function in originals.items():
            setattr(stock_module, name, function)


def stock_throughput_blocker(text_config) -> str | None:
    """Why stock's step metrics cannot compute the model's FLOPs per token (TRL's ``compute_flops_per_token`` reads
    a homogeneous, dense or Mixtral-style config; stock never reaches it for the families it refuses), or None."""
    from trl.trainer.utils import compute_flops_per_token

    try:
        compute_flops_per_token(text_config, 1)
    except Exception as error:  # noqa: BLE001 - any failure of TRL's reader: the figures stock derives are left out
        return f"{type(error).__name__}: {error}".splitlines()[0]
    return None


def _hide_from_stock_refusals(model):
    """Hide from stock's constructor what its FA3 tree kernel refuses and the plugin runs exactly: layer kinds other
    than full and sliding attention (segment recurrence runs state-carrying layers per node of the prefix tree) and
    parameters named ``*.sinks`` (the kernels take attention sinks). Returns the function that puts both back."""
    text_config = model.config.get_text_config()
    layer_types = getattr(text_config, "layer_types", None)
    hidden_layers = bool(layer_types) and bool(set(layer_types) - _STOCK_LAYER_TYPES)
    if hidden_layers:
        text_config.layer_types = None
    has_sinks = any(name.endswith(".sinks") for name, _ in model.named_parameters())
    if has_sinks:
        named_parameters = type(model).named_parameters

        def without_sinks(*args, **kwargs):
            return ((n, p) for n, p in named_parameters(model, *args, **kwargs) if not n.endswith(".sinks"))

        model.named_parameters = without_sinks

    def put_back() -> None:
        if hidden_layers:
            text_config.layer_types = layer_types
        if has_sinks:
            del model.named_parameters

    return put_back

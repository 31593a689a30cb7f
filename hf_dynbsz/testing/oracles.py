"""Reference computations the tests (and benchmarks) check results against: stock TRL's log-probs of a padded
batch, TRL-style batches, first-fit-decreasing packing, the shared-segment attention mask, a plain varlen attention,
and the comparisons of the stock-against-dynamic runs (parameters, logged metrics). Heavy libraries are imported
inside the functions.
"""

from __future__ import annotations

__all__ = [
    "first_fit_decreasing",
    "grpo_batch",
    "logged_metrics",
    "logps_alone",
    "metric_mismatches",
    "overridden_stock_methods",
    "parameter_mismatches",
    "reference_varlen_attention",
    "reference_varlen_attn",
    "relative_difference",
    "segment_mask",
    "signature_mismatches",
    "stock_logps",
    "switched_off_mismatches",
    "tree_mask",
    "update_difference",
    "varlen_attn_standin",
]

#: Logged keys that measure time, not training.
TIMINGS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def stock_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Completion log-probs and entropies as TRL 1.16's ``_get_per_token_logps_and_entropies`` computes one chunk:
    the padded samples as separate sequences under their attention mask (``model`` has TRL's fused LM head)."""
    import torch

    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits_to_keep = completion_ids.size(1)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    labels[:, :-logits_to_keep] = -100
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -logits_to_keep:], out.entropy[:, -logits_to_keep:]


def logps_alone(model, table, index: int):
    """Sample ``index`` of ``table`` (a ``SequenceTable``) run alone, as generation computed it: its completion
    log-probs ``(completion,)`` through stock's forward of the one unpadded sequence (empty for an empty completion)."""
    import torch

    p, c = int(table.prompt_lengths[index]), int(table.completion_lengths[index])
    if c == 0:
        return torch.zeros(0)
    tokens, ones = table.tokens[index], torch.ones(1, p + c, dtype=torch.long)
    return stock_logps(model, tokens[None, :p], ones[:, :p], tokens[None, p:], ones[:, p:])[0][0]


def grpo_batch(prompt_lengths, completion_lengths, repeats, *, seed: int = 0, token_high: int = 40, pad_id: int = 0):
    """TRL-style tensors of a generation batch: ``(prompt_ids, prompt_mask, completion_ids, completion_mask)``,
    prompts left-padded and completions right-padded; prompt ``k`` (of ``prompt_lengths[k]`` random tokens) repeated
    ``repeats[k]`` times, one completion of each of ``completion_lengths``; token ids in ``[3, token_high)``."""
    import torch
    from trl.trainer.utils import pad

    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for length, count in zip(prompt_lengths, repeats):
        prompts += [torch.randint(3, token_high, (int(length),), generator=generator)] * count
    completions = [torch.randint(3, token_high, (int(n),), generator=generator) for n in completion_lengths]
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts (repeats) for {len(completions)} completions")
    return (
        pad(prompts, padding_value=pad_id, padding_side="left"),
        pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left"),
        pad(completions, padding_value=pad_id, padding_side="right"),
        pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right"),
    )


def first_fit_decreasing(lengths, max_tokens: int, layout: str = "padding_free", pad_to_multiple_of: int | None = None):
    """Baseline for tests and benchmarks: first-fit-decreasing bin packing under the token budget, what fixes the
    pass count of :func:`hf_dynbsz.planning.partition.partition_by_token_budget` (its count is
    :func:`~hf_dynbsz.planning.partition.min_num_microbatches`).

    Sequences are visited longest first (ties by index) and each goes into the first micro-batch (in opening order)
    where it fits; a sequence over the budget gets a micro-batch of its own. Returns lists of indices, ordered like
    ``partition_by_token_budget``'s output (ascending inside, micro-batches by smallest index). The arguments are
    validated as the partitioner validates them (same errors).
    """
    import numpy as np

    from hf_dynbsz.planning.partition import min_num_microbatches, round_up

    min_num_microbatches(lengths, max_tokens, layout=layout, pad_to_multiple_of=pad_to_multiple_of)  # validates
    values = [int(value) for value in lengths]
    if layout == "padding_free":  # round_up(sum, m) <= max_tokens  <=>  sum <= floor(max_tokens / m) * m
        capacity = int(max_tokens) // (pad_to_multiple_of or 1) * (pad_to_multiple_of or 1)
        sizes = values
    else:  # rows x the first (widest) rounded row
        capacity, sizes = int(max_tokens), [round_up(value, pad_to_multiple_of) for value in values]
    bins = [[index] for index, size in enumerate(sizes) if size > capacity]  # oversize: alone
    fitting = sorted((i for i, size in enumerate(sizes) if size <= capacity), key=lambda i: (-values[i], i))
    opened: list[list[int]] = []
    # Room left per opened micro-batch: tokens (padding_free), or rows of its first row's width (padded).
    room = np.zeros(len(fitting), dtype=np.int64)
    for index in fitting:
        need = sizes[index] if layout == "padding_free" else 1
        fits = room[: len(opened)] >= need
        number = int(fits.argmax()) if fits.any() else len(opened)
        if number == len(opened):
            opened.append([])
            room[number] = capacity if layout == "padding_free" else capacity // sizes[index]
        opened[number].append(index)
        room[number] -= need
    return sorted((sorted(members) for members in opened + bins), key=lambda members: members[0])


def segment_mask(prefix: int, blocks: tuple[int, ...]):
    """The rule of a shared segment written as a dense ``(L, L)`` bool mask (True = may attend): prefix causal, each
    block on the prefix and causally on itself. A test oracle for :mod:`hf_dynbsz.execution.attention`."""
    import torch

    length = prefix + sum(blocks)
    owner = torch.full((length,), -1, dtype=torch.long)  # -1: prefix, j: block j
    offset = prefix
    for number, block in enumerate(blocks):
        owner[offset : offset + block] = number
        offset += block
    position = torch.arange(length)
    causal = position.unsqueeze(1) >= position.unsqueeze(0)
    key_owner, query_owner = owner.unsqueeze(0), owner.unsqueeze(1)
    return causal & ((key_owner == -1) | (key_owner == query_owner))


def tree_mask(nodes, window: int | None = None):
    """The rule of a prefix-tree row written as a dense ``(width, width)`` bool mask (True = may attend), from its
    nodes ``(start, length, parent)`` (row order, parents numbered before children): a query sees the keys of every
    ancestor of its node and its own node's keys up to itself, and with ``window`` only keys fewer than ``window``
    positions (depths) before it. Walks parent links, not the row order the kernels rely on. A test oracle for
    :mod:`hf_dynbsz.execution.attention`."""
    import torch

    width = max((start + length for start, length, _ in nodes), default=0)
    owner, depth = torch.full((width,), -1, dtype=torch.long), torch.zeros(width, dtype=torch.long)
    first = []
    for number, (start, length, parent) in enumerate(nodes):
        first.append(0 if parent < 0 else first[parent] + nodes[parent][1])
        owner[start : start + length] = number
        depth[start : start + length] = torch.arange(first[number], first[number] + length)
    allowed = torch.zeros(width, width, dtype=torch.bool)
    for number, (start, length, _) in enumerate(nodes):
        line, above = [number], nodes[number][2]
        while above >= 0:
            line.append(above)
            above = nodes[above][2]
        seen = torch.isin(owner, torch.tensor(line))
        rows = slice(start, start + length)
        allowed[rows] = seen.unsqueeze(0) & (depth.unsqueeze(0) <= depth[rows].unsqueeze(1))
        if window is not None:
            allowed[rows] &= depth.unsqueeze(0) > depth[rows].unsqueeze(1) - window
    return allowed


def _spans(query, key, value, q_bounds, k_bounds):
    """Span ``i``'s queries (rows ``q_bounds[i]`` to ``q_bounds[i + 1]``), keys and values (``k_bounds``'s), each
    ``(1, heads, length, d)``, for the reference attentions below."""
    for i in range(len(q_bounds) - 1):
        q = query[q_bounds[i] : q_bounds[i + 1]].transpose(0, 1).unsqueeze(0)
        k = key[k_bounds[i] : k_bounds[i + 1]].transpose(0, 1).unsqueeze(0)
        v = value[k_bounds[i] : k_bounds[i + 1]].transpose(0, 1).unsqueeze(0)
        yield q, k, v


def reference_varlen_attention(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    scale: float | None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
):
    """What a causal flash-attention varlen kernel computes, in plain PyTorch (CPU tests stand it in for the kernel).

    ``query`` ``(total_q, heads, d)``, ``key``/``value`` ``(total_k, kv_heads, d)``; span ``i`` of the queries attends
    to span ``i`` of the keys, causally aligned bottom-right (query ``t`` of a span of ``q`` sees keys ``0 ..
    t + k - q``), and to the last ``sliding_window`` of those when given. Returns ``(total_q, heads, d)``.
    """
    import torch
    import torch.nn.functional as F

    outputs = []
    for q, k, v in _spans(query, key, value, cu_seqlens_q, cu_seqlens_k):
        q_len, k_len = q.size(2), k.size(2)
        last = torch.arange(q_len, device=q.device).unsqueeze(1) + k_len - q_len  # the last key each query sees
        keys = torch.arange(k_len, device=q.device).unsqueeze(0)
        mask = keys <= last
        if sliding_window is not None:
            mask &= keys > last - sliding_window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=True)
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs)


def reference_varlen_attn(
    query,
    key,
    value,
    cu_seq_q,
    cu_seq_k,
    max_q: int,
    max_k: int,
    *,
    return_aux=None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
):
    """``torch.nn.attention.varlen.varlen_attn`` (torch 2.13's signature and contract) in plain PyTorch, for CPU tests
    (torch has no CPU kernel): ``query`` ``(Tq, heads, d)``, ``key``/``value`` ``(Tk, kv_heads, d)``, span ``i`` of the
    queries (``cu_seq_q[i]:cu_seq_q[i + 1]``) attends to span ``i`` of the keys, per-segment softmax. ``window_size``
    ``(left, right)`` as FlashAttention draws it, aligned bottom-right: query ``t`` of a span of ``q`` queries and
    ``k`` keys sees key ``j`` when ``t + k - q - left <= j <= t + k - q + right`` (a negative side: unbounded;
    ``(-1, 0)`` is causal). Returns ``(Tq, heads, d)``.

    Stricter than the kernel where a caller's index arithmetic could be wrong unnoticed: ``cu_seq_*`` must be int32,
    start at 0 and end at the row's last token (tokens after ``cu_seq[-1]`` get NaN gradients from the kernel,
    pytorch#176793), ``max_q``/``max_k`` must be the spans' true maxima (Python ints), and key heads must equal query
    heads unless ``enable_gqa`` (as torch >= 2.12 checks).
    """
    import torch
    import torch.nn.functional as F

    for name, cu, total, longest in (("q", cu_seq_q, query.size(0), max_q), ("k", cu_seq_k, key.size(0), max_k)):
        bounds = cu.tolist()
        if cu.dtype != torch.int32 or cu.dim() != 1 or bounds[0] != 0 or bounds[-1] != total:
            raise ValueError(f"cu_seq_{name} must be int32 from 0 to the {total} tokens, got {cu.dtype} {bounds}")
        spans = [b - a for a, b in zip(bounds, bounds[1:])]
        if not isinstance(longest, int) or longest != max(spans) or min(spans) < 0:
            raise ValueError(f"max_{name}={longest!r} is not the longest span of {spans}")
    if len(cu_seq_q) != len(cu_seq_k):
        raise ValueError("cu_seq_q and cu_seq_k must hold as many spans")
    if query.size(1) != key.size(1) and not enable_gqa:
        raise ValueError(f"Hq={query.size(1)} and Hkv={key.size(1)}: set enable_gqa=True for GQA")
    left, right = window_size
    q_bounds, k_bounds = cu_seq_q.tolist(), cu_seq_k.tolist()
    outputs = []
    for q, k, v in _spans(query, key, value, q_bounds, k_bounds):
        q_len, k_len = q.size(2), k.size(2)
        diagonal = torch.arange(q_len).unsqueeze(1) + k_len - q_len  # the key aligned with each query
        keys = torch.arange(k_len).unsqueeze(0)
        mask = torch.ones(q_len, k_len, dtype=torch.bool)
        if left >= 0:
            mask &= keys >= diagonal - left
        if right >= 0:
            mask &= keys <= diagonal + right
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outputs.append(out.squeeze(0).transpose(0, 1))
    out = torch.cat(outputs)
    if return_aux is not None and return_aux.lse:
        raise NotImplementedError("the reference gives no log-sum-exp (training never merges partial attention)")
    return out


def relative_difference(a: dict, b: dict) -> float:
    """||a - b|| / ||b|| over all parameters."""
    import torch

    num = torch.sqrt(sum(((a[k] - b[k]).double() ** 2).sum() for k in a))
    den = torch.sqrt(sum((b[k].double() ** 2).sum() for k in b))
    return float(num / den)


def update_difference(initial: dict, ours: dict, stock: dict) -> float:
    """Relative difference of the parameter UPDATES (far more sensitive than comparing parameters)."""
    import torch

    num = torch.sqrt(sum(((ours[k] - stock[k]).double() ** 2).sum() for k in ours))
    den = torch.sqrt(sum(((stock[k] - initial[k]).double() ** 2).sum() for k in stock))
    return float(num / den)


def parameter_mismatches(
    initial: dict, ours: dict, stock: dict, *, trained_by: float | None, update_tolerance: float, param_tolerance: float
) -> list[str]:
    """Where our final parameters ``ours`` are not stock's ``stock``, both trained from ``initial`` (empty: the same
    training). A LoRA run (stock has ``lora_`` parameters) compares the adapters' parameters only (the base ones do not
    train) and needs stock's ``lora_B`` to have left 0; any other compares the updates (:func:`update_difference`, at
    most ``update_tolerance``) and needs stock to have moved more than ``trained_by`` (relative; None: unchecked). Both
    then compare the parameters (:func:`relative_difference`, at most ``param_tolerance``)."""
    found = []
    if any("lora_" in name for name in stock):
        stock, ours = ({n: p for n, p in params.items() if "lora_" in n} for params in (stock, ours))
        if not all(float(p.abs().max()) > 0 for n, p in stock.items() if "lora_B" in n):
            found.append("stock's LoRA B matrices did not train (they start at 0)")
    else:
        if (update := update_difference(initial, ours, stock)) > update_tolerance:
            found.append(f"updates differ by {update:.3g} > {update_tolerance}")
        if trained_by is not None and (moved := relative_difference(stock, initial)) <= trained_by:
            found.append(f"stock's parameters moved by {moved:.3g} <= {trained_by}: it did not train")
    if (difference := relative_difference(ours, stock)) > param_tolerance:
        found.append(f"parameters differ by {difference:.3g} > {param_tolerance}")
    return found


def switched_off_mismatches(stock: tuple, ours: tuple, model_dir: str, output_dir: str) -> list[str]:
    """Where the plugin's trainer, switched off (``dynamic_batching=False``), is not stock's on the same run
    (:func:`~hf_dynbsz.testing.run_training` from ``model_dir``; ``stock`` and ``ours``: a trainer class and its
    config class): other completions, other final parameters (to the bit), or the plugin's metrics logged."""
    from pathlib import Path

    from hf_dynbsz.testing.fixtures import run_training

    _, stock_params, stock_completions, _ = run_training(*stock, model_dir, str(Path(output_dir) / "stock"))
    _, params, completions, history = run_training(
        *ours, model_dir, str(Path(output_dir) / "ours"), dynamic_batching=False
    )
    found = [] if completions == stock_completions else ["other completions than stock's"]
    if (difference := relative_difference(params, stock_params)) != 0.0:
        found.append(f"parameters differ from stock's by {difference:.3g}")
    if any("dynbsz/microbatches" in entry for entry in history):
        found.append("the plugin's metrics logged")
    return found


def logged_metrics(history: list[dict], left_out: tuple[str, ...] = ()) -> list[dict]:
    """Every value of a Trainer's ``log_history`` but the timings, the plugin's own ``dynbsz/*`` and the names that
    start with one of ``left_out``, entry by entry."""
    left_out = ("dynbsz/", *TIMINGS, *left_out)
    return [{k: v for k, v in entry.items() if not k.startswith(left_out)} for entry in history]


def metric_mismatches(ours: list[dict], stock: list[dict], rel: float = 1e-5, abs: float = 1e-6) -> list[str]:
    """Where two runs' :func:`logged_metrics` differ: an entry count, an entry's names, or a value beyond ``rel``
    (relative) and ``abs`` (absolute), each as ``"entry i: name ours != stock"`` (empty: the same logs). None (TRL's
    value when every entry of a window was NaN) equals None only."""
    import math

    if len(ours) != len(stock):
        return [f"{len(ours)} entries logged, stock {len(stock)}"]
    found = []
    for i, (our_entry, stock_entry) in enumerate(zip(ours, stock)):
        if sorted(our_entry) != sorted(stock_entry):
            found.append(f"entry {i}: names {sorted(set(our_entry) ^ set(stock_entry))} on one side only")
            continue
        for name, expected in stock_entry.items():
            value = our_entry[name]
            same = (
                value == expected
                if value is None or expected is None
                else math.isclose(value, expected, rel_tol=rel, abs_tol=abs)
            )
            if not same:
                found.append(f"entry {i}: {name} {value!r} != stock {expected!r}")
    return found


def overridden_stock_methods(ours: type, stock: type) -> list[str]:
    """Stock's methods that ``ours`` or a class of the plugin it inherits from (the hooks the trainers share)
    defines, sorted."""
    plugin = [cls for cls in ours.__mro__ if cls.__module__.startswith("hf_dynbsz")]
    return sorted(
        {name for cls in plugin for name, value in vars(cls).items() if callable(value) and hasattr(stock, name)}
    )


def signature_mismatches(ours: type, stock: type) -> list[str]:
    """Where trainer class ``ours`` does not take stock's arguments: its constructor's signature, or that of one of
    :func:`overridden_stock_methods`, each as ``"name: ours != stock"`` (empty: a drop-in)."""
    import inspect

    found = []
    if inspect.signature(ours) != inspect.signature(stock):
        found.append(f"constructor: {inspect.signature(ours)} != stock {inspect.signature(stock)}")
    for name in overridden_stock_methods(ours, stock):
        method, stock_method = getattr(ours, name), getattr(stock, name)
        # Compared as written where ours carries stock's own signature object (__init__): inspect does not evaluate a
        # __signature__, and stock's string annotations evaluate or not depending on which optional packages load.
        evaluate = not hasattr(method, "__signature__")
        try:  # string annotations (ours use `from __future__ import annotations`) compared as objects
            ours_signature = inspect.signature(method, eval_str=evaluate)
            stock_signature = inspect.signature(stock_method, eval_str=evaluate)
        except NameError:  # stock's own annotations name optional packages (PeftModel): compare as written
            ours_signature, stock_signature = inspect.signature(method), inspect.signature(stock_method)
        if ours_signature != stock_signature:
            found.append(f"{name}: {ours_signature} != stock {stock_signature}")
    return found


def varlen_attn_standin(monkeypatch) -> list[dict]:
    """The run a capable GPU gets on sdpa (torch's varlen_attn, one call per layer), on this CPU: the device facts of
    a capable CUDA device, :func:`reference_varlen_attn` standing in for torch's kernel (its signature, the caller
    reads it), no sdpa span ever run; ``monkeypatch`` undoes it. Returns the list each kernel call's keyword arguments
    are appended to."""
    import functools

    from hf_dynbsz.execution import attention, setup
    from hf_dynbsz.planning.model_support import DeviceFacts

    capable = DeviceFacts("cuda", (9, 0), (2, 13), varlen_attn=True, varlen_window=True, compute_dtype="bfloat16")
    monkeypatch.setattr(setup, "device_facts", lambda *args: capable)
    calls = []

    @functools.wraps(reference_varlen_attn)  # its signature is what the caller reads
    def kernel(*args, **kwargs):
        calls.append(kwargs)
        return reference_varlen_attn(*args, **kwargs)

    monkeypatch.setattr(attention, "VARLEN_ATTN_KERNEL", kernel)
    monkeypatch.setattr(attention.SegmentLayout, "_build_span_calls", None)  # no sdpa span ever runs
    return calls

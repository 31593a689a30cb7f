"""Segment recurrence: padding-free rows and prefix trees through layers that carry state along a sequence.

The counterpart of segment attention (:mod:`hf_dynbsz.execution.attention`) for the sequence mixers of hybrid and
state-space models: Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-hybrid), Kimi's and Bailing's delta attention, MiniMax's
lightning attention, the Mamba / Mamba-2 mixers (Mamba, Jamba, Bamba, Zamba, Falcon-H1, Nemotron-H), short causal
convolutions (LFM2, Inkling) and RecurrentGemma's recurrent block. Run over a padding-free row as it stands, such a
layer carries its convolution window and recurrent state from one sequence into the next. Here each one runs **per
sequence**, so every sequence starts from a zero state, exactly as it does alone:

* a plain sequence runs alone;
* a shared prompt ``[prefix | block_1 | ... | block_k]``: each block starts from the state the prefix ends in, as
  generation's cache does. A mixer that reads its states through transformers' cache interface (Gated DeltaNet,
  delta attention, the Mamba-2 mixers, LFM2's convolution: :func:`cache_arguments`) runs **each prefix once** and is
  handed, for its blocks, the prefix's final convolution inputs and recurrent state (:class:`RunStates`, which keeps
  the autograd graph), once its first row with shared prompts has shown that this gives the recomputed outputs
  (:func:`prefix_states`; checked once per module). Any other mixer (RecurrentGemma's block, MiniMax's lightning
  attention, Mamba's) runs ``[prefix ; block_j]`` for each block, the prefix's own outputs taken from the first run
  (the layer is causal): the prefix is recomputed in that layer only;
* a prefix tree (any depth): every node starts from its parent's final states, copied for each child. With states
  handed on, the inner nodes (those with children) run level by level from the roots, each once, then every leaf;
  a mixer hands states down chains of inner nodes only where its check also passed on the row cut in halves
  (:func:`chained_states`), and otherwise recomputes the paths of trees deeper than shared prompts. No run from a
  state is one token long (a mixer's decoding path updates its state in place): an inner node of one token below a
  root runs in front of each of its children (:func:`continuation_runs`). Recomputing, each leaf runs
  ``[path ; own]``, the first leaf under a node keeping the node's outputs;
* runs are batched into few calls of the layer: each run is right-padded to its *bucket* length (16, 24, 32, 48,
  64, 96, ...: less than half as many tokens again), and the runs of a bucket make one call. A mixer is causal, so
  tokens after a run's end (copies of its last token) change none of its outputs, and they are dropped;
* tokens of the row outside every segment (padding to a multiple) get a zero output;
* a mixer's other outputs (attention weights, final states: per run, and read by no layer in training) are None.

Each layer runs **its own forward** (its own kernels: the torch fallbacks transformers ships on CPU, or the
flash-linear-attention / causal-conv1d / mamba-ssm kernels on GPU when installed), only on gathered rows: every
tensor argument laid out along the row (``(1, width, ...)``: hidden states, position ids, position embeddings, a 2-D
mask) is gathered the same way, anything else passes as it is. Which modules are sequence mixers is decided in
:mod:`hf_dynbsz.planning.model_support` (``ModelSupport.sequence_mixers``); the self-check
(:mod:`hf_dynbsz.execution.self_check`) verifies the result on the first step's samples. The segments come from the
layout :func:`~hf_dynbsz.execution.attention.use_segments` named for the pass; a pass without one (padded rows) runs
the layers untouched, so a model without sequence mixers, or a padded pass, sees the identity.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
import weakref
from collections import defaultdict

import torch

from hf_dynbsz.execution.attention.layout import SegmentLayout, active_segments
from hf_dynbsz.planning.prefix_tree import PrefixTree

logger = logging.getLogger("hf_dynbsz")

__all__ = [
    "RecurrenceCall",
    "RunStates",
    "chained_states",
    "continuation_calls",
    "continuation_runs",
    "prefix_states",
    "cache_arguments",
    "recurrence_calls",
    "segment_recurrence",
    "state_argument",
]


@dataclasses.dataclass(frozen=True)
class RecurrenceCall:
    """One batched call of a sequence mixer: ``rows`` runs of ``length`` tokens.

    ``gather``: ``(rows, length)`` row positions of each run's tokens; ``keep``: ``(rows, length)`` True where a run's
    output is the row's output at that position (False: a prefix recomputed to start a block from its state, or
    padding). ``state_rows``: with prefix states (:func:`continuation_calls`), the row of the bank of prefixes' final
    states each run starts from (the bank's last row: a zero state).
    """

    gather: torch.Tensor
    keep: torch.Tensor
    state_rows: torch.Tensor | None = None  # (rows,) the run's row of the prefix-state bank; None: all from zero


#: The shortest bucket: runs up to this many tokens share one call.
SHORTEST_BUCKET = 16


def bucket_length(tokens: int) -> int:
    """The length a run of ``tokens`` is padded to: the smallest of 16, 24, 32, 48, 64, 96, ... (powers of two and
    one and a half times them) that holds it."""
    length = SHORTEST_BUCKET
    while length < tokens:
        length = length * 3 // 2 if length & (length - 1) == 0 else length * 4 // 3
    return length


def recurrence_calls(layout: SegmentLayout, device) -> tuple[list[RecurrenceCall], torch.Tensor]:
    """``(calls, positions)``: the batched runs of a sequence mixer over ``layout``'s row with paths recomputed (each
    leaf of the row's prefix tree runs as ``[path ; own]``), and the row positions of their kept outputs
    (concatenated call after call, ``keep`` order). A run keeps the outputs of the nodes no earlier run kept: the
    first leaf under a node keeps the node's. Built once per pass and device."""

    def build():
        runs, kept = [], set()
        for part in layout.parts():
            if part.children:
                continue
            ancestors = _ancestors(layout, part)
            covered = sum(len(layout.parts()[a].own) for a in ancestors if a in kept)
            kept.update(ancestors)
            runs.append(([*(p for r in part.path for p in r), *part.own], covered, None))
        calls = _bucketed(runs, device)
        return calls, _kept_positions(calls, device)

    return layout.cached(("recurrence", device), build)


def _ancestors(layout: SegmentLayout, part) -> list[int]:
    """The numbers of ``part``'s ancestors, root first."""
    ancestors, above = [], part.parent
    parts = layout.parts()
    while above >= 0:
        ancestors.append(above)
        above = parts[above].parent
    return ancestors[::-1]


def _bucketed(runs: list[tuple[list[int], int, int | None]], device) -> list[RecurrenceCall]:
    """Calls of ``(positions, kept from, state row)`` runs, one per bucket length (see :func:`bucket_length`); state
    rows None: every run from a zero state."""
    buckets: dict[int, list[tuple[list[int], int, int | None]]] = defaultdict(list)
    for run in runs:
        buckets[bucket_length(len(run[0]))].append(run)
    calls = []
    for length in sorted(buckets):
        group = buckets[length]
        gather = torch.tensor([positions + positions[-1:] * (length - len(positions)) for positions, _, _ in group])
        steps = torch.arange(length).unsqueeze(0)
        keep = (steps >= torch.tensor([[start] for _, start, _ in group])) & (
            steps < torch.tensor([[len(positions)] for positions, _, _ in group])
        )
        rows = [row for _, _, row in group]
        state_rows = None if rows[0] is None else torch.tensor(rows, device=device)
        calls.append(RecurrenceCall(gather.to(device), keep.to(device), state_rows))
    return calls


def _kept_positions(calls: list[RecurrenceCall], device) -> torch.Tensor:
    """The row positions of ``calls``' kept outputs, call after call, in ``keep`` order."""
    kept = [call.gather[call.keep] for call in calls]
    return torch.cat(kept) if kept else torch.zeros(0, dtype=torch.long, device=device)


def continuation_calls(
    layout: SegmentLayout, device
) -> tuple[list[list[RecurrenceCall]], list[RecurrenceCall], torch.Tensor]:
    """``(levels, calls, positions)`` with states handed on: every node with children (an *inner* node) runs once,
    level by level from the roots (nodes of one level and length in one unpadded call, each from its parent's final
    states: ``state_rows`` into the bank of the inner nodes run before, None for roots, which start from zero), and
    their final states fill the bank in call order; then every leaf, by bucket, from its parent's final states (a root
    leaf from the bank's zero row, its last). An inner node of one token below a root runs in front of each of its
    children instead (:func:`continuation_runs`): no run from a state is one token long. ``positions``: the row
    positions of the kept outputs, inner calls first."""

    def build():
        parts, runs = layout.parts(), continuation_runs(layout)
        level: dict[int, int] = {}
        inner: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))  # level -> length -> nodes
        for node, (positions, _, start) in runs.items():
            level[node] = 0 if start < 0 else level[start] + 1
            if parts[node].children:
                inner[level[node]][len(positions)].append(node)
        levels, bank_row = [], {}
        for depth in sorted(inner):
            calls = []
            for length in sorted(inner[depth]):
                nodes = inner[depth][length]
                gather = torch.tensor([runs[n][0] for n in nodes])
                keep = torch.arange(length).unsqueeze(0) >= torch.tensor([[runs[n][1]] for n in nodes])
                rows = None if depth == 0 else torch.tensor([bank_row[runs[n][2]] for n in nodes], device=device)
                calls.append(RecurrenceCall(gather.to(device), keep.to(device), rows))
                for n in nodes:
                    bank_row[n] = len(bank_row)
            levels.append(calls)
        zero_row = len(bank_row)
        leaves = [(positions, kept, bank_row.get(start, zero_row))
                  for node, (positions, kept, start) in runs.items() if not parts[node].children]  # fmt: skip
        calls = _bucketed(leaves, device)
        return levels, calls, _kept_positions([call for calls in levels for call in calls] + calls, device)

    return layout.cached(("continuation", device), build)


def continuation_runs(layout: SegmentLayout) -> dict[int, tuple[list[int], int, int]]:
    """Per node that runs with states handed on, in row order: ``(positions, kept from, start)``, the row positions it
    runs, the first of them whose output it keeps, and the node whose final states it starts from (-1: a zero state).

    A node runs its own positions from its parent's final states, but for an inner node of **one token** below a root:
    it does not run, each of its children runs its token in front of their own from its parent's states, the first
    child keeping its output. A mixer run on one token from a state takes its decoding path, which updates the state
    in place once it has used it (Mamba-2's ``state * dA`` then ``state.copy_``, in every Mamba-2 mixer): autograd
    cannot go back through it (the backward raises; under gradient checkpointing the recomputation reads the updated
    state and its gradients are silently wrong)."""
    runs: dict[int, tuple[list[int], int, int]] = {}
    carried: dict[int, tuple[list[int], int]] = {}  # a node run in front of its children: its positions, its start
    claimed: set[int] = set()  # such nodes whose output a child keeps
    for part in layout.parts():
        before, start = carried.get(part.parent, ([], part.parent))
        kept = len(before)
        if part.parent in carried and part.parent not in claimed:
            kept = 0
            claimed.add(part.parent)
        positions = [*before, *part.own]
        if part.children and start >= 0 and len(positions) == 1:
            carried[part.node] = (positions, start)
            continue
        runs[part.node] = (positions, kept, start)
    return runs


def _along_row(value, width: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == width


def _gathered(value, width: int, gather: torch.Tensor):
    """``value`` with its row dimension gathered into ``gather``'s runs, when it is laid out along the row (tuples
    and lists of such tensors too: position embeddings); anything else as it is."""
    if _along_row(value, width):
        return value[0].index_select(0, gather.reshape(-1)).view(*gather.shape, *value.shape[2:])
    if isinstance(value, (tuple, list)) and any(_along_row(item, width) for item in value):
        return type(value)(_gathered(item, width, gather) for item in value)
    return value


class RunStates:
    """A sequence mixer's states for one batched call, behind the methods of transformers' cache that mixers call
    (``get_conv_state``, ``update_conv_state``, ``get_recurrent_state``, ``update_recurrent_state``,
    ``is_recording_past``, and since transformers 5.25 ``get_recurrent_states_to_keep`` and ``increase_count``):
    empty for runs from a zero state, the prefixes' final states for blocks that continue them. Unlike a generation
    cache it keeps the autograd graph (no in-place copy) and records the whole past of the convolution's input (the
    mixer convolves ``[state ; new]`` and keeps the new part). It keeps no intermediate recurrent states (nothing is
    cropped in training) and never takes a one-token decoding step (it records the past), so its token count is not
    kept either."""

    def __init__(self, conv: dict | None = None, recurrent: dict | None = None) -> None:
        self.conv, self.recurrent = dict(conv or {}), dict(recurrent or {})

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.conv.get(state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self.recurrent.get(state_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        return True

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        return None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        previous = self.conv.get(state_idx)
        self.conv[state_idx] = conv_states if previous is None else torch.cat([previous, conv_states], dim=-1)
        return self.conv[state_idx]

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self.recurrent[state_idx] = recurrent_states
        return recurrent_states


#: The names transformers gives a mixer's cache argument (``cache_params`` became ``cache`` in 5.24).
CACHE_ARGUMENTS = ("cache", "cache_params", "past_key_values")


def cache_arguments(module) -> tuple[str, ...]:
    """The keywords of ``module``'s forward under which it may take transformers' cache (:data:`CACHE_ARGUMENTS` its
    signature names). Whether it reads its conv / recurrent states through one of them (a block can then start from
    its prefix's final states) is decided by running it (:func:`_decided`), not by reading its source: transformers
    5.25 moved the reads into module-level helpers. Read once per class."""
    return _cache_arguments_of(type(module))


@functools.cache
def _cache_arguments_of(module_class) -> tuple[str, ...]:
    try:
        names = inspect.signature(module_class.forward).parameters
    except (TypeError, ValueError):  # no signature to read: the mixer keeps recomputing (_decide logs it)
        return ()
    return tuple(name for name in names if name in CACHE_ARGUMENTS)


def state_argument(module) -> str | None:
    """The cache keyword through which ``module``'s blocks start from their prefix's final states, once decided on a
    first row with shared prompts (:func:`prefix_states`); None before, and for a mixer that recomputes."""
    return _STATE_ARGUMENT.get(module)


def _call(forward, call: RecurrenceCall, width: int, args: tuple, kwargs: dict, **extra):
    """``forward`` on ``call``'s gathered runs: ``(output, extras)``, extras None or a tuple of Nones."""
    replaced = set(CACHE_ARGUMENTS) if extra else set()  # our states stand for the cache, under any of its names
    gathered = {name: _gathered(value, width, call.gather) for name, value in kwargs.items() if name not in replaced}
    out = forward(*(_gathered(value, width, call.gather) for value in args), **{**gathered, **extra})
    if isinstance(out, tuple):  # (hidden states, attention weights or final states): the rest is per run
        return out[0], (None,) * (len(out) - 1)
    return out, None


def _assembled(outputs: list, positions: torch.Tensor, width: int, extras):
    out = outputs[0]
    row = out.new_zeros(width, *out.shape[1:]).index_copy(0, positions, torch.cat(outputs)).unsqueeze(0)
    return (row, *extras) if extras is not None else row


def _recomputed(forward, layout: SegmentLayout, args: tuple, kwargs: dict, width: int, device):
    """``forward`` over a padding-free row, each block run as ``[prefix ; block]`` (:func:`recurrence_calls`)."""
    calls, positions = recurrence_calls(layout, device)
    outputs, extras = [], None
    for call in calls:
        out, extras = _call(forward, call, width, args, kwargs)
        outputs.append(out[call.keep])
    return _assembled(outputs, positions, width, extras)


def _bank(states: list[dict], kernel: int) -> dict:
    """Each state index's final states of the prefix calls, stacked in bank order, plus a zero row (a fresh run);
    convolution states cut (or left-padded with zeros) to the last ``kernel`` inputs."""
    bank = {}
    for index in states[0] if states else ():
        parts = [state[index] for state in states]
        if kernel:
            parts = [part[..., -kernel:] for part in parts]
            parts = [torch.nn.functional.pad(part, (kernel - part.shape[-1], 0)) for part in parts]
        stacked = torch.cat(parts)
        bank[index] = torch.cat([stacked, torch.zeros_like(stacked[:1])])
    return bank


def _continued(forward, argument: str, kernel: int, layout: SegmentLayout, args, kwargs, width: int, device):
    """``forward`` over a padding-free row, each inner node of its prefix tree run once and every node from its
    parent's final states (:func:`continuation_calls`; an inner node of one token below a root in front of each of its
    children); ``argument``: the forward's cache keyword (:func:`cache_arguments`). A node's states are copied out of
    the bank for it (the bank is never updated in place: siblings each start from their own copy of their parent's)."""
    levels, calls, positions = continuation_calls(layout, device)
    outputs, extras, conv, recurrent = [], None, [], []
    for level in levels:
        conv_bank, recurrent_bank = _bank(conv, kernel), _bank(recurrent, 0)
        for call in level:
            states = _run_states(call, conv_bank, recurrent_bank)
            out, extras = _call(forward, call, width, args, kwargs, **{argument: states})
            outputs.append(out[call.keep])
            conv.append(states.conv)
            recurrent.append(states.recurrent)
    conv_bank, recurrent_bank = _bank(conv, kernel), _bank(recurrent, 0)
    for call in calls:
        out, extras = _call(
            forward, call, width, args, kwargs, **{argument: _run_states(call, conv_bank, recurrent_bank)}
        )
        outputs.append(out[call.keep])
    return _assembled(outputs, positions, width, extras)


def _run_states(call: RecurrenceCall, conv_bank: dict, recurrent_bank: dict) -> RunStates:
    """The states ``call``'s runs start from: empty (zero) without state rows, else their rows of the banks."""
    if call.state_rows is None:
        return RunStates()
    return RunStates(
        {index: bank.index_select(0, call.state_rows) for index, bank in conv_bank.items()},
        {index: bank.index_select(0, call.state_rows) for index, bank in recurrent_bank.items()},
    )


def _agree(recomputed, continued) -> bool:
    """Whether the prefix-state run gives the recomputed run's outputs: in fp32 (see :func:`_decided`), within the
    fp32 tolerance of the self-check relative to the largest output.

    Relative, not absolute: a mixer's output is small beside the residual stream it is added to (about 1e-2 on a tiny
    random Jamba), so a block that ignores its prefix's recurrent state (Jamba's and Mamba's full-sequence scans start
    from zero whatever the cache holds) changed the outputs by less than an absolute 1e-4, and the log-probs by 5e-7,
    while its gradients (``A_log``'s above all) were far from each sample's own. In fp32, not the run's precision:
    under bf16 the difference hid in bf16's own rounding, and Mamba's blocks started from their prefix's states."""
    from hf_dynbsz.execution.self_check import tolerance

    a = (recomputed[0] if isinstance(recomputed, tuple) else recomputed).detach().float()
    b = (continued[0] if isinstance(continued, tuple) else continued).detach().float()
    return bool((a - b).abs().max().item() <= tolerance(torch.float32) * a.abs().max().item())


def _in_fp32(module, forward, device):
    """``forward`` of ``module`` run in fp32 without autocast, on fp32 copies of its floating-point inputs: the module
    itself where its parameters are fp32, else an fp32 copy of it (one layer, once per module)."""
    if all(p.dtype == torch.float32 for p in module.parameters()):
        run = forward
    else:
        copied = copy.deepcopy(module).float()
        copied.__dict__.pop("forward", None)  # the class's own forward (not segment recurrence's wrapper)
        run = copied.forward

    def fp32(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.float()
        if isinstance(value, (tuple, list)):
            return type(value)(fp32(item) for item in value)
        return value

    def forward_fp32(*args, **kwargs):
        with torch.autocast(torch.device(device).type, enabled=False):
            return run(*(fp32(a) for a in args), **{name: fp32(value) for name, value in kwargs.items()})

    return forward_fp32


def _decided(module, forward, kernel, layout, args, kwargs, width, device) -> tuple[str | None, bool, str]:
    """``(argument, chains, reason)``: the cache keyword (of :func:`cache_arguments`) under which ``module``'s nodes
    may start from their parent's final states, for roots' children (its run with states handed on and its
    recomputed run of this row agree, :func:`_agree`), or None; ``chains``: whether also down chains of inner nodes
    (over this row with every node cut in two, :func:`_deepened`, so that inner nodes that start from a state hand
    theirs on); ``reason``: why not, for the log. Both decided in fp32 whatever the run's precision
    (:func:`_in_fp32`). A mixer that reads no state through its cache argument, or ignores what it reads, disagrees
    (its blocks start from zero); one that fails under the states is decided against with the error as the reason."""
    arguments = cache_arguments(module)
    if not arguments:
        return None, False, "its forward takes no cache argument"
    fp32 = _in_fp32(module, forward, device)
    recomputed = _recomputed(fp32, layout, args, kwargs, width, device)
    reasons = []
    for argument in arguments:
        try:
            if not _agree(recomputed, _continued(fp32, argument, kernel, layout, args, kwargs, width, device)):
                reasons.append(
                    f"blocks started from their prefix's states through `{argument}` differ from recomputing"
                )
                continue
            deeper = _deepened(layout)
            chains = _agree(recomputed, _continued(fp32, argument, kernel, deeper, args, kwargs, width, device))
            return argument, chains, ""
        except Exception as error:  # noqa: BLE001 - the mixer recomputes its prefixes; _decide logs this reason
            reasons.append(
                f"its forward failed when handed states through `{argument}`: {type(error).__name__}: {error}"
            )
    return None, False, "; ".join(reasons)


def _deepened(layout: SegmentLayout) -> SegmentLayout:
    """``layout`` with every node of two positions or more cut in two, the first half the parent of the second (and
    of the node's children): the same attention, with a chain of inner nodes under every root."""
    parent, length, last = [], [], {}  # last: per node of ``layout``, the number of its second half
    for node, (above, size) in enumerate(zip(layout.tree.parent, layout.tree.length)):
        half = (size + 1) // 2 if size > 1 else size
        parent.append(last.get(above, -1)), length.append(half)
        if half < size:
            parent.append(len(parent) - 1), length.append(size - half)
        last[node] = len(parent) - 1
    return SegmentLayout(PrefixTree.of_nodes(parent, length), layout.base_implementation)


def _inner_levels(layout: SegmentLayout) -> int:
    """How many levels of ``layout``'s prefix tree hold inner nodes (nodes with children): 1 for shared prompts."""
    parts = layout.parts()
    depth: dict[int, int] = {}
    for part in parts:
        depth[part.node] = 0 if part.parent < 0 else depth[part.parent] + 1
    return len({depth[part.node] for part in parts if part.children})


#: Per mixer module: whether its blocks start from their prefix's final states (True), or its prefixes are
#: recomputed (False); absent until its first row with shared prompts has been checked.
_PREFIX_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Per mixer module whose blocks start from their prefix's final states: the cache keyword it takes them under.
_STATE_ARGUMENT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Mixer classes whose recomputed prefixes have been logged (once per class and process).
_LOGGED: set[str] = set()
#: Per mixer module whose blocks start from their prefix's final states: whether inner nodes below a root do too
#: (hand on the states they started from and ran on), so deeper trees continue rather than recompute.
_CHAINED_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prefix_states(module) -> bool | None:
    """Whether ``module`` (a sequence mixer) runs each shared prefix once and starts its blocks from the prefix's
    final states (True), recomputes the prefix in front of each block (False), or has not met a shared prompt yet."""
    return _PREFIX_STATES.get(module)


def chained_states(module) -> bool:
    """Whether ``module`` also hands states down chains of inner nodes (trees deeper than shared prompts); False
    until decided, and for a mixer whose blocks recompute."""
    return bool(_CHAINED_STATES.get(module))


def _decide(module, forward, kernel, layout, args, kwargs, width, device) -> None:
    """Record :func:`_decided` for ``module``; a mixer that takes a cache argument and still recomputes its prefixes
    is logged once per class with the reason (a capability lost to a library change says so)."""
    argument, chains, reason = _decided(module, forward, kernel, layout, args, kwargs, width, device)
    _PREFIX_STATES[module], _CHAINED_STATES[module] = argument is not None, chains
    if argument is not None:
        _STATE_ARGUMENT[module] = argument
    name = type(module).__name__
    if argument is None and name not in _LOGGED:
        _LOGGED.add(name)
        log = logger.warning if cache_arguments(module) else logger.info
        log("Segment recurrence: %s recomputes each shared prefix in front of its blocks (%s).", name, reason)


def _wrap(module):
    """``module``'s forward, run per node of the active layout. A mixer that reads its states through transformers'
    cache runs each inner node once and starts every node from its parent's final states, once a first no-grad row
    with shared prompts showed that this gives the recomputed outputs (checked once per module, for roots' children
    and for chains of inner nodes: :func:`_decide`; else the paths stay recomputed in it)."""
    forward = module.forward
    kernel = max((m.kernel_size[0] for m in module.modules() if isinstance(m, torch.nn.Conv1d)), default=0)

    def segmented_forward(*args, **kwargs):
        layout = active_segments()
        hidden = args[0] if args else next(iter(kwargs.values()), None)
        if layout is None or not isinstance(hidden, torch.Tensor) or hidden.dim() < 2 or hidden.shape[0] != 1:
            return forward(*args, **kwargs)
        width, device = hidden.shape[1], hidden.device
        decided = _PREFIX_STATES.get(module)
        if decided is False or not layout.gathers:
            return _recomputed(forward, layout, args, kwargs, width, device)
        if decided is None:  # decided in a no-grad pass (the self-check's): a training pass and gradient
            if not torch.is_grad_enabled():  # checkpointing's recomputation of it must take the same path
                _decide(module, forward, kernel, layout, args, kwargs, width, device)
            return _recomputed(forward, layout, args, kwargs, width, device)
        if not chained_states(module) and layout.cached("inner levels", lambda: _inner_levels(layout)) > 1:
            return _recomputed(forward, layout, args, kwargs, width, device)
        return _continued(forward, _STATE_ARGUMENT[module], kernel, layout, args, kwargs, width, device)

    return segmented_forward


@contextlib.contextmanager
def segment_recurrence(model, mixer_classes: tuple[str, ...]):
    """Run every module of ``model`` whose class is named in ``mixer_classes`` per sequence of the active layout
    inside the context (forward and gradient checkpointing's recomputation). The identity for an empty tuple, and
    for passes without a layout."""
    if not mixer_classes:
        yield
        return
    modules = [module for module in model.modules() if type(module).__name__ in mixer_classes]
    own = [module.__dict__.get("forward") for module in modules]  # a forward set on the instance (hooks) stays
    for module in modules:
        module.forward = _wrap(module)
    try:
        yield
    finally:
        for module, forward in zip(modules, own):
            if forward is None:
                del module.forward
            else:
                module.forward = forward

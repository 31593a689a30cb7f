"""The budget from memory: how much a pass needs, and the largest token budget that fits a device's memory.

A pass's peak memory (MiB per device) is modelled as what the process holds before it plus what the pass adds::

    peak = held + reserved + pending_gradients + fixed + per_token x tokens + per_path_key x path_keys
           + per_pair x pairs

``tokens`` are the token positions the pass computes (as the budget counts them: a prefix tree's shared positions
once), ``path_keys`` the keys its attention gathers in front of the row's nodes (a prefix tree's node attends to its
root-to-node path: every layer gathers the path's keys and values, and the sdpa / eager spans its queries, in front
of the node's own; :meth:`~hf_dynbsz.planning.prefix_tree.PrefixTree.path_keys`, 0 for samples that share nothing),
``pairs`` its attention term (every position's queries against its path's keys: the sum of squared sequence
lengths for samples alone, an upper bound for padded rows); ``held`` is measured before the pass (parameters,
gradients, optimizer state, everything else the process holds: on CPU its resident set), ``reserved`` is what the
process will hold by the pass that it does not hold yet (a distillation teacher's last hidden states, produced pass
by pass or arriving with moved samples: :func:`held_states_mib`) and ``pending_gradients`` are the gradients the
first backward of a step allocates. ``fixed`` (the LM head's tile, workspace), ``per_token`` (activations kept for
backward, or one layer's live activations in a no-grad pass), ``per_path_key`` (the gathered copies of a path's
queries, keys and values and their gradients: one layer's with gradient checkpointing, every layer's without) and
``per_pair`` (the attention scores of an eager kernel; about 0 for sdpa and flash kernels) start from a prior read
off the model config, precision, gradient checkpointing and ``tensor_batch_size``, and are refitted from every
measured pass by least squares, separately for training and no-grad passes: a wrong first guess corrects itself
within a few steps. What it assumes: the increment of a pass is linear in its tokens, path keys and attention pairs
(true of a transformer's activations; the LM head's tile makes it piecewise linear below ``tensor_batch_size``
tokens), and what the process holds between passes changes slowly (measured again before every plan).

:meth:`MemoryModel.budget` is the largest budget whose predicted whole-process peak, with ``INCREMENT_MARGIN`` of
the pass's increment added, fits ``limit x (1 - MEMORY_HEADROOM)``, given the longest sequence of the step (a pass
of ``B`` tokens whose sequences are at most ``L`` long has at most ``B x min(B, L)`` pairs) and its path keys per
token (the step's tree's). Its passes then planned, :meth:`MemoryModel.fitting_budget` checks each one's own shape
(a pass of short leaves under a long trunk gathers more path keys per token than the step) and gives a smaller
budget to plan again with when one does not fit. A pass that ran out of memory teaches the model its point
(:meth:`MemoryModel.record_failure`) and caps later budgets below it.

Pure Python (no torch): the planner (``hf-dynbsz plan --max_memory_mib``) uses the same model.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FIT_REPLANS",
    "INCREMENT_MARGIN",
    "MEMORY_HEADROOM",
    "RESIDENT_SET_INCREMENT_MARGIN",
    "KINDS",
    "Coefficients",
    "FailedPass",
    "MemoryModel",
    "OutOfMemoryBudgetError",
    "estimated_held_mib",
    "held_states_mib",
    "plan_rows",
    "teacher_budget_scale",
]

#: Share of the limit kept free (allocator fragmentation, what changes between plans) ...
MEMORY_HEADROOM = 0.02
#: ... and share of a pass's predicted increment added to it (the model's error: passes measured within +-6% of
#: their whole-process peak by benchmarks/memory_budget.py, about twice that on the increment alone).
INCREMENT_MARGIN = 0.10
#: The increment margin where a pass's peak is the process's resident set (CPU): pages the allocator keeps or gives
#: back between passes make increments noisier than a CUDA allocator's counters (a CI machine's pass added 21% more
#: than predicted, where this machine's stayed within 13%).
RESIDENT_SET_INCREMENT_MARGIN = 0.25
#: Pass kinds with a model of their own: a training forward/backward, a no-grad log-prob pass, and a distillation
#: teacher's no-grad pass (the teacher's config, a log-prob pass's shape).
KINDS = ("training", "logprob", "teacher")
#: A pass that ran out of memory caps later budgets of its kind at this share of its tokens.
FAILURE_SHRINK = 0.7
#: A step's passes are planned again with a smaller budget at most this many times when a planned pass does not fit
#: (:meth:`MemoryModel.fitting_budget`; each time smaller by the worst pass's overshoot, so one or two suffice).
FIT_REPLANS = 4
#: Passes whose token counts differ by less than this factor cannot tell the fixed term from the per-token one:
#: until they do, the prior's shape is kept and only its scale is fitted.
MIN_TOKEN_SPREAD = 1.5
#: Measured passes needed before all terms are fitted (before that, one scale of the prior's load terms).
MIN_POINTS_FOR_FIT = 6
#: The prior errs high by this factor: before any pass is measured, a budget too small is slower, one too large
#: runs out of memory.
PRIOR_SAFETY = 1.2
#: Observations kept per kind (the newest; older ones describe a process that held other things).
OBSERVATIONS_KEPT = 128
_MIB = 2**20
_FUSED_HEAD_COLUMNS = 8192  # vocabulary columns per tile of the tiled LM head (hf_dynbsz.execution.tiling)


class OutOfMemoryBudgetError(RuntimeError):
    """A pass ran out of memory at the smallest budget there is: its longest sequence alone does not fit."""


@dataclass(frozen=True)
class Coefficients:
    """What a pass adds to the memory the process holds, in MiB: ``fixed + per_token x tokens + per_pair x pairs +
    per_path_key x path_keys``."""

    fixed: float
    per_token: float
    per_pair: float
    per_path_key: float = 0.0

    def increment(self, tokens: int, pairs: int, path_keys: int = 0) -> float:
        return self.fixed + self.per_token * tokens + self.per_pair * pairs + self.per_path_key * path_keys

    def scaled(self, factor: float) -> Coefficients:
        return Coefficients(
            self.fixed * factor, self.per_token * factor, self.per_pair * factor, self.per_path_key * factor
        )

    def describe(self) -> str:
        return (
            f"{self.fixed:.0f} MiB + {self.per_token * 1024:.1f} KiB/token"
            + (f" + {self.per_path_key * 1024:.1f} KiB/path key" if self.per_path_key else "")
            + (f" + {self.per_pair * _MIB:.2f} B/pair" if self.per_pair else "")
        )


def prior_coefficients(
    config: Any,
    kind: str,
    *,
    activation_bytes: int = 4,
    gradient_checkpointing: bool = False,
    tensor_batch_size: int | None = 1024,
    attn_implementation: str | None = None,
) -> Coefficients:
    """A first guess of a pass's increment from a transformers config (or namespace), before any pass is measured.

    Per layer and token, a decoder keeps about ``18 x hidden + 4 x intermediate`` activations for backward
    (projections, norms, the MLP's gated product); gradient checkpointing keeps only each layer's input and
    recomputes one layer at a time; a no-grad pass holds about one layer's activations. An eager attention kernel
    holds its score matrices (``heads`` values per pair and layer); sdpa and flash kernels do not. The LM head's
    tile is ``tensor_batch_size`` tokens x 8192 columns of fp32 (logits, log-softmax and its gradient).
    """
    from hf_dynbsz.planning.cost import config_value, text_config_of  # the config readers (pure Python too)

    text = text_config_of(config)
    hidden = config_value(text, "hidden_size", 0, kind="size") or 4096
    layers = config_value(text, "num_hidden_layers", 0, kind="size") or 32
    intermediate = config_value(text, "intermediate_size", 0, kind="size") or 4 * hidden
    heads = config_value(text, "num_attention_heads", 0, kind="size") or max(1, hidden // 128)
    vocab = config_value(text, "vocab_size", 0, kind="size") or 32000
    per_layer = (18 * hidden + 4 * intermediate) * activation_bytes
    eager = attn_implementation in (None, "eager")
    tile_tokens = tensor_batch_size or 4096
    tile = tile_tokens * min(vocab, _FUSED_HEAD_COLUMNS if tensor_batch_size else 32768) * 4 * 3
    gathered = _path_key_bytes(text, hidden, heads, activation_bytes, attn_implementation)
    if kind == "training":
        kept = layers * hidden * activation_bytes + 2 * per_layer if gradient_checkpointing else layers * per_layer
        per_token = kept + 4 * hidden * activation_bytes
        per_pair = (2 if gradient_checkpointing else 2 * layers) * heads * activation_bytes if eager else 0
        # the gathered copies kept for backward (one layer's, recomputed, with checkpointing), and one layer's
        # gradients of them in backward
        per_path_key = (1 if gradient_checkpointing else layers) * gathered + gathered
    elif kind in ("logprob", "teacher"):  # a teacher's pass: the log-prob pass's shape, of the teacher's config
        per_token = per_layer + 2 * hidden * activation_bytes
        per_pair = 2 * heads * activation_bytes if eager else 0
        per_path_key = gathered  # one layer's gathered copies
    else:
        raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    return Coefficients(
        fixed=tile / _MIB, per_token=per_token / _MIB, per_pair=per_pair / _MIB, per_path_key=per_path_key / _MIB
    ).scaled(PRIOR_SAFETY)


def _path_key_bytes(text: Any, hidden: int, heads: int, activation_bytes: int, attn_implementation: str | None) -> int:
    """Bytes one layer gathers per path key of a prefix tree's row: the key and value copies in front of each node
    (varlen and flash kernels), and the query copy and its output too where a span recomputes its path's queries
    (sdpa and eager spans); none under flex_attention, whose block mask reads the row's keys where they are."""
    from hf_dynbsz.planning.cost import config_value

    if attn_implementation == "flex_attention":
        return 0
    head_dim = config_value(text, "head_dim", 0, kind="size") or max(1, hidden // max(heads, 1))
    kv_heads = config_value(text, "num_key_value_heads", 0, kind="size") or heads
    query = heads * head_dim
    if attn_implementation is not None and attn_implementation not in ("sdpa", "eager"):  # varlen / flash: keys
        return 2 * kv_heads * head_dim * activation_bytes
    return (2 * query + 2 * kv_heads * head_dim) * activation_bytes


@dataclass
class _Observation:
    tokens: int
    pairs: int
    increment: float  # MiB the pass added to what the process held
    path_keys: int = 0


@dataclass
class MemoryModel:
    """Predicts the peak memory of a pass and chooses the largest token budget that fits ``limit_mib``.

    ``limit_mib``: the memory one process (device) may use, in MiB (None: predict only, choose nothing).
    ``priors``: per kind (:data:`KINDS`), the coefficients before any measurement (:func:`prior_coefficients`).
    The model learns from :meth:`observe` (a measured pass) and :meth:`record_failure` (a pass that ran out of
    memory); :meth:`coefficients` is the current fit.
    """

    priors: dict[str, Coefficients]
    limit_mib: float | None = None
    headroom: float = MEMORY_HEADROOM
    increment_margin: float = INCREMENT_MARGIN
    observations: dict[str, deque] = field(default_factory=dict)
    caps: dict[str, int] = field(default_factory=dict)
    #: ``(kind, tokens, pairs, held, predicted peak, measured peak, path keys)`` of the newest measured passes (MiB),
    #: the prediction made before the pass ran: what ``benchmarks/memory_budget.py`` reports.
    history: deque = field(default_factory=lambda: deque(maxlen=4096))
    _fits: dict[str, Coefficients] = field(default_factory=dict)

    #: the kinds the plan table shows (:func:`plan_rows`): the teacher's with a teacher
    table_kinds: tuple[str, ...] = ("training", "logprob")

    @classmethod
    def from_config(
        cls,
        config: Any,
        limit_mib: float | None = None,
        increment_margin: float = INCREMENT_MARGIN,
        teacher_config: Any = None,
        **prior_options,
    ) -> MemoryModel:
        """The model of a transformers config (and of a distillation's ``teacher_config``: its "teacher" passes);
        ``prior_options`` go to :func:`prior_coefficients`."""
        configs = {"training": config, "logprob": config, "teacher": teacher_config or config}
        priors = {kind: prior_coefficients(configs[kind], kind, **prior_options) for kind in KINDS}
        table_kinds = KINDS if teacher_config is not None else ("training", "logprob")
        return cls(priors, limit_mib, increment_margin=increment_margin, table_kinds=table_kinds)

    # ------------------------------------------------------------------ learning
    def observe(self, kind: str, tokens: int, pairs: int, increment_mib: float, path_keys: int = 0) -> None:
        """A measured pass of ``kind``: ``tokens``, ``pairs`` and ``path_keys`` as planned, ``increment_mib`` its
        measured peak minus what the process held before it (and minus the gradients its backward allocated for the
        first time)."""
        self.observations.setdefault(kind, deque(maxlen=OBSERVATIONS_KEPT)).append(
            _Observation(int(tokens), int(pairs), max(float(increment_mib), 0.0), int(path_keys))
        )
        self._fits.pop(kind, None)

    def measured(
        self, kind: str, tokens: int, pairs: int, held_mib: float, peak_mib: float, path_keys: int = 0
    ) -> None:
        """A pass that ran while the process held ``held_mib`` and peaked at ``peak_mib`` (whole process): recorded
        beside what the model predicted for it (:attr:`history`), then learnt (:meth:`observe`)."""
        predicted = self.peak(kind, tokens, pairs, held_mib, path_keys)
        self.history.append((kind, int(tokens), int(pairs), held_mib, predicted, peak_mib, int(path_keys)))
        self.observe(kind, tokens, pairs, peak_mib - held_mib, path_keys)

    def record_failure(self, kind: str, tokens: int, pairs: int, held_mib: float | None, path_keys: int = 0) -> None:
        """A pass of ``tokens`` (``pairs``, ``path_keys``) ran out of memory while the process held ``held_mib``
        (None: not measured, without a limit): later budgets of ``kind`` stay below ``FAILURE_SHRINK x tokens`` and,
        with a limit, the fit learns that the pass needed more than the limit left."""
        self.caps[kind] = min(self.caps.get(kind, tokens), max(1, int(tokens * FAILURE_SHRINK)))
        if self.limit_mib is not None and held_mib is not None:
            self.observe(kind, tokens, pairs, self.limit_mib - held_mib, path_keys)

    def coefficients(self, kind: str) -> Coefficients:
        """The current fit of ``kind``: the prior scaled to the measurements while they cannot separate the terms,
        then least squares (non-negative) over the kept observations."""
        if kind not in self._fits:
            self._fits[kind] = self._fit(kind)
        return self._fits[kind]

    def _fit(self, kind: str) -> Coefficients:
        prior = self.priors[kind]
        points = list(self.observations.get(kind, ()))
        if not points:
            return prior
        sizes = [p.tokens for p in points]
        if len(points) < MIN_POINTS_FOR_FIT or max(sizes) < MIN_TOKEN_SPREAD * max(min(sizes), 1):
            # too few, or too alike, to part the fixed term from the per-token one (measurements are noisy): keep
            # the prior's fixed term and fit one scale of its load terms
            load = [prior.increment(p.tokens, p.pairs, p.path_keys) - prior.fixed for p in points]
            scale = sum(x * (p.increment - prior.fixed) for x, p in zip(load, points)) / max(
                sum(x * x for x in load), 1e-12
            )
            return dataclasses.replace(prior.scaled(max(scale, 0.0)), fixed=prior.fixed)
        columns = ["fixed", "per_token"]
        if prior.per_pair > 0 and len({(p.tokens, p.pairs) for p in points}) >= 3:
            columns.append("per_pair")
        if prior.per_path_key > 0 and _varies_apart_from_tokens(points, "path_keys"):
            columns.append("per_path_key")
        # a term the points cannot tell apart keeps the prior's share of the per-token one (fitted with it)
        kept = {name: getattr(prior, name) / prior.per_token if prior.per_token else 0.0
                for name in ("per_pair", "per_path_key") if name not in columns}  # fmt: skip
        fitted = _least_squares(points, columns, kept)
        for name, share in kept.items():
            fitted[name] = fitted["per_token"] * share
        return Coefficients(fitted["fixed"], fitted["per_token"], fitted["per_pair"], fitted["per_path_key"])

    # ------------------------------------------------------------------ predicting and choosing
    def increment(self, kind: str, tokens: int, pairs: int, path_keys: int = 0) -> float:
        """MiB a pass of ``tokens``, ``pairs`` and ``path_keys`` adds to what the process holds."""
        return self.coefficients(kind).increment(tokens, pairs, path_keys)

    def peak(self, kind: str, tokens: int, pairs: int, held_mib: float, path_keys: int = 0) -> float:
        """Predicted whole-process peak (MiB) of a pass while the process holds ``held_mib`` (pending gradients
        included)."""
        return held_mib + self.increment(kind, tokens, pairs, path_keys)

    def room(self, held_mib: float) -> float | None:
        """MiB a pass may add while the process holds ``held_mib`` (None without a limit)."""
        if self.limit_mib is None:
            return None
        return self.limit_mib * (1.0 - self.headroom) - held_mib

    def budget(
        self, kind: str, held_mib: float, longest: int, path_keys_per_token: float = 0.0, reserved_mib: float = 0.0
    ) -> int | None:
        """The largest token budget whose passes fit: ``(1 + increment_margin) x increment(B, B x min(B, longest),
        B x path_keys_per_token) <= room(held_mib + reserved_mib)``.

        ``longest``: the longest sequence (tokens) of the step; ``path_keys_per_token``: the keys a pass gathers per
        token it computes (the step's prefix tree's, :meth:`~hf_dynbsz.planning.prefix_tree.PrefixTree.path_keys`
        over its tokens; 0 for samples that share nothing); ``reserved_mib``: what the process will hold by then
        that it does not hold yet (:func:`held_states_mib`). None without a limit. At least 1: when even one token
        does not fit, every sequence runs alone (and :meth:`oversize_message` says why it cannot fit). Never above
        the cap a failed pass left (:meth:`record_failure`).
        """
        room = self.room(held_mib + reserved_mib)
        if room is None:
            return None
        c = self.coefficients(kind).scaled(1.0 + self.increment_margin)
        longest = max(int(longest), 1)
        available = room - c.fixed
        best = 1
        if available > 0:
            per_token = c.per_token + c.per_path_key * max(float(path_keys_per_token), 0.0)
            long_rate = per_token + c.per_pair * longest  # every pass at least as long as the longest sequence
            best = available / long_rate if long_rate > 0 else math.inf
            if best < longest:  # passes shorter than the longest sequence: pairs <= B^2
                best = _largest_root(c.per_pair, per_token, -available)
        best = max(1, int(min(best, 2**40)))
        return min(best, self.caps.get(kind, best))

    def fitting_budget(
        self,
        kind: str,
        held_mib: float,
        budget: int,
        passes: list[tuple[int, int, int, int]],
        reserved_mib: float = 0.0,
    ) -> int:
        """The budget to plan with once ``budget``'s passes are planned: ``budget`` when each pass that holds more
        than one sample is predicted, with the margin, to fit ``room(held_mib + reserved_mib)``; otherwise smaller
        than ``budget``, by the share of the room the worst such pass overshoots (at least 1).

        ``passes``: per planned pass, ``(tokens, pairs, path_keys, samples)``. A pass of one sample cannot be
        split: it runs as it is, however small the budget (the executor's oversize warning says what it needs).
        """
        room = self.room(held_mib + reserved_mib)
        if room is None:
            return budget
        c = self.coefficients(kind).scaled(1.0 + self.increment_margin)
        share = min(
            (
                (room - c.fixed) / max(c.increment(tokens, pairs, path_keys) - c.fixed, 1e-12)
                for tokens, pairs, path_keys, samples in passes
                if samples > 1 and c.increment(tokens, pairs, path_keys) > room
            ),
            default=None,
        )
        if share is None:
            return budget
        return max(1, min(budget - 1, int(budget * max(share, 0.0))))

    def describe(self, kind: str) -> str:
        fits = "fitted" if self.observations.get(kind) else "prior"
        return f"{self.coefficients(kind).describe()} ({fits})"


@dataclass
class FailedPass:
    """A pass that ran out of memory: its ``kind``, ``tokens`` and ``pairs`` as planned, what the process held before
    it (None: unmeasured), its ``samples`` and ``longest`` sequence (``samples`` 0: it failed on another process),
    the error's first line; ``hopeless`` when every process agreed that it cannot be retried; its ``path_keys``."""

    kind: str
    tokens: int
    pairs: int
    held: float | None
    samples: int
    longest: int
    message: str
    hopeless: bool = False
    path_keys: int = 0

    def explain(self, memory: MemoryModel) -> str:
        """What failed, for the log line of a retry and for :class:`OutOfMemoryBudgetError`."""
        if not self.samples:
            return f"a {self.kind} pass of another process ran out of memory"
        what = (
            f"a {self.kind} pass of {self.samples} sequence(s), {self.tokens} tokens (the longest {self.longest}), "
            f"ran out of memory ({self.message})"
        )
        if self.samples > 1:
            return what
        needed = memory.increment(self.kind, self.tokens, self.pairs, self.path_keys)
        limit = "" if memory.limit_mib is None else f" of the {memory.limit_mib:.0f} MiB limit"
        held = "" if self.held is None else f" while the process held {self.held:.0f} MiB{limit}"
        return (
            f"{what}: one sequence of {self.longest} tokens alone needs about {needed:.0f} MiB more{held}, twice, "
            "and cannot be split. Lower max_completion_length, turn on gradient checkpointing, lower "
            "tensor_batch_size, or give the process more memory (max_memory_per_device_mib)."
        )


def plan_rows(memory: MemoryModel, held_mib: float, held_source: str, longest: int) -> list[tuple[str, str, str]]:
    """``(setting, per-device value, meaning)`` rows of the plan table for a memory limit: the limit, what the
    process holds, each kind's model and the budget that fits with sequences up to ``longest`` tokens."""
    rows = [
        (
            "max_memory_per_device_mib",
            f"{memory.limit_mib:.0f}",
            f"MiB one process may use; a pass's predicted peak (+{memory.increment_margin:.0%} of what it adds) fits "
            f"it less {memory.headroom:.0%}",
        ),
        ("memory held before passes", f"{held_mib:.0f} MiB", held_source),
    ]
    labels = {"training": "training", "logprob": "no-grad", "teacher": "teacher"}
    for kind, label in ((kind, labels[kind]) for kind in memory.table_kinds):
        rows.append(
            (
                f"memory of a {label} pass",
                memory.describe(kind),
                "on top of what the process holds; refitted from every measured pass",
            )
        )
        fits = memory.room(held_mib) > memory.coefficients(kind).fixed * (1 + memory.increment_margin)
        rows.append(
            (
                f"budget that fits, {label}",
                str(memory.budget(kind, held_mib, longest)) if fits else "none",
                f"tokens per pass whose predicted peak fits, sequences up to {longest} tokens"
                if fits
                else "what the process holds leaves no room for a pass: raise the limit, or shard with ZeRO",
            )
        )
    return rows


def teacher_budget_scale(student_config: Any, teacher_config: Any, **prior_options) -> float:
    """The student's no-grad activation memory per token over the teacher's (:func:`prior_coefficients` of both
    configs, a log-prob pass's shape): a distillation teacher's automatic token budget is the log-prob one times this
    (:meth:`hf_dynbsz.planning.schedule.Scheduler.budget`), so that its passes hold about what the student's no-grad
    passes would. About 0.5 for a teacher twice as wide."""
    student = prior_coefficients(student_config, "logprob", **prior_options).per_token
    teacher = prior_coefficients(teacher_config, "teacher", **prior_options).per_token
    return student / teacher if teacher > 0 else 1.0


def estimated_held_mib(config: Any, num_processes: int = 1, zero_stage: int | None = None) -> float:
    """What a training process holds before its passes when only the config is known (the planner): fp32
    weights, gradients and AdamW's two moments, 16 bytes per parameter, the parts ZeRO shards divided among
    ``num_processes``. Parameters are read off the config (layers' projections and MLP, embeddings, an untied LM
    head)."""
    from hf_dynbsz.planning.cost import ModelFlops, text_config_of

    flops = ModelFlops.from_model_config(config)
    tied = bool(getattr(text_config_of(config), "tie_word_embeddings", False))
    parameters = flops.per_token + flops.per_logit_token * (1 if tied else 2)
    shards = {None: (16, 0), 0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)}[zero_stage]
    return parameters * (shards[0] + shards[1] / max(num_processes, 1)) / _MIB


def held_states_mib(tokens: int, width: int, element_bytes: int) -> float:
    """MiB of per-token states a process holds for ``tokens`` tokens, ``width`` values of ``element_bytes`` each (a
    distillation teacher's last hidden states: ``width`` its hidden size, in its output dtype): what the teacher's
    passes reserve for the states they produce, and the training passes for the states that arrive with moved
    samples (:meth:`MemoryModel.budget`'s ``reserved_mib``)."""
    return max(int(tokens), 0) * int(width) * int(element_bytes) / _MIB


def _varies_apart_from_tokens(points: list[_Observation], name: str) -> bool:
    """Whether the points' ``name`` (``path_keys``) varies apart from their tokens: some non-zero, and at least three
    different ratios to the tokens (else the least squares could not part the two terms)."""
    ratios = {round(getattr(p, name) / max(p.tokens, 1), 3) for p in points}
    return any(getattr(p, name) for p in points) and len(ratios) >= 3


def _least_squares(points: list[_Observation], columns: list[str], kept: dict[str, float]) -> dict[str, float]:
    """Non-negative least squares of the increments over the named terms (few terms: drop a negative one, refit);
    ``kept``: terms not fitted that count as this share of the per-token term (their load joins its column)."""
    import numpy as np

    load = {"per_pair": lambda p: float(p.pairs), "per_path_key": lambda p: float(p.path_keys)}
    features = {
        "fixed": lambda p: 1.0,
        "per_token": lambda p: float(p.tokens) + sum(share * load[name](p) for name, share in kept.items()),
        **load,
    }
    active = list(columns)
    y = np.array([p.increment for p in points])
    while True:
        x = np.array([[features[name](p) for name in active] for p in points])
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        solution = np.linalg.lstsq(x / scale, y, rcond=None)[0] / scale
        negative = [name for name, value in zip(active, solution) if value < 0]
        if not negative or len(active) == 1:
            values = dict(zip(active, np.maximum(solution, 0.0).tolist()))
            return {name: values.get(name, 0.0) for name in columns}
        active.remove(negative[0])


def _largest_root(a: float, b: float, c: float) -> float:
    """The largest ``x`` with ``a x^2 + b x + c <= 0`` (``a, b >= 0``, ``c < 0``)."""
    if a <= 0:
        return -c / b if b > 0 else math.inf
    return -2 * c / (b + math.sqrt(b * b - 4 * a * c))  # the root's stable form (no cancellation for small a)

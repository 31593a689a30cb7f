"""The plugin's settings, each written once: name, type, default, unit, ``DIFFU_*`` variable and help.

Everything that describes a setting is derived from :data:`SETTINGS`: the fields and docstring of
:class:`~hf_dynbsz.configs.grpo.DynamicBatchGRPOConfig` (and so ``hf-dynbsz plan --help`` and
``examples/grpo.py --help``, which read the fields' ``metadata["help"]``), the ``DIFFU_*`` overrides of
:mod:`hf_dynbsz.planning.env`, the validation of :func:`hf_dynbsz.planning.validation.validate_dynamic_batch_fields`
(with the value checks of :mod:`hf_dynbsz.planning.coerce`), the meaning column of the plan table and the
settings tables of ``docs/configuration.md`` (``python -m hf_dynbsz.planning.settings docs/configuration.md`` rewrites
them; ``tests/test_settings.py`` fails when the document differs).

Units: *samples* are completions (one prompt with ``num_generations`` completions is ``num_generations``
samples); *tokens* are prompt + completion tokens; *per device* means one process, *global* means all
processes together.

Pure Python (no torch, no TRL): the planner imports it on any machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hf_dynbsz.planning.balance import MIN_RELATIVE_GAIN

__all__ = [
    "DEFAULTS",
    "ENV_SETTINGS",
    "SETTINGS",
    "Setting",
    "SharePrefix",
    "defaults_of",
    "markdown_tables",
    "setting",
    "update_readme",
]

#: Tokens per tile of TRL 1.16's fused LM head (``trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE``); its tiles are
#: this many tokens x 32768 vocabulary columns (``trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE``).
TRL_TENSOR_TILE_TOKENS = 4096


@dataclass(frozen=True)
class Setting:
    """One setting of the plugin (or one TRL setting a ``DIFFU_*`` variable overrides).

    ``kind`` drives conversion and validation: ``"bool"``, ``"count"`` (a positive integer, ``None`` allowed when
    ``default`` is ``None`` or ``optional``), ``"number"`` (a positive real number, the same for ``None``),
    ``"choice"`` (one of ``choices``) or ``"sharing"`` (a bool or one of ``choices``). ``expected`` and ``fix`` are the
    two halves of the error message for a bad value: "<name> must be <expected>, got <value>: <fix>".
    """

    name: str
    type: str  # as written in the README table and the docstring
    default: Any
    kind: str
    unit: str  # "-" when the setting has no unit
    summary: str  # one line: the plan table's "meaning" column
    help: str  # the full text: config help, CLI help (argparse: no percent signs), README
    env: str | None = None  # the DIFFU_* variable that overrides it
    expected: str = ""
    fix: str = ""
    choices: tuple[str, ...] = ()
    optional: bool = False  # None is a valid value (besides a None default)
    trl_field: bool = False  # a GRPOConfig field, not one the plugin adds
    #: the trainers whose config has the field (None: every trainer's); e.g. ("distillation",) for the teacher's
    trainers: tuple[str, ...] | None = None

    def applies_to(self, trainer: str) -> bool:
        """Whether ``trainer``'s config ("grpo", "rloo", "distillation") has this field."""
        return self.trainers is None or trainer in self.trainers

    @property
    def accepts_none(self) -> bool:
        return self.default is None or self.optional


SETTINGS: tuple[Setting, ...] = (
    Setting(
        name="dynamic_batching",
        type="bool",
        default=True,
        kind="bool",
        unit="-",
        summary="repack micro-batches by token budget",
        help="Repack each optimizer step's samples into micro-batches by a token budget instead of TRL's fixed "
        "micro-batches of per_device_train_batch_size samples padded to the longest row of the generation batch. "
        "The loss and gradients are the stock ones. False gives stock GRPOTrainer behaviour exactly.",
        expected="true or false",
    ),
    Setting(
        name="max_tokens_per_microbatch",
        type="int | None",
        default=None,
        kind="count",
        unit="tokens per device per training forward/backward",
        summary="tokens per training micro-batch (prompt + completion positions computed)",
        help="Token budget per device of one training forward/backward, counted as the token positions the pass "
        "computes: the sum of the samples' prompt + completion tokens for padding-free rows, rows x longest row "
        "for padded micro-batches (lengths rounded up to GRPOConfig's pad_to_multiple_of when set). None "
        "('auto'): per generation batch, the padded token count of stock TRL's own micro-batch for the same "
        "samples, i.e. per_device_train_batch_size * (longest prompt + longest completion in the generation "
        "batch), so memory is never worse than stock's.",
        env="DIFFU_MAX_TOKENS",
        expected="a positive integer number of tokens per device per training micro-batch",
        fix="set it to at least the longest prompt + completion you expect (e.g. 8192), or leave it unset (None) for "
        "the automatic budget per_device_train_batch_size x (longest prompt + longest completion in the generation "
        "batch).",
    ),
    Setting(
        name="max_tokens_per_microbatch_logprob",
        type="int | None",
        default=None,
        kind="count",
        unit="tokens per device per no-grad pass",
        summary="tokens per no-grad log-prob micro-batch (old policy, reference)",
        help="Token budget per device of the log-prob passes without gradients (old policy, reference model), "
        "counted like max_tokens_per_microbatch. None: 2 x the training budget. May be smaller than the training "
        "budget.",
        expected="a positive integer number of tokens per device per no-grad log-prob micro-batch",
        fix="set a positive value (no-grad passes usually fit about twice the training budget), or leave it unset "
        "(None) for 2 x the training budget.",
    ),
    Setting(
        name="max_tokens_per_microbatch_teacher",
        type="int | None",
        default=None,
        kind="count",
        unit="tokens per device per teacher pass",
        summary="tokens per no-grad teacher micro-batch (distillation)",
        help="DynamicBatchDistillationConfig only. Token budget per device of the teacher's no-grad passes (the "
        "teacher's hidden states of every completion token), counted like max_tokens_per_microbatch. None: with "
        "a memory limit, the largest budget whose predicted peak fits it (the teacher's own memory model); without "
        "one, the log-prob rule at the teacher's size: 2 x the training budget x the student's no-grad activation "
        "memory per token over the teacher's (read off both configs), so a teacher twice as wide gets about the "
        "training budget.",
        expected="a positive integer number of tokens per device per teacher micro-batch",
        fix="set a positive value, or leave it unset (None) for 2 x the training budget scaled by the student's "
        "no-grad memory per token over the teacher's.",
        trainers=("distillation",),
    ),
    Setting(
        name="async_step",
        type="str",
        default="stock",
        kind="choice",
        choices=("stock", "samples"),
        unit="-",
        summary="asynchronous GRPO's optimizer step: stock's (default) or samples-defined",
        help="DynamicBatchAsyncGRPOConfig only. Which optimizer step the asynchronous trainer trains. 'stock' "
        "(default): stock AsyncGRPOTrainer's step at this config: with token_budget > 0 the samples its "
        "TokenBudgetBatcher puts in gradient_accumulation_steps micro-batches (samples longer than token_budget "
        "dropped, as stock drops them), with token_budget <= 0 gradient_accumulation_steps micro-batches of "
        "per_device_train_batch_size x processes samples; each micro-batch normalised by its own trained tokens, "
        "as stock; token_budget only decides the step's samples, the passes' size comes from "
        "max_tokens_per_microbatch or the memory budget. 'samples': the plugin's own step, "
        "per_device_train_batch_size x gradient_accumulation_steps x processes samples normalised by the step's "
        "trained tokens (stock's fixed-count step with the whole step in one micro-batch: 8 x 2 trains what stock's "
        "16 x 1 does), token_budget the tokens per pass, no sample dropped.",
        expected="'stock' or 'samples'",
        fix="'stock' trains stock AsyncGRPOTrainer's step at your config, 'samples' the plugin's step of "
        "per_device_train_batch_size x gradient_accumulation_steps x processes samples.",
        trainers=("async_grpo",),
    ),
    Setting(
        name="per_device_generation_batch_size",
        type="int | None",
        default=None,
        kind="count",
        unit="samples per device generated at once",
        summary="samples generated at once per device (transformers generate path)",
        help="Samples generated at once per device: the chunk size of the transformers generate path (vLLM and "
        "continuous batching schedule their own batches). Does not change the training math. None: the whole "
        "per-device share of the generation round at once. TRL's generation_batch_size keeps its meaning: GLOBAL "
        "samples per generation round.",
        env="DIFFU_BATCH_SIZE",
        expected="a positive integer number of samples generated at once per device",
        fix="set it to 1 or more, or leave it unset (None) to generate the whole per-device share of the generation "
        "round at once.",
    ),
    Setting(
        name="tensor_batch_size",
        type="int | None",
        default=1024,
        kind="count",
        optional=True,
        unit="tokens per device per tile",
        summary="tokens per tile of LM-head / log-softmax / entropy work",
        help="Tile of vocabulary-sized work (LM head, log-softmax, entropy) in tokens per device, in the training "
        "pass (tiles recomputed in backward) and the no-grad log-prob passes: a tile is tensor_batch_size tokens "
        "x 8192 vocabulary columns. Default 1024, chosen by benchmarks/memory.py. None: TRL's own tile, "
        f"{TRL_TENSOR_TILE_TOKENS} tokens x 32768 columns.",
        env="DIFFU_TENSOR_BATCH_SIZE",
        expected="a positive integer number of tokens per tile of vocabulary-sized work",
        fix="set it to 1 or more (e.g. 1024), or to None for TRL's own tile of "
        f"{TRL_TENSOR_TILE_TOKENS} tokens x 32768 vocabulary columns.",
    ),
    Setting(
        name="oversize_policy",
        type="str",
        default="warn",
        kind="choice",
        choices=("warn", "error"),
        unit="-",
        summary="sequence longer than the budget: warn (own micro-batch) or error",
        help="A single sequence (prompt + completion tokens) longer than the token budget: 'warn' gives it a "
        "micro-batch of its own (one warning per run); 'error' raises before the step.",
        fix="'warn' gives a sequence longer than the budget a micro-batch of its own, 'error' stops the run.",
    ),
    Setting(
        name="packing_layout",
        type="str",
        default="auto",
        kind="choice",
        choices=("auto", "padding_free", "padded"),
        unit="-",
        summary="auto: padding_free with flash-attention or segment attention, padded otherwise",
        help="Micro-batch layout: 'padding_free' (the samples of a micro-batch concatenated into one row, each "
        "attending to itself only: flash-attention varlen kernels, or segment attention on sdpa, eager and "
        "flex_attention, through torch's varlen_attn on CUDA for sdpa and eager), 'padded' (each micro-batch padded "
        "only to its own longest row), or 'auto': padding_free where each sequence can attend to itself alone "
        "(flash-attention, or a model segment attention supports), padded otherwise; on CUDA 'auto' times the "
        "layouts the self-check passes on the run's own passes and keeps the fastest. 'padding_free' and 'padded' "
        "pin the layout.",
        fix="'auto' packs rows padding-free where each sequence can attend to itself alone and pads otherwise.",
    ),
    Setting(
        name="balance_across_ranks",
        type="bool",
        default=True,
        kind="bool",
        unit="-",
        summary="move samples between processes so none waits for the busiest (exact)",
        help="Before each optimizer step's passes (and each no-grad log-prob pass), move whole samples between "
        "processes so that the largest per-process cost (tokens plus attention, by the partitioner's workload "
        "model) is as small as possible; samples sharing a prefix move together, or are cut apart along their "
        "prefix tree when that lowers the largest cost (the shared prefix then computed on each process holding "
        "some of them). Every process all-gathers the sample lengths and computes the same "
        "assignment; samples move with their advantages, log-probs and loss weights, and no-grad results go back "
        "to the process that owns the sample, so the training math stays stock's. Skipped for a step when the "
        f"predicted gain is below {MIN_RELATIVE_GAIN * 100:g} percent of the largest per-process cost; a no-op on "
        "one process.",
        expected="true or false",
    ),
    Setting(
        name="share_prompt_prefix",
        type="bool | str",
        default=True,
        kind="sharing",
        choices=("tree", "groups"),
        unit="-",
        summary="compute each shared prefix once per pass: 'tree' (any shared run of tokens) or 'groups' (each prompt "
        "in its group)",
        help="In a padding-free pass, samples that begin with the same tokens share one copy of them, through "
        "segment attention, so every log-prob is stock's. 'tree': the pass's samples fold into a prefix tree, whatever "
        "their prompts: a tool schema or few-shot block common to every prompt, a prompt's completions, the shared "
        "trunks and branches of tree-search rollouts are each computed once, every node attending to its root-to-node "
        "path. "
        "'groups': the samples whose prompts are identical (a GRPO prompt's num_generations completions, or duplicate "
        "prompts) share one copy of the prompt, [prompt | completion 1 | completion 2 ...]. For vision-language "
        "models, images are shared only by prompts with the same tokens and the same pictures, and encoded once per "
        "pass. The token budget counts shared tokens once. True: the default rule ('tree'); False: nothing shared. "
        "Not applied, with one logged reason, where it cannot be exact: the padded layout, vision-language families "
        "other than Qwen2-VL, Qwen2.5-VL and LLaVA, models whose attention does not go through transformers' "
        "AttentionInterface or whose layers carry state along a row.",
        env="DIFFU_SHARE_PROMPT_PREFIX",
        expected="'tree', 'groups', true or false",
        fix="'tree' computes every shared prefix once, 'groups' each prompt once in its group, false shares nothing "
        "(true: the default rule).",
    ),
    Setting(
        name="self_check",
        type="bool",
        default=True,
        kind="bool",
        unit="-",
        summary="check the layout against each sample alone at start; step down if it differs",
        help="Before the run's first pass, run one no-grad pass over a few of that step's samples in the fastest "
        "layout the model allows (padding-free with a prefix tree, with shared prompts, padding-free, padded, "
        "padded with an attention mask, in that order) and compare the completion log-probs with each sample "
        "computed alone, then one backward over the shorter of them and compare the gradients (every kind of "
        "parameter, in its first and last layer) with those of the samples alone; keep the first layout within "
        "tolerance on every process (log-probs 1e-4 and gradients 1e-3 relative in fp32, 5e-2 and 0.25 in "
        "bf16/fp16: the check runs in the precision the forwards compute in), trying the next one only when it "
        "is not, and log why the faster ones were left (the parameter whose gradients differ most). When none "
        "passes, stock TRL math runs. Gradients are not compared under DeepSpeed ZeRO-3 (partitioned "
        "parameters) or reentrant gradient checkpointing, and the log says so. A check pass that runs out of "
        "memory is recovered (not under ZeRO-3, nor FSDP on several processes): the check runs again with every "
        "completion cut to its first 16 tokens, and where that runs out of memory too, stock math runs; the log "
        "line says which. Costs five small forwards and two "
        "backwards of three short samples once per run when the fastest layout passes; False skips it and trusts "
        "the decision read off the model.",
        expected="true or false",
    ),
    Setting(
        name="peak_tflops_per_device",
        type="float | None",
        default=None,
        kind="number",
        unit="TFLOP/s per device",
        summary="peak dense TFLOP/s of one device, the denominator of dynbsz/mfu",
        help="Peak dense TFLOP/s of one device at the training precision: the denominator of the logged dynbsz/mfu "
        "(model FLOPs of the step's forward and backward passes over training time, per device). None: looked up "
        "for known datacenter GPUs (A100, H100, H200, B200, L4, L40S, A10) when training in bf16 or fp16; elsewhere, "
        "CPU included, dynbsz/mfu is logged only when this is set.",
        expected="a positive number of TFLOP/s (per device)",
        fix="give your device's peak at the training precision, e.g. 989 for an H100 SXM in bf16, or leave it unset.",
    ),
    Setting(
        name="max_memory_per_device_mib",
        type="int | None",
        default=None,
        kind="count",
        unit="MiB per device",
        summary="memory one process may use: sets the automatic token budgets and recovers from out-of-memory",
        help="Memory one process (device) may use, in MiB: the whole process's resident set on CPU, allocated memory "
        "on GPU. With max_tokens_per_microbatch (or max_tokens_per_microbatch_logprob) left unset, each step's "
        "budget is the largest whose predicted peak fits this limit (hf_dynbsz.planning.memory: a model "
        "of a pass's memory refitted from every measured pass), the same on every process; each step logs "
        "dynbsz/predicted_peak_memory_mib beside dynbsz/peak_memory_mib. A pass that runs out of memory is "
        "re-planned with a smaller budget and the step runs again, with stock's math (single process and DDP). "
        "None: budgets as documented above, and out-of-memory errors are recovered in a single process only.",
        env="DIFFU_MAX_MEMORY_MIB",
        expected="a positive integer number of MiB per device",
        fix="give the memory one process may use (e.g. 70000 on an 80 GB GPU), set max_memory_fraction_per_device "
        "on a GPU, or leave it unset.",
    ),
    Setting(
        name="max_memory_fraction_per_device",
        type="float | None",
        default=None,
        kind="number",
        unit="fraction of the device's memory",
        summary="on a GPU: max_memory_per_device_mib as a fraction of the device's total memory",
        help="On a GPU, the memory limit as a fraction (0 < f <= 1) of the device's total memory, e.g. 0.9; "
        "max_memory_per_device_mib wins when both are set. Needs a CUDA device.",
        env="DIFFU_MAX_MEMORY_FRACTION",
        expected="a fraction of the device's memory, 0 < f <= 1",
        fix="give e.g. 0.9, or set max_memory_per_device_mib in MiB (on CPU), or leave it unset.",
    ),
    Setting(
        name="sequence_parallel_size",
        type="int",
        default=1,
        kind="count",
        unit="processes per sequence",
        summary="processes that share each packed row (DeepSpeed Ulysses sequence parallelism)",
        help="Processes that share each packed row along the sequence (DeepSpeed Ulysses, UlyssesSPAttentionHF): "
        "the processes of a group pool their samples, every pass's row is cut into this many shards, and attention "
        "exchanges heads across the group, so a group fits this many times longer rows (the token budgets stay per "
        "device; a pass holds budget x this many tokens). Data parallelism runs across groups. Also set by "
        "parallelism_config=ParallelismConfig(sp_backend='deepspeed', sp_size=N), which stock GRPOConfig refuses. "
        "Needs padding-free rows (a text model whose attention segment attention runs) and a number of processes "
        "it divides. 1: off.",
        expected="a positive integer number of processes that divides the number of processes",
        fix="set 1 (off) or the number of processes that should share one sequence, e.g. 2.",
    ),
    # A GRPOConfig field: only its DIFFU_* variable belongs to the plugin.
    Setting(
        name="per_device_train_batch_size",
        type="int",
        default=8,
        kind="count",
        unit="samples per device per training step",
        summary="samples per training step (stock TRL's fixed micro-batch)",
        help="TRL's per_device_train_batch_size. With gradient_accumulation_steps it still defines which samples "
        "make an optimizer step; the token budget only decides how those samples are grouped into passes.",
        env="DIFFU_TRAIN_BATCH_SIZE",
        expected="a positive integer number of samples per device (training micro-batch)",
        trl_field=True,
    ),
)

_BY_NAME = {s.name: s for s in SETTINGS}

#: Defaults of the fields that the plugin's configs add to TRL's (each config has those that apply to its trainer).
DEFAULTS: Mapping[str, Any] = {s.name: s.default for s in SETTINGS if not s.trl_field}


def defaults_of(trainer: str) -> dict[str, Any]:
    """The defaults of the fields ``trainer``'s config adds ("grpo", "rloo", "distillation")."""
    return {s.name: s.default for s in SETTINGS if not s.trl_field and s.applies_to(trainer)}


#: The settings a DIFFU_* variable overrides, in table order.
ENV_SETTINGS: tuple[Setting, ...] = tuple(s for s in SETTINGS if s.env)


class SharePrefix(str, Enum):
    """The sharing rule of padding-free rows: the one value that ``share_prompt_prefix`` holds once checked, that a
    :class:`~hf_dynbsz.planning.model_support.Layout` and the :class:`~hf_dynbsz.planning.schedule.Scheduler` carry,
    and that the collator and the metrics read. ``TREE``: every prefix a pass's samples share is computed once
    (:mod:`hf_dynbsz.planning.prefix_tree`); ``GROUPS``: each prompt once for its group's completions; ``NONE``:
    every sample whole. A member is its value as a string (``SharePrefix.TREE == "tree"``, hashed alike, printed as
    ``tree``), and ``NONE`` is false: ``if sharing:`` reads "something is shared"."""

    NONE = "none"
    GROUPS = "groups"
    TREE = "tree"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __hash__(self) -> int:
        return hash(self.value)

    def __bool__(self) -> bool:
        return self is not SharePrefix.NONE

    @classmethod
    def of(cls, value: Any) -> SharePrefix:
        """The rule of a (checked) ``share_prompt_prefix`` value: a member as itself, ``True`` the default
        (:attr:`TREE`), ``False`` and None :attr:`NONE`, a member's value (``"tree"``, ``"groups"``, ``"none"``) that
        member."""
        if isinstance(value, cls):
            return value
        if value is True:
            return cls.TREE
        if value is False or value is None:
            return cls.NONE
        if isinstance(value, str) and value in {rule.value for rule in cls}:
            return cls(value)
        raise ValueError(f"share_prompt_prefix must be 'tree', 'groups', true or false, got {value!r}")


def setting(name: str) -> Setting:
    """The :class:`Setting` called ``name`` (KeyError for an unknown name)."""
    return _BY_NAME[name]


def config_docstring(trainer: str = "grpo") -> str:
    """The ``Parameters`` section of the docstring of ``trainer``'s config (HF docstring style): the fields it has."""
    lines = []
    for s in SETTINGS:
        if s.trl_field or not s.applies_to(trainer):
            continue
        default = "" if s.default is None else f", defaults to `{s.default!r}`"
        lines.append(f"        {s.name} (`{s.type}`, *optional*{default}):")
        lines.append(f"            {s.help}" + (f" Environment override: `{s.env}`." if s.env else ""))
    return "\n".join(lines)


def _markdown_default(s: Setting) -> str:
    if s.default is None:
        return "`None`"
    return f'`"{s.default}"`' if isinstance(s.default, str) else f"`{s.default}`"


def markdown_tables() -> dict[str, str]:
    """The generated tables of ``docs/configuration.md`` by marker name: the plugin's fields, and the DIFFU_* variables.

    In the document each sits between ``<!-- NAME -->`` and ``<!-- /NAME -->``; ``python -m hf_dynbsz.planning.settings
    docs/configuration.md`` rewrites them, and ``tests/test_settings.py`` fails when they differ from these.
    """
    fields = ["| field | default | unit | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        if not s.trl_field:
            meaning = s.help + (f" Environment: `{s.env}`." if s.env else "")
            fields.append(f"| `{s.name}` | {_markdown_default(s)} | {s.unit} | {meaning} |")
    variables = ["| variable | overrides | unit |", "|---|---|---|"]
    variables += [f"| `{s.env}` | `{s.name}` | {s.unit} |" for s in ENV_SETTINGS]
    return {"settings-table": "\n".join(fields), "env-table": "\n".join(variables)}


def readme_block(readme: str, marker: str) -> str:
    """The text between ``<!-- marker -->`` and ``<!-- /marker -->`` in ``readme`` (stripped)."""
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    if start not in readme or end not in readme:
        raise ValueError(f"the README has no {start} ... {end} block")
    return readme.split(start, 1)[1].split(end, 1)[0].strip()


def with_readme_block(readme: str, marker: str, content: str) -> str:
    """``readme`` with the text between ``<!-- marker -->`` and ``<!-- /marker -->`` replaced by ``content``."""
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    readme_block(readme, marker)  # both markers are there
    head, rest = readme.split(start, 1)
    return f"{head}{start}\n{content}\n{end}{rest.split(end, 1)[1]}"


def update_readme(path: str) -> None:
    """Rewrite the generated tables of the README at ``path`` in place."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    for marker, table in markdown_tables().items():
        text = with_readme_block(text, marker, table)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1:
        update_readme(sys.argv[1])
    else:
        print("\n\n".join(markdown_tables().values()))

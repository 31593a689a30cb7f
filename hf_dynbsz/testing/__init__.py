"""Offline building blocks shared by the tests, the benchmarks and the example (as accelerate's ``test_utils``).

Nothing here downloads anything, and importing the package is cheap (torch, transformers, TRL and datasets are
imported inside the functions). The modules:

* :mod:`~hf_dynbsz.testing.fixtures`: a character-level tokenizer and tiny causal LMs built from a config (random
  weights), prompt datasets, rewards, scripted rollouts (``rollout_func``), an environment, the comparison runs'
  config and training run;
* :mod:`~hf_dynbsz.testing.vision`: tiny vision-language models, image prompt datasets, a rollout for image prompts;
* :mod:`~hf_dynbsz.testing.oracles`: reference computations the results are checked against (stock's log-probs,
  first-fit-decreasing packing, attention masks, parameter differences);
* :mod:`~hf_dynbsz.testing.passes`: one pass of a bare model as the executor runs it (collator, segment attention,
  segment recurrence);
* :mod:`~hf_dynbsz.testing.processes`: a subprocess runner with a timeout, a run's whole-process peak memory;
* :mod:`~hf_dynbsz.testing.fsdp`: accelerate's FSDP on CPU processes (accelerate turns it on for accelerator devices
  only);
* :mod:`~hf_dynbsz.testing.engines`: what a multi-process run's engine did with the parameters (recorded by the
  worker: sharded or whole, per process) against what its accelerate config asks for, and a model's whole parameters;
* :mod:`~hf_dynbsz.testing.layouts`: padding-free rows written by hand (shared prompts' segments, nodes) as planning's
  prefix tree, and a segment layout's nodes read back;
* :mod:`~hf_dynbsz.testing.mixes`: the benchmarks' named length mixes (completion and prompt lengths);
* :mod:`~hf_dynbsz.testing.preference`: preference pairs (lengths from ranges or a long tail, a system block shared
  across pairs, several pairs per prompt) and one DPO run of stock's trainer or the plugin's;
* :mod:`~hf_dynbsz.testing.prefixes`: samples with prefix structure beyond prompt groups (a block every prompt
  begins with, tree-search rollouts' trunks and branches);
* :mod:`~hf_dynbsz.testing.scenarios`: the multi-process preference tests' runs by named scenario (the worker's
  fields and results, the test's launches, each rank's record, the comparison with stock, lockstep);
* :mod:`~hf_dynbsz.testing.harness`: one builder of a run (model shape, scripted rollout of a mix, stock's or the
  plugin's config with the CPU run's fields, the trainer, a step clock) and the commands that launch workers;
* :mod:`~hf_dynbsz.testing.async_grpo`: TRL's ``AsyncGRPOTrainer`` offline: a rollout worker and a weight transfer
  through TRL's protocols over scripted samples, stock's FA3 tree kernel in plain torch, a run of either trainer;
* :mod:`~hf_dynbsz.testing.vllm_standin`: a stand-in for vLLM behind TRL's own ``VLLMGeneration`` (server and colocate
  mode: completions sampled from the synced weights, log-probs with fixed noise), installed by ``vllm_standin()``;
* :mod:`~hf_dynbsz.testing.zoo`: tiny models of every causal-LM architecture of transformers (imports torch).

Every public name but the zoo's is re-exported here: ``from hf_dynbsz.testing import X``.
"""

from __future__ import annotations

import sys

from hf_dynbsz.testing.async_grpo import *  # noqa: F403
from hf_dynbsz.testing.engines import *  # noqa: F403
from hf_dynbsz.testing.fixtures import *  # noqa: F403
from hf_dynbsz.testing.fsdp import *  # noqa: F403
from hf_dynbsz.testing.harness import *  # noqa: F403
from hf_dynbsz.testing.layouts import *  # noqa: F403
from hf_dynbsz.testing.mixes import *  # noqa: F403
from hf_dynbsz.testing.oracles import *  # noqa: F403
from hf_dynbsz.testing.passes import *  # noqa: F403
from hf_dynbsz.testing.preference import *  # noqa: F403
from hf_dynbsz.testing.prefixes import *  # noqa: F403
from hf_dynbsz.testing.processes import *  # noqa: F403
from hf_dynbsz.testing.scenarios import *  # noqa: F403
from hf_dynbsz.testing.vision import *  # noqa: F403
from hf_dynbsz.testing.vllm_standin import *  # noqa: F403

#: The submodules whose public names (their ``__all__``) this package re-exports: all but the zoo and the probes of
#: process exits and host reads, which are imported by their module's name.
REEXPORTED = (
    "async_grpo", "engines", "fixtures", "fsdp", "harness", "layouts", "mixes", "oracles", "passes", "preference",
    "prefixes", "processes", "scenarios", "vision", "vllm_standin",
)  # fmt: skip
# (by sys.modules: the attribute ``vllm_standin`` of this package is the function, not the module)
__all__ = list(dict.fromkeys(name for module in REEXPORTED for name in sys.modules[f"{__name__}.{module}"].__all__))

"""Issue 66: Gemma-3n text's residual against stock, amplifier by amplifier.

Run:  python benchmarks/gemma3n_residual.py [VARIANT ...] [--dtype float64]   (from the repository root)
Results of 2026-12-07: benchmarks/results/gemma3n_residual.md.
Prints one JSON line per (variant, run): update_difference(initial, ours, stock) (||ours - stock|| / ||stock - initial||
over all parameters) for the plugin's runs, and for stock cut another way (its own split noise).
Same machinery as tests/test_model_zoo.py::train (2 steps, equal prompts, across-group prefix rollout).

Runs (columns): stock_2x4 / stock_8x1: stock with another per_device_train_batch_size x gradient_accumulation_steps
cut (its split noise); stock_eager: stock with eager attention instead of sdpa (same math, forward rounded another
way); tree / groups / none / padded: the plugin (share_prompt_prefix, packing_layout); tree_b40: the tree with a
40-token budget; tree_b40_vs_tree: the plugin against itself (its own re-cut noise).
Variants (positional): see VARIANTS (amplifiers off one at a time; control_* are other architectures).
Options: --dtype float64 (model in fp64; TRL's fused LM head replaced by a plain fp64 one, and the fp32 casts inside
Gemma-3n's RMSNorm / AltUp router and the controls' RMSNorm removed unless --keep-fp32-casts), --seed N (weights),
--settings JSON (GRPOConfig fields for every run, e.g. '{"max_steps": 4}'), --runs a,b,c, --varied, --threads N.
Examples:
  ... benchmarks/gemma3n_residual.py base sparsity_off kv_shared_off softcap_off laurel_rank0 all_off
  ... benchmarks/gemma3n_residual.py base all_off control_llama control_gemma3 --dtype float64 \
      --runs stock_2x4,stock_8x1,tree,groups,none,padded,tree_b40
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_model_zoo as zoo_test  # noqa: E402

from hf_dynbsz.testing.oracles import update_difference  # noqa: E402
from hf_dynbsz.testing.zoo import MAX_PARAMS, _count_params_meta, tiny_causal_lm_config  # noqa: E402

VARIANTS = {
    "base": {},
    "control_llama": dict(model_type="llama"),
    "control_gemma3": dict(model_type="gemma3_text"),
    "control_gemma4": dict(model_type="gemma4_text"),
    "sparsity_off": dict(activation_sparsity_pattern=[0.0] * 4),
    "kv_shared_off": dict(num_kv_shared_layers=0),
    "softcap_off": dict(final_logit_softcapping=None),
    "altup_clip_off": dict(altup_coef_clip=None),
    "laurel_rank0": dict(laurel_rank=0),
    "sparsity_softcap_off": dict(activation_sparsity_pattern=[0.0] * 4, final_logit_softcapping=None),
    "all_off": dict(
        activation_sparsity_pattern=[0.0] * 4,
        num_kv_shared_layers=0,
        final_logit_softcapping=None,
        altup_coef_clip=None,
    ),
}

RUNS = {  # name: (trainer, settings)
    "stock_2x4": ("stock", dict(per_device_train_batch_size=2, gradient_accumulation_steps=4)),
    "stock_8x1": ("stock", dict(per_device_train_batch_size=8, gradient_accumulation_steps=1)),
    # stock's forward rounded another way (same math): eager attention instead of sdpa
    "stock_eager": ("stock", dict(attn="eager")),
    "tree": ("ours", dict(share_prompt_prefix="tree")),
    "groups": ("ours", dict(share_prompt_prefix="groups")),
    "none": ("ours", dict(share_prompt_prefix="none")),
    "padded": ("ours", dict(share_prompt_prefix="none", packing_layout="padded")),
    # the plugin against itself: the same tree cut into smaller micro-batches (its own layout noise)
    "tree_b40": ("ours", dict(share_prompt_prefix="tree", max_tokens_per_microbatch=40)),
}

DTYPE = torch.float32
EQUAL = True
COMMON: dict = {}
SEED = 0


class ReferenceLogProb:
    """Drop-in for trl.kernels.ChunkedLogProbFunction computing in the inputs' dtype (TRL's kernel keeps fp32
    accumulators): used for --dtype float64 so that the LM head is float64 too."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0, outputs=()):
        z = hidden @ weight.t()
        if bias is not None:
            z = z + bias
        z = z * logit_scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / temperature
        logp = torch.log_softmax(z, dim=-1)
        lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        lssp = torch.logsumexp(2 * logp, -1) if "log_sum_sq_probs" in outputs else None
        mean = z.mean(-1) if "mean_logits" in outputs else None
        top1 = (z.argmax(-1) == targets) if "is_top1" in outputs else None
        return lp, entropy, lssp, mean, top1


def full_float64_gemma3n():
    """Gemma-3n's RMSNorm and AltUp router cast to fp32 inside the model (``hidden_states.float()``,
    ``tanh(routed.float())``): in a float64 run they keep the input's dtype instead."""
    from transformers.models.gemma3n import modeling_gemma3n as g

    def norm_forward(self, hidden_states):
        normed = self._norm(hidden_states)
        return normed * self.weight if self.with_scale else normed

    def router(self, x):
        return torch.tanh(self.modality_router(self.router_norm(x) * self.router_input_scale))

    g.Gemma3nRMSNorm.forward = norm_forward
    g.Gemma3nTextAltUp.compute_router_modalities = router

    from transformers.models.llama import modeling_llama as llama  # the control's RMSNorm casts to fp32 too

    def llama_norm(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))

    llama.LlamaRMSNorm.forward = llama_norm

    from transformers.models.gemma3 import modeling_gemma3 as gemma3  # and Gemma-3's (the other control)

    gemma3.Gemma3RMSNorm.forward = lambda self, x: self._norm(x) * (1.0 + self.weight)


def build(overrides: dict, attn=None):
    overrides = dict(overrides)
    model_type = overrides.pop("model_type", "gemma3n_text")
    config = tiny_causal_lm_config(model_type)
    for key, value in overrides.items():
        try:
            setattr(config, key, value)
        except Exception:  # noqa: BLE001 - strict dataclass validation (None for a float field)
            object.__setattr__(config, key, value)
        assert getattr(config, key) == value
    if "num_kv_shared_layers" in overrides:  # recompute derived kv_sharing_modes if the config derives them
        try:
            config = type(config)(**config.to_dict())
        except Exception:  # noqa: BLE001
            pass
    assert _count_params_meta(config) <= MAX_PARAMS
    torch.manual_seed(SEED)
    from transformers import AutoModelForCausalLM

    extra = {} if attn is None else {"attn_implementation": attn}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra)
    return model.to(DTYPE)


def train(overrides, trainer, output_dir, **settings):
    """Two optimizer steps of stock GRPO (``trainer`` "stock") or ours on :func:`build`'s model (``attn`` of
    ``settings`` its attention): the zoo test's run (``tests/test_model_zoo.py``'s ``train_model``), :data:`COMMON`
    and ``settings`` its fields."""
    from trl import GRPOConfig, GRPOTrainer

    from hf_dynbsz import DynamicBatchGRPOConfig, DynamicBatchGRPOTrainer

    trainer_cls, config_cls = (
        (GRPOTrainer, GRPOConfig) if trainer == "stock" else (DynamicBatchGRPOTrainer, DynamicBatchGRPOConfig)
    )
    settings = dict(settings)
    model = build(overrides, settings.pop("attn", None))
    return zoo_test.train_model(model, trainer_cls, config_cls, output_dir, EQUAL, True, **{**COMMON, **settings})


def main():
    global DTYPE
    argv = sys.argv[1:]
    keep_casts = "--keep-fp32-casts" in argv
    if keep_casts:
        argv.remove("--keep-fp32-casts")
    if "--dtype" in argv:
        i = argv.index("--dtype")
        DTYPE = getattr(torch, argv[i + 1])
        if DTYPE == torch.float64:
            import trl.trainer.utils as trl_utils

            trl_utils._ChunkedLogProbFunction = ReferenceLogProb
            if not keep_casts:
                full_float64_gemma3n()
        del argv[i : i + 2]
    runs = list(RUNS)
    global EQUAL, SEED
    threads = 1
    if "--threads" in argv:
        i = argv.index("--threads")
        threads = int(argv[i + 1])
        del argv[i : i + 2]
    if "--settings" in argv:  # JSON of GRPOConfig fields for every run (e.g. '{"num_iterations": 2}')
        i = argv.index("--settings")
        COMMON.update(json.loads(argv[i + 1]))
        del argv[i : i + 2]
    if "--varied" in argv:
        argv.remove("--varied")
        EQUAL = False
    if "--seed" in argv:
        i = argv.index("--seed")
        SEED = int(argv[i + 1])
        del argv[i : i + 2]
    if "--runs" in argv:
        i = argv.index("--runs")
        runs = argv[i + 1].split(",")
        del argv[i : i + 2]
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING)
    for variant in argv or list(VARIANTS):
        with tempfile.TemporaryDirectory() as d:
            t0 = time.time()
            initial, stock, _ = train(VARIANTS[variant], "stock", str(Path(d) / "stock"))
            finals = {}
            line = {
                "variant": variant,
                "dtype": str(DTYPE),
                "equal_prompts": EQUAL,
                "seed": SEED,
                "threads": threads,
                "settings": COMMON,
            }
            for name in runs:
                kind, settings = RUNS[name]
                init2, final, t = train(VARIANTS[variant], kind, str(Path(d) / name), **settings)
                assert all(torch.equal(init2[k], initial[k]) for k in initial)
                line[name] = update_difference(initial, final, stock)
                finals[name] = final
                if kind == "ours":
                    line[name + "_layout"] = zoo_test.trained_layout(t)
            if "tree" in finals and "tree_b40" in finals:
                line["tree_b40_vs_tree"] = update_difference(initial, finals["tree_b40"], finals["tree"])
            line["seconds"] = round(time.time() - t0, 1)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()

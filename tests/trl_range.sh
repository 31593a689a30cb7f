#!/usr/bin/env bash
# The tests that depend on TRL's internals, against each given TRL release, each in a virtual environment of its
# own (.venv-trl-VERSION, reused when present): the checked private names and signatures, training against stock
# for every loss type, MoE, the self-check and the model-zoo subset.
#
#   tests/trl_range.sh 1.16.0        # from the repository root
#
# hf_dynbsz._trl_compat.TESTED_TRL_RANGE and pyproject.toml's trl requirement say which releases it covered. Outside
# that range `import hf_dynbsz` stops (UntestedTRLVersionError), so the tests run with HF_DYNBSZ_ALLOW_UNTESTED_TRL=1
# (one warning instead); test_installed_trl_is_inside_the_tested_range then fails by design, naming the release.
# TRL 1.15 needs a machine with Triton (a GPU): its fused LM head has no PyTorch fallback, so without Triton stock
# GRPOTrainer fails in its first training forward ('NoneType' object has no attribute 'apply') and there is nothing
# to compare the plugin with.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ "$#" -gt 0 ] || { echo "usage: tests/trl_range.sh TRL_VERSION [TRL_VERSION ...]" >&2; exit 2; }
for version in "$@"; do
    env=".venv-trl-$version"
    echo "== trl $version ($env)"
    [ -x "$env/bin/python" ] || python3 -m venv "$env"
    command -v nvidia-smi >/dev/null || "$env/bin/pip" install -q torch==2.13.0
    "$env/bin/pip" install -q -e ".[dev]"
    "$env/bin/pip" install -q "trl==$version"  # on its own: outside pyproject's trl pin pip warns instead of refusing
    "$env/bin/python" -c "import trl; assert trl.__version__ == '$version', trl.__version__"
    HF_DYNBSZ_ALLOW_UNTESTED_TRL=1 "$env/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" \
        tests/test_trl_compat.py tests/test_init.py tests/test_trainer.py tests/test_router_loss.py \
        tests/test_self_check.py tests/test_model_zoo.py
done

#!/usr/bin/env bash
# The DIFFU_* sweep: which token budget (and LM-head tile) gives the most tokens per second within your memory?
#
#   examples/sweep.sh [OUT_DIR] [-- options for examples/grpo.py]
#
# Trains examples/grpo.py for $STEPS optimizer steps once per DIFFU_MAX_TOKENS value in $BUDGETS ("auto": the
# variable unset, the budget of stock TRL's own micro-batch) and DIFFU_TENSOR_BATCH_SIZE value in $TILES, each
# into OUT_DIR/max_tokens-B_tensor-T, then compares the runs with `hf-dynbsz report` (OUT_DIR/report.md, printed,
# and OUT_DIR/report.png). Defaults: OUT_DIR runs/sweep, STEPS 20, BUDGETS "auto 256 512 1024 2048", TILES 1024.
# Without options it sweeps the offline demo (about 2 minutes on 2 CPU cores); on your model, pass the script's
# options after "--" and launch through accelerate, e.g.
#
#   LAUNCH="accelerate launch --config_file accelerate_configs/zero2.yaml" BUDGETS="8192 16384 32768" \
#   TILES="1024 4096" examples/sweep.sh runs/sweep -- --model_name_or_path Qwen/Qwen3-0.6B \
#       --dataset_name trl-lib/DeepMath-103K --max_completion_length 2048
#
# The DIFFU_* variables reach every process accelerate starts on this machine; on several machines, run the
# same sweep (same variables) on each.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
out="runs/sweep"
if [ $# -gt 0 ] && [ "$1" != "--" ]; then out="$1"; shift; fi
if [ $# -gt 0 ] && [ "$1" = "--" ]; then shift; fi
steps="${STEPS:-20}"
budgets="${BUDGETS:-auto 256 512 1024 2048}"
tiles="${TILES:-1024}"
read -r -a launch <<< "${LAUNCH:-python}"
mkdir -p "$out"

runs=()
for budget in $budgets; do
    for tile in $tiles; do
        name="max_tokens-${budget}_tensor-${tile}"
        settings=(-u DIFFU_MAX_TOKENS DIFFU_TENSOR_BATCH_SIZE="$tile")
        if [ "$budget" != auto ]; then settings+=(DIFFU_MAX_TOKENS="$budget"); fi
        echo "== $name: ${launch[*]} examples/grpo.py --max_steps $steps $* (log: $out/$name.log)"
        if ! env "${settings[@]}" "${launch[@]}" "$here/grpo.py" --max_steps "$steps" --output_dir "$out/$name" \
                --save_strategy no "$@" > "$out/$name.log" 2>&1; then
            tail -n 30 "$out/$name.log" >&2
            echo "examples/sweep.sh: run $name failed (log: $out/$name.log)" >&2
            exit 1
        fi
        runs+=("$out/$name")
    done
done

echo
hf-dynbsz report "${runs[@]}" --png "$out/report.png" --markdown "$out/report.md"

#!/usr/bin/env bash
# The quick tests that touch torch, transformers, accelerate, DeepSpeed and PEFT, in a fresh virtual environment per
# row of versions (.venv-matrix-ROW, rebuilt unless MATRIX_REUSE=1): the oldest releases pyproject.toml declares and the newest
# the package index serves. One table line per row: the versions installed, then passed / failed.
#
#   tests/version_matrix.sh                  # both rows, from the repository root
#   tests/version_matrix.sh oldest           # one row
#   OLDEST_TORCH=2.7.1 tests/version_matrix.sh oldest
#   tests/version_matrix.sh "mine: torch==2.9.1 transformers==5.3.0 accelerate==1.12.0 deepspeed==0.18.0 peft==0.18.0"
#
# A row is "oldest", "newest", or "NAME: REQUIREMENT ..." (pip requirements, installed with the package). Versions of
# the two named rows come from OLDEST_* / NEWEST_* (TORCH, TRANSFORMERS, ACCELERATE, DEEPSPEED, PEFT). TRL is the
# one release pyproject.toml allows (tests/trl_range.sh covers TRL). Set MATRIX_VENVS to put the environments
# elsewhere, MATRIX_PYTEST to pass pytest more arguments. docs/version-matrix.md records the last results.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

OLDEST="torch==${OLDEST_TORCH:-2.13.0} transformers==${OLDEST_TRANSFORMERS:-5.21.0} \
accelerate==${OLDEST_ACCELERATE:-1.10.1} deepspeed==${OLDEST_DEEPSPEED:-0.19.8} peft==${OLDEST_PEFT:-0.18.0}"
NEWEST="torch==${NEWEST_TORCH:-2.14.1} transformers==${NEWEST_TRANSFORMERS:-5.25.0} \
accelerate==${NEWEST_ACCELERATE:-1.16.0} deepspeed==${NEWEST_DEEPSPEED:-0.19.8} peft==${NEWEST_PEFT:-0.21.2}"
TESTS=(tests/test_trl_compat.py tests/test_init.py tests/test_trainer.py tests/test_self_check.py)
[ "$#" -gt 0 ] || set -- oldest newest
venvs="${MATRIX_VENVS:-.}"
table=()

for row in "$@"; do
    case "$row" in
        oldest) name=oldest requirements="$OLDEST" ;;
        newest) name=newest requirements="$NEWEST" ;;
        *:*) name="${row%%:*}" requirements="${row#*:}" ;;
        *) echo "unknown row '$row': oldest, newest or 'NAME: REQUIREMENT ...'" >&2; exit 2 ;;
    esac
    env="$venvs/.venv-matrix-$name"
    log="$env.log"
    echo "== $name: $requirements ($env, log $log)"
    start=$SECONDS
    [ "${MATRIX_REUSE:-0}" = 1 ] && [ -x "$env/bin/python" ] || { rm -rf "$env" && python3 -m venv "$env"; }
    # shellcheck disable=SC2086  # the requirements are words
    if ! "$env/bin/pip" install -q -e ".[deepspeed,dev]" $requirements >"$log" 2>&1; then
        tail -5 "$log"
        table+=("| $name | $requirements | install failed (see $log) |")
        continue
    fi
    versions=$("$env/bin/python" - <<'EOF'
import importlib.metadata as m
print(" ".join(f"{p}=={m.version(p)}" for p in ("torch", "transformers", "accelerate", "deepspeed", "peft", "trl")))
EOF
    )
    summary=()
    for selection in "not slow" "representative"; do
        if [ "$selection" = representative ]; then files=(tests/test_model_zoo.py); else files=("${TESTS[@]}"); fi
        # shellcheck disable=SC2086
        out=$("$env/bin/python" -m pytest -q -p no:cacheprovider -p no:randomly -m "$selection" "${files[@]}" \
            ${MATRIX_PYTEST:-} 2>&1)
        printf '%s\n' "$out" >>"$log"
        printf '%s\n' "$out" | tail -3
        line=$(printf '%s\n' "$out" | grep -E '[0-9]+ (passed|failed|errors?)|no tests ran' | tail -1)
        summary+=("$(echo "${line:-no pytest summary (see $log)}" | sed -E 's/^=+ //; s/ in [0-9.]+s.*//; s/ =+$//; s/, [0-9]+ (warnings?|deselected)//g')")
    done
    table+=("| $name | $versions | ${summary[0]} | ${summary[1]} | $((SECONDS - start)) s |")
done

echo
echo "| row | versions | quick tests | zoo representative | time |"
echo "|---|---|---|---|---|"
printf '%s\n' "${table[@]}"

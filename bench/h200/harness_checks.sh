#!/usr/bin/env bash
# The harness's GPU checks on one H200, in one call of at most 10 minutes:
#   1. evaluate dsa_indexer_topk's baseline against itself on CUDA (must be no-gain),
#   2. the GPU-only planted bugs and hacks of the corpus (pytest, no Django),
#   3. the red team on CUDA: every hack caught, no legit kernel rejected,
#   4. (with --repeatability) the repeatability of the medians: the baseline and the
#      torch chunked variant, each evaluated 3 times by fresh harness processes.
#
#   bash bench/h200/harness_checks.sh [--repeatability]
#
# Needs only the harness's dependencies (python3 with torch, triton, numpy, scipy,
# pytest) and, for the red team's CuTe kernel, CuTe DSL on PYTHONPATH. Writes every
# result under $OUT (default /tmp/h200-checks), packs it into checks.tgz there, and
# prints a short table last. A section that fails is reported and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/h200-checks}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT/checks"
export PYTHONUNBUFFERED=1 CUTE_DSL_ARCH=${CUTE_DSL_ARCH:-sm_90a}
declare -a SUMMARY

section() {  # name, seconds, command...: run it, keep its log, note how it ended
  local name=$1 limit=$2; shift 2
  local started=$SECONDS
  timeout "$limit" "$@" >"$OUT/checks/$name.out" 2>"$OUT/checks/$name.log"
  local status=$?
  SUMMARY+=("$(printf '%-14s exit %-3s %4ss  %s' "$name" "$status" "$((SECONDS - started))" \
    "$(tail -n 1 "$OUT/checks/$name.out" | cut -c1-90)")")
}

{ nvidia-smi || true; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } \
  >"$OUT/checks/machine.txt" 2>&1

section aa 150 bash -c 'python3 -m runners.harness evaluate dsa_indexer_topk baseline --device "$0" --json >"$1" &&
  python3 bench/h200/verdict.py "$1"' "$DEVICE" "$OUT/checks/aa.json"

section corpus 240 python3 -m pytest -c /dev/null --noconftest -p no:cacheprovider -q -rA \
  tests/test_harness_corpus.py -k "gpu_hack or planted or correct" --rootdir .

section red_team 300 python3 scripts/red_team.py --device "$DEVICE" --json "$OUT/checks/red_team.json"

if [[ ${1:-} == --repeatability ]]; then
  section repeatability 540 python3 bench/repeatability.py dsa_indexer_topk baseline \
    runners/ops/dsa_indexer_topk/kernels/chunked_topk.py --device "$DEVICE" --repeats 3 \
    --out "$OUT/checks/repeatability"
fi

tar czf "$OUT/checks.tgz" -C "$OUT" checks && rm -rf "$OUT/checks"
printf '%s\n' "${SUMMARY[@]}"

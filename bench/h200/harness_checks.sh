#!/usr/bin/env bash
# The harness's GPU checks on one H200, by section:
#   aa             evaluate dsa_indexer_topk's baseline against itself on CUDA (no-gain),
#   corpus         the GPU-only planted bugs and hacks of the corpus (pytest, no Django),
#   red_team       the red team on CUDA: every hack caught, no legit kernel rejected,
#   repeatability  the baseline and the torch chunked variant, each evaluated 3 times by
#                  fresh harness processes: how far their medians move between runs,
#   paged          the paged decode ops' baselines against themselves (no-gain, the decode
#                  loop's tokens per second),
#   first_call     the kept CuTe indexers on their dense ops: what their first call at a
#                  new context length costs (the first-call guard; needs CuTe DSL),
#   kept_loop      the kept CuTe indexers wired into the paged decode loop through a thin
#                  adapter: the cost of every decode step (bench/h200/kept_decode_loop.py),
#   graph_replay   the CUDA-only tests of graph replay with new lengths and of the GPU
#                  hacks (a kernel that bakes the captured lengths into its graph).
#   clock          the clock check on short calls, timed in batches: how far honest
#                  processes' requests land apart (A/A, and the Triton and CuTe rmsnorm
#                  kernels against the baseline; bench/harness_overhead.py), and the
#                  GPU clock hacks at a short call (T=1024) and a long one (the CuTe
#                  kernel only where CuTe DSL is on PYTHONPATH),
#   attacks        the GPU attacks of tests/test_harness_attacks.py: each shown misbehaving
#                  outside the harness, then rejected inside it,
#   machine        the machine state a result reports (runners/harness/machine.py), read
#                  through NVML, and what the results-file check says of it.
#
#   bash bench/h200/harness_checks.sh SECTION ...
#
# Each section has its own time limit; pick sections so one call stays within 10 minutes:
# on an H200 (2026-11-30) corpus and red_team each took over 4 and 5 minutes, so each
# gets a call of its own, as does repeatability (aa fits beside any of them).
#
# Needs only the harness's dependencies (python3 with torch, triton, numpy, scipy,
# pytest) and, for the red team's CuTe kernel, CuTe DSL on PYTHONPATH. Writes every
# result under $OUT (default /tmp/h200-checks), packs it into checks.tgz there, and
# prints a short table last. A section that fails is reported and the next one runs.
set -uo pipefail
SECTIONS=("$@")
if [[ $# -eq 0 ]]; then
  echo "usage: $0 SECTION ... (aa, corpus, red_team, repeatability, paged, first_call, kept_loop, graph_replay, clock, attacks, machine)" >&2
  exit 2
fi
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

wanted() { [[ " ${SECTIONS[*]} " == *" $1 "* ]]; }

wanted aa && section aa 150 bash -c 'python3 -m runners.harness evaluate dsa_indexer_topk baseline --device "$0" --json >"$1" &&
  python3 bench/h200/verdict.py "$1"' "$DEVICE" "$OUT/checks/aa.json"

wanted corpus && section corpus 540 python3 -m pytest -c /dev/null --noconftest -p no:cacheprovider -v -rA \
  tests/test_harness_corpus.py -k "gpu_hack or planted or correct" --rootdir .

wanted red_team && section red_team ${RED_TEAM_S:-560} python3 scripts/red_team.py --device "$DEVICE" --jobs 5 --json "$OUT/checks/red_team.json"

# Up to 3 s of timing per workload (a side stops sooner once its median is known to
# +-1%); the whole section took 166 s on an H200 (docs/benchmarks.md).
wanted repeatability && section repeatability ${REPEATABILITY_S:-560} python3 bench/repeatability.py dsa_indexer_topk \
  baseline runners/ops/dsa_indexer_topk/kernels/chunked_topk.py --device "$DEVICE" --repeats 3 \
  --time-budget ${REPEATABILITY_BUDGET_S:-3} --out "$OUT/checks/repeatability"

wanted paged && section paged 400 bash -c 'for op in dsa_indexer_topk_paged dsa_indexer_topk_paged_fp8; do
    python3 -m runners.harness evaluate $op baseline --device "$0" --ctx 4096,65536 --json >"$1/$op.json" &&
    python3 bench/h200/verdict.py "$1/$op.json"; done' "$DEVICE" "$OUT/checks"

wanted first_call && section first_call ${FIRST_CALL_S:-330} bash -c 'for pair in dsa_indexer_topk:logits_topk_cute dsa_indexer_topk_fp8:logits_topk_fp8_cute; do
    op=${pair%%:*}; kernel=${pair#*:}
    python3 -m runners.harness evaluate $op runners/ops/$op/kernels/$kernel.py --device "$0" --dsl cute --ctx 65536,262144 \
      --json >"$1/first_call_$op.json"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], r[\"verdict\"], *[g[\"detail\"] for g in r[\"guards\"] if g[\"name\"]==\"first-call\"])" \
      "$1/first_call_$op.json" "$op"; done' "$DEVICE" "$OUT/checks"

wanted kept_loop && section kept_loop 200 python3 bench/h200/kept_decode_loop.py --json "$OUT/checks/kept_loop.json"

wanted graph_replay && section graph_replay 200 python3 -m pytest -c /dev/null --noconftest -p no:cacheprovider -v -rA \
  tests/test_ops_paged.py tests/test_harness_corpus.py -k "host or bakes or gpu_hack" --rootdir .

wanted clock && section clock ${CLOCK_S:-420} bash -c 'ctx=1024,16384,65536
  python3 bench/harness_overhead.py --device "$0" --ctx $ctx --runs 2 >"$1/clock_aa.txt"
  python3 bench/harness_overhead.py --device "$0" --ctx $ctx --runs 2 --dsl triton \
    --candidate runners/ops/rmsnorm/kernels/rows_triton.py >"$1/clock_triton.txt"
  if python3 -c "import cutlass" 2>/dev/null; then
    python3 bench/harness_overhead.py --device "$0" --ctx $ctx --runs 1 --dsl cute \
      --candidate runners/ops/rmsnorm/kernels/rows_cute.py >"$1/clock_cute.txt"; fi
  for hack in rmsnorm_halves_gpu_time rmsnorm_leaves_gpu_work rmsnorm_skips_the_harness_work; do
    python3 -m runners.harness evaluate rmsnorm tests/candidates/$hack.py --device "$0" --ctx 1024,65536 \
      --json >"$1/clock_$hack.json"
    python3 bench/h200/verdict.py "$1/clock_$hack.json"; done
  tail -n 1 "$1"/clock_*.txt' "$DEVICE" "$OUT/checks"

wanted attacks && section attacks 300 python3 -m pytest -c /dev/null --noconftest -p no:cacheprovider -v -rA \
  tests/test_harness_attacks.py -k gpu_attack --rootdir .

wanted machine && section machine 60 python3 -c 'import json
from runners.harness.machine import COMPARED, machine_state
from runners.harness.results_file import machine_problem
state = machine_state("cuda")
print(json.dumps(state, indent=1))
unknown = [key for key in COMPARED if state.get(key) is None]
print("nvml:", state.get("nvml"), "| results-file check:", machine_problem(state) or "ok",
      "| compared fields unknown:", ", ".join(unknown) or "none")'

tar czf "$OUT/checks.tgz" -C "$OUT" checks && rm -rf "$OUT/checks"
printf '%s\n' "${SUMMARY[@]}"

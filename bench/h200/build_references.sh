#!/usr/bin/env bash
# Builds what bench/h200/indexer_vs_production.py needs on a GPU host that has no network
# (the H200: nvcc 13, torch 2.11+cu130, Python 3.12), from the checkout root, then writes
# /opt/refs.env to source:
#
#   bash bench/h200/build_references.sh && . /opt/refs.env \
#     && python3 bench/h200/indexer_vs_production.py --out "$OUT/vs_production"
#
# Inputs, git-ignored, brought along with the checkout (neither is committed: DeepGEMM's
# and CUTLASS's code stays out of the project):
#
#   .dg/deepgemm.tar.xz   DeepGEMM's source (commit 54e2261 when this was written) with the
#                         CUTLASS and fmt headers its submodules pin. Made on a machine
#                         with the three git repositories, from the checkout root:
#                           ../shared/gpu/pack-deepgemm DEEPGEMM_GIT CUTLASS_GIT FMT_GIT
#                         (git dirs of deepseek-ai/DeepGEMM, NVIDIA/cutlass, fmtlib/fmt;
#                         the pinned commits are read from DeepGEMM's tree; about 1.3 MB).
#   .cutedsl/piece.*      nvidia-cutlass-dsl 4.8.1 (CuTe DSL) for CPython 3.12 x86-64, in
#                         pieces of 30 MB (../shared/gpu/pack-cutedsl). Optional: without
#                         it, run the bench with --no-cute. Where a host takes at most
#                         64 MB a transfer, bring piece.00 first and the others in a second
#                         transfer: each run copies whatever pieces it finds to
#                         /opt/cutedsl/ and unpacks once all three are there.
#
# Each step is skipped when its result is already there, so a second run on the same
# host only writes /opt/refs.env. DeepGEMM builds in about 90 s (16 jobs); its kernels
# are compiled at their first call (its own JIT, cached under ~/.deep_gemm).
set -euo pipefail
root=$PWD
cuda_home=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
paths=()

# DeepGEMM: unpack, link the CUTLASS headers where its JIT includes them, build _C in place.
dg=/opt/dg/DeepGEMM
if [ -f "$root/.dg/deepgemm.tar.xz" ] || [ -d "$dg" ]; then
  if ! ls "$dg"/deep_gemm/_C*.so >/dev/null 2>&1; then
    mkdir -p /opt/dg && xz -dc "$root/.dg/deepgemm.tar.xz" | tar xf - -C /opt/dg
    (
      cd "$dg"
      ln -sfn "$PWD/third-party/cutlass/include/cutlass" deep_gemm/include/cutlass
      ln -sfn "$PWD/third-party/cutlass/include/cute" deep_gemm/include/cute
      started=$(date +%s)
      CUDA_HOME=$cuda_home MAX_JOBS=16 DG_USE_LOCAL_VERSION=0 python3 setup.py build > /opt/dg/build.log 2>&1 \
        || { tail -40 /opt/dg/build.log; exit 1; }
      so=$(find build -name "_C*.so" -type f | head -n 1)
      ln -sf "$PWD/$so" deep_gemm/
      echo "DeepGEMM built in $(( $(date +%s) - started )) s: $so"
    )
  fi
  paths+=("$dg")
else
  echo "no .dg/deepgemm.tar.xz: DeepGEMM left out" >&2
fi

# CuTe DSL: gather the pieces, unpack once all three are there.
cutedsl=/opt/cutedsl
mkdir -p "$cutedsl"
if ls "$root"/.cutedsl/piece.* >/dev/null 2>&1; then cp "$root"/.cutedsl/piece.* "$cutedsl"/; fi
if [ -d "$cutedsl/nvidia_cutlass_dsl" ]; then
  paths+=("$cutedsl" "$cutedsl/nvidia_cutlass_dsl/dsl_packages")
elif [ "$(ls "$cutedsl"/piece.* 2>/dev/null | wc -l)" -ge 3 ]; then
  cat "$cutedsl"/piece.* | xz -dc | tar xf - -C "$cutedsl"
  paths+=("$cutedsl" "$cutedsl/nvidia_cutlass_dsl/dsl_packages")
  echo "CuTe DSL unpacked"
else
  echo "CuTe DSL: $(ls "$cutedsl"/piece.* 2>/dev/null | wc -l) of 3 pieces here, not unpacked" >&2
fi

# DeepGEMM's _C names no C++ runtime it needs (ldd lists only libgcc_s), so its C++
# symbols resolve to whichever definitions the process loaded first, and on these hosts
# those are not the system libstdc++'s that built it: its first JIT call died in
# std::regex's constructor (IncludeParser::get_includes; a bracket matcher calling
# through a wrong facet, `__codecvt_utf16_base::do_unshift`), every case of
# bench/h200/deepgemm_smoke.py (seen on the H200, traced on an H100 with a preloaded
# SIGSEGV backtrace). With the system's libstdc++ preloaded every case runs.
stdcxx=$(g++ -print-file-name=libstdc++.so.6 2>/dev/null || true)
joined=$(IFS=:; echo "${paths[*]:-}")
cat > /opt/refs.env <<EOF
export CUDA_HOME=$cuda_home
export PYTHONPATH=${joined:+$joined:}$root\${PYTHONPATH:+:\$PYTHONPATH}
${stdcxx:+export LD_PRELOAD=$(readlink -f "$stdcxx")}
EOF
cat /opt/refs.env

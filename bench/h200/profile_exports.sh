#!/usr/bin/env bash
# Real profiler exports of bench/h200/profile_step.py on a GPU host, for the evidence
# parser's fixtures: a torch.profiler trace, `ncu --csv --page details` with ncu's
# default sections, and `nsys stats` CSVs where Nsight Systems can make a report.
#
#   OUT=/tmp/exports bash bench/h200/profile_exports.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/exports}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ncu --version >"$OUT/tools.txt" 2>&1
python3 bench/h200/profile_step.py --trace "$OUT/h200_torch_trace.json.gz" 2>&1 | tail -n 3
# ncu leaves the clocks alone (the card is shared); its ==PROF== lines and the program's
# own output land in the export as they do for every user who redirects stdout.
timeout 300 ncu --csv --page details --clock-control none --launch-count 40 \
  python3 bench/h200/profile_step.py --steps 2 >"$OUT/h200_ncu_details.csv" 2>"$OUT/ncu.log"
echo "ncu exit $?: $(wc -l <"$OUT/h200_ncu_details.csv") lines"
nsys=$(command -v nsys || ls /opt/nvidia/nsight-systems*/bin/nsys /opt/nvidia/nsight-compute/*/host/target-linux-x64/nsys 2>/dev/null | head -n 1)
if [[ -n "$nsys" ]]; then
  # CUDA tracing alone: a virtual machine gives nsys no CPU sampling or context-switch
  # events, and asked for them it ended with "ShutdownRequest" and no report. The H200
  # host's only nsys (2026-12-04) is the target-side copy inside Nsight Compute: it
  # writes a .qdstrm and has no importer to turn it into the .nsys-rep `nsys stats`
  # reads ("Unable to retrieve the importer version"), so no nsys CSV comes from there.
  timeout 120 "$nsys" profile --force-overwrite true --trace cuda --sample none --cpuctxsw none \
    -o /tmp/step python3 bench/h200/profile_step.py --steps 2 >"$OUT/nsys.log" 2>&1
  for report in cuda_gpu_kern_sum cuda_gpu_trace; do
    timeout 60 "$nsys" stats --report $report --format csv --output "$OUT/h200_nsys" /tmp/step.nsys-rep \
      >>"$OUT/nsys.log" 2>&1
  done
  echo "nsys ($nsys): $(ls "$OUT" | grep -c nsys_) CSVs; $(tail -n 2 "$OUT/nsys.log" | tr '\n' ' ')"
else
  echo "nsys: not on this host"
fi
ls -la "$OUT"

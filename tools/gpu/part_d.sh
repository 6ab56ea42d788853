#!/usr/bin/env bash
# After the lab polish (2026-11-30): the gpu/multigpu tiers of every exercise and of the
# trace/overlap tests, lab 07's pp_bench with its figures, and nbval of solutions 04-08 on
# two NVLink GPUs, from the repository root:  bash tools/gpu/part_d.sh  (about 6 minutes).
set -u
RESULTS=${RESULTS:-/tmp/gpu-D}
mkdir -p "$RESULTS"
source tools/gpu/prelude.sh
step() { echo "=== $1 ($(date +%T), limit ${2}s)"; }
step "gpu tiers: exercises, trace, overlap" 120
timeout -k 5 120 python3 -m pytest -q -rfEs -p no:cacheprovider -m "gpu or multigpu" \
  tests/exercises tests/test_trace.py tests/test_overlap.py 2>&1 | tail -20
step "pp_bench" 60
timeout -k 5 60 python3 -m distlab.pp_bench --out "$RESULTS/pp" --timeout 50 2>&1 | grep -v "it/s\]" | tail -16
step "nbval solutions 04-08" 200
timeout -k 5 200 python3 -m pytest -q -rfEs -p no:cacheprovider --nbval --nbval-current-env \
  solutions/04_data_parallel.ipynb solutions/05_zero.ipynb solutions/06_tensor_parallel.ipynb \
  solutions/07_pipeline_parallel.ipynb solutions/08_overlap.ipynb 2>&1 | tail -60
step done 0
[ -n "${OUT:-}" ] && tar czf "$OUT/gpu-D.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"

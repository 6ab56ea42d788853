#!/usr/bin/env bash
# Issue 10 on two NVLink GPUs (nvidia-h200-x2), from the repository root, in ~2-2.5 minutes:
#   1. nccl-tests' six *_perf binaries, 8 B .. 1 GiB, 50 iterations (if built in /tmp/nt by
#      .ncclt/build.sh);
#   2. python -m distlab.bench at 2 NCCL ranks, the same sizes, side by side with (1),
#      back to back as nccl-tests times (median of 3 runs per size), then again in a CUDA
#      graph (no host cost per call; median of 5 runs, the fastest beside it);
#   2b. the same at one NCCL rank, 4 KiB .. 1 GiB (what lab 01 explains);
#   2c. python -m distlab.bench --api nccl: NCCL called through cupy, no torch per call
#      (median of 5 runs per size), side by side with (1);
#   every bench with nccl-tests' counts: 10 warm-up calls, 50 timed back to back;
#   3. python -m distlab.ring_bench: the reference ring (whole chunks on NCCL) against
#      NCCL's all_reduce, busbw, 64 MiB .. 1 GiB, median and range over 15 rounds, beside
#      pipelined variants of 64, 128 and 256 MiB pieces and "1 GiB pieces" (the same
#      algorithm as the default at these sizes: how far two runs of one thing differ;
#      PIECES="" leaves them out), with the host's time to issue each call; then again
#      in CUDA graphs (RING_GRAPH=0 skips it);
#   4. the ring's correctness at world size 2, 1 B .. 1 GiB, odd lengths;
#   5. the multigpu tests of the ring and the bench.
# Everything lands in $OUT (default /tmp/issue10): *.txt logs, JSON and PNG figures.
# tools/gpu/prelude.sh (wheels, environment, nccl-tests build) is sourced first.
set -u
OUT=${OUT:-/tmp/issue10}
PY=${PY:-python3}
[ -f tools/gpu/prelude.sh ] && source tools/gpu/prelude.sh
export PYTHONPATH="$PWD/lib${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
SIZES=(-b 8 -e 1G -f 2)
TIMING=(-w 10 -i 50)  # nccl-tests' -w 10 -n 50: warm-up calls, then calls timed back to back
step() { echo; echo "=== $* ($(date +%T))"; }

REF=()
if [ -x /tmp/nt/all_reduce_perf ]; then
  step "nccl-tests, 2 GPUs in one process"
  NH=$($PY -c "import nvidia.nccl, os; print(list(nvidia.nccl.__path__)[0])" 2>/dev/null)
  [ -n "$NH" ] && export LD_LIBRARY_PATH="$NH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  mkdir -p "$OUT/nccl-tests"
  for op in all_reduce all_gather reduce_scatter broadcast reduce sendrecv; do
    timeout 120 /tmp/nt/${op}_perf "${SIZES[@]}" -g 2 -w 10 -n 50 > "$OUT/nccl-tests/${op}_perf.txt" 2>&1
    echo "$op: exit $?, $(grep 'Avg bus bandwidth' "$OUT/nccl-tests/${op}_perf.txt")"
  done
  REF=(--nccl-tests "$OUT/nccl-tests")
else
  echo "no /tmp/nt/all_reduce_perf: build nccl-tests with .ncclt/build.sh for the side-by-side table"
fi

step "distlab.bench, 2 NCCL ranks, back to back"
timeout 240 $PY -m distlab.bench -n 2 --backend nccl "${SIZES[@]}" "${TIMING[@]}" -r 3 ${REF[@]+"${REF[@]}"} \
  --out "$OUT/bench" 2>&1 | grep -v 'it/s\]' | tee "$OUT/bench.txt"

if [ "${GRAPH:-1}" = 1 ]; then  # GRAPH=0 skips it (saves about 25 s)
  step "distlab.bench, 2 NCCL ranks, in a CUDA graph"
  timeout 240 $PY -m distlab.bench -n 2 --backend nccl "${SIZES[@]}" "${TIMING[@]}" --graph --each 0 -r 5 \
    ${REF[@]+"${REF[@]}"} --out "$OUT/bench-graph" 2>&1 | grep -v 'it/s\]' | tee "$OUT/bench-graph.txt"
fi

if [ "${ONE_RANK:-1}" = 1 ]; then  # ONE_RANK=0 skips it (saves about 10 s)
  step "distlab.bench, 1 NCCL rank (lab 01: what a one-rank bench times)"
  timeout 120 $PY -m distlab.bench -n 1 --backend nccl -b 4K -e 1G -f 4 --out "$OUT/bench-1" \
    2>&1 | grep -v 'it/s\]' | tee "$OUT/bench-1.txt"
fi

if [ "${API_NCCL:-1}" = 1 ]; then  # API_NCCL=0 skips it
  step "distlab.bench --api nccl, 2 ranks: NCCL through cupy, back to back"
  timeout 240 $PY -m distlab.bench -n 2 --backend nccl "${SIZES[@]}" "${TIMING[@]}" -r 5 --api nccl \
    ${REF[@]+"${REF[@]}"} --out "$OUT/bench-nccl" 2>&1 | grep -v 'it/s\]' | tee "$OUT/bench-nccl.txt"
fi

PIECES=${PIECES-64M,128M,256M,1G}
step "distlab.ring_bench: reference ring vs NCCL all_reduce, 64 MiB .. 1 GiB"
timeout 150 $PY -m distlab.ring_bench --backend nccl -n 2 -b 64M -e 1G -f 2 \
  ${PIECES:+--pieces $PIECES} --out "$OUT/ring_bench" 2>&1 | grep -v 'it/s\]' \
  | tee "$OUT/ring_bench.txt"
if [ "${RING_GRAPH:-1}" = 1 ]; then
  step "distlab.ring_bench --graph: the same in CUDA graphs (no host cost per call)"
  timeout 150 $PY -m distlab.ring_bench --backend nccl -n 2 -b 64M -e 1G -f 2 --graph \
    --out "$OUT/ring_bench-graph" 2>&1 | grep -v 'it/s\]' | tee "$OUT/ring_bench-graph.txt"
fi

if [ "${CHECK:-1}" = 1 ]; then  # CHECK=0 skips it
step "ring all-reduce correctness, 2 NCCL ranks, 1 B .. 1 GiB"
timeout 240 $PY -m distlab.ring_bench --check --backend nccl -n 2 2>&1 | grep -v 'it/s\]' \
  | tee "$OUT/ring_check.txt"
fi

step "multigpu tests of the ring and the bench"
timeout 300 $PY -m pytest -q -m "gpu or multigpu" tests/test_ring.py tests/test_bench.py tests/test_nccl_raw.py \
  -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest.txt"
step "done"

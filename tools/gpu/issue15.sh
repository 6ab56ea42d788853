#!/usr/bin/env bash
# Issue 15 (lab 08, overlap) on two NVLink GPUs (nvidia-h200-x2), from the repository root,
# in ~4-5 minutes:
#   1. the gpu/multigpu tests of DataParallel, the overlap channels (CUDA comm stream, raw
#      NCCL through cupy) and the overlap bench's CLI on a small model (~1 min);
#   2. python -m distlab.overlap_bench on NVLink and through host memory: the 98M GPT,
#      bf16, 16x1024 and 4x1024 tokens per GPU, naive / bucketed / torch DDP, hidden
#      fraction from a profiler trace (~2 min);
#   3. the same over TCP sockets, 4x1024 tokens per GPU (~1 min).
# Everything lands in $OUT (default /tmp/issue15): *.txt logs, JSON, PNG, Chrome traces.
# ROUNDS and ITERS (default 3 and 3) set the bench's rounds and timed steps per round.
set -u
OUT=${OUT:-/tmp/issue15}
PY=${PY:-python}
export PYTHONPATH="$PWD/lib${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
step() { echo; echo "=== $* ($(date +%T))"; }

step "gpu and multigpu tests: dp, overlap, trace"
timeout 300 $PY -m pytest -q -m "gpu or multigpu" tests/test_dp.py tests/test_overlap.py \
  tests/test_trace.py -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/pytest.txt"

step "overlap_bench: NVLink and host memory"
BENCH=(--rounds "${ROUNDS:-3}" --iters "${ITERS:-3}")
timeout 300 $PY -m distlab.overlap_bench --out "$OUT/bench" --links nvlink,host "${BENCH[@]}" 2>&1 \
  | grep -v 'USDT' | tee "$OUT/bench-nvlink-host.txt"

step "overlap_bench: TCP sockets"
timeout 240 $PY -m distlab.overlap_bench --out "$OUT/bench-socket" --links socket "${BENCH[@]}" 2>&1 \
  | grep -v 'USDT' | tee "$OUT/bench-socket.txt"
step "done"

#!/usr/bin/env bash
# Issue 16 (lab 06, tensor parallel) on two NVLink GPUs (nvidia-h200-x2), from the
# repository root, in about 3-4 minutes:
#   1. the multigpu tests of distlab.tp: the TP GPT (plain, vocabulary-parallel,
#      sequence-parallel) on 2 NCCL ranks against one process, and tp_bench's NCCL path on
#      a small model (~1 min);
#   2. python -m distlab.tp_bench on NVLink: the 98M GPT, bf16, global batch 8x1024, TP=2
#      (distlab against torch's DTensor TP) beside DP=2 (torch DDP, distlab DataParallel),
#      with the share of each step in NCCL kernels from a profiler trace (~1 min);
#   3. the same through host memory and over TCP sockets, fresh ranks per link (~1-2 min).
# Everything lands in $OUT (default /tmp/issue16): *.txt logs, JSON, PNG, Chrome traces.
# Each launch gives up after 120 s with every rank's stack, inside the outer timeouts.
set -u
OUT=${OUT:-/tmp/issue16}
PY=${PY:-python}
export PYTHONPATH="$PWD/lib${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
step() { echo; echo "=== $* ($(date +%T))"; }

step "multigpu tests of distlab.tp"
# -vv -rfEs --tb=short: every failure and skip in full (the summary lines uncut)
timeout 270 $PY -m pytest -vv -rfEs --tb=short -m "gpu or multigpu" tests/test_tp.py \
  -p no:cacheprovider 2>&1 | tee "$OUT/pytest.txt"

step "tp_bench: NVLink"
timeout 180 $PY -m distlab.tp_bench --world-size 2 --out "$OUT/nvlink" --links nvlink 2>&1 \
  | tee "$OUT/tp_bench-nvlink.txt"

step "tp_bench: host memory and TCP sockets"
timeout 270 $PY -m distlab.tp_bench --world-size 2 --out "$OUT/network" --links host,socket 2>&1 \
  | tee "$OUT/tp_bench-network.txt"
step "done"

#!/usr/bin/env bash
# Issue 11 (lab 05, ZeRO) on two NVLink GPUs (nvidia-h200-x2), from the repository root,
# in about 2-3 minutes:
#   1. python -m distlab.zero_bench at 2 NCCL ranks on the 98M GPT: the sharded AdamW
#      kernel (cupy) against torch's fused AdamW and a device copy (bandwidth at 28 B per
#      parameter), per-rank memory of data parallel and ZeRO-1/2/3 against
#      distlab.memory.accounting (activations measured apart), ZeRO-3 against FSDP2;
#   2. the gpu and multigpu tests of distlab.zero (the kernel against torch.optim.AdamW on
#      its shard only; every stage against one process under NCCL).
# Everything lands in $OUT (default /tmp/issue11): *.txt logs, zero/zero_bench.{json,png}.
set -u
OUT=${OUT:-/tmp/issue11}
PY=${PY:-python}
export PYTHONPATH="$PWD/lib${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
step() { echo; echo "=== $* ($(date +%T))"; }

step "distlab.zero_bench, 2 NCCL ranks, gpt-100m, 8 x 1024 tokens per rank"
timeout 300 $PY -m distlab.zero_bench --world-size 2 --backend nccl --batch-size 8 \
  --out "$OUT/zero" 2>&1 | tee "$OUT/zero_bench.txt"

step "gpu and multigpu tests of distlab.zero"
timeout 300 $PY -m pytest -q -m "gpu or multigpu" tests/test_zero.py -p no:cacheprovider \
  2>&1 | tail -15 | tee "$OUT/pytest.txt"
step "done"

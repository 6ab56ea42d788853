#!/usr/bin/env bash
# Issue 11 (lab 05, ZeRO) on two NVLink GPUs (nvidia-h200-x2), from the repository root,
# in about 2 minutes:
#   1. python -m distlab.zero_bench at 2 NCCL ranks on the 98M GPT, 8 x 1024 tokens per
#      rank: the sharded AdamW kernel (cupy) against torch's fused AdamW and a device copy;
#      per rank and strategy (data parallel, ZeRO-1/2/3), each built after the previous
#      one is deleted and read above a baseline: model states at the end of backward
#      against distlab.memory.accounting, the optimizer step's buffers against
#      distlab.memory.step_buffers, the peak against states + max(activations, step
#      buffers), what was left behind; ZeRO-3 against FSDP2 with AdamW foreach and fused
#      (backward and optimizer step timed apart, collectives per step counted);
#   2. the memory section again at 1 x 128 tokens per rank, where activations are small
#      and the buffers of forward and backward (gathered units, reduce-scatters in
#      flight) show in the "bwd buf" column;
#   3. the gpu and multigpu tests of distlab.zero (the kernel against torch.optim.AdamW on
#      its shard only; every stage against one process under NCCL).
# Everything lands in $OUT (default /tmp/issue11): *.txt logs, zero/ and zero-small/
# with zero_bench.{json,png}.
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

if [ "${SMALL:-1}" = 1 ]; then  # SMALL=0 skips it
  step "distlab.zero_bench memory only, 1 x 128 tokens per rank"
  timeout 180 $PY -m distlab.zero_bench --world-size 2 --backend nccl --batch-size 1 \
    --seq-len 128 --sections memory --out "$OUT/zero-small" 2>&1 | tee "$OUT/zero_bench_small.txt"
fi

step "gpu and multigpu tests of distlab.zero"
timeout 300 $PY -m pytest -q -m "gpu or multigpu" tests/test_zero.py -p no:cacheprovider \
  2>&1 | tail -15 | tee "$OUT/pytest.txt"
step "done"

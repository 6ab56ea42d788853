#!/usr/bin/env bash
# The GPU runs of labs 01-08 on two NVLink GPUs, in parts that each fit a 10-minute
# call:  bash tools/gpu/session.sh PART, PART one of A to P (from the repository root).
#   A: issue10.sh (bench against nccl-tests, the ring), issue11.sh (ZeRO), pp_bench (lab 07)
#   B: issue15.sh (overlap), issue16.sh (TP), the gpu tiers of every exercise, nbval 01-03
#   C: the re-runs after fixes: issue10.sh (eager, 2 ranks), pp_bench and its tests, issue16.sh,
#      issue11.sh (the 8 x 1024 bench and the tests)
#   D: after the lab polish: the gpu tiers of every exercise, trace and overlap, pp_bench
#      with its figures, nbval of solutions 04-08 (about 6 minutes)
#   E: the ring at 64-256 MiB with NCCL's default point-to-point channels and with 32, then
#      nbval of solutions 05-08, one notebook per step (about 8 minutes)
#   F: after the hooks' fix: issue15.sh with 7 rounds of 5 steps, then nbval of solutions 08,
#      07 and 06 (about 8 minutes)
#   G: where the bucketed step loses time at 4 x 1024 tokens: overlap_bench on NVLink with
#      the host's time per step and every rank's traces, with the CUDA comm stream and with
#      plain work handles; the ring bench, 64 MiB .. 1 GiB (about 4 minutes)
#   H: after the default channel became torch's handles: issue15.sh with 7 rounds of 5
#      steps, nbval of solution 08, the gpu tiers of the exercises, comm and launch
#   I: issue10.sh with the bench through cupy's NCCL (--api nccl) beside torch's and
#      nccl-tests, the ring with the host's time per call and in CUDA graphs, the multigpu
#      tests of bench, ring and nccl_raw (about 7 minutes)
#   J: experiments: the ring's exchange through cheaper host paths (eager and graphed),
#      the bucketed step with the process group's own allreduce, 11 rounds at 4 x 1024
#   L: issue10.sh with nccl-tests' counts (10 warm-up, 50 timed calls), then overlap_bench
#      at 4 x 1024 tokens on NVLink and through host memory, 15 rounds (about 7 minutes)
#   M: overlap_bench on NVLink and through host memory, 16 x 1024 and 4 x 1024 tokens,
#      21 rounds of 5 steps (about 4 minutes)
#   N: after the hook's trim: overlap_bench at 4 x 1024 tokens on NVLink and through host
#      memory, 21 rounds; the gpu tiers of dp, overlap and the exercises; nbval of 08
#   O: where a step's host time goes at 4 x 1024 tokens (exp_profile_dp.py): forward,
#      backward, finish and optimizer of bucketed, DDP and naive, and the hooks' own time
#   P: one hook per bucket against one per parameter (exp_overlap_host.py's "bucketed
#      sentinel"), 21 rounds at 4 x 1024 tokens, on NVLink and through host memory
#   K (4 GPUs, nvidia-h200-x4; N from the GPUs present, so it also runs on two): the ring's correctness and bench (eager and graphed), the
#      bench through cupy beside nccl-tests, the gpu/multigpu tests of ring, bench,
#      nccl_raw, dp, overlap and the exercises, at every GPU of the machine
# Each step has its own time limit; whatever ran lands in $RESULTS (default /tmp/gpu-PART)
# and, when $OUT is set (the device tool), in $OUT/gpu-PART.tgz.
set -u
part=${1:?A to P, or K}
RESULTS=${RESULTS:-/tmp/gpu-$part}
mkdir -p "$RESULTS"
source tools/gpu/prelude.sh > "$RESULTS/prelude.txt" 2>&1
cat "$RESULTS/prelude.txt"
run() {  # run LIMIT NAME COMMAND...: one step, its log in $RESULTS/NAME.txt
  local limit=$1 name=$2; shift 2
  echo "=== $name ($(date +%T), limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$RESULTS/$name.txt" 2>&1
  echo "=== $name: exit $? ($(date +%T))"
  tail -n 25 "$RESULTS/$name.txt"
}
nbval() {  # nbval NOTEBOOK:LIMIT: one solution notebook, its GPU cells run for real
  run "${1#*:}" "nbval_${1%:*}" python3 -m pytest -q -rfEs -p no:cacheprovider --nbval \
    --nbval-current-env "solutions/${1%:*}.ipynb"
}
if [ "$part" = A ]; then
  run 240 issue10 env OUT="$RESULTS/issue10" bash tools/gpu/issue10.sh
  run 170 issue11 env OUT="$RESULTS/issue11" bash tools/gpu/issue11.sh
  run 120 pp_bench python3 -m distlab.pp_bench --out "$RESULTS/pp"
  run 60 pp_tests python3 -m pytest -q -p no:cacheprovider -m multigpu tests/test_pp.py
elif [ "$part" = C ]; then
  run 150 issue10 env OUT="$RESULTS/issue10" GRAPH=0 ONE_RANK=0 bash tools/gpu/issue10.sh
  run 60 pp_bench python3 -m distlab.pp_bench --out "$RESULTS/pp" --timeout 50
  run 50 pp_tests python3 -m pytest -q -rfEs -p no:cacheprovider -m multigpu tests/test_pp.py
  run 130 issue16 env OUT="$RESULTS/issue16" bash tools/gpu/issue16.sh
  run 120 issue11 env OUT="$RESULTS/issue11" SMALL=0 bash tools/gpu/issue11.sh
elif [ "$part" = D ]; then
  run 120 gpu_tiers python3 -m pytest -q -rfEs -p no:cacheprovider -m "gpu or multigpu" \
    tests/exercises tests/test_trace.py tests/test_overlap.py
  run 60 pp_bench python3 -m distlab.pp_bench --out "$RESULTS/pp" --timeout 50
  run 200 nbval_04_08 python3 -m pytest -q -rfEs -p no:cacheprovider --nbval --nbval-current-env \
    solutions/04_data_parallel.ipynb solutions/05_zero.ipynb solutions/06_tensor_parallel.ipynb \
    solutions/07_pipeline_parallel.ipynb solutions/08_overlap.ipynb
elif [ "$part" = E ]; then
  ring="python3 -m distlab.ring_bench --backend nccl -n 2 -b 64M -e 256M -f 2 --iters 40"
  run 50 ring_default $ring --out "$RESULTS/ring_default"
  run 50 ring_p2p32 env NCCL_MIN_P2P_NCHANNELS=32 NCCL_MAX_P2P_NCHANNELS=32 \
    NCCL_NCHANNELS_PER_PEER=32 $ring --out "$RESULTS/ring_p2p32"
  for nb in 05_zero:110 06_tensor_parallel:90 07_pipeline_parallel:110 08_overlap:170; do
    nbval "$nb"
  done
elif [ "$part" = F ]; then
  run 300 issue15 env OUT="$RESULTS/issue15" ROUNDS=7 ITERS=5 bash tools/gpu/issue15.sh
  for nb in 08_overlap:100 07_pipeline_parallel:100 06_tensor_parallel:200; do
    nbval "$nb"
  done
elif [ "$part" = G ]; then
  ob="python3 -m distlab.overlap_bench --links nvlink --rounds 7 --iters 5 --all-traces"
  run 150 overlap_stream $ob --shapes 4x1024,16x1024 --out "$RESULTS/overlap_stream"
  run 100 overlap_handles $ob --shapes 4x1024 --channel handles --out "$RESULTS/overlap_handles"
  run 90 ring_bench python3 -m distlab.ring_bench --backend nccl -n 2 -b 64M -e 1G -f 2 \
    --out "$RESULTS/ring_bench"
elif [ "$part" = H ]; then
  run 280 issue15 env OUT="$RESULTS/issue15" ROUNDS=7 ITERS=5 bash tools/gpu/issue15.sh
  nbval 08_overlap:90
  run 120 gpu_tiers python3 -m pytest -q -rfEs -p no:cacheprovider -m "gpu or multigpu" \
    tests/exercises tests/test_comm.py tests/test_launch.py
elif [ "$part" = I ]; then
  run 420 issue10 env OUT="$RESULTS/issue10" ONE_RANK=0 PIECES= CHECK=0 bash tools/gpu/issue10.sh
elif [ "$part" = J ]; then
  run 200 exp_ring_host python3 tools/gpu/exp_ring_host.py 64M 128M
  run 300 exp_overlap_host env MODES=traced ROUNDS=11 SHAPES=4x1024 \
    python3 tools/gpu/exp_overlap_host.py
elif [ "$part" = L ]; then
  run 330 issue10 env OUT="$RESULTS/issue10" ONE_RANK=0 PIECES= CHECK=0 bash tools/gpu/issue10.sh
  run 220 overlap python3 -m distlab.overlap_bench --links nvlink,host --shapes 4x1024 \
    --rounds 15 --iters 5 --out "$RESULTS/overlap"
elif [ "$part" = M ]; then
  run 500 overlap python3 -m distlab.overlap_bench --links nvlink,host --shapes 16x1024,4x1024 \
    --rounds 21 --iters 5 --out "$RESULTS/overlap"
elif [ "$part" = N ]; then
  run 200 overlap python3 -m distlab.overlap_bench --links nvlink,host --shapes 4x1024 \
    --rounds 21 --iters 5 --out "$RESULTS/overlap"
  run 150 gpu_tiers python3 -m pytest -q -rfEs -p no:cacheprovider -m "gpu or multigpu" \
    tests/test_dp.py tests/test_overlap.py tests/exercises
  nbval 08_overlap:120
elif [ "$part" = O ]; then
  run 200 exp_profile_dp python3 tools/gpu/exp_profile_dp.py
elif [ "$part" = P ]; then
  for link in nvlink host; do
    run 150 "exp_sentinel_$link" env MODES=traced ROUNDS=21 SHAPES=4x1024 \
      VARIANTS="naive,DDP,bucketed handles,bucketed sentinel" \
      $([ $link = host ] && echo NCCL_P2P_DISABLE=1) python3 tools/gpu/exp_overlap_host.py
  done
elif [ "$part" = K ]; then
  n=$(python3 -c "import torch; print(torch.cuda.device_count())")
  run 90 ring_check python3 -m distlab.ring_bench --check --backend nccl -n "$n"
  for g in "" --graph; do
    run 80 "ring_bench$g" python3 -m distlab.ring_bench --backend nccl -n "$n" -b 64M -e 1G \
      -f 2 $g --out "$RESULTS/ring_bench$g"
  done
  if [ -x /tmp/nt/all_reduce_perf ]; then
    mkdir -p "$RESULTS/nccl-tests"
    NH=$(python3 -c "import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])" 2>/dev/null)
    for op in all_reduce all_gather reduce_scatter broadcast reduce sendrecv; do
      LD_LIBRARY_PATH="$NH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 60 \
        /tmp/nt/${op}_perf -b 8 -e 1G -f 4 -g "$n" -w 10 -n 50 > "$RESULTS/nccl-tests/${op}_perf.txt" 2>&1
    done
  fi
  run 120 bench_nccl python3 -m distlab.bench -n "$n" --backend nccl -b 8 -e 1G -f 4 -w 10 -i 50 \
    -r 3 --api nccl --nccl-tests "$RESULTS/nccl-tests" --out "$RESULTS/bench-nccl"
  run 240 gpu_tests python3 -m pytest -q -rfEs -p no:cacheprovider -m "gpu or multigpu" \
    tests/test_ring.py tests/test_bench.py tests/test_nccl_raw.py tests/test_dp.py \
    tests/test_overlap.py tests/exercises
else
  run 200 issue15 env OUT="$RESULTS/issue15" bash tools/gpu/issue15.sh
  run 170 issue16 env OUT="$RESULTS/issue16" bash tools/gpu/issue16.sh
  run 120 exercises_gpu python3 -m pytest -q -rs -p no:cacheprovider -m "gpu or multigpu" \
    tests/exercises tests/test_launch.py tests/test_nccl_raw.py
  run 100 grade_00_04 python3 -m distlab.grade solutions/00_setup.ipynb solutions/04_data_parallel.ipynb
  run 120 nbval_01_03 python3 -m pytest -q -p no:cacheprovider --nbval --nbval-current-env \
    solutions/01_primitives.ipynb solutions/02_parameter_server.ipynb solutions/03_ring_allreduce.ipynb
fi
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/gpu-$part.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
fi

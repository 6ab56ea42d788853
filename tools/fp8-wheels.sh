#!/usr/bin/env bash
# The torchao wheel for lab 10's FP8 section and the acceptance check `fp8`, for a GPU machine
# without internet (torch 2.11, Python 3.12), beside the wheels of ../shared/tools/device-prep.sh.
# Run from the project root on a machine with internet: it adds torchao 0.17.0, the release built
# for torch 2.11 (torchao's compatibility table; ABI-stable from torch 2.11 on; no runtime
# dependencies), to .whl/ (ignored by git). On the GPU machine, the preamble of device-prep.sh
# installs it with the rest:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site:$PWD/lib NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# then: python3 -m distlab.acceptance --only fp8 --out docs/results
set -euo pipefail
TORCHAO=${TORCHAO:-0.17.0}
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl "torchao==$TORCHAO"
ls .whl | grep -i torchao

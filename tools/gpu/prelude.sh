# Source from the repository root on a GPU machine with torch, CUDA and cupy but no
# jupyter stack and no internet (the wheels that machine lacks travel in .whl/, made by
# ../shared/tools/device-prep.sh). Keeps NVLink multicast off: the GPUs may be shared.
if [ -d .whl ] && ! python3 -c "import nbformat, nbval" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/lib${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -x .ncclt/build.sh ] && [ ! -x /tmp/nt/all_reduce_perf ]; then
  bash .ncclt/build.sh > /tmp/ncclt-build.txt 2>&1 || echo "nccl-tests did not build: /tmp/ncclt-build.txt"
fi
nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"

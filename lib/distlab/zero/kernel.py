"""The sharded AdamW update as one CUDA kernel (cupy ``RawKernel``), launched over this
rank's shard only: the course material's kernel, made right.

The material offsets each rank's threads by ``rank * (total / world)`` (integer
division) and guards only ``idx >= total``. Two things go wrong whenever the world
size does not divide the buffer, or the grid is rounded up to whole blocks:

* the last ``total % world`` elements belong to no rank: never updated;
* a rank's spare threads of its last block run on into the next rank's shard, and two
  ranks update the same elements (with different moments).

:func:`material_indices` replays that index arithmetic in Python and
:func:`kernel_indices` ours, so both can be checked on a machine without a GPU. Here the
shard is ``shard_range(total, rank, world)`` (``torch.tensor_split``'s pieces), the
guard is the shard's own length, the weights and gradients are the whole flat buffers
and the moments hold the shard only.

Memory traffic: :data:`BYTES_PER_PARAM` = 28 bytes per fp32 parameter, read weight,
gradient, momentum and variance (16 B), write weight, momentum and variance (12 B).
The update does ~15 flops per 28 bytes: memory-bound on any GPU, so its speed is its
achieved bandwidth against the device's.

cupy is imported when a kernel is first built, so this module imports anywhere.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from distlab.shards import shard_range

BYTES_PER_PARAM = 28
BLOCK = 256

SOURCE = r"""
extern "C" __global__
void adamw_shard(float* __restrict__ param, const float* __restrict__ grad,
                 float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                 long long start, long long count, float beta1, float beta2, float eps,
                 float decay, float step_size, float inv_sqrt_bc2)
{
    // i: the element's index in this rank's shard; one thread per element
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;              // the shard's own end, not the buffer's
    long long idx = start + i;           // start = shard_range(total, rank, world)[0]
    float g = grad[idx];
    float m = exp_avg[i];
    m = m + (1.0f - beta1) * (g - m);                  // m <- beta1 m + (1 - beta1) g
    float v = beta2 * exp_avg_sq[i] + (1.0f - beta2) * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    float denom = sqrtf(v) * inv_sqrt_bc2 + eps;       // sqrt(v / (1 - beta2^t)) + eps
    param[idx] = param[idx] * decay - step_size * m / denom;   // decay = 1 - lr wd
}
"""


def kernel_indices(total: int, rank: int, world_size: int, block: int = BLOCK, *,
                   shard_range=shard_range) -> np.ndarray:
    """The elements :data:`SOURCE`'s threads update on ``rank``, launched with
    ``ceil(count / block)`` blocks over its shard ``shard_range(total, rank, world_size)``
    (default: the library's; lab 05 passes its own)."""
    start, end = shard_range(total, rank, world_size)
    count = end - start
    threads = np.arange(-(-count // block) * block)
    return start + threads[threads < count]


def material_indices(total: int, rank: int, world_size: int, block: int = BLOCK) -> np.ndarray:
    """The elements the course material's kernel updates on ``rank``: threads offset by
    ``rank * (total // world_size)``, launched over ``ceil((total // world_size) /
    block)`` blocks, guarded by ``idx < total`` only."""
    per_rank = total // world_size
    idx = np.arange(-(-per_rank // block) * block) + rank * per_rank
    return idx[idx < total]


def coverage(indices_of, total: int, world_size: int, block: int = BLOCK) -> np.ndarray:
    """How many ranks update each element, given ``indices_of(total, rank, world,
    block)``: all ones when the shards tile the buffer."""
    return sum(np.bincount(indices_of(total, rank, world_size, block), minlength=total)
               for rank in range(world_size))


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise ImportError("the AdamW kernel needs cupy on a CUDA machine: pip install "
                          "'distlab[gpu]' (cupy-cuda13x; cupy-cuda12x for CUDA 12 builds of "
                          "torch)") from e
    return cupy


_compiled = {}


def _kernel():
    cupy = _cupy()
    device = cupy.cuda.Device().id
    if device not in _compiled:
        _compiled[device] = cupy.RawKernel(SOURCE, "adamw_shard")
    return _compiled[device]


class ShardAdamW:
    """AdamW on this rank's shard of flat fp32 CUDA buffers with the kernel.

    ``param`` and ``grad``: the whole flat buffers (every rank holds them whole in
    stage 1); ``start, end``: this rank's shard (``shard_range``). The moments are
    allocated for the shard only. :meth:`step` launches one kernel on torch's current
    stream; hyperparameters as ``torch.optim.AdamW``'s."""

    def __init__(self, param: torch.Tensor, grad: torch.Tensor, start: int, end: int,
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        for name, t in (("param", param), ("grad", grad)):
            if t.device.type != "cuda" or t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous float32 CUDA tensor, got "
                                 f"{t.dtype} on {t.device}")
        if not 0 <= start <= end <= param.numel() or grad.numel() != param.numel():
            raise ValueError(f"the shard [{start}, {end}) must lie in both buffers of "
                             f"{param.numel()} and {grad.numel()} elements")
        cupy = _cupy()
        self.param, self.grad, self.start, self.count = param, grad, start, end - start
        self.exp_avg = torch.zeros(self.count, device=param.device)
        self.exp_avg_sq = torch.zeros(self.count, device=param.device)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.steps = 0
        self._arrays = [cupy.from_dlpack(t) for t in (param, grad, self.exp_avg,
                                                      self.exp_avg_sq)]

    def step(self) -> None:
        if self.count == 0:
            return
        cupy = _cupy()
        self.steps += 1
        beta1, beta2 = self.betas
        bc1, bc2 = 1 - beta1 ** self.steps, 1 - beta2 ** self.steps
        stream = torch.cuda.current_stream(self.param.device)
        with cupy.cuda.Device(self.param.device.index), \
                cupy.cuda.ExternalStream(stream.cuda_stream):
            _kernel()((-(-self.count // BLOCK),), (BLOCK,), (
                *self._arrays, np.int64(self.start), np.int64(self.count), np.float32(beta1),
                np.float32(beta2), np.float32(self.eps),
                np.float32(1 - self.lr * self.weight_decay), np.float32(self.lr / bc1),
                np.float32(1 / math.sqrt(bc2))))

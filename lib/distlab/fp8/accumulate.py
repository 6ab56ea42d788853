"""An FP8 matrix product's accumulator, emulated on the CPU (DeepSeek-V3's technical
report, section 3.3.2, "Increasing Accumulation Precision").

DeepSeek-V3 measured the FP8 GEMMs of H800 GPUs keeping about 14 bits of their
accumulator, with a maximum relative error near 2 % for random matrices at an inner
dimension K = 4096, and fixed it by copying the partial sums to FP32 registers every
N_C = 128 elements of K. :func:`limited_matmul` emulates that width: the products
(exact: two FP8 significands multiply into 8 bits) are added one element of K at a time,
the running sum rounded after each addition to ``bits`` bits after its leading one (to
nearest, or toward zero: the report does not say which); with ``promote_every``, that
limited sum restarts every so many elements and is added into a float32 accumulator.
What it emulates is the accumulator's width, not the tensor core's order of summation,
which the report does not give either. Leading dimensions of ``a`` and ``b`` are a batch.
"""
from __future__ import annotations

import torch


ROUNDINGS = {"nearest": torch.round, "zero": torch.trunc}


def round_significand(x: torch.Tensor, bits: int, rounding: str = "nearest") -> torch.Tensor:
    """``x`` rounded to a value with ``bits`` bits after its leading one, exponent
    unlimited: to the nearest (ties to even) or toward zero (``rounding``)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {sorted(ROUNDINGS)}, got {rounding!r}")
    m, e = torch.frexp(x)                     # x = m · 2^e, 0.5 <= |m| < 1
    step = 2.0 ** (bits + 1)
    return torch.ldexp(ROUNDINGS[rounding](m * step) / step, e)


def limited_matmul(a: torch.Tensor, b: torch.Tensor, bits: int = 14,
                   promote_every: int | None = None, rounding: str = "nearest") -> torch.Tensor:
    """``a @ b`` (float64 result; ``a`` (..., M, K), ``b`` (..., K, N)) summed along K in
    order in an accumulator of ``bits`` bits after the leading one; with
    ``promote_every``, that accumulator's value goes into a float32 sum and restarts every
    ``promote_every`` elements of K."""
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"inner dimensions differ: {tuple(a.shape)} @ {tuple(b.shape)}")
    a, b = a.double(), b.double()
    shape = torch.broadcast_shapes(a.shape[:-1], b.shape[:-2] + (1,)) + b.shape[-1:]
    total = torch.zeros(shape, dtype=torch.float32)
    part = torch.zeros(shape, dtype=torch.float64)
    for k in range(a.shape[-1]):
        part = round_significand(part + a[..., :, k, None] * b[..., None, k, :], bits, rounding)
        if promote_every and (k + 1) % promote_every == 0:
            total, part = total + part.float(), torch.zeros_like(part)
    return (total + part.float()).double() if promote_every else part

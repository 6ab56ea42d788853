"""The two FP8 formats, their range and precision, and how far a cast tensor is from the
original (Micikevicius et al. 2022, "FP8 Formats for Deep Learning"): what every recipe
of :mod:`distlab.fp8` shares.
"""
from __future__ import annotations

import math

import torch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
AMAX_FLOOR = 1e-12  # an all-zero tensor gets a finite scale (its cast is zeros), not inf


def dtype_of(fmt) -> torch.dtype:
    """The torch dtype of ``fmt`` ("e4m3", "e5m2", or one of the two dtypes)."""
    if fmt in FORMATS.values():
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"unknown FP8 format {fmt!r}; choose one of {sorted(FORMATS)} "
                         f"(torch.float8_e4m3fn, torch.float8_e5m2)")
    return FORMATS[fmt]


def describe(fmt) -> dict:
    """Range and precision of ``fmt``, from ``torch.finfo``: the largest value, the
    smallest normal and subnormal ones, the relative step between neighbours (eps, 2^-m
    for m mantissa bits) and the dynamic range in binades (factors of 2)."""
    info = torch.finfo(dtype_of(fmt))
    subnormal = info.tiny * info.eps
    return {"dtype": str(dtype_of(fmt)).removeprefix("torch."), "max": info.max,
            "smallest normal": info.tiny, "smallest subnormal": subnormal, "eps": info.eps,
            "mantissa bits": round(-math.log2(info.eps)),
            "binades": math.log2(info.max / subnormal)}


def sqnr(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB, ``20 log10(‖ref‖ / ‖ref − approx‖)``
    (inf when equal): the measure torchao's float8 tests hold to 20 dB or more."""
    ref, approx = reference.detach().double(), approx.detach().double()
    noise = (ref - approx).norm()
    if noise == 0:
        return math.inf
    return float(20 * torch.log10(ref.norm() / noise))

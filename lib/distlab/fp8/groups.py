"""One FP8 scale per group of a matrix: tensorwise, rowwise, and the fine-grained tiles
and blocks of DeepSeek-V3 (its technical report, section 3.3.2: activations scaled per
1x128 tile, per token and 128 channels; weights per 128x128 block).

A group of ``rows x cols`` elements gets the scale of its own amax. The groups are laid
out as the rows of one matrix and cast rowwise (:func:`distlab.fp8.round_trip` with
``rowwise=True``, or any cast with one scale per row that is passed in), so every
grouping is the same rowwise cast: ``(R, C)`` is tensorwise, ``(1, C)`` rowwise,
``(1, 128)`` DeepSeek-V3's activation tiles and ``(128, 128)`` its weight blocks.
"""
from __future__ import annotations

import torch

from distlab.fp8.scaling import round_trip


def rowwise(m: torch.Tensor, fmt) -> torch.Tensor:
    """Each row of ``m`` as ``fmt`` sees it with a scale of its own (the library's cast)."""
    return round_trip(m, fmt, rowwise=True)


def grouped_round_trip(x: torch.Tensor, rows: int | None, cols: int | None, fmt="e4m3",
                       rowwise_round_trip=rowwise) -> torch.Tensor:
    """The matrix ``x`` (R, C) as ``fmt`` sees it with one scale per ``rows x cols``
    group (None: the whole dimension), groups tiling ``x`` from its corner;
    ``rowwise_round_trip(m, fmt)`` casts each row of ``m`` with its own scale and reads it
    back."""
    if x.dim() != 2:
        raise ValueError(f"x must be a matrix, got shape {tuple(x.shape)}")
    big, wide = x.shape
    r, c = rows or big, cols or wide
    if big % r or wide % c:
        raise ValueError(f"groups of {r} x {c} do not tile a {big} x {wide} matrix")
    groups = x.reshape(big // r, r, wide // c, c).transpose(1, 2).reshape(-1, r * c)
    back = rowwise_round_trip(groups, fmt)
    return back.reshape(big // r, wide // c, r, c).transpose(1, 2).reshape(big, wide)

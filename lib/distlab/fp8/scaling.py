"""FP8 casts: the library's answer to lab 10's ``fp8_linear`` (its dynamic scaling, cast
and dequantization; this module holds only answers, and the grader refuses them while
grading the exercise) and the recipes built from the same pieces (rowwise, delayed, the
sharded amax). What each recipe means, and why a sharded amax is all-reduced with MAX,
is told in :mod:`distlab.fp8`, which re-exports these.
"""
from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from distlab.fp8.formats import AMAX_FLOOR, dtype_of


def amax(x: torch.Tensor, rowwise: bool = False, group=None) -> torch.Tensor:
    """max |x| in float32: one number, or one per row (shape (..., 1)) with ``rowwise``;
    with ``group``, the largest over the group's ranks (all-reduce, MAX), so that every
    rank holds the amax of the whole tensor its shard is part of."""
    a = x.detach().abs().float()
    a = a.amax(dim=-1, keepdim=True) if rowwise else a.amax()
    if group is not None:
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    return a


def scale_for(amax_: torch.Tensor, fmt) -> torch.Tensor:
    """``max_f / amax`` (float32): the scale that puts ``amax`` on the format's largest
    value; an amax of 0 counts as :data:`AMAX_FLOOR`."""
    return (torch.finfo(dtype_of(fmt)).max / amax_.float().clamp(min=AMAX_FLOOR)).float()


def cast(x: torch.Tensor, fmt, scale: torch.Tensor) -> torch.Tensor:
    """``x · scale`` in ``fmt``, saturated at ±max (what falls outside the range becomes
    the largest value, never inf or NaN)."""
    top = torch.finfo(dtype_of(fmt)).max
    return (x.float() * scale).clamp(-top, top).to(dtype_of(fmt))


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor back in float32: ``q / scale``."""
    return q.float() / scale


def quantize(x: torch.Tensor, fmt, rowwise: bool = False,
             group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``x`` cast to ``fmt`` with a dynamic scale from its amax now, one
    per tensor or per row; with ``group``, the amax of the whole tensor that ``x`` is a
    shard of (see :func:`amax`)."""
    scale = scale_for(amax(x, rowwise, group), fmt)
    return cast(x, fmt, scale), scale


def round_trip(x: torch.Tensor, fmt, rowwise: bool = False, group=None) -> torch.Tensor:
    """``x`` as FP8 sees it: quantized (:func:`quantize`) and back in float32."""
    return dequantize(*quantize(x, fmt, rowwise, group))


class DelayedScaling:
    """Delayed scaling for one tensor's successive values (Transformer Engine's recipe):
    each call casts with the scale of the largest amax of the last ``history`` calls,
    then records this tensor's amax (the first call, with no history, uses its own).

    >>> scaler = DelayedScaling("e4m3", history=16)
    >>> q, scale = scaler(x)          # x's amax joins the history after the cast
    """

    def __init__(self, fmt="e4m3", history: int = 16, group=None):
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self.fmt, self.group = dtype_of(fmt), group
        self.amaxes: collections.deque = collections.deque(maxlen=history)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        now = amax(x, group=self.group)
        known = torch.stack(list(self.amaxes)).amax() if self.amaxes else now
        scale = scale_for(known, self.fmt)
        self.amaxes.append(now)
        return cast(x, self.fmt, scale), scale

"""Checks that speak plain words: what the exercise tests and the notebooks show a student
when a tensor is wrong."""
from __future__ import annotations

# torch.testing.assert_close's default (rtol, atol) per dtype, to count the wrong elements
_TOLERANCES = {"float16": (1e-3, 1e-5), "bfloat16": (1.6e-2, 1e-5), "float32": (1.3e-6, 1e-5),
               "float64": (1e-7, 1e-7)}


def expect_close(actual, expected, what: str, rtol: float | None = None,
                 atol: float | None = None) -> None:
    """Assert two tensors match, saying in plain words where and how they differ.

    Tolerances default to torch.testing's for the dtype; integers must match exactly."""
    import torch

    if not isinstance(actual, torch.Tensor):
        raise AssertionError(f"{what}: expected a tensor, got {type(actual).__name__}")
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)}, expected "
                             f"{tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: dtype {actual.dtype}, expected {expected.dtype}")
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError:
        a, e = actual.detach().cpu().flatten(), expected.detach().cpu().flatten()
        if expected.is_floating_point():
            default_rtol, default_atol = _TOLERANCES.get(str(expected.dtype).removeprefix("torch."), (1.3e-6, 1e-5))
            a, e = a.double(), e.double()
            tol_abs = atol if atol is not None else default_atol
            tol_rel = rtol if rtol is not None else default_rtol
            bad = ((a - e).abs() > tol_abs + tol_rel * e.abs()).nonzero().flatten()
        else:  # integers must match exactly (and a double would round those above 2**53)
            bad = (a != e).nonzero().flatten()
        i = int(bad[0]) if len(bad) else 0
        show = (lambda v: f"{v.item():g}") if expected.is_floating_point() else (
            lambda v: str(v.item()))
        raise AssertionError(
            f"{what}: {len(bad)} of {a.numel()} elements are wrong; the first at flat index "
            f"{i} is {show(a[i])} but should be {show(e[i])}") from None

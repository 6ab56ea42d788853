"""Hockney's alpha-beta model of a message's time, ``t(size) = alpha + size / bandwidth``,
fitted to measured rows (those of :mod:`distlab.bench.collectives`, or any objects with ``op``,
``size``, ``seconds``, ``algbw`` and ``busbw``). The plots of :mod:`distlab.viz` draw
the fit from here, without importing the code that measured the rows.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Fit:
    """The alpha-beta (latency-bandwidth) model ``t(size) = alpha + size / bandwidth``.

    Hockney's model; ``bandwidth`` is the algorithm bandwidth the op tends to for large
    messages, ``busbw`` that times the op's bus factor. ``half_size = alpha * bandwidth``
    is the message at which latency and transfer take equal time: below it an op is
    latency-bound, above it bandwidth-bound (it then reaches half its peak algbw).
    """

    op: str
    alpha: float
    bandwidth: float
    busbw: float

    @property
    def half_size(self) -> float:
        return self.alpha * self.bandwidth

    def seconds(self, size):
        return self.alpha + np.asarray(size, dtype=float) / self.bandwidth


def fit(rows) -> Fit:
    """Least-squares alpha-beta fit of one op's rows, in relative error (each size
    weighs the same, small messages included, instead of the largest dominating)."""
    ops = {r.op for r in rows}
    if len(ops) != 1 or len(rows) < 2:
        raise ValueError(f"fit one op over at least 2 sizes, got {len(rows)} rows of {ops}")
    size = np.array([r.size for r in rows], dtype=float)
    t = np.array([r.seconds for r in rows])
    design = np.stack([np.ones_like(size), size], axis=1) / t[:, None]
    (alpha, inv_bw), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    bandwidth = 1.0 / inv_bw if inv_bw > 0 else float("inf")
    factor = rows[0].busbw / rows[0].algbw if rows[0].algbw else 0.0
    return Fit(rows[0].op, float(alpha), float(bandwidth), float(bandwidth * factor))


def fits(rows) -> dict[str, Fit]:
    """One fit per op present in ``rows``."""
    by_op: dict[str, list] = {}
    for r in rows:
        by_op.setdefault(r.op, []).append(r)
    return {op: fit(rs) for op, rs in by_op.items() if len(rs) >= 2}

"""The cost of a chunked, pipelined broadcast along a chain of K ranks (lab 01's
``pipelined_broadcast``, :mod:`distlab.collectives.broadcast`), and its fit to measured
times.

Step model (lecture 14 of the source; each step moves one chunk over every link at
once, links full duplex): chunk c leaves the root at step c+1 and reaches the end of
the chain, K-1 links away, at step c+K-1, so the last chunk arrives after K+S-2 steps.
With a per-message latency alpha and link bandwidth B:

    T(S) = (K+S-2) * (alpha + N/(S*B)) = (1 + (K-2)/S) * N/B + (K+S-2) * alpha

The lecture keeps only the first term, which falls to N/B as S grows. The second grows
with S: the best chunk count is S* = sqrt((K-2) * N / (alpha * B)), and with K = 2
chunking cannot help at all.
"""
from __future__ import annotations

import math

import numpy as np


def steps(num_ranks: int, num_chunks: int) -> int:
    """Steps of the chain broadcast: K+S-2 (none on a single rank)."""
    return 0 if num_ranks < 2 else num_ranks + num_chunks - 2


def model_seconds(nbytes: float, num_ranks: int, num_chunks: int, bandwidth: float,
                  latency: float = 0.0) -> float:
    """T = steps * (latency + nbytes / (num_chunks * bandwidth)); latency 0 gives the
    lecture's (1 + (K-2)/S) * N/B."""
    return steps(num_ranks, num_chunks) * (latency + nbytes / (num_chunks * bandwidth))


def best_chunks(nbytes: float, num_ranks: int, bandwidth: float, latency: float) -> int:
    """The S that minimises :func:`model_seconds`: sqrt((K-2) N / (alpha B)), at least 1."""
    if latency <= 0:
        raise ValueError("with no latency more chunks are always better: pass latency > 0")
    best = math.sqrt(max(num_ranks - 2, 0) * nbytes / (latency * bandwidth))
    around = {max(1, math.floor(best)), max(1, math.ceil(best))}
    return min(around, key=lambda s: model_seconds(nbytes, num_ranks, s, bandwidth, latency))


def fit(nbytes: float, num_ranks: int, chunk_counts, seconds) -> tuple[float, float]:
    """(latency, bandwidth) that make :func:`model_seconds` best match measured times
    (least squares in relative error; the model is linear in latency and 1/bandwidth)."""
    s = np.asarray(chunk_counts, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if num_ranks < 2 or len(s) < 2:
        raise ValueError("fit times measured on 2 or more ranks for 2 or more chunk counts")
    n_steps = num_ranks + s - 2
    design = np.stack([n_steps, n_steps * nbytes / s], axis=1) / t[:, None]
    (latency, inv_bw), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    return float(latency), float(1.0 / inv_bw) if inv_bw > 0 else float("inf")

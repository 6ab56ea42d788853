"""Chunked, pipelined broadcast along a ring, over point-to-point calls only.

The K ranks of the group form a chain that starts at the root: root -> root+1 -> ...
-> root+K-1 (group ranks, modulo K). The buffer is cut into S chunks (as
``torch.tensor_split``: the first ``numel % S`` are one element longer). Each rank
receives chunk c from its predecessor and forwards it to its successor while it
receives chunk c+1, so the chain works like a pipeline.

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
import torch
import torch.distributed as dist

from distlab.comm import in_group


def pipelined_broadcast(tensor: torch.Tensor, src: int, num_chunks: int,
                        group=None) -> torch.Tensor | None:
    """In place: every rank of ``group`` ends with the ``tensor`` of rank ``src`` (a
    global rank, as in ``dist.broadcast``). Equals ``dist.broadcast``; point to point
    only. Returns ``tensor``; a rank outside ``group`` returns None at once.

    Step i of a rank in the middle of the chain is one group (``batch_isend_irecv``):
    forward chunk i-1 and receive chunk i. So its calls are issued in pipeline order,
    which NCCL needs: there a rank's calls run in order on one stream, and a rank that
    posted every receive before its first send would forward nothing until the whole
    tensor had arrived. Waiting for a step's calls before the next (to forward chunk
    i-1, it must have arrived) blocks the host on gloo; on NCCL it only orders streams.
    The two ends of the chain only send or only receive, so they post everything at
    once."""
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive integer, got {num_chunks!r}")
    if not in_group(group):
        return None
    if not tensor.is_contiguous():
        raise ValueError("pipelined_broadcast works in place on a contiguous tensor; "
                         "pass tensor.contiguous() and copy the result back")
    ranks = dist.get_process_group_ranks(group) if group is not None else list(
        range(dist.get_world_size()))
    if src not in ranks:
        raise ValueError(f"src={src} is not a rank of the group {ranks}")
    k, start = len(ranks), ranks.index(src)
    pos = (ranks.index(dist.get_rank()) - start) % k  # place in the chain
    prev, succ = ranks[(start + pos - 1) % k], ranks[(start + pos + 1) % k]
    chunks = [c for c in torch.tensor_split(tensor.view(-1), num_chunks) if c.numel()]
    if k == 1:
        return tensor
    if pos == 0:          # the source: every chunk out, in order
        works = [dist.isend(c, succ, group) for c in chunks]
    elif pos == k - 1:    # the end of the chain: every chunk in, in order
        works = [dist.irecv(c, prev, group) for c in chunks]
    else:                 # in between, step i: forward chunk i-1, receive chunk i
        works = []
        for i in range(len(chunks) + 1):
            ops = [dist.P2POp(dist.isend, chunks[i - 1], succ, group)] if i else []
            if i < len(chunks):
                ops.append(dist.P2POp(dist.irecv, chunks[i], prev, group))
            for work in works:  # the previous step's: chunk i-1 is here
                work.wait()
            works = dist.batch_isend_irecv(ops)
    for work in works:
        work.wait()
    return tensor


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

"""Lab 01's answer ``pipelined_broadcast``: a chunked, pipelined broadcast along a ring,
over point-to-point calls only.

The K ranks of the group form a chain that starts at the root: root -> root+1 -> ...
-> root+K-1 (group ranks, modulo K). The buffer is cut into S chunks (as
``torch.tensor_split``: the first ``numel % S`` are one element longer). Each rank
receives chunk c from its predecessor and forwards it to its successor while it
receives chunk c+1, so the chain works like a pipeline; its cost model is
:mod:`distlab.collectives.broadcast_model`.
"""
from __future__ import annotations

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

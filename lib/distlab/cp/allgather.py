"""Context parallelism by all-gather: Llama 3's method (Dubey et al. 2024, "The Llama 3
Herd of Models", section 3.3.2).

Each rank holds its tokens of the sequence (the zigzag layout, chunks r and 2W-1-r, as
Llama 3 cuts it; contiguous works too). Instead of passing K/V blocks around a ring
while computing (Liu et al. 2023), every rank all-gathers the whole sequence's K and V
once per layer and computes attention for its own queries. The all-gather sits on the
critical path; Llama 3 accepts that because with grouped-query attention (Ainslie et al.
2023) K and V are much smaller than Q, and because any mask, such as the document mask
of its long-context data, is easy to apply once a rank holds every key.

Backward, the gradients of K and V are computed for the whole sequence on every rank
and reduce-scattered home (each rank keeps the sum over ranks of its own tokens' dK,
dV): the all-gather's adjoint. Forward and backward each move ``(W-1)/W`` of the whole
sequence's K and V per rank.

:func:`visible` is the mask (causal, document, or both) from the tokens' positions: the
attention uses it, and its count per rank is the work a kernel that skips masked scores
would do.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distlab import comm
from distlab.cp.layout import bounds, positions
from distlab.tp.ops import all_gather_along


def allgather_attention(q, k, v, seq_len: int, group=None, *, causal: bool = False,
                        layout: str = "zigzag", documents: torch.Tensor | None = None):
    """Softmax attention (scale ``1/sqrt(D)``) of this rank's queries over the whole
    sequence, K and V all-gathered once; differentiable. ``q``: this rank's tokens
    (B, H, T_r, D) of a ``seq_len``-token sequence cut by ``layout``; ``k``, ``v``:
    (B, H_kv, T_r, D), H a multiple of H_kv (grouped-query attention: query head h
    reads K/V head ``h // (H / H_kv)``). ``documents``: None, or the document id of each
    of the ``seq_len`` positions (the same on every rank): a query sees only keys of its
    own document. A rank outside ``group`` returns None."""
    if dist.is_initialized() and dist.get_rank(group) < 0:
        return None
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    mine = positions(seq_len, world, rank, layout)
    if q.dim() != 4 or q.shape[2] != mine.numel() or k.shape != v.shape \
            or k.shape[:1] + k.shape[2:] != q.shape[:1] + q.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q must be this rank's (B, H, {mine.numel()}, D) tokens of a "
                         f"{seq_len}-token sequence ({layout}, {world} ranks) and k, v "
                         f"(B, H_kv, {mine.numel()}, D) with H a multiple of H_kv; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    sizes = [sum(b - a for a, b in bounds(seq_len, world, r, layout)) for r in range(world)]
    kv = torch.cat((k, v), dim=-1)
    if world > 1:
        kv = _GatherKV.apply(kv, sizes, group)
    keys = torch.cat([positions(seq_len, world, r, layout) for r in range(world)])
    kk, vv = kv.repeat_interleave(q.shape[1] // k.shape[1], dim=1).split(q.shape[-1], dim=-1)
    # the mask built where attention runs: (T_r, T) elements, seconds on a host at 32K
    mask = visible(mine.to(q.device), keys.to(q.device), causal,
                   None if documents is None else documents.to(q.device))
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)


def visible(queries: torch.Tensor, keys: torch.Tensor, causal: bool,
            documents: torch.Tensor | None = None) -> torch.Tensor | None:
    """(len(queries), len(keys)) bool: which key positions each query position sees
    (None: every one): at or before it under ``causal``, in its document when
    ``documents`` (one id per position of the sequence) is given."""
    mask = None
    if causal:
        mask = keys[None, :] <= queries[:, None]
    if documents is not None:
        same = documents[queries][:, None] == documents[keys][None, :]
        mask = same if mask is None else mask & same
    return mask


class _GatherKV(torch.autograd.Function):
    """Every rank's K/V tokens (dim 2, rank r's ``sizes[r]`` of them) in rank order;
    backward, the sum over ranks of this rank's tokens' gradient (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, kv, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return all_gather_along(kv, 2, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        sizes, longest = ctx.sizes, max(ctx.sizes)
        pieces = [p.movedim(2, 0) for p in grad.split(sizes, dim=2)]
        padded = torch.cat([torch.cat([p, p.new_zeros(longest - p.shape[0], *p.shape[1:])])
                            for p in pieces])
        out = padded.new_empty(longest, *padded.shape[1:])
        comm.reduce_scatter_into(out, padded.contiguous(), group=ctx.group)
        mine = sizes[dist.get_rank(ctx.group)]
        return out[:mine].movedim(0, 2).contiguous(), None, None

"""Ring attention: the library's answer to lab 10's exercise ``ring_attention`` (this
module holds only that answer; the grader refuses it while grading the exercise).
Everyone else imports it from :mod:`distlab.cp`.

Ring attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers
for Near-Infinite Context"): each rank keeps its queries, and the K/V blocks travel the
ring of lab 03 (received from the previous rank, sent to the next), W-1 exchanges
forward. Each block's partial softmax is merged into the running one exactly by its
log-sum-exp (the online softmax of Milakov & Gimelshein 2018 and FlashAttention, Dao et
al. 2022): with ``m = logaddexp(l_a, l_b)``, ``o = o_a e^(l_a - m) + o_b e^(l_b - m)``.
Blocks are split into the chunks of the layout (:mod:`distlab.cp.layout`), and a chunk
pair that the causal mask hides entirely is skipped: that skipping is what the zigzag
layout balances.

Backward (FlashAttention's, per block, from the saved output and log-sum-exp):
``P = exp(S - lse)``, ``dV += P^T dO``, ``dS = P (dO V^T - rowsum(dO o))``,
``dQ += dS K``, ``dK += dS^T Q`` (times the softmax scale). The K/V blocks travel the
ring again, and each block's dK/dV accumulator travels with it, one step more: after W
steps it is back on the rank that owns the block.
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from distlab.cp.layout import bounds, ring_neighbours


def ring_attention(q, k, v, seq_len: int, group=None, *, causal: bool = False,
                   layout: str = "contiguous", stats: dict | None = None) -> torch.Tensor:
    """Softmax attention of this rank's queries over the whole sequence's keys and values
    (scale ``1/sqrt(D)``), each of ``q, k, v`` this rank's tokens (B, H, T_r, D) of a
    ``seq_len``-token sequence cut by ``layout``; differentiable. ``stats``, when given,
    gets ``"blocks"`` and ``"scores"``: the chunk pairs and score elements computed
    forward, and ``"compute_s"``: the seconds spent computing them, forward and then
    backward added (waits for blocks excluded)."""
    world, rank = _place(group)
    mine = bounds(seq_len, world, rank, layout)
    local = sum(b - a for a, b in mine)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4 or t.shape[2] != local:
            raise ValueError(f"ring_attention: {name} must be this rank's (B, H, {local}, D) "
                             f"tokens of a {seq_len}-token sequence ({layout} layout, "
                             f"{world} ranks), got shape {tuple(t.shape)}")
    return _RingAttention.apply(q, k, v, seq_len, group, causal, layout, stats)


def _place(group):
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _pieces(seq_len, world, rank, layout):
    """(offset in the rank's tokens, start, stop) of each non-empty chunk it holds."""
    out, offset = [], 0
    for a, b in bounds(seq_len, world, rank, layout):
        if b > a:
            out.append((offset, a, b))
        offset += b - a
    return out


def _pairs(seq_len, world, rank, src, layout, causal):
    """The chunk pairs (query chunk of ``rank``, key chunk of ``src``) the mask does not
    hide entirely, each as (q slice, k slice, mask needed)."""
    for qo, qa, qb in _pieces(seq_len, world, rank, layout):
        for ko, ka, kb in _pieces(seq_len, world, src, layout):
            if causal and ka >= qb:
                continue                       # every key after every query
            yield (slice(qo, qo + qb - qa), slice(ko, ko + kb - ka),
                   (torch.arange(qa, qb)[:, None] < torch.arange(ka, kb)[None, :])
                   if causal and kb - 1 > qa else None)


def _scores(q, k, mask, scale):
    s = (q @ k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(mask.to(s.device), float("-inf"))


def _merge(out, lse, o_b, l_b):
    """Two partial softmaxes over disjoint keys, merged by their log-sum-exps."""
    new = torch.logaddexp(lse, l_b)
    ref = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows no key reached
    return out * torch.exp(lse - ref)[..., None] + o_b * torch.exp(l_b - ref)[..., None], new


def _exchange(sends, recvs, prev, nxt, group):
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in sends if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, prev, group) for t in recvs if t.numel()]
    return dist.batch_isend_irecv(ops) if ops else []


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq_len, group, causal, layout, stats):
        world, rank = _place(group)
        prev, nxt = ring_neighbours(group) if world > 1 else (0, 0)
        acc = torch.promote_types(q.dtype, torch.float32)
        scale = 1.0 / math.sqrt(q.shape[-1])
        qa = q.to(acc)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack((k, v)).contiguous()
        blocks = scores = 0
        busy = 0.0
        for step in range(world):
            src = (rank - step) % world
            works, incoming = [], None
            if step < world - 1:               # the next block crosses while this one computes
                n = sum(b - a for a, b in bounds(seq_len, world, (src - 1) % world, layout))
                incoming = kv.new_empty((2, *k.shape[:2], n, k.shape[-1]))
                works = _exchange([kv], [incoming], prev, nxt, group)
            start = time.perf_counter()
            for qs, ks, mask in _pairs(seq_len, world, rank, src, layout, causal):
                s = _scores(qa[:, :, qs], kv[0][:, :, ks].to(acc), mask, scale)
                l_b = torch.logsumexp(s, -1)
                p = torch.exp(s - torch.where(torch.isinf(l_b), 0, l_b)[..., None])
                o_b = p @ kv[1][:, :, ks].to(acc)
                out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], o_b, l_b)
                blocks, scores = blocks + 1, scores + s.shape[-2] * s.shape[-1]
            busy += time.perf_counter() - start
            for work in works:
                work.wait()
            if incoming is not None:
                kv = incoming
        if stats is not None:
            stats.update(blocks=blocks, scores=scores, compute_s=busy)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (seq_len, group, causal, layout, stats)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        seq_len, group, causal, layout, stats = ctx.args
        world, rank = _place(group)
        prev, nxt = ring_neighbours(group) if world > 1 else (0, 0)
        acc, scale = out.dtype, 1.0 / math.sqrt(q.shape[-1])
        qa, do = q.to(acc), grad.to(acc)
        delta = (do * out).sum(-1)             # rowsum(dO o)
        base = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
        dq = torch.zeros_like(qa)
        kv = torch.stack((k, v)).contiguous()
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        busy = 0.0
        for step in range(world):
            src = (rank - step) % world
            start = time.perf_counter()
            for qs, ks, mask in _pairs(seq_len, world, rank, src, layout, causal):
                kb, vb = kv[0][:, :, ks].to(acc), kv[1][:, :, ks].to(acc)
                p = torch.exp(_scores(qa[:, :, qs], kb, mask, scale) - base[:, :, qs, None])
                dkv[1][:, :, ks] += p.transpose(-1, -2) @ do[:, :, qs]
                ds = p * (do[:, :, qs] @ vb.transpose(-1, -2) - delta[:, :, qs, None])
                dq[:, :, qs] += (ds @ kb) * scale
                dkv[0][:, :, ks] += (ds.transpose(-1, -2) @ qa[:, :, qs]) * scale
            busy += time.perf_counter() - start
            if world == 1:
                break
            # the accumulators go on with their block; after the last step, home
            nsrc = (src - 1) % world
            n = sum(b - a for a, b in bounds(seq_len, world, nsrc, layout))
            next_dkv = dkv.new_empty((2, *k.shape[:2], n, k.shape[-1]))
            sends, recvs = [dkv.contiguous()], [next_dkv]
            if step < world - 1:
                next_kv = kv.new_empty(next_dkv.shape)
                sends, recvs = [kv, *sends], [next_kv, *recvs]
            for work in _exchange(sends, recvs, prev, nxt, group):
                work.wait()
            dkv = next_dkv
            if step < world - 1:
                kv = next_kv
        if stats is not None:
            stats["compute_s"] = stats.get("compute_s", 0.0) + busy
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None)

"""The parameter server as its first papers built it: sharded, and stale.

* :func:`sharded_sgd_step`: every rank of the group is the server of one piece of the
  flat parameters, cut as ``torch.tensor_split`` cuts them (Dean et al. 2012, §4.1: each
  shard stores and updates its fraction of the parameters; Li et al., OSDI 2014, §4.3:
  each server node holds ranges of keys). Push: rank r sends piece j of its gradient to
  rank j, which sums the pieces it owns (a reduce-scatter, as direct exchanges). Pull:
  each owner sends its updated piece to every rank (an all-gather). Every rank sends,
  and receives, 2(W-1)/W·N bytes of an N-byte model, where one server moves (W-1)·N.
* :func:`stale_sgd`: SGD whose gradients are computed on parameters ``tau`` steps old,
  the worst case that Li et al.'s bounded delay (§3.5) admits and the staleness that
  Downpour SGD's asynchrony creates; ``tau = 0`` is synchronous SGD.
"""
from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from distlab.comm import in_group


def _exchange(sends, recvs, group) -> None:
    """``sends`` and ``recvs``: (tensor, global peer) pairs, posted as one batch and waited
    for (no blocking send that could deadlock); empty tensors travel nowhere."""
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs if t.numel()]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


@torch.no_grad()
def sharded_sgd_step(params, grads, lr: float, group=None) -> None:
    """In place on every rank of ``group``: ``params -= lr * mean over ranks of grads``,
    each piece of the flat parameters updated by its owner (rank j of the group owns
    piece j of ``torch.tensor_split(flat, W)``). ``grads`` are left as they were; a rank
    outside ``group`` returns at once."""
    if not in_group(group):
        return
    params, grads = list(params), list(grads)
    if len(params) != len(grads) or any(p.shape != g.shape for p, g in zip(params, grads)):
        raise ValueError("pass one gradient per parameter, of the parameter's shape")
    members = dist.get_process_group_ranks(group or dist.group.WORLD)
    me, world = members.index(dist.get_rank()), len(members)
    others = [(j, peer) for j, peer in enumerate(members) if j != me]
    flat_grads = torch.tensor_split(torch.cat([g.reshape(-1) for g in grads]), world)
    mine = flat_grads[me].clone()
    arrived = {j: torch.empty_like(mine) for j, _ in others}
    _exchange([(flat_grads[j], peer) for j, peer in others],               # push
              [(arrived[j], peer) for j, peer in others], group)
    for j, _ in others:
        mine += arrived[j]
    flat = torch.cat([p.reshape(-1) for p in params])
    pieces = torch.tensor_split(flat, world)
    pieces[me].sub_(mine, alpha=lr / world)                                 # update, my shard
    _exchange([(pieces[me], peer) for _, peer in others],                   # pull
              [(pieces[j], peer) for j, peer in others], group)
    for p, new in zip(params, torch.split(flat, [p.numel() for p in params])):
        p.copy_(new.view_as(p))


def stale_sgd(loss_fn, params, batches, steps: int, lr: float, tau: int) -> list[float]:
    """``steps`` steps of SGD from ``params`` (not modified) in one process, the workers'
    mean gradient at step t taken on the parameters of step max(t - tau, 0): ``batches``
    is one ``(x, y)`` per worker, ``loss_fn(params, x, y)`` a worker's loss. Returns the
    loss of the parameters in force at each step, on all the workers' data."""
    if tau < 0:
        raise ValueError(f"tau is a delay in steps: >= 0, got {tau}")
    history = collections.deque([[p.detach().clone() for p in params]], maxlen=tau + 1)
    losses = []
    for _ in range(steps):
        current = history[-1]
        seen = [p.clone().requires_grad_() for p in history[0]]   # step max(t - tau, 0)
        with torch.no_grad():
            losses.append(sum(loss_fn(current, x, y) for x, y in batches).item() / len(batches))
        total = [torch.zeros_like(p) for p in current]
        for x, y in batches:
            for s, g in zip(total, torch.autograd.grad(loss_fn(seen, x, y), seen)):
                s += g
        history.append([p - lr / len(batches) * s for p, s in zip(current, total)])
    return losses

"""Lab 05's answers ``zero2_step`` and the core of ``ZeRO3Unit`` (flat buffers sharded
over the ranks, freed and gathered back), AdamW on flat tensors, and the gradient
reduction of lab 09's ``distributed_train_step``: what :mod:`distlab.zero` is built
from. Students use them through :mod:`distlab.zero.flat` and :mod:`distlab.zero`, whose
documentation gives their contracts.

Shards follow ``torch.tensor_split`` (:func:`distlab.shards.shard_range`). NCCL and gloo
move equal pieces only, so a collective sees a buffer in its *padded* form
(:class:`Layout`): ``N`` rows of ``ceil(numel / N)`` elements, row ``r`` holding shard
``r`` followed by a zero where the shard is one element short; when ``N`` divides
``numel`` the padded form is the buffer itself.

:func:`adamw_` is AdamW (Loshchilov & Hutter 2019, "Decoupled weight decay
regularization") on flat tensors, computed as ``torch.optim.AdamW`` computes it.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.comm import all_gather_into, in_group, reduce_scatter_into
from distlab.shards import shard_range


class Layout:
    """``numel`` elements over ``world_size`` ranks: the shards, and the padded form that
    equal-size collectives need (``world_size`` rows of :attr:`chunk` elements)."""

    def __init__(self, numel: int, world_size: int):
        self.numel, self.world_size = numel, world_size
        self.chunk = -(-numel // world_size)
        self.long = numel % world_size          # shards one element longer than the rest

    @property
    def even(self) -> bool:
        return self.long == 0

    @property
    def padded_numel(self) -> int:
        return self.chunk * self.world_size

    def bounds(self, rank: int) -> tuple[int, int]:
        return shard_range(self.numel, rank, self.world_size)

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        """The padded form of ``flat`` (``flat`` itself when the shards are equal)."""
        if self.even:
            return flat
        out = flat.new_empty(self.padded_numel)
        rows, k, c = out.view(self.world_size, self.chunk), self.long, self.chunk
        rows[:k].copy_(flat[:k * c].view(k, c))
        rows[k:, :c - 1].copy_(flat[k * c:].view(self.world_size - k, c - 1))
        rows[k:, c - 1].zero_()
        return out

    def unpad(self, padded: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the shards of a padded buffer into ``out`` (``numel`` elements)."""
        if padded.data_ptr() == out.data_ptr():
            return out
        if self.even:
            return out.copy_(padded)
        rows, k, c = padded.view(self.world_size, self.chunk), self.long, self.chunk
        out[:k * c].view(k, c).copy_(rows[:k])
        out[k * c:].view(self.world_size - k, c - 1).copy_(rows[k:, :c - 1])
        return out


class Pending:
    """An issued collective: :meth:`wait` waits for it and returns its finished result.
    The work handle is dropped before the result is finished, so the collective's input
    buffer (which the handle keeps alive) is freed before ``finish`` allocates."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def wait(self):
        work, self.work = self.work, None
        if work is not None:
            work.wait()
        del work
        return self.finish()


def reduce_scatter_mean(flat: torch.Tensor, layout: Layout, group=None,
                        async_op: bool = False) -> Pending:
    """This rank's shard of the mean of ``flat`` over the group: one reduce-scatter of
    the padded buffer (SUM, then a division: ``ReduceOp.AVG`` is not offered by every
    backend and version). Its message is ``padded_numel`` elements (nccl-tests counts
    a reduce-scatter by its input)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world == 1:                     # one rank: its gradient is the mean, no collective
        return Pending(None, lambda: flat)
    start, end = layout.bounds(rank)
    out = flat.new_empty(layout.chunk)
    work = reduce_scatter_into(out, layout.pad(flat), op=dist.ReduceOp.SUM, group=group,
                               async_op=async_op)
    return Pending(work if async_op else None, lambda: out[:end - start].div_(world))


def all_reduce_mean(flat: torch.Tensor, group=None, async_op: bool = False) -> Pending:
    """The mean of ``flat`` over the group, in place: one all-reduce (SUM, then the same
    division as :func:`reduce_scatter_mean`, so a replicated gradient is rounded as a
    sharded one and as :class:`distlab.dp.DataParallel`'s)."""
    world = dist.get_world_size(group)
    if world == 1:
        return Pending(None, lambda: flat)
    work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return Pending(work if async_op else None, lambda: flat.div_(world))


def all_gather_shards(shard: torch.Tensor, layout: Layout, out: torch.Tensor, group=None,
                      async_op: bool = False) -> Pending:
    """Fill ``out`` (``numel`` elements) with every rank's shard; ``shard`` is this
    rank's and must not share memory with ``out``."""
    if layout.world_size == 1:
        return Pending(None, lambda: out.copy_(shard))
    if layout.even:
        chunk, target = shard, out
    else:
        chunk = shard.new_zeros(layout.chunk)
        chunk[:shard.numel()] = shard
        target = out.new_empty(layout.padded_numel)
    work = all_gather_into(target, chunk, group=group, async_op=async_op)
    return Pending(work if async_op else None, lambda: layout.unpad(target, out))


def source_rank(group) -> int:
    """The global rank of ``group``'s first rank (the source of construction-time
    broadcasts)."""
    return dist.get_global_rank(group, 0) if group is not None else 0


class FlatParams:
    """Parameters of one ZeRO unit in one flat buffer, sharded over ``group`` (or, with
    ``replicate=True``, kept whole on every rank of it).

    - :attr:`full`: every element in the compute dtype; the parameters' ``.data`` are
      views into it. :meth:`free` releases its memory (the views stay, with no storage)
      and :meth:`gather` all-gathers it back from the master shards.
    - :attr:`master`: this rank's shard, fp32 (or the parameters' dtype when wider).
    - :attr:`pieces`: per parameter, an ``nn.Parameter`` viewing the part of
      :attr:`master` that belongs to it (empty where this rank holds none of it), with
      the parameter's ``requires_grad``. An optimizer over the pieces keeps state for
      this rank's shard only.

    At construction the group's first rank broadcasts its values, so every rank starts
    from the same weights.

    ``replicate=True``: every rank's "shard" is the whole buffer, each piece the whole
    parameter with its shape, :meth:`gather` a local cast, and :func:`reduce_grads` an
    all-reduce (mean).
    """

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], group=None,
                 compute_dtype: torch.dtype | None = None, replicate: bool = False):
        if not named_params:
            raise ValueError("a ZeRO unit needs at least one parameter")
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        kinds = {(p.dtype, p.device) for p in self.params}
        if len(kinds) > 1:
            raise ValueError(f"the parameters of one flat buffer must share a dtype and a "
                             f"device, got {sorted(map(str, kinds))}; convert the model with "
                             f".to(dtype, device) first")
        param_dtype, self.device = next(iter(kinds))
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.params))]
        self.replicated = replicate
        self.numel = sum(self.numels)
        self.layout = Layout(self.numel, 1 if replicate else self.world_size)
        self.start, self.end = self.layout.bounds(0 if replicate else self.rank)
        self.dtype = compute_dtype or param_dtype
        self.master_dtype = torch.promote_types(param_dtype, torch.float32)
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in self.params])
            dist.broadcast(flat, src=source_rank(group), group=group)
            self.master = flat[self.start:self.end].to(self.master_dtype, copy=True)
            self.full = flat.to(self.dtype)
        for p, off, n in zip(self.params, self.offsets, self.numels):
            p.data = self.full[off:off + n].view(p.shape)
        self.pieces, self.ranges = [], []  # ranges: (lo, hi) within each flattened parameter
        for p, off, n in zip(self.params, self.offsets, self.numels):
            lo, hi = max(off, self.start), min(off + n, self.end)
            lo, hi = (lo, hi) if lo < hi else (off, off)
            self.ranges.append((lo - off, hi - off))
            local = self.master[lo - self.start:hi - self.start] if hi > lo else \
                self.master[:0]
            if replicate:
                local = local.view(p.shape)
            self.pieces.append(nn.Parameter(local, requires_grad=p.requires_grad))

    # ------------------------------------------------------------------ parameters

    @property
    def allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def free(self) -> None:
        """Release the full buffer (the parameters' views keep their shapes)."""
        self.full.untyped_storage().resize_(0)

    def gather(self, async_op: bool = False) -> Pending:
        """All-gather the master shards, cast to the compute dtype, into :attr:`full`."""
        if not self.allocated:
            self.full.untyped_storage().resize_(self.numel * self.full.element_size())
        with torch.no_grad():
            return all_gather_shards(self.master.to(self.dtype, copy=True), self.layout,
                                     self.full, self.group, async_op)

    def gather_master(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, in the master dtype, by name (a collective)."""
        return self.unflatten(self.gather_flat(self.master))

    def gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole buffer whose shard on this rank is ``shard`` (a collective)."""
        out = shard.new_empty(self.numel)
        all_gather_shards(shard.clone(), self.layout, out, self.group).wait()
        return out

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: flat[off:off + n].view(p.shape).clone() for name, p, off, n in
                zip(self.names, self.params, self.offsets, self.numels)}

    # ------------------------------------------------------------------- gradients

    def take_averaged_grads(self) -> None:
        """The pieces' gradients from the parameters' own, already averaged over the
        ranks (by :class:`distlab.dp.DataParallel` or torch's DDP)."""
        with torch.no_grad():
            for p, piece, (lo, hi) in zip(self.params, self.pieces, self.ranges):
                if p.grad is not None:
                    piece.grad = p.grad.reshape(-1)[lo:hi].to(
                        self.master_dtype, copy=True).view(piece.shape)

    def clear_piece_grads(self) -> None:
        for piece in self.pieces:
            piece.grad = None


def adamw_(param: torch.Tensor, grad: torch.Tensor, state: dict, lr: float = 1e-3,
           betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
           weight_decay: float = 1e-2) -> None:
    """One AdamW step on ``param`` in place; ``state`` holds ``step``, ``exp_avg`` and
    ``exp_avg_sq`` (created at the first step, like ``param``)."""
    beta1, beta2 = betas
    if not state:
        state.update(step=0, exp_avg=torch.zeros_like(param),
                     exp_avg_sq=torch.zeros_like(param))
    state["step"] += 1
    t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
    param.mul_(1 - lr * weight_decay)
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(eps)
    param.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))


def zero2_step(flat_params: torch.Tensor, flat_grads: torch.Tensor, state: dict, group=None,
               lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-2) -> None:
    """One ZeRO-2 step on flat buffers, in place: ``flat_grads``' mean over the group,
    reduce-scattered, drives AdamW on this rank's shard of ``flat_params``
    (``torch.tensor_split``'s pieces), whose moments ``state`` holds; then every rank's
    ``flat_params`` gets every updated shard (all-gather). A rank that is not a member
    of ``group`` returns at once and touches nothing."""
    if not in_group(group):
        return None
    layout = Layout(flat_params.numel(), dist.get_world_size(group))
    start, end = layout.bounds(dist.get_rank(group))
    grad = reduce_scatter_mean(flat_grads, layout, group).wait()
    shard = flat_params[start:end]
    adamw_(shard, grad, state, lr, betas, eps, weight_decay)
    all_gather_shards(shard.clone(), layout, flat_params, group).wait()
    return None

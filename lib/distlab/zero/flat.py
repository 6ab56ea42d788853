"""Lab 05's answers at the core of ``zero2_step`` and ``ZeRO3Unit``: flat buffers sharded
over the ranks, and the two collectives ZeRO runs on them, what :mod:`distlab.zero`'s
stages and lab 09's train step are built from.

A ZeRO rank owns a contiguous *shard* of a flat buffer of ``numel`` elements, split as
``torch.tensor_split`` splits (:func:`distlab.shards.shard_range`): with
``numel = q·N + k`` the first ``k`` ranks own ``q + 1`` elements, the others ``q``.

``Layout(numel, world_size)``
    ``numel`` elements over ``world_size`` ranks. ``bounds(rank)``: that rank's
    ``(start, end)``; ``chunk``: ``ceil(numel / world_size)``, the length of the equal
    pieces a collective moves; ``padded_numel``: ``chunk · world_size``; ``even``: every
    shard has ``chunk`` elements.

``reduce_scatter_mean(flat, layout, group=None, async_op=False) -> Pending``
    This rank's shard (``layout.bounds(rank)``, in ``flat``'s dtype) of the element-wise
    mean of ``flat`` (``layout.numel`` elements) over the ranks of ``group``: one
    reduce-scatter of ``layout.padded_numel`` elements (none on a group of one rank,
    where ``flat`` itself is the result). ``flat`` must be kept unchanged until the
    result is waited for.

``all_gather_shards(shard, layout, out, group=None, async_op=False) -> Pending``
    Fills ``out`` (``layout.numel`` elements) with every rank's shard; ``shard`` is this
    rank's and must not share memory with ``out``. One all-gather of
    ``layout.padded_numel`` elements.

``Pending.wait()`` (:mod:`distlab.zero.collective`)
    Waits for the collective (when issued with ``async_op=True``) and returns its
    finished result (the shard; ``out``). Call it once.

``FlatParams(named_params, group=None, compute_dtype=None, replicate=False)``
    One ZeRO *unit*: the parameters ``named_params`` (``[(name, parameter)]``, one dtype
    and device) viewed into one flat buffer, sharded over ``group``. At construction the
    group's first rank broadcasts its values (a collective: every rank of the group
    builds its units in the same order). Attributes: ``names``, ``params``, ``numels``,
    ``offsets`` (each parameter's place in the buffer), ``numel``, ``layout`` (a
    ``Layout``), ``start``/``end`` (this rank's shard), ``group``, ``dtype`` (the compute
    dtype), ``master_dtype`` (fp32, or wider);

    - ``full``: every element in the compute dtype; the parameters' ``.data`` are views
      into it;
    - ``master``: this rank's shard of the buffer, in ``master_dtype`` (a copy, not a
      view of ``full``): the weights an optimizer updates;
    - ``pieces``: per parameter, an ``nn.Parameter`` viewing the part of ``master`` that
      belongs to it (empty where this rank holds none of it); ``ranges``: each piece's
      ``(lo, hi)`` within its flattened parameter;
    - ``gather(async_op=False) -> Pending``: all-gather ``master``, cast to ``dtype``,
      into ``full`` (so into the parameters);
    - ``gather_master()``: every parameter whole, in ``master_dtype``, by name (a
      collective).

    ``replicate=True`` keeps the unit whole on every rank: the shard is the whole
    buffer, each piece the whole parameter with its shape.

NCCL and gloo move equal pieces only, so a collective sees a buffer in its *padded* form
(:class:`Layout`): ``N`` rows of ``ceil(numel / N)`` elements, row ``r`` holding shard
``r`` followed by a zero where the shard is one element short; when ``N`` divides
``numel`` the padded form is the buffer itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.comm import all_gather_into, reduce_scatter_into
from distlab.shards import shard_range
from distlab.zero.collective import Pending, source_rank


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

"""Where a rank's local tensor sits in the global one: the chunks (offsets and sizes)
that DCP's planner reads, for tensor_split shards, row blocks and flat ranges."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


# ------------------------------------------------------ layouts: local tensor -> global chunks


@dataclass
class _Layout:
    """Where a rank's local tensor lies in the global tensor: ``chunks`` of (global offsets,
    sizes, view), ``view(local)`` being the chunk's contiguous data; ``mesh`` = (group, dim)
    when the layout is DTensor's ``Shard(dim)`` over that group."""

    shape: tuple
    chunks: list = field(default_factory=list)
    mesh: tuple | None = None
    replicated: bool = False   # every rank holds the whole tensor

    @classmethod
    def whole(cls, shape) -> _Layout:
        shape = tuple(shape)
        return cls(shape, [((0,) * len(shape), shape, lambda t: t)], replicated=True)


def _split(shape, dim: int, group) -> _Layout:
    """This rank's ``tensor_split`` piece along ``dim`` over ``group``."""
    from distlab.shards import shard_sizes

    shape = tuple(shape)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = shard_sizes(shape[dim], size)
    offsets = [0] * len(shape)
    offsets[dim] = sum(sizes[:rank])
    local = list(shape)
    local[dim] = sizes[rank]
    chunk = -(-shape[dim] // size)
    as_chunk = [max(0, min(chunk, shape[dim] - i * chunk)) for i in range(size)]
    mesh = (group, dim) if sizes == as_chunk else None
    return _Layout(shape, [(tuple(offsets), tuple(local), lambda t: t)], mesh)


def _rows(shape, rows: list[int]) -> _Layout:
    """A local tensor whose rows are the global rows ``rows``: one chunk per run of
    consecutive rows."""
    shape, chunks, start = tuple(shape), [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            a, b = start, i
            chunks.append(((rows[a],) + (0,) * (len(shape) - 1), (b - a,) + shape[1:],
                           lambda t, a=a, b=b: t[a:b]))
            start = i
    return _Layout(shape, chunks)


def _rects(shape: tuple, lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """The flat range ``[lo, hi)`` of a row-major tensor of ``shape`` as rectangles
    (offsets, sizes), in order, each contiguous in the flat order."""
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(lo, inner), divmod(hi, inner)
    if r0 == r1:
        return [((r0,) + o, (1,) + s) for o, s in _rects(shape[1:], c0, c1)]
    out = []
    if c0:
        out += [((r0,) + o, (1,) + s) for o, s in _rects(shape[1:], c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + tuple(shape[1:])))
    if c1:
        out += [((r1,) + o, (1,) + s) for o, s in _rects(shape[1:], 0, c1)]
    return out


def _flat_range(shape, lo: int, hi: int) -> _Layout:
    """A 1-D local tensor holding elements ``[lo, hi)`` of the flattened global tensor."""
    shape, chunks = tuple(shape), []
    for offsets, sizes in _rects(shape, lo, hi):
        start = sum(o * math.prod(shape[i + 1:]) for i, o in enumerate(offsets)) - lo
        n = math.prod(sizes)
        chunks.append((offsets, sizes, lambda t, s=start, n=n, z=sizes: t[s:s + n].view(z)))
    return _Layout(shape, chunks)


def _flat_range_of(outer: _Layout, local_shape, lo: int, hi: int) -> _Layout:
    """A 1-D local tensor holding elements ``[lo, hi)`` of the flattened local tensor of
    ``local_shape``, itself laid out in the global tensor by ``outer`` (a tensor-parallel
    shard, whose chunks tile the local tensor along dim 0 in order): ZeRO over TP. Each
    rectangle of the flat range is cut where ``outer``'s chunks meet and moved to its
    global offsets."""
    local_shape, chunks = tuple(local_shape), []
    starts, row = [], 0
    for _offsets, sizes, _view in outer.chunks:      # each outer chunk's first local row
        starts.append(row)
        row += sizes[0] if sizes else 1
    for offsets, sizes in _rects(local_shape, lo, hi):
        flat = sum(o * math.prod(local_shape[i + 1:]) for i, o in enumerate(offsets)) - lo
        if not local_shape:
            chunks.append(((), (), lambda t, s=flat: t[s:s + 1].view(())))
            continue
        r0, r1 = offsets[0], offsets[0] + sizes[0]
        width = math.prod(sizes[1:])        # elements per row of the rectangle
        for (g, _s, _v), a, (_, csizes, _) in zip(outer.chunks, starts, outer.chunks):
            top, bottom = max(r0, a), min(r1, a + csizes[0])
            if top >= bottom:
                continue
            where = (g[0] + top - a,) + tuple(go + o for go, o in zip(g[1:], offsets[1:]))
            size = (bottom - top,) + tuple(sizes[1:])
            start, n = flat + (top - r0) * width, (bottom - top) * width
            chunks.append((where, size, lambda t, s=start, n=n, z=size: t[s:s + n].view(z)))
    return _Layout(tuple(outer.shape), chunks)


@dataclass
class _Local:
    """A placeholder in the DCP state dict: ``tensor`` (this rank's) laid out by ``layout``."""

    tensor: torch.Tensor
    layout: _Layout


"""Flat buffers sharded over the ranks, and the collectives ZeRO runs on them: the API
that :mod:`distlab.zero`'s stages and lab 09's train step are built from. Their code is
in :mod:`distlab.reference.zero` (it answers lab 05's exercises: read it after grading).

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

``Pending.wait()``
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
"""
from distlab.reference.zero import (FlatParams, Layout, Pending, all_gather_shards,
                                    reduce_scatter_mean, source_rank)

__all__ = ["FlatParams", "Layout", "Pending", "all_gather_shards", "reduce_scatter_mean",
           "source_rank"]

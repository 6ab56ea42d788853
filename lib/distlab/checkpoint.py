"""Sharded checkpoints on PyTorch's distributed checkpoint (DCP, ``torch.distributed.checkpoint``):
every rank writes its own shards, and a checkpoint saved at one layout loads at another.

    checkpoint.save("ckpt", {"model": model, "optim": opt, "epoch": 3}, step=100)
    step = checkpoint.load("ckpt", {"model": model, "optim": opt, "epoch": None})

Both are collectives over ``group`` (default: every rank). ``state`` maps names to modules,
optimizers, tensors and picklable values; ``load`` fills the modules and optimizers in place
and puts the other values back into ``state``.

**What DCP does.** ``dcp.save`` runs a *planner* on every rank (a local plan: one write item
per tensor chunk, each named by its fully qualified name and its *global offsets*), gathers
the plans on the coordinator (group rank 0), which removes duplicates (a replicated tensor is
written once), checks that each tensor's chunks tile it (no overlap, the whole volume) and
builds the global plan; each rank then writes its items with
``FileSystemWriter`` (one ``__<rank>_*.distcp`` file or more per rank, fsynced), and the
coordinator writes ``.metadata`` last: for each name its global shape, dtype and list of
chunks (offsets, sizes) with where each lies in which file. ``dcp.load`` reads
``.metadata``, and each rank's load planner intersects the chunks it wants (its current
layout, again as global offsets) with the saved ones and reads only those bytes, in place
into the given tensors. So resharding is DCP's: neither side needs to know the other's
layout, only the global offsets of its own chunks.

**How this library's shards are described to DCP.** Every entry is named and shaped as in
the single-process model, under its key in ``state``: ``model.<param>``,
``optim.state.<param>.exp_avg``, ``optim.param_groups...`` (the layout of DCP's own
``get_state_dict``, so either side may be a plain model), plus ``_checkpoint.step``:

* a plain module and a plain optimizer: DCP's helpers ``get_state_dict`` / ``set_state_dict``
  (``torch.distributed.checkpoint.state_dict``), which name the optimizer state by parameter
  name and create an empty optimizer's state before a load;
* :mod:`distlab.tp` layers (``tensor_split`` shards, the first ``n % t`` ranks one row longer):
  a ``DTensor`` with ``Shard(dim)`` on a 1-D ``DeviceMesh`` over the TP group when the
  split equals ``torch.chunk``'s (the only uneven split DTensor knows: ceil-sized pieces,
  the last short), else a ``ShardedTensor`` (``torch.distributed._shard``) whose shard
  metadata gives each piece's offsets. The fused qkv weight, whose rows are regrouped by
  head, is three chunks per rank (its q, k and v rows): a ``ShardedTensor`` too;
* :class:`distlab.zero.ShardedOptimizer`: each rank's states cover a range of the flat
  buffer, i.e. a range of each flattened parameter. A range of a row-major tensor is a few
  rectangles (a partial row, whole rows, a partial row), each a contiguous piece of the
  state: a ``ShardedTensor`` with those local shards, at the parameter's full shape;
* :class:`distlab.zero.FullyShardedDataParallel` (ZeRO-2/3): the same rectangles, for its
  fp32 master pieces as the model's weights (under every name of a tied one) and for the
  optimizer's state over them;
* :class:`distlab.pp.Stage`: its module keeps the whole model's names, so each stage
  saves and requests its own subset of the keys.

**Limits found.** ``DTensor.from_local(..., shape=, stride=)`` over ``tensor_split`` pieces
that differ from ``torch.chunk``'s (13 rows on 3 ranks: 5, 4, 4 against 5, 5, 3) is saved
*without an error* but with chunk offsets computed the ``torch.chunk`` way, i.e. a corrupt
checkpoint (a load then fails on a size mismatch, or reads wrong rows); hence the
``ShardedTensor`` there, which torch marks as deprecated in favour of DTensor (its
FutureWarnings are silenced here) but which DCP still reads and writes natively. Not covered:
ZeRO over a tensor-parallel model (a 2-D layout); models from ``tp.parallelize_with_torch``
(refused: their DTensors hold qkv's rows in head order); the fp32 master weights of a
low-precision model under ShardedOptimizer (the model's own weights are saved; after a load
the masters are refreshed from them).

**Atomicity: where DCP's guarantees stop.** DCP fsyncs its files and writes ``.metadata``
through a temporary file and a rename, so a directory without ``.metadata`` is never taken
for a checkpoint. But it writes in place: saving again into a directory overwrites the data
files while the old ``.metadata`` still describes them, and it deletes the old
``.metadata`` before the rename, so a crash mid-save destroys the previous checkpoint; it
also keeps no notion of "the latest checkpoint". :func:`save` therefore writes into a fresh
sibling directory ``step-N.tmp-<random>``; once DCP returns (all ranks' files written and
the metadata with them) group rank 0 fsyncs it, renames it to ``step-N`` (a new name:
``os.replace`` of a directory is atomic on POSIX), fsyncs the parent, and only then moves the
``latest`` pointer, a file written to a temporary name, fsynced and ``os.replace``-d.
:func:`load` reads through ``latest``. A crash at any point leaves ``latest`` naming a
complete checkpoint; an abandoned ``*.tmp-*`` directory is removed by the next save that
commits. Not guarded: two concurrent saves into one root, and file systems whose rename
is not atomic (some object stores).
"""
from __future__ import annotations

import math
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["POINTER", "latest", "load", "save"]

POINTER = "latest"              # the file, in a checkpoint root, naming the current checkpoint
_META = "_checkpoint"           # the entry holding the step
_COMMITTED = re.compile(r"^step-(\d+)(?:\.(\d+))?$")
_TMP = re.compile(r"^step-\d+\.tmp-[0-9a-f]+$")


# ------------------------------------------------------------------------------- the API


def save(path: str | os.PathLike, state: dict, *, step: int, keep: int | None = None,
         group=None) -> str:
    """Save ``state`` as checkpoint ``step`` under the root directory ``path``, atomically
    (see the module); return the committed directory. A collective over ``group``.

    ``keep``: how many committed checkpoints to keep (the oldest go), None for all."""
    _check_state(state)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive int or None, got {keep!r}")
    import torch.distributed.checkpoint as dcp

    root = os.fspath(path)
    tmp = _agree(group, lambda: _fresh_dir(root, step))
    sd = _build(state, None)
    sd[_META] = {"step": step}
    _realize(sd, group)
    with _quiet():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True, overwrite=False),
                 process_group=group)
    # dcp.save returns on every rank once the coordinator (group rank 0) wrote .metadata
    return _agree(group, lambda: _commit(root, tmp, step, keep))


def load(path: str | os.PathLike, state: dict, *, group=None) -> int | None:
    """Load the checkpoint ``path`` names (a root written by :func:`save`, read through its
    ``latest`` pointer, or one DCP checkpoint directory) into ``state``, at whatever
    layout ``state`` has now; return its step (None for a DCP checkpoint that
    :func:`save` did not write). A collective over ``group``.

    Raises FileNotFoundError when there is no checkpoint there, and ValueError naming the
    key when the checkpoint lacks an entry or holds it at another shape."""
    _check_state(state)
    import torch.distributed.checkpoint as dcp

    directory = _agree(group, lambda: _resolve(os.fspath(path)))
    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    try:
        sd = _build(state, saved)
        if f"{_META}.step" in saved:              # absent from a DCP checkpoint of others
            sd[_META] = {"step": -1}
        problem = _mismatch(sd, saved, directory)
    except Exception as exc:  # told to the other ranks, which would wait in a collective
        sd, problem = None, exc
    problems = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    problem = next((p for p in problems if p is not None), None)
    if isinstance(problem, Exception):
        raise problem
    if problem:
        raise ValueError(problem)
    placeholders = _realize(sd, group)
    with _quiet():
        dcp.load(sd, storage_reader=dcp.FileSystemReader(directory), process_group=group)
    _apply(state, sd, placeholders)
    return int(sd[_META]["step"]) if _META in sd else None


def latest(path: str | os.PathLike) -> str | None:
    """The checkpoint directory ``path``'s ``latest`` pointer names (``path`` itself when it
    is a DCP checkpoint directory), or None when there is none."""
    root = os.fspath(path)
    pointer = os.path.join(root, POINTER)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            return os.path.join(root, f.read().strip())
    if os.path.isfile(os.path.join(root, ".metadata")):
        return root
    return None


# ------------------------------------------------------------------- commit and pointer


def _fresh_dir(root: str, step: int) -> str:
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f"step-{step}.tmp-{secrets.token_hex(4)}")
    os.mkdir(tmp)
    return tmp


def _commit(root: str, tmp: str, step: int, keep: int | None) -> str:
    if not os.path.isfile(os.path.join(tmp, ".metadata")):
        raise RuntimeError(f"DCP returned but wrote no .metadata in {tmp}")
    _fsync_dir(tmp)
    name, k = f"step-{step}", 1
    while os.path.exists(os.path.join(root, name)):   # never replace a committed checkpoint
        k += 1
        name = f"step-{step}.{k}"
    final = os.path.join(root, name)
    os.replace(tmp, final)
    _fsync_dir(root)
    pointer = os.path.join(root, f".{POINTER}.tmp-{secrets.token_hex(4)}")
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, os.path.join(root, POINTER))
    _fsync_dir(root)
    _prune(root, name, keep)
    return final


def _prune(root: str, current: str, keep: int | None) -> None:
    """Remove abandoned ``*.tmp-*`` directories and, with ``keep``, the oldest checkpoints."""
    committed = []
    for entry in os.listdir(root):
        if _TMP.match(entry):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
        elif (m := _COMMITTED.match(entry)) and entry != current:
            committed.append((int(m.group(1)), int(m.group(2) or 1), entry))
    if keep is not None:
        for *_, entry in sorted(committed)[:max(0, len(committed) - (keep - 1))]:
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _resolve(path: str) -> str:
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}: the path does not exist")
    directory = latest(path)
    if directory is None:
        raise FileNotFoundError(f"no checkpoint at {path!r}: it has neither a {POINTER!r} "
                                f"pointer (written by distlab.checkpoint.save) nor a DCP "
                                f".metadata file")
    if not os.path.isfile(os.path.join(directory, ".metadata")):
        raise FileNotFoundError(f"{path!r}'s {POINTER!r} names {directory!r}, which holds no "
                                f"complete checkpoint (no .metadata)")
    return directory


def _agree(group, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on group rank 0 and return its result on every rank (its exception, raised
    on every rank, when it fails)."""
    out = [None]
    if dist.get_rank(group) == 0:
        try:
            out = [("ok", fn())]
        except Exception as exc:  # sent to the other ranks, then raised everywhere
            out = [("error", exc)]
    dist.broadcast_object_list(out, src=dist.get_global_rank(group, 0) if group is not None
                               else 0, group=group)
    kind, value = out[0]
    if kind == "error":
        raise value
    return value


@contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*")
        yield


def _check_state(state) -> None:
    if not isinstance(state, dict) or not all(isinstance(k, str) and k for k in state):
        raise TypeError("state must be a dict with string keys, such as {'model': model, "
                        "'optim': optimizer}")
    if _META in state:
        raise ValueError(f"{_META!r} is reserved for the checkpoint's own entries")
    if any("." in k for k in state):
        raise ValueError(f"state keys may not contain '.' (DCP joins nested names with it): "
                         f"{[k for k in state if '.' in k]}")


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


@dataclass
class _Local:
    """A placeholder in the DCP state dict: ``tensor`` (this rank's) laid out by ``layout``."""

    tensor: torch.Tensor
    layout: _Layout


# --------------------------------------------------------------- the state dict for DCP


def _build(state: dict, saved: dict | None) -> dict:
    """The nested state dict DCP saves (``saved`` None) or loads in place (``saved``: the
    checkpoint's metadata by name): modules and optimizers by their parameters' names,
    this library's shards as :class:`_Local` placeholders for :func:`_realize`."""
    from torch.optim import Optimizer

    modules = {k: _unwrap(v) for k, v in state.items() if isinstance(v, nn.Module)}
    sd = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            sd[key] = _module_dcp(modules[key])
        elif isinstance(value, Optimizer):
            sd[key] = _optim_dcp(value, modules[_owner(value, modules, key)], key, saved)
        else:
            sd[key] = value
    return sd


def _unwrap(module: nn.Module) -> nn.Module:
    """The model inside a wrapper whose one child is ``.module`` (pp.Stage, DataParallel),
    but not inside FullyShardedDataParallel, whose pieces are what it holds."""
    from distlab.zero import FullyShardedDataParallel

    while isinstance(getattr(module, "module", None), nn.Module) and \
            [n for n, _ in module.named_children()] == ["module"] and \
            not isinstance(module, FullyShardedDataParallel):
        module = module.module
    return module


def _owner(optim, modules: dict, key: str) -> str:
    ids = {id(p) for g in optim.param_groups for p in g["params"]}
    for name, module in modules.items():
        if ids <= {id(p) for p in module.parameters()}:
            return name
    raise ValueError(f"state[{key!r}] is an optimizer over parameters of no module in state: "
                     f"put the model in the same dict (its parameter names key the "
                     f"optimizer's state)")


def _names(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> its name (a tied parameter: its first name, as DCP's helpers)."""
    names = {}
    for name, p in module.named_parameters():
        names.setdefault(id(p), name)
    return names


def _is_tp(module: nn.Module) -> bool:
    """Whether the module holds :mod:`distlab.tp` layers (laid out here, not by DCP)."""
    from distlab.tp.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from distlab.tp.parallelize import ParallelSelfAttention

    for m in module.modules():
        if isinstance(m, ParallelSelfAttention) and not isinstance(m.qkv, ColumnParallelLinear):
            raise NotImplementedError(
                "a model from tp.parallelize_with_torch keeps qkv's rows regrouped by head in "
                "its DTensors, which DCP would save in that order; checkpoint the model made "
                "by tp.tensor_parallel instead")
    return any(isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))
               for m in module.modules())


def _fsdp_pieces(fsdp) -> list:
    """(every name of the parameter, its piece, layout) for each parameter of a
    FullyShardedDataParallel: the piece is this rank's range of its flat buffer, in the
    master dtype (a tied parameter lies in one unit, under each of its names)."""
    where = {id(m): name for name, m in fsdp.module.named_modules(remove_duplicate=False)}
    out = []
    for unit in fsdp._units:
        flat = unit.flat
        for p, piece, (lo, hi), slots in zip(flat.params, flat.pieces, flat.ranges, unit.slots):
            names = [f"{where[id(owner)]}.{attr}".lstrip(".") for owner, attr in slots]
            out.append((names, piece, _flat_range(p.shape, lo, hi)))
    return out


def _module_dcp(module: nn.Module) -> dict:
    from distlab.zero import FullyShardedDataParallel

    if isinstance(module, FullyShardedDataParallel):
        sd = {name: _Local(piece.detach(), layout)
              for names, piece, layout in _fsdp_pieces(module) for name in names}
        sd.update({n: b.detach() for n, b in module.module.named_buffers()})
        return sd
    if not _is_tp(module):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(module)
    layouts = _tp_layouts(module)
    return {name: _Local(t.detach(), layouts.get(name) or _Layout.whole(t.shape))
            for name, t in module.state_dict(keep_vars=True).items()}


def _tp_layouts(module: nn.Module) -> dict[str, _Layout]:
    """Each tensor-parallel parameter's layout in the single-process model, by name."""
    from distlab.shards import shard_sizes
    from distlab.tp.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from distlab.tp.parallelize import ParallelSelfAttention

    out = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        if isinstance(m, ParallelSelfAttention):  # qkv's rows regrouped by head
            size, rank = dist.get_world_size(m.qkv.group), dist.get_rank(m.qkv.group)
            n, sizes = m.qkv.out_features, shard_sizes(m.qkv.out_features, size)
            start = sum(sizes[:rank])
            rows = m.qkv_order[start:start + sizes[rank]].tolist()
            for name, p in m.qkv.named_parameters(recurse=False):
                out[f"{dot}qkv.{name}"] = _rows((n,) + tuple(p.shape[1:]), rows)
        elif isinstance(m, ColumnParallelLinear) and f"{dot}weight" not in out:
            out[f"{dot}weight"] = _split((m.out_features, m.in_features), 0, m.group)
            if m.bias is not None:
                out[f"{dot}bias"] = _split((m.out_features,), 0, m.group)
        elif isinstance(m, RowParallelLinear):
            out[f"{dot}weight"] = _split((m.out_features, m.in_features), 1, m.group)
        elif isinstance(m, VocabParallelEmbedding):
            out[f"{dot}weight"] = _split((m.num_embeddings, m.weight.shape[1]), 0, m.group)
    return out


def _optim_entries(optim, module: nn.Module):
    """(the optimizer holding the tensors, [(name, key tensor, layout)], param groups as
    names) for the optimizers this module lays out itself."""
    from distlab.zero import FullyShardedDataParallel, ShardedOptimizer

    names = _names(module)
    groups = [[names[id(p)] for p in g["params"]] for g in optim.param_groups]
    if isinstance(module, FullyShardedDataParallel):
        layouts = {id(piece): layout for _, piece, layout in _fsdp_pieces(module)}
        return optim, [(names[id(p)], p, layouts[id(p)])
                       for g in optim.param_groups for p in g["params"]], groups
    if isinstance(optim, ShardedOptimizer):
        if _is_tp(module):
            raise NotImplementedError("checkpointing ZeRO over a tensor-parallel model (a 2-D "
                                      "layout) is not supported")
        return optim.optim, [(names[id(p)], piece, _flat_range(p.shape, lo, hi))
                             for unit in optim.flat_params()
                             for p, piece, (lo, hi) in zip(unit.params, unit.pieces,
                                                           unit.ranges)], groups
    layouts = _tp_layouts(module)
    return optim, [(names[id(p)], p, layouts.get(names[id(p)]) or _Layout.whole(p.shape))
                   for g in optim.param_groups for p in g["params"]], groups


def _native(optim, module: nn.Module) -> bool:
    """Whether DCP's own helpers handle this optimizer (a plain one on a plain model)."""
    from distlab.zero import FullyShardedDataParallel, ShardedOptimizer

    return not isinstance(optim, ShardedOptimizer) and not _is_tp(module) and \
        not isinstance(module, FullyShardedDataParallel)


def _optim_dcp(optim, module: nn.Module, key: str, saved: dict | None) -> dict:
    """The optimizer's state as ``{"state": {name: {k: ...}}, "param_groups": [...]}``, the
    format of DCP's ``get_optimizer_state_dict``. To load, the destinations are made from
    what the checkpoint holds (a fresh optimizer has no state yet): per-element entries
    laid out like the parameter's state, the others (a step count) whole."""
    if _native(optim, module):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(module, optim)
    local, entries, groups = _optim_entries(optim, module)
    out = {"state": {}, "param_groups": [
        {**{k: v for k, v in g.items() if k != "params"}, "params": names}
        for g, names in zip(local.param_groups, groups)]}
    for name, param, layout in entries:
        have = local.state.get(param, {})
        if saved is None:
            if have:
                out["state"][name] = {k: _Local(v.detach(), layout) if _per_element(v, param)
                                      else v for k, v in have.items()}
            continue
        prefix, dest = f"{key}.state.{name}.", {}
        for entry, md in saved.items():
            k = entry[len(prefix):]
            if not entry.startswith(prefix) or "." in k:
                continue
            size, value = getattr(md, "size", None), have.get(k)
            if size is None:                       # not a tensor: DCP reads it as bytes
                dest[k] = value
            elif tuple(size) == layout.shape:
                if not _per_element(value, param):
                    value = torch.zeros_like(param, dtype=md.properties.dtype
                                             if not param.is_floating_point() else param.dtype)
                dest[k] = _Local(value.detach(), layout)
            else:
                if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(size):
                    value = torch.zeros(tuple(size), dtype=md.properties.dtype,
                                        device=param.device)
                dest[k] = value
        if dest:
            out["state"][name] = dest
    return out


def _per_element(value, param) -> bool:
    """A state entry with one value per element of the (local) parameter: a moment."""
    return isinstance(value, torch.Tensor) and value.shape == param.shape


def _walk(d: dict, prefix: str = ""):
    """(DCP's flat name, leaf) of a nested dict, as DCP joins the keys (lists left whole)."""
    for k, v in d.items():
        if isinstance(v, dict):
            yield from _walk(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


_DROP = object()


def _map(d: dict, fn, prefix: str = "") -> None:
    """Replace each leaf ``v`` of ``d`` in place by ``fn(name, v)`` (dropped: ``_DROP``)."""
    for k, v in list(d.items()):
        if isinstance(v, dict):
            _map(v, fn, f"{prefix}{k}.")
        else:
            d[k] = fn(f"{prefix}{k}", v)
            if d[k] is _DROP:
                del d[k]


def _realize(sd: dict, group) -> dict[str, _Local]:
    """Replace each :class:`_Local` by what DCP understands: the tensor itself when whole,
    a DTensor on the layout's mesh, else a ShardedTensor (the chunks of every rank gathered
    over ``group`` in one collective, for its shard metadata). Returns the placeholders by
    name."""
    placeholders = {k: v for k, v in _walk(sd) if isinstance(v, _Local)}
    sharded = {k: [(o, s) for o, s, _ in v.layout.chunks] for k, v in placeholders.items()
               if not v.layout.replicated and v.layout.mesh is None}
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (dist.get_rank(), sharded), group=group)

    def real(name, v):
        if not isinstance(v, _Local):
            return v
        if not v.layout.chunks:
            # nothing here (a ZeRO rank without a piece of this parameter): DCP's planner
            # drops a ShardedTensor without local shards, and its load planner then takes
            # the request for an old (torch <= 2.3) checkpoint's; leave the entry out
            return _DROP
        if v.layout.replicated:
            return v.tensor
        if v.layout.mesh is not None:
            return _dtensor(v)
        return _sharded_tensor(name, v, everyone, group)

    _map(sd, real)
    return placeholders


_meshes: dict = {}


def _dtensor(v: _Local):
    """``DTensor.from_local`` with the global shape and stride given (an uneven torch.chunk
    split leaves the local shapes unequal)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    group, dim = v.layout.mesh
    group = group if group is not None else dist.group.WORLD
    key = (id(group), v.tensor.device.type)
    if key not in _meshes or _meshes[key][0] is not group:  # (holding the group keeps its id)
        _meshes[key] = (group, DeviceMesh.from_group(group, v.tensor.device.type))
    shape = torch.Size(v.layout.shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(v.tensor, _meshes[key][1], [Shard(dim)], run_check=False,
                              shape=shape, stride=stride)


def _sharded_tensor(name: str, v: _Local, everyone: list, group):
    """A ShardedTensor of this rank's chunks; its global shard metadata lists every distinct
    chunk of the group once (replicas hold the same chunks; DCP writes each once)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (ShardedTensorMetadata,
                                                                  TensorProperties)

    me, device = dist.get_rank(), str(v.tensor.device)
    mine = {(tuple(o), tuple(s)) for o, s, _ in v.layout.chunks}
    holders: dict = {}
    for rank, table in everyone:
        for o, s in table.get(name, []):
            holders.setdefault((tuple(o), tuple(s)), rank)
    shards = [ShardMetadata(list(o), list(s), f"rank:{me if (o, s) in mine else r}/{device}")
              for (o, s), r in holders.items()]
    local = []
    for o, s, view in v.layout.chunks:
        piece = view(v.tensor)
        if not piece.is_contiguous():
            raise RuntimeError(f"{name}: the chunk at {o} is not contiguous in this rank's "
                               f"tensor")
        local.append(Shard(piece, ShardMetadata(list(o), list(s), f"rank:{me}/{device}")))
    meta = ShardedTensorMetadata(shards, torch.Size(v.layout.shape),
                                 TensorProperties(dtype=v.tensor.dtype))
    with _quiet():
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            local, meta, process_group=group)


# ----------------------------------------------------------------------------- loading


def _mismatch(sd: dict, saved: dict, directory: str) -> str | None:
    """What the checkpoint lacks of what ``sd`` asks for, or holds at another shape."""
    missing, shapes = [], []
    for name, value in _walk(sd):
        if isinstance(value, _Local):
            shape = value.layout.shape
        elif isinstance(value, torch.Tensor):
            shape = tuple(value.shape)
        else:   # a value DCP pickles: under its name, or flattened below it (a dict, a list)
            if name not in saved and not any(k.startswith(f"{name}.") for k in saved):
                missing.append(name)
            continue
        md = saved.get(name)
        if md is None:
            missing.append(name)
        elif tuple(getattr(md, "size", shape)) != tuple(shape):
            shapes.append(f"{name} is {tuple(md.size)} in the checkpoint but {tuple(shape)} "
                          f"here")
    if shapes:
        return (f"checkpoint {directory} does not fit this state: " + "; ".join(shapes[:8]) +
                (f" (and {len(shapes) - 8} more)" if len(shapes) > 8 else ""))
    if missing:
        entries = "entry" if len(missing) == 1 else "entries"
        return (f"checkpoint {directory} lacks {len(missing)} {entries} this state asks for: "
                + ", ".join(missing[:8]) +
                (f" (and {len(missing) - 8} more)" if len(missing) > 8 else ""))
    return None


def _apply(state: dict, sd: dict, placeholders: dict[str, _Local]) -> None:
    """After ``dcp.load``: DCP's helpers set plain modules and optimizers, the optimizers
    laid out here get their loaded local tensors, other values go back into ``state``.
    (Tensor-parallel and FSDP modules were loaded in place: FSDP all-gathers the loaded
    master shards at its next forward.)"""
    from torch.optim import Optimizer

    from distlab.zero import FullyShardedDataParallel

    modules = {k: _unwrap(v) for k, v in state.items() if isinstance(v, nn.Module)}
    for key, module in modules.items():
        if not _is_tp(module) and not isinstance(module, FullyShardedDataParallel):
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(module, sd[key])
    for key, value in state.items():
        if isinstance(value, Optimizer):
            module = modules[_owner(value, modules, key)]
            if _native(value, module):
                from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

                set_optimizer_state_dict(module, value, sd[key])
            else:
                _load_optim(value, module, key, sd[key], placeholders)
        elif not isinstance(value, nn.Module):
            state[key] = sd[key]


def _load_optim(optim, module: nn.Module, key: str, loaded: dict,
                placeholders: dict[str, _Local]) -> None:
    """Give the optimizer over this rank's tensors (a ShardedOptimizer's local one) the
    loaded state, and refresh ZeRO's master weights from the loaded parameters."""
    from distlab.zero import ShardedOptimizer

    local, entries, groups = _optim_entries(optim, module)
    theirs = [list(g["params"]) for g in loaded["param_groups"]]
    if groups != theirs:
        raise ValueError(f"the checkpoint's optimizer has param groups of {theirs}, this one "
                         f"of {groups}: build it over the same parameters and groups")
    index = {id(p): i for i, p in enumerate(p for g in local.param_groups for p in g["params"])}
    state = {}
    for name, param, _ in entries:
        prefix = f"{key}.state.{name}."
        got = dict(loaded["state"].get(name, {}))
        got.update({k[len(prefix):]: v.tensor for k, v in placeholders.items()
                    if k.startswith(prefix) and "." not in k[len(prefix):]})
        if got:
            state[index[id(param)]] = got
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in loaded["param_groups"]]
    current = local.state_dict()["param_groups"]
    local.load_state_dict({"state": state, "param_groups": [
        {**g, **h, "params": g["params"]} for g, h in zip(current, hyper)]})
    if isinstance(optim, ShardedOptimizer):
        for g, h in zip(optim.param_groups, hyper):
            g.update(h)
        with torch.no_grad():
            for unit in optim.flat_params():
                unit.master.copy_(unit.full[unit.start:unit.end])

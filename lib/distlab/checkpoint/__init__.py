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
* a :class:`distlab.train.Trainer` (``{"trainer": trainer}``, the composed step): each
  bucket's master pieces and AdamW moments are flat ranges of the parameters' TP shards;
  each range is cut into rectangles of the shard (as ShardedOptimizer's), and each
  rectangle moved to where the shard lies in the whole tensor (row or column offsets,
  qkv's rows regrouped by head), under the single-process names, a weight tied across
  stages under both of its names. So a run saved at one (dp, tp, pp) resumes at any
  other. A trainer with a loss scaler (fp16) saves its scale, the steps since the scale
  last changed and the steps skipped, so that a resumed run does not start its scale over.

**Limits found.** ``DTensor.from_local(..., shape=, stride=)`` over ``tensor_split`` pieces
that differ from ``torch.chunk``'s (13 rows on 3 ranks: 5, 4, 4 against 5, 5, 3) is saved
*without an error* but with chunk offsets computed the ``torch.chunk`` way, i.e. a corrupt
checkpoint (a load then fails on a size mismatch, or reads wrong rows); hence the
``ShardedTensor`` there, which torch marks as deprecated in favour of DTensor (its
FutureWarnings are silenced here) but which DCP still reads and writes natively. Not
covered: ShardedOptimizer over a tensor-parallel model (the Trainer's buckets are);
models from ``tp.parallelize_with_torch`` (refused: their DTensors hold qkv's rows in
head order); the fp32 master weights of a
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

import os

import torch
import torch.distributed as dist
from torch import nn

from distlab.checkpoint.commit import (_META, POINTER, _agree, _check_state, _commit, _fresh_dir,
                                       _quiet, _resolve, latest)
from distlab.checkpoint.layouts import _Local
from distlab.checkpoint.state import (_build, _is_tp, _native, _optim_entries, _owner, _realize,
                                      _unwrap, _walk)

__all__ = ["POINTER", "latest", "load", "save"]



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

    from distlab.train import Trainer
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
        elif isinstance(value, Trainer):   # masters and moments were loaded in place
            for bucket in value.buckets:
                bucket.state["step"] = int(sd[key]["adamw_step"])
                bucket.flat.gather().wait()
            scaler = sd[key].get("loss_scaler")
            if scaler is not None:
                value.scaler.scale_value = float(scaler["scale"])
                value.scaler.good_steps = int(scaler["good_steps"])
                value.scaler.skipped = int(scaler["skipped"])
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

"""The state dict handed to DCP: each module, optimizer and layout of the kit written
under its single-process names, as DTensors or ShardedTensors with global offsets."""
from __future__ import annotations


import torch
import torch.distributed as dist
from torch import nn

from distlab.checkpoint.commit import _quiet
from distlab.checkpoint.layouts import (_Layout, _Local, _flat_range, _flat_range_of, _rows,
                                        _split)


# --------------------------------------------------------------- the state dict for DCP


def _build(state: dict, saved: dict | None) -> dict:
    """The nested state dict DCP saves (``saved`` None) or loads in place (``saved``: the
    checkpoint's metadata by name): modules and optimizers by their parameters' names,
    this library's shards as :class:`_Local` placeholders for :func:`_realize`."""
    from torch.optim import Optimizer

    from distlab.train import Trainer

    modules = {k: _unwrap(v) for k, v in state.items() if isinstance(v, nn.Module)}
    sd = {}
    for key, value in state.items():
        if isinstance(value, nn.Module):
            sd[key] = _module_dcp(modules[key])
        elif isinstance(value, Trainer):
            sd[key] = _trainer_dcp(value, loading=saved is not None)
            if value.scaler is not None and (saved is None or f"{key}.loss_scaler.scale" in saved):
                sd[key]["loss_scaler"] = _scaler_state(value.scaler)
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
    master dtype, or the whole parameter in its replicated unit (a tied parameter lies in
    one unit, under each of its names)."""
    where = {id(m): name for name, m in fsdp.module.named_modules(remove_duplicate=False)}
    out = []
    for unit in fsdp._units:
        flat = unit.flat
        for p, piece, (lo, hi), slots in zip(flat.params, flat.pieces, flat.ranges, unit.slots):
            names = [f"{where[id(owner)]}.{attr}".lstrip(".") for owner, attr in slots]
            out.append((names, piece, _Layout.whole(p.shape) if flat.replicated else
                        _flat_range(p.shape, lo, hi)))
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


def _trainer_dcp(trainer, loading: bool) -> dict:
    """A :class:`distlab.train.Trainer` (ZeRO-2 over DP of a tensor-parallel pipeline
    stage): each parameter's master piece as ``model.<name>`` and AdamW's moments over it
    as ``optim.<name>.exp_avg`` / ``.exp_avg_sq``: a flat range of the parameter's TP
    shard, placed in the whole tensor (:func:`_flat_range_of`); a tied parameter saved
    under each of the single-process model's names (stage 0 holds ``tok_emb.weight``,
    the last stage ``head.weight``: either loads either); AdamW's step count whole.
    Loading fills a fresh trainer's masters and moments in place. A trainer with a loss
    scaler also saves the scaler's state (``loss_scaler``, see :func:`_build`)."""
    from distlab.model import GPT

    tp_layouts = _tp_layouts(trainer.model) if trainer.mesh.tp > 1 else {}
    with torch.device("meta"):
        whole = GPT(trainer.model.cfg)
    names_of: dict[int, list[str]] = {}
    for name, p in whole.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    aliases = {n: names for names in names_of.values() for n in names}
    model, optim, steps = {}, {}, 0
    for bucket in trainer.buckets:
        flat, state = bucket.flat, bucket.state
        if loading and not state:            # a fresh trainer: moments to load into
            state.update(step=0, exp_avg=torch.zeros_like(flat.master),
                         exp_avg_sq=torch.zeros_like(flat.master))
        steps = max(steps, state.get("step", 0))
        # no update yet (every step so far skipped by the loss scaler): AdamW's moments
        # are zeros, as a first update would start them
        moments = state if "exp_avg" in state else {
            k: torch.zeros_like(flat.master) for k in ("exp_avg", "exp_avg_sq")}
        for name, p, off, (lo, hi) in zip(flat.names, flat.params, flat.offsets, flat.ranges):
            at = off + lo - flat.start if hi > lo else 0
            layout = _flat_range_of(tp_layouts.get(name) or _Layout.whole(p.shape), p.shape,
                                    lo, hi)
            for alias in ([name] if loading else aliases.get(name, [name])):
                model[alias] = _Local(flat.master[at:at + hi - lo], layout)
                optim[alias] = {k: _Local(moments[k][at:at + hi - lo], layout)
                                for k in ("exp_avg", "exp_avg_sq")}
    return {"model": model, "optim": optim, "adamw_step": steps}


def _scaler_state(scaler) -> dict:
    """A :class:`distlab.zero.DynamicLossScaler`'s state, the same on every rank: its
    scale, the steps since it last changed and the steps skipped (a resumed fp16 run
    goes on with them instead of starting its scale over)."""
    return {"scale": scaler.scale_value, "good_steps": scaler.good_steps,
            "skipped": scaler.skipped}


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


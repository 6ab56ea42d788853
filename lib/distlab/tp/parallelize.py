"""Tensor parallelism applied to an unmodified :class:`distlab.model.GPT` (attention by
heads, the MLP column then row, optionally the vocabulary and the sequence), and the
comparison with torch's own DTensor tensor parallelism."""
from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab import comm
from distlab.comm import in_group
from distlab.shards import shard_sizes
from distlab.tp.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from distlab.tp.ops import all_gather_along, gather_from_group, split_sequence
from distlab.tp.sequence import SequenceParallelColumn, SequenceParallelRow


def heads_per_rank(n_head: int, size: int) -> int:
    """Heads each rank computes; a clear error when they do not split evenly."""
    if n_head % size:
        fits = [t for t in range(1, n_head + 1) if n_head % t == 0]
        raise ValueError(f"{n_head} attention heads cannot be split over {size} ranks: tensor "
                         f"parallelism gives each rank whole heads. Use a tensor-parallel size that "
                         f"divides {n_head} ({fits}) or a model whose head count is a multiple of {size}")
    return n_head // size


def qkv_rows_by_rank(d_model: int, n_head: int, size: int) -> torch.Tensor:
    """The order of a fused qkv weight's rows (q, k, v stacked, ``d_model`` each) that
    puts rank r's q, k and v rows (those of its heads) in its ``tensor_split`` piece:
    ``grouped = weight[order]``. A plain split of the fused weight would give rank 0
    all the queries."""
    width = heads_per_rank(n_head, size) * (d_model // n_head)
    return torch.cat([torch.arange(r * width, (r + 1) * width) + part * d_model
                      for r in range(size) for part in range(3)])


def _reordered(linear: nn.Linear, order: torch.Tensor) -> nn.Linear:
    """A copy of ``linear`` with its output features (rows) in ``order``."""
    out = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    device="meta")
    out.weight = nn.Parameter(linear.weight.detach()[order.to(linear.weight.device)],
                              requires_grad=linear.weight.requires_grad)
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias.detach()[order.to(linear.bias.device)],
                                requires_grad=linear.bias.requires_grad)
    return out


class ParallelSelfAttention(nn.Module):
    """Causal self-attention over this rank's heads: ``qkv`` yields the q, k and v of
    its heads (a column-parallel layer over rows grouped by :func:`qkv_rows_by_rank`),
    ``proj`` is row-parallel over the same heads' features. It computes what
    :class:`distlab.model.CausalSelfAttention` does, with the local head count taken
    from the width of ``qkv``'s output (that class reads it from its config).
    ``qkv_order`` is kept to rebuild the full weight (:func:`full_state_dict`)."""

    def __init__(self, qkv: nn.Module, proj: nn.Module, head_dim: int, qkv_order: torch.Tensor):
        super().__init__()
        self.qkv, self.proj, self.head_dim, self.qkv_order = qkv, proj, head_dim, qkv_order

    def forward(self, x):
        qkv = self.qkv(x)
        b, s, _ = qkv.shape  # under sequence parallelism x holds a slice of the sequence
        q, k, v = (z.view(b, s, -1, self.head_dim).transpose(1, 2) for z in qkv.chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, -1))


def _grouped_attention(attn: nn.Module, size: int, column, row) -> ParallelSelfAttention:
    d_model = attn.qkv.in_features
    order = qkv_rows_by_rank(d_model, attn.n_head, size)
    return ParallelSelfAttention(column(_reordered(attn.qkv, order)), row(attn.proj),
                                 d_model // attn.n_head, order)


@dataclasses.dataclass(frozen=True)
class Split:
    """How :func:`tensor_parallel` split a layer (kept on it as ``tp_split``): the
    dimension of each split parameter (the others are whole), the shards' lengths along
    it, the group. :func:`full_state_dict` gathers the shards back from it, whoever wrote
    the layer."""
    dims: dict
    sizes: list
    group: object


def _split(layer: nn.Module, dims: dict, n: int, group) -> nn.Module:
    layer.tp_split = Split(dims, shard_sizes(n, dist.get_world_size(group)), group)
    return layer


def _splitters(group, sequence_parallel: bool, column, row):
    """The two functions that replace an ``nn.Linear`` by its column- or row-parallel
    split over ``group`` (``column(linear, group)``, ``row(linear, group)``, wrapped for
    sequence parallelism), each recorded (:class:`Split`)."""
    col_seq, row_seq = ((SequenceParallelColumn, SequenceParallelRow) if sequence_parallel
                        else (lambda m, _: m, lambda m, _: m))
    return (lambda m: _split(col_seq(column(m, group), group), {"weight": 0, "bias": 0},
                             m.out_features, group),
            lambda m: _split(row_seq(row(m, group), group), {"weight": 1}, m.in_features, group))


def parallel_attention(attn: nn.Module, group=None, *, sequence_parallel: bool = False,
                       column=ColumnParallelLinear, row=RowParallelLinear) -> ParallelSelfAttention:
    """The GPT's :class:`~distlab.model.CausalSelfAttention` split by heads over
    ``group``: qkv ``column``-parallel over this rank's heads, proj ``row``-parallel. One
    all-reduce forward (in proj), one backward (at qkv's input)."""
    size = dist.get_world_size(group)
    heads_per_rank(attn.n_head, size)
    return _grouped_attention(attn, size, *_splitters(group, sequence_parallel, column, row))


def parallel_mlp(mlp: nn.Module, group=None, *, sequence_parallel: bool = False,
                 column=ColumnParallelLinear, row=RowParallelLinear) -> nn.Module:
    """The GPT's :class:`~distlab.model.MLP`, in place: up ``column``-parallel, down
    ``row``-parallel, so that GELU runs on this rank's hidden features and one all-reduce
    forward (in down) and one backward (at up's input) remain."""
    split_column, split_row = _splitters(group, sequence_parallel, column, row)
    mlp.up, mlp.down = split_column(mlp.up), split_row(mlp.down)
    return mlp


def tensor_parallel(model: nn.Module, group=None, *, vocab_parallel: bool = False,
                    sequence_parallel: bool = False, column=ColumnParallelLinear,
                    row=RowParallelLinear, embedding=VocabParallelEmbedding) -> nn.Module:
    """Make a :class:`distlab.model.GPT` tensor-parallel over ``group``, in place, by
    replacing its submodules; parameter names stay those of the GPT.

    Per block: attention split by heads (qkv column-parallel, proj row-parallel) and
    the MLP (up column-parallel, down row-parallel). Embeddings, LayerNorms and the
    head stay replicated unless ``vocab_parallel``: then the token embedding and the
    head (tied or not) are split over the vocabulary, the model returns this rank's
    slice of the logits, and the loss is :func:`vocab_parallel_cross_entropy`.
    ``sequence_parallel`` runs LayerNorms and residuals on a slice of the sequence
    (:mod:`distlab.tp.sequence` wraps the split linears); after backward, call
    :func:`allreduce_sequence_parallel_grads`.

    ``column``, ``row`` and ``embedding``: the classes of the split layers, called as
    ``cls(full_layer, group)`` (lab 06's exercises; the library's by default; a lab
    passes the student's own). Every rank must start from the same weights (same seed,
    or a broadcast)."""
    from distlab.model import GPT

    if not isinstance(model, GPT):
        raise TypeError(f"tensor_parallel applies to distlab.model.GPT, got {type(model).__name__}")
    if not in_group(group):
        raise ValueError("this rank is not in the tensor-parallel group: call tensor_parallel "
                         "only on the group's ranks")
    if any(isinstance(getattr(m, "tp_split", None), Split) for m in model.modules()):
        raise ValueError("this model is already tensor-parallel; build a fresh GPT")
    size = dist.get_world_size(group)
    heads_per_rank(model.cfg.n_head, size)
    tied = model.head.weight is model.tok_emb.weight
    layers = dict(sequence_parallel=sequence_parallel, column=column, row=row)

    for block in model.blocks:
        block.attn = parallel_attention(block.attn, group, **layers)
        parallel_mlp(block.mlp, group, **layers)
    if vocab_parallel:
        head, vocab = model.head, model.tok_emb.num_embeddings
        model.tok_emb = _split(embedding(model.tok_emb, group), {"weight": 0}, vocab, group)
        model.head = _splitters(group, sequence_parallel, column, row)[0](head)
        if tied:  # the same vocabulary rows on this rank: the tie holds shard by shard
            model.head.weight = model.tok_emb.weight
    if sequence_parallel:
        model.blocks[0].register_forward_pre_hook(lambda _, args: (split_sequence(args[0], group),))
        if not vocab_parallel:  # a replicated head needs the whole sequence
            model.ln_f.register_forward_hook(lambda _, __, out: gather_from_group(
                out, 1, [out.shape[1]] * size, group))
        for norm in [b.ln1 for b in model.blocks] + [b.ln2 for b in model.blocks] + [model.ln_f]:
            for p in norm.parameters():
                p.sequence_parallel = True
    return model


def allreduce_sequence_parallel_grads(model: nn.Module, group=None) -> None:
    """Sum over ``group`` the gradients of the replicated parameters that see only this
    rank's slice of the sequence (LayerNorms, row-parallel biases; marked
    ``sequence_parallel``): one all-reduce of them all, after backward (as Megatron)."""
    grads = [p.grad for p in model.parameters()
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the single-process model, gathered on every rank from a model
    made parallel by :func:`tensor_parallel` or :func:`parallelize_with_torch`
    (collective: every rank of the group calls it)."""
    return _gathered(model, dict(model.state_dict()), grads=False)


def full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """The gradients the single-process model would hold, by parameter name (tied
    parameters under each of their names), gathered as :func:`full_state_dict`."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return _gathered(model, {n: p.grad for n, p in params.items()}, grads=True)


def _gathered(model: nn.Module, tensors: dict, grads: bool) -> dict:
    # DTensors exist only once torch.distributed.tensor is imported (a slow import)
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", ())
    out = {n: None if t is None else t.full_tensor() if isinstance(t, dtensor) else
           t.detach().clone() for n, t in tensors.items()}
    for name, module in model.named_modules(remove_duplicate=False):
        split = getattr(module, "tp_split", None)
        if isinstance(split, Split):
            for key, dim in split.dims.items():
                p = getattr(module, key)
                if p is None:  # a linear without bias
                    continue
                t = p.grad if grads else p
                out[f"{name}.{key}" if name else key] = None if t is None else all_gather_along(
                    t.detach(), dim, split.sizes, split.group)
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, ParallelSelfAttention):
            for key in ("weight", "bias"):
                grouped = out.get(f"{name}.qkv.{key}")
                if grouped is not None:
                    original = torch.empty_like(grouped)
                    original[module.qkv_order.to(grouped.device)] = grouped
                    out[f"{name}.qkv.{key}"] = original
    return out


def parallelize_with_torch(model: nn.Module, mesh) -> nn.Module:
    """The same split with PyTorch's own tensor parallelism (DTensor): ``ColwiseParallel``
    on qkv and up, ``RowwiseParallel`` on proj and down, over a 1-D ``DeviceMesh``.

    Torch shards a weight in even ``torch.chunk`` pieces of its rows, so the fused qkv is
    regrouped by heads first, as for :func:`tensor_parallel` (torchtitan's models have
    separate q, k and v projections instead)."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    size = mesh.size()
    heads_per_rank(model.cfg.n_head, size)
    plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()}
    for block in model.blocks:
        block.attn = _grouped_attention(block.attn, size, lambda m: m, lambda m: m)
        parallelize_module(block, mesh, plan)
    return model


def dtensor_param_groups(model: nn.Module) -> list[dict]:
    """The parameters of a model made parallel by :func:`parallelize_with_torch` as two
    optimizer parameter groups: the DTensors (the split linears), then the plain tensors
    (embeddings, LayerNorms, head, replicated on every rank).

    A foreach or fused optimizer step, PyTorch's default for CUDA tensors, runs one
    kernel over a list of tensors and refuses a list that mixes DTensors with plain
    tensors; one group of each keeps that fast step for both. Torch's own examples
    instead make every parameter a DTensor, by also splitting the embedding and running
    the LayerNorms sequence-parallel: a different split from this one."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)],
              [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": group} for group in groups if group]


def allreduce_bytes_per_layer(batch: int, seq: int, hidden: int, tp: int,
                              element_size: int = 2) -> float:
    """Bytes each rank sends (and receives) per transformer layer, forward and backward:
    4 all-reduces of ``b·s·h`` elements, each moving ``2(t-1)/t`` of its size through
    every rank's link in a ring (nccl-tests' bus factor), times the bytes per element:
    ``8·b·s·h·(t-1)/t · element_size`` (Narayanan et al. 2021, section 3.2, count the
    ``8·b·s·h·(t-1)/t`` in elements)."""
    return 4 * batch * seq * hidden * comm.bus_factor("all_reduce", tp) * element_size

"""Lab 06's answers: the tensor-parallel layers (Megatron-LM, section 3), each built from
a full layer and keeping this rank's ``torch.tensor_split`` shard of it, and the
vocabulary-parallel cross-entropy that goes with the third. This module holds only
answers: while lab 06 is graded it is absent from the graded ranks
(:mod:`distlab.grading.answers`).

* :class:`ColumnParallelLinear` (``linear, group=None, gather_output=False``): the output
  features split; takes the whole input, returns this rank's slice of the output (the
  whole output with ``gather_output``);
* :class:`RowParallelLinear` (``linear, group=None``): the input features split; takes
  this rank's slice, returns the whole output on every rank;
* :class:`VocabParallelEmbedding`: the rows of the vocabulary split; returns every
  token's embedding on every rank;
* :func:`vocab_parallel_cross_entropy`: Megatron's loss over vocabulary-sharded logits,
  three all-reduces of ``b·s`` floats instead of gathering ``b·s·V`` logits (lab 06's
  core exercise).

The operators they are built on are in :mod:`distlab.tp.ops`; sequence parallelism wraps
the two linears (:mod:`distlab.tp.sequence`); :func:`distlab.tp.full_state_dict` gathers
their shards back.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab.comm import in_group
from distlab.shards import shard_sizes
from distlab.tp.ops import compute_dtype, copy_to_group, gather_from_group, reduce_from_group


def _shard(tensor: torch.Tensor | None, dim: int, group) -> nn.Parameter | None:
    """This rank's ``tensor_split`` shard along ``dim`` as a parameter of its own memory."""
    if tensor is None:
        return None
    piece = tensor.detach().tensor_split(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]
    return nn.Parameter(piece.clone(), requires_grad=tensor.requires_grad)


def _check_width(n: int, what: str, size: int, cls: str) -> None:
    if n < size:
        raise ValueError(f"{cls}: {n} {what} cannot be split over {size} ranks (every rank needs "
                         f"at least one); use a tensor-parallel group of at most {n} ranks")


class ColumnParallelLinear(nn.Module):
    """``ColumnParallelLinear(linear, group=None, gather_output=False)``: the output
    features of ``linear`` split over the ranks of ``group``.

    Keeps this rank's ``tensor_split`` shard of the rows of ``linear.weight`` (PyTorch
    stores the output features as rows) and of ``linear.bias``. Takes the full input and
    returns this rank's slice of the output, or the full output with
    ``gather_output=True`` (an all-gather). The input's gradient is summed over the
    group (f).

    A rank that is not a member of ``group`` keeps no shard and its forward returns None
    at once, as torch.distributed's collectives do."""

    def __init__(self, linear: nn.Linear, group=None, gather_output: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group, self.gather_output = group, gather_output
        if not in_group(group):
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
            return
        _check_width(self.out_features, "output features", dist.get_world_size(group), "ColumnParallelLinear")
        self.weight = _shard(linear.weight, 0, group)
        self.bias = _shard(linear.bias, 0, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.weight is None:
            return None
        y = F.linear(copy_to_group(compute_dtype(x), self.group), self.weight, self.bias)
        if self.gather_output:
            return gather_from_group(y, -1, shard_sizes(self.out_features, dist.get_world_size(self.group)),
                                     self.group)
        return y

    def extra_repr(self) -> str:
        shard = None if self.weight is None else self.weight.shape[0]
        return (f"in_features={self.in_features}, out_features={self.out_features} (this rank: "
                f"{shard}), bias={self.bias is not None}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``RowParallelLinear(linear, group=None)``: the input features of ``linear`` split
    over the ranks of ``group``.

    Keeps this rank's ``tensor_split`` shard of the columns of ``linear.weight`` and the
    whole ``linear.bias``. Takes this rank's slice of the input features and all-reduces
    the partial products (g), then adds the bias once.

    A rank that is not a member of ``group`` keeps no shard and its forward returns None."""

    def __init__(self, linear: nn.Linear, group=None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group = group
        if not in_group(group):
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
            return
        _check_width(self.in_features, "input features", dist.get_world_size(group), "RowParallelLinear")
        self.weight = _shard(linear.weight, 1, group)
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.weight is None:
            return None
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"RowParallelLinear takes this rank's slice of the input features: "
                             f"{self.weight.shape[1]} of {self.in_features}, got {x.shape[-1]}; feed "
                             f"it the output of a ColumnParallelLinear (gather_output=False)")
        y = reduce_from_group(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        shard = None if self.weight is None else self.weight.shape[1]
        return (f"in_features={self.in_features} (this rank: {shard}), out_features="
                f"{self.out_features}, bias={self.bias is not None}")


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` whose rows (the vocabulary) are split over the group: each
    rank looks up the tokens of its range, zeros elsewhere, and g sums the pieces
    (one all-reduce of ``b·s·h`` forward, none backward)."""

    def __init__(self, embedding: nn.Embedding, group=None):
        super().__init__()
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
            raise ValueError("VocabParallelEmbedding supports plain embeddings only (no "
                             "padding_idx, max_norm or sparse gradients)")
        size = dist.get_world_size(group)
        _check_width(embedding.num_embeddings, "tokens", size, "VocabParallelEmbedding")
        self.group, self.num_embeddings = group, embedding.num_embeddings
        self.start = sum(shard_sizes(self.num_embeddings, size)[:dist.get_rank(group)])
        self.weight = _shard(embedding.weight, 0, group)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return reduce_from_group(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} tokens, this rank: {self.start}..."
                f"{self.start + self.weight.shape[0] - 1}, dim {self.weight.shape[1]}")


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                                 group=None) -> torch.Tensor:
    """Mean cross-entropy from this rank's slice of the logits over a vocabulary of
    ``vocab_size`` tokens (the output of a column-parallel head), without gathering them
    (Megatron's algorithm).

    Three all-reduces of one float per token: the largest logit (for a stable
    log-sum-exp), the target's logit (held by one rank, zero on the others) and the sum
    of the exponentials. Gathering the logits would move ``b·s·V`` elements. Backward
    needs no collective: each rank's logits get ``softmax - one_hot`` on its own slice."""
    sizes = shard_sizes(vocab_size, dist.get_world_size(group))
    rank = dist.get_rank(group)
    if logits.shape[-1] != sizes[rank]:
        raise ValueError(f"rank {rank} holds {sizes[rank]} of the {vocab_size} logits, got "
                         f"{logits.shape[-1]}; pass the output of the column-parallel head")
    start = sum(sizes[:rank])
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    peak = logits.detach().amax(dim=-1)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak.unsqueeze(-1)
    local = targets - start
    outside = (local < 0) | (local >= sizes[rank])
    picked = shifted.gather(-1, local.masked_fill(outside, 0).unsqueeze(-1)).squeeze(-1)
    picked = reduce_from_group(picked.masked_fill(outside, 0.0), group)
    sum_exp = reduce_from_group(shifted.exp().sum(-1), group)
    return (sum_exp.log() - picked).mean()

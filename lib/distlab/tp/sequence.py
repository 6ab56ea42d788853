"""Sequence parallelism's linears (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", figure 5): a column- or row-parallel layer
whose activations outside the pair are this rank's slice of the sequence.

Each wraps a layer already split over ``group`` (any object with the ``.weight`` and
``.bias`` shards of :class:`~distlab.tp.layers.ColumnParallelLinear` or
:class:`~distlab.tp.layers.RowParallelLinear`, lab 06's exercises), keeps those very
parameters and replaces the layer's communication: before the column-parallel product an
all-gather of the sequence (in place of f), after the row-parallel one a reduce-scatter
along the sequence (in place of g). The bytes on the wire are those of the all-reduces.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from distlab.tp.ops import compute_dtype, gather_sequence, reduce_scatter_sequence


class SequenceParallelColumn(nn.Module):
    """``layer``'s shard of the output features, fed this rank's slice of the sequence:
    all-gathered forward, the gradient reduce-scattered backward."""

    def __init__(self, layer: nn.Module, group=None):
        super().__init__()
        self.group, self.weight, self.bias = group, layer.weight, layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(gather_sequence(compute_dtype(x), self.group), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"shard {tuple(self.weight.shape)}, bias={self.bias is not None}, sequence parallel"


class SequenceParallelRow(nn.Module):
    """``layer``'s shard of the input features; the partial products reduce-scattered
    along the sequence, then the whole bias added. The bias then sees this rank's tokens
    only: it is marked ``sequence_parallel`` for
    :func:`~distlab.tp.parallelize.allreduce_sequence_parallel_grads`."""

    def __init__(self, layer: nn.Module, group=None):
        super().__init__()
        self.group, self.weight, self.bias = group, layer.weight, layer.bias
        if self.bias is not None:
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_scatter_sequence(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"shard {tuple(self.weight.shape)}, bias={self.bias is not None}, sequence parallel"

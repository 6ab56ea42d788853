"""The tensor-parallel layers (Megatron-LM, section 3), each built from a full layer and
keeping this rank's ``torch.tensor_split`` shard of it:

* :class:`ColumnParallelLinear` (``linear, group=None, gather_output=False``): the output
  features split; takes the whole input, returns this rank's slice of the output (the
  whole output with ``gather_output``);
* :class:`RowParallelLinear` (``linear, group=None``): the input features split; takes
  this rank's slice, returns the whole output on every rank;
* :class:`VocabParallelEmbedding`: the rows of the vocabulary split; returns every
  token's embedding on every rank.

Each has ``full_parameters()`` (the whole layer's, gathered). The first two are lab 06's
warm-ups, and the loss that goes with the third its core exercise: their implementation
lives in :mod:`distlab.reference.tp`.
"""
from distlab.reference.tp import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]

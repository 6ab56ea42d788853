"""Tensor parallelism (Megatron-LM: Shoeybi et al. 2019, "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", section 3).

Each weight matrix of a block is split over the ``t`` ranks of a group, and every rank
sees the whole batch. Two linear layers pair up so that the activation between them
never needs a collective:

* :class:`ColumnParallelLinear` splits the *output* features: rank r computes
  ``X A_r``, its slice of the output columns, from the full input X;
* :class:`RowParallelLinear` splits the *input* features: rank r computes
  ``Y_r B_r`` from its slice of the input, and the partial products are summed.

Column then row computes ``gelu(X A) B`` with one all-reduce forward (the sum, Megatron's
**g**) and one backward (the input's gradient ``dX = sum_r dY_r A_r^T``, Megatron's
**f**). Attention is split by heads, each rank keeping the q, k and v rows of its heads.
A block therefore costs 2 all-reduces of ``b·s·h`` elements forward and 2 backward
(the paper's figure 4).

:func:`tensor_parallel` applies this to an unmodified :class:`distlab.model.GPT` by
replacing its submodules, as torchtitan does; the model's code knows nothing of it.
Options: a vocabulary-parallel embedding and cross-entropy (Megatron's, three all-reduces
of ``b·s`` floats instead of gathering ``b·s·V`` logits; the loss, lab 06's exercise, is
:func:`distlab.tp.layers.vocab_parallel_cross_entropy`) and sequence parallelism
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models": LayerNorms and residuals on a slice of the sequence, an all-gather and a
reduce-scatter in place of each all-reduce).

Shards follow ``torch.tensor_split``: the first ``n % t`` ranks hold one row more.
Attention heads cannot be split, so the head count must be a multiple of ``t``.

- :mod:`~distlab.tp.ops`: the operators f and g, and the sequence-parallel pair;
- :mod:`~distlab.tp.layers`: the layers built on them and the loss (lab 06's answers);
- :mod:`~distlab.tp.sequence`: those layers' sequence-parallel wrappers;
- :mod:`~distlab.tp.parallelize`: the whole model (from the library's layers or the
  student's), and torch's DTensor version beside it.
"""
from distlab.shards import shard_sizes
from distlab.tp.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                              vocab_parallel_cross_entropy)
from distlab.tp.ops import (all_gather_along, compute_dtype, copy_to_group, gather_from_group,
                            gather_sequence, reduce_from_group, reduce_scatter_sequence,
                            split_sequence)
from distlab.tp.parallelize import (ParallelSelfAttention, Split, allreduce_bytes_per_layer,
                                    allreduce_sequence_parallel_grads, dtensor_param_groups,
                                    full_grads, full_state_dict, heads_per_rank, parallel_attention,
                                    parallel_mlp, parallelize_with_torch, qkv_rows_by_rank,
                                    tensor_parallel)
from distlab.tp.sequence import SequenceParallelColumn, SequenceParallelRow

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "SequenceParallelColumn",
           "SequenceParallelRow", "Split", "VocabParallelEmbedding",
           "all_gather_along", "compute_dtype", "copy_to_group",
           "gather_from_group", "gather_sequence", "reduce_from_group", "reduce_scatter_sequence",
           "split_sequence", "ParallelSelfAttention", "allreduce_bytes_per_layer",
           "allreduce_sequence_parallel_grads", "dtensor_param_groups", "full_grads",
           "full_state_dict", "heads_per_rank", "parallel_attention", "parallel_mlp",
           "parallelize_with_torch", "qkv_rows_by_rank", "tensor_parallel", "shard_sizes",
           "vocab_parallel_cross_entropy"]

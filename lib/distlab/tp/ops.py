"""Megatron-LM's communication operators for tensor parallelism (Shoeybi et al. 2019,
section 3, and Korthikanti et al. 2022 for the sequence-parallel pair), as autograd
functions: each is a collective forward and its adjoint backward.

* **f** (:func:`copy_to_group`): identity forward, all-reduce of the gradient backward;
* **g** (:func:`reduce_from_group`): all-reduce forward, identity backward;
* :func:`gather_from_group` (every rank's piece along a dimension, pieces of the given
  sizes; backward keeps this rank's slice) and :func:`all_gather_along` (the same,
  without autograd);
* :func:`split_sequence`, :func:`gather_sequence`, :func:`reduce_scatter_sequence`:
  sequence parallelism's entry and exits, each the adjoint of another;
* :func:`compute_dtype`: a tensor in the autocast dtype when autocast is on.

f and g are part of lab 06's warm-ups; their implementation lives beside the layers in
:mod:`distlab.reference.tp`.
"""
from distlab.reference.tp import (all_gather_along, compute_dtype, copy_to_group,
                                  gather_from_group, gather_sequence, reduce_from_group,
                                  reduce_scatter_sequence, split_sequence)

__all__ = ["all_gather_along", "compute_dtype", "copy_to_group", "gather_from_group",
           "gather_sequence", "reduce_from_group", "reduce_scatter_sequence", "split_sequence"]

"""Data parallelism: :mod:`~distlab.dp.data_parallel` holds the wrappers (lab 04's
one-shot all-reduce, lab 08's buckets overlapped with backward), and
:mod:`~distlab.dp.channels` how a bucket's all-reduce is issued."""
from distlab.dp.data_parallel import (MB, DataParallel, OneShotDataParallel, allreduce_gradients,
                                      broadcast_state, plan_buckets, shard_loss_weight)

__all__ = ["MB", "DataParallel", "OneShotDataParallel", "allreduce_gradients",
           "broadcast_state", "plan_buckets", "shard_loss_weight"]

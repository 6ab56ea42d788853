"""Data parallelism: every rank holds the whole model, computes gradients on its own
slice of the global batch, and the ranks average their gradients before each step.

Both wrappers are shaped like ``torch.nn.parallel.DistributedDataParallel``
(``.module``, rank 0's parameters and buffers broadcast at construction, ``no_sync()``)::

    model = DataParallel(GPT(cfg).to(backend.device()))   # rank 0's weights everywhere
    loss_fn(model(x), y).backward()                        # buckets all-reduce meanwhile
    model.finish_gradient_synchronization()                # wait for the last of them
    optimizer.step()

- ``DataParallel(module, bucket_cap_mb=25, group=None, *, channel="auto")`` (lab 08):
  gradients averaged in buckets of ``bucket_cap_mb`` MiB (``plan_buckets``' plan, in
  reverse parameter order as backward produces them), each bucket's all-reduce issued
  during backward (Li et al. 2020, "PyTorch Distributed"); ``None`` is one all-reduce
  per parameter;
- ``OneShotDataParallel(module, group=None, *, allreduce=allreduce_gradients)`` (lab 04):
  one blocking ``allreduce(module, group)`` of every gradient after backward;
- ``allreduce_gradients(module, group=None)``, ``broadcast_state(module, group=None)``,
  ``shard_loss_weight(local_count, global_count, world_size)`` (a rank's loss weight when
  its rows are not an equal share), ``plan_buckets(params, bucket_cap_mb=25)``.

:mod:`~distlab.dp.channels` says how a bucket's all-reduce is issued. The answers of labs
04 and 08 are in :mod:`distlab.dp.allreduce` and :mod:`distlab.dp.bucketed` (read them
after grading); :mod:`~distlab.dp.replicas` holds what the wrappers are built on, and the
one-shot wrapper.
"""
from distlab.dp.allreduce import allreduce_gradients
from distlab.dp.bucketed import DataParallel
from distlab.dp.replicas import (MB, OneShotDataParallel, broadcast_state, plan_buckets,
                                 shard_loss_weight)

__all__ = ["MB", "DataParallel", "OneShotDataParallel", "allreduce_gradients",
           "broadcast_state", "plan_buckets", "shard_loss_weight"]

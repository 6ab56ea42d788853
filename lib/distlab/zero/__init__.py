"""ZeRO, the zero-redundancy optimizer (Rajbhandari et al. 2020): data parallelism whose
ranks shard, instead of replicating, what training keeps per parameter.

| stage | sharded | per-rank bytes, mixed-precision Adam | traffic per step and rank |
| --- | --- | --- | --- |
| 1 | optimizer states (+ fp32 master weights) | 4Ψ + 12Ψ/N | 2Ψ (reduce-scatter + all-gather) |
| 2 | + gradients | 2Ψ + 14Ψ/N | 2Ψ |
| 3 | + parameters | 16Ψ/N | 3Ψ (one more all-gather) |

Modules, one concept each:

* :mod:`~distlab.zero.flat`: :func:`shard_range` (the ``torch.tensor_split`` split), the
  padded layout and the two collectives, :class:`FlatParams` (one sharded unit);
* :mod:`~distlab.zero.step`: :func:`zero2_step`, the ZeRO-2 step on a flat buffer;
* :mod:`~distlab.zero.optimizer`: :class:`ShardedOptimizer`, stage 1;
* :mod:`~distlab.zero.fsdp`: :class:`FullyShardedDataParallel`, stages 3 and 2;
* :mod:`~distlab.zero.scaler`: :class:`DynamicLossScaler` for fp16;
* :mod:`~distlab.zero.kernel`: the sharded AdamW update as a CUDA kernel (cupy).

:mod:`distlab.zero.memory` accounts the bytes each rank holds.
"""
from distlab.shards import shard_range
from distlab.zero.flat import FlatParams, Layout
from distlab.zero.fsdp import FullyShardedDataParallel
from distlab.zero.optimizer import ShardedOptimizer
from distlab.zero.scaler import DynamicLossScaler
from distlab.zero.step import adamw_, zero2_step

__all__ = ["DynamicLossScaler", "FlatParams", "FullyShardedDataParallel", "Layout",
           "ShardedOptimizer", "adamw_", "shard_range", "zero2_step"]

"""ZeRO stages 2 and 3 as a module wrapper (Rajbhandari et al. 2020, "ZeRO", sections
5.2-5.3; PyTorch's FSDP, Zhao et al. 2023, is the same idea).

    model = FullyShardedDataParallel(GPT(cfg), compute_dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)   # this rank's fp32 shard only
    loss_fn(model(x), y).backward()
    model.finish_gradient_synchronization()
    opt.step()

What it holds: per rank, the fp32 master weights, gradients and optimizer state of
1/N of the parameters, split the ``torch.tensor_split`` way over the units of the model
(each block of an ``nn.ModuleList``, and the root); small parameters (one dimension or
none, or ``persistence_threshold``) replicated. ``shard_parameters=False`` is stage 2
(parameters whole between steps), the default stage 3 (only the shard between steps).
Traffic per step and rank: stage 2 an all-gather and a reduce-scatter of Psi (2 Psi);
stage 3 one more all-gather (3 Psi); the replicated parameters an all-reduce. In fp32 at
world size 2 a step equals :class:`distlab.dp.DataParallel`'s bit for bit. Each forward
must be followed by its backward before the next forward.

How it does it is lab 05's exercise ``ZeRO3Unit`` (its implementation lives in
:mod:`distlab.reference.fsdp`).
"""
from distlab.reference.fsdp import FullyShardedDataParallel

__all__ = ["FullyShardedDataParallel"]

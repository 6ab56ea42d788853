"""Dynamic loss scaling for fp16 training on sharded gradients (Micikevicius et al. 2018,
"Mixed precision training", section 3.2).

fp16 flushes gradients below about 6e-8 to zero, so the loss is multiplied by a large
scale before backward and the gradients divided by it before the step. When a scaled
gradient overflows (inf or nan) the step is skipped and the scale halved; after
``growth_interval`` good steps it doubles. With sharded gradients each rank sees only
its shard, so the ranks all-reduce (MAX) one flag and take the same decision: a rank
that stepped alone would leave the model unsynchronised.

    scaler = DynamicLossScaler()
    scaler.scale(loss).backward()
    scaler.step(optimizer)     # a ShardedOptimizer, or any optimizer over FSDP's pieces
    scaler.update()

bf16 has fp32's exponent range and needs none of this.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from distlab import backend


class DynamicLossScaler:
    """The shape of ``torch.amp.GradScaler`` (``scale``, ``step``, ``update``) for
    gradients sharded over ``group``."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, group=None):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError("need init_scale > 0, growth_factor > 1 and 0 < backoff_factor < 1")
        self.scale_value, self.group = float(init_scale), group
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.good_steps, self.found_inf, self.skipped = 0, False, 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def step(self, optimizer) -> bool:
        """Unscale this rank's gradients, agree with the other ranks on whether any
        overflowed, and step the optimizer unless one did. Returns whether it stepped."""
        if hasattr(optimizer, "reduce_gradients"):          # a ShardedOptimizer
            optimizer.reduce_gradients()
            groups = optimizer.optim.param_groups
        else:
            groups = optimizer.param_groups
        grads = [p.grad for g in groups for p in g["params"] if p.grad is not None]
        bad = torch.zeros(1, device=backend.device())
        with torch.no_grad():
            for g in grads:
                g.mul_(1.0 / self.scale_value)
                bad += (~torch.isfinite(g)).any().to(bad.device, bad.dtype)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        self.found_inf = bool(bad.item() > 0)
        if self.found_inf:
            optimizer.zero_grad()
            self.skipped += 1
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """Halve the scale after an overflow; double it after ``growth_interval`` steps
        without one."""
        if self.found_inf:
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale_value *= self.growth_factor
                self.good_steps = 0

"""Per-rank memory of data-parallel training: what the ZeRO paper predicts, what
:mod:`distlab.zero` holds exactly, and what a rank measures.

With mixed-precision Adam each parameter costs 2 bytes of fp16/bf16 weights, 2 of
gradients and K = 12 of optimizer state (fp32 master weights, momentum and variance)
(Rajbhandari et al. 2020, "ZeRO", section 3.1). Over N ranks, per rank
(:func:`zero_bytes`):

| stage | shards | bytes per rank |
| --- | --- | --- |
| 0 (data parallel) | nothing | (2 + 2 + K)Ψ = 16Ψ |
| 1 | optimizer state | 4Ψ + KΨ/N |
| 2 | + gradients | 2Ψ + (2 + K)Ψ/N |
| 3 | + parameters | (4 + K)Ψ/N |

:func:`accounting` gives the exact bytes :mod:`distlab.zero` holds at the end of
backward, shard by shard (uneven shards included); it differs from the paper in one
place: stages 2 and 3 keep the gradient shard in fp32, the optimizer's dtype (4 bytes,
not 2), and stage 3 keeps no low-precision copy of its parameter shard (the all-gather
casts the master shard), so stage 3 adds up to 16Ψ/N all the same and stage 2 to
2Ψ + 16Ψ/N. :func:`live_bytes` counts the storage a rank's objects hold (exact, on any
device); :func:`cuda_memory` reads the CUDA allocator.
"""
from __future__ import annotations

import dataclasses

import torch

STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "data parallel", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}


def zero_bytes(num_params: float, world_size: int, stage: int, k: float = 12) -> float:
    """Bytes per rank for ``num_params`` (Ψ) parameters over ``world_size`` ranks with
    mixed-precision Adam (the paper's formula; ``k`` bytes of optimizer state per
    parameter)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES} (0 is plain data parallelism), "
                         f"got {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    psi, n = num_params, world_size
    return {0: (4 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n,
            3: (4 + k) * psi / n}[stage]


@dataclasses.dataclass
class RankBytes:
    """Bytes one rank holds, by what they are."""

    params: int = 0       # the model's weights as forward uses them
    grads: int = 0        # gradients (whole or shard)
    master: int = 0       # fp32 master weights of the shard (none in plain DP with fp32)
    optimizer: int = 0    # optimizer state per element (Adam's two moments)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.master + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def accounting(unit_numels: list[int], world_size: int, rank: int, stage: int,
               param_bytes: int = 2, grad_bytes: int = 2, master_bytes: int = 4,
               state_bytes: int = 8) -> RankBytes:
    """Exact bytes rank ``rank`` holds at the end of backward in :mod:`distlab.zero`,
    for units (flat buffers) of ``unit_numels`` elements each sharded the
    ``torch.tensor_split`` way. Stage 0 is data parallelism with fp32 master weights
    (a :class:`~distlab.zero.ShardedOptimizer` over a group of one rank)."""
    from distlab.zero.flat import shard_range

    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    total = sum(unit_numels)
    shard = total if stage == 0 else sum(
        end - start for start, end in (shard_range(n, rank, world_size) for n in unit_numels))
    return RankBytes(params=total * param_bytes if stage < 3 else 0,
                     grads=total * grad_bytes if stage < 2 else shard * master_bytes,
                     master=shard * master_bytes, optimizer=shard * state_bytes)


def live_bytes(params=(), grads=(), master=(), optimizer=None) -> RankBytes:
    """Bytes of storage behind the given tensors, each storage counted once (a freed
    buffer counts 0). ``optimizer``: a torch optimizer whose per-element state counts
    (its moments; scalar step counters are left out). DTensors count their local shard."""
    def nbytes(tensors):
        seen, total = set(), 0
        for t in tensors:
            if t is None:
                continue
            t = t.to_local() if hasattr(t, "to_local") else t
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes(), str(t.device))
            if storage.nbytes() and key not in seen:
                seen.add(key)
                total += storage.nbytes()
        return total

    state = [] if optimizer is None else [
        v for s in optimizer.state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0]
    return RankBytes(nbytes(params), nbytes(grads), nbytes(master), nbytes(state))


def cuda_memory(device=None) -> dict[str, int]:
    """The CUDA caching allocator's bytes in use now and at peak (since the last
    ``torch.cuda.reset_peak_memory_stats``); zeros without CUDA."""
    if not torch.cuda.is_available():
        return {"allocated": 0, "peak": 0}
    return {"allocated": torch.cuda.memory_allocated(device),
            "peak": torch.cuda.max_memory_allocated(device)}


def human(nbytes: float) -> str:
    """Decimal units as the paper writes them: 1.9 GB, 120 GB, 2.8 TB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{nbytes:.0f} B"


def held_bytes(model, optimizer) -> RankBytes:
    """What this rank holds for ``model`` and ``optimizer``: distlab's
    :class:`~distlab.zero.ShardedOptimizer` or
    :class:`~distlab.zero.FullyShardedDataParallel` (their flat buffers, master shards,
    gradients and the local optimizer's state), or any other module (a DataParallel
    wrapper, an FSDP2-sharded model) with its optimizer (torch's
    ZeroRedundancyOptimizer counts its local optimizer)."""
    flats = [f for obj in (model, optimizer) if hasattr(obj, "flat_params")
             for f in obj.flat_params()]
    local = getattr(optimizer, "optim", optimizer)
    if flats:
        grads = [p.grad for f in flats for p in list(f.params) + list(f.pieces)]
        return live_bytes([f.full for f in flats], grads, [f.master for f in flats], local)
    module = getattr(model, "module", model)
    params = list(module.parameters())
    return live_bytes(params, [p.grad for p in params], (), local)

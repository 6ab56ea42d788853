"""Lab 05's answer ``zero_bytes_per_rank``: the ZeRO paper's bytes per rank
(Rajbhandari et al. 2020, section 3.1), used through :mod:`distlab.zero.memory`."""
from __future__ import annotations


def zero_bytes(num_params: float, world_size: int, stage: int, k: float = 12) -> float:
    """Bytes per rank for ``num_params`` (Ψ) parameters over ``world_size`` ranks with
    mixed-precision Adam (the paper's formula; ``k`` bytes of optimizer state per
    parameter); ``stage`` 0 is plain data parallelism."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be one of (0, 1, 2, 3) (0 is plain data parallelism), "
                         f"got {stage!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    psi, n = num_params, world_size
    return {0: (4 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n,
            3: (4 + k) * psi / n}[stage]

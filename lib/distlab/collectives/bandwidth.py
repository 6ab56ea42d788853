"""Lab 01's answer ``bus_bandwidth``: nccl-tests' bus bandwidth of a collective, the rate
each link carries, from its algorithm bandwidth (bytes / time) times a factor of the op
and the world size, so that one number compares every collective and every world size
(nccl-tests' doc/PERFORMANCE.md).

It lives with the collectives, not with the benchmarks that time them: the factor is
what a rank of the (ring) algorithm must send, a property of the collective, and
:mod:`distlab.comm`, below every benchmark, counts a log's bytes on the wire with it.
The rest of the library uses it through :func:`distlab.comm.bus_factor`.
"""
from __future__ import annotations

# busbw = algbw * factor(n): a ring all-reduce sends 2(n-1)/n of the buffer per rank.
_BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}
_OP_FAMILY = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
              "all_to_all_single": "all_to_all", "send": "sendrecv", "recv": "sendrecv",
              "isend": "sendrecv", "irecv": "sendrecv"}


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth for ``op``."""
    family = _OP_FAMILY.get(op, op)
    if family not in _BUS_FACTORS:
        raise ValueError(f"no bus-bandwidth factor for {op!r}; known: {sorted(_BUS_FACTORS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return _BUS_FACTORS[family](world_size)


def bus_bandwidth(op: str, nbytes: float, seconds: float, world_size: int) -> float:
    """busbw in bytes/s of ``op`` moving ``nbytes`` in ``seconds`` on ``world_size`` ranks:
    algbw = nbytes / seconds, times :func:`bus_factor`."""
    return nbytes / seconds * bus_factor(op, world_size)

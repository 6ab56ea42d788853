"""Byte counts as people read them: binary units for buffers and messages (KiB, MiB,
GiB, as nccl-tests prints them), decimal ones for model sizes as papers write them
(GB, TB)."""
from __future__ import annotations

_BINARY = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
_DECIMAL = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def _scaled(nbytes: float, units) -> tuple[float, str]:
    for unit, size in units:
        if abs(nbytes) >= size:
            return nbytes / size, unit
    return nbytes, "B"


def human_bytes(nbytes: float) -> str:
    """4.0 KiB, 16.0 MiB, 3 B."""
    value, unit = _scaled(nbytes, _BINARY)
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


def size_label(nbytes: float) -> str:
    """A message size for tables and axes: 64 KiB, 1.5 MiB (as short as it is exact)."""
    value, unit = _scaled(nbytes, _BINARY)
    return f"{value:g} {unit}"


def decimal_bytes(nbytes: float) -> str:
    """Decimal units as the ZeRO paper writes them: 1.9 GB, 120 GB, 2.8 TB."""
    value, unit = _scaled(nbytes, _DECIMAL)
    return f"{value:.0f} B" if unit == "B" else f"{value:.3g} {unit}"

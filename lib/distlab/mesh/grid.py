"""Lab 09's answer ``mesh_groups``: the rank grid, ``dp × pp × tp`` ranks with tensor
parallelism varying fastest, then pipeline stages, data parallelism slowest:

    rank = d · (pp · tp) + p · tp + t

:class:`Grid` is that arithmetic (no process group), so a layout can be checked and
printed anywhere; :func:`mesh_groups` is the exercise's form of it, what
:class:`distlab.mesh.Mesh` builds its process groups from. :mod:`distlab.mesh` says why
TP varies fastest.
"""
from __future__ import annotations

import dataclasses
import itertools


@dataclasses.dataclass(frozen=True)
class Grid:
    """``dp × pp × tp`` ranks, TP fastest."""

    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self):
        for dim in self.dims:
            size = getattr(self, dim)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{dim} must be a positive integer (ranks along that "
                                 f"dimension), got {size!r}")

    @property
    def dims(self) -> tuple[str, ...]:
        """The dimensions, slowest to fastest varying."""
        return tuple(f.name for f in dataclasses.fields(self))

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.tp

    def rank(self, d: int, p: int, t: int) -> int:
        """The global rank at coordinates ``(d, p, t)``."""
        return (d * self.pp + p) * self.tp + t

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(d, p, t)`` of a global rank."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a grid of {self.size} ranks")
        rest, t = divmod(rank, self.tp)
        d, p = divmod(rest, self.pp)
        return d, p, t

    def groups(self, dim: str) -> list[list[int]]:
        """The rank lists of every group along ``dim`` ("dp", "pp" or "tp"): ranks that
        share the other two coordinates, in increasing order."""
        if dim not in self.dims:
            raise ValueError(f"dim must be one of {self.dims}, got {dim!r}")
        others = [d for d in self.dims if d != dim]
        out = []
        for fixed in itertools.product(*(range(getattr(self, d)) for d in others)):
            where = dict(zip(others, fixed))
            out.append([self.rank(**{d[0]: where.get(d, i) for d in self.dims})
                        for i in range(getattr(self, dim))])
        return out

    def check(self, world_size: int, gpus_per_node: int | None = None,
              num_layers: int | None = None) -> None:
        """Raise ValueError, saying what to change, when this grid cannot run here."""
        if self.size != world_size:
            raise ValueError(f"dp × pp × tp = {self.dp} × {self.pp} × {self.tp} = {self.size}, "
                             f"but the world has {world_size} ranks: choose sizes whose product "
                             f"is {world_size}")
        if gpus_per_node and self.tp > gpus_per_node:
            raise ValueError(f"tp = {self.tp} is more than the {gpus_per_node} GPUs of one node: "
                             f"tensor parallelism all-reduces every layer and belongs inside a "
                             f"node; use tp <= {gpus_per_node} and more pp or dp")
        if num_layers is not None and self.pp > num_layers:
            raise ValueError(f"pp = {self.pp} stages for a model of {num_layers} layers: each "
                             f"stage needs at least one layer; use pp <= {num_layers}")

    def __str__(self) -> str:
        """The grid, one line per (dp, pp) pair: the TP group's ranks."""
        lines = [f"dp={self.dp} × pp={self.pp} × tp={self.tp} ({self.size} ranks, TP fastest)"]
        for d in range(self.dp):
            for p in range(self.pp):
                ranks = [self.rank(d, p, t) for t in range(self.tp)]
                lines.append(f"  dp {d}  stage {p}:  ranks {ranks}")
        return "\n".join(lines)


def mesh_groups(rank: int, world_size: int, dp: int = 1, tp: int = 1, pp: int = 1,
                gpus_per_node: int | None = None, num_layers: int | None = None) -> dict:
    """``{"coords": (d, p, t), "dp": [...], "pp": [...], "tp": [...]}``: rank ``rank``'s
    coordinates on the grid and the global ranks of its three groups, in increasing
    order; ValueError (saying what to change) for a grid that cannot run here."""
    grid = Grid(dp, pp, tp)
    grid.check(world_size, gpus_per_node, num_layers)
    return {"coords": grid.coords(rank),
            **{dim: next(g for g in grid.groups(dim) if rank in g) for dim in grid.dims}}

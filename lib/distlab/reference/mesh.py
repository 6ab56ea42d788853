"""One owner of the process groups: data × pipeline × tensor parallelism on one rank grid.

    mesh = Mesh(dp=2, pp=2, tp=2)        # inside a launched function, 8 ranks
    mesh.tp_group, mesh.pp_group, mesh.dp_group, mesh.coords   # (d, p, t) of this rank

Ranks are laid out with tensor parallelism varying fastest, then pipeline stages, data
parallelism slowest:

    rank = d · (pp · tp) + p · tp + t

so a TP group is ``tp`` consecutive ranks: the GPUs of one node, joined by NVLink, where
its all-reduces (every layer) belong (Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", section 3.3). What goes
outermost is a choice. Megatron-LM's default order, ``tp-cp-ep-dp-pp`` (its
``initialize_model_parallel``), and torchtitan's mesh, ``["pp", "dp_replicate",
"dp_shard", "cp", "tp"]``, put PP outermost; this grid is Megatron's other order,
``tp-pp-dp``. PP outermost sends only a stage boundary's activations over the slowest
links and keeps DP's gradient traffic, the largest of a step, on nearer ones; DP
outermost keeps a pipeline's transfers, on the critical path of every micro-batch,
near, and gives the slow links DP's traffic, which overlaps backward.

:class:`Grid` is that arithmetic alone (no process group), so a layout can be checked
and printed anywhere; :class:`Mesh` builds the groups from it. Every rank must build
every group, in the same order, even the groups it is not in (``dist.new_group`` is
collective over the whole world): :class:`Mesh` does, once.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch.distributed as dist

DIMS = ("dp", "pp", "tp")  # slowest to fastest


@dataclasses.dataclass(frozen=True)
class Grid:
    """``dp × pp × tp`` ranks, TP fastest."""

    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self):
        for dim in DIMS:
            size = getattr(self, dim)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{dim} must be a positive integer (ranks along that "
                                 f"dimension), got {size!r}")

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
        if dim not in DIMS:
            raise ValueError(f"dim must be one of {DIMS}, got {dim!r}")
        others = [d for d in DIMS if d != dim]
        out = []
        for fixed in itertools.product(*(range(getattr(self, d)) for d in others)):
            where = dict(zip(others, fixed))
            out.append([self.rank(**{d[0]: where.get(d, i) for d in DIMS})
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


class Mesh:
    """The process groups of a :class:`Grid` over the default group, built collectively.

    ``tp_group``, ``pp_group`` and ``dp_group`` are this rank's groups; ``coords`` its
    ``(d, p, t)``; ``prev_stage`` and ``next_stage`` the global ranks of the neighbouring
    pipeline stages (None at either end)."""

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, *,
                 gpus_per_node: int | None = None, num_layers: int | None = None):
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs a process group: build it inside a function run by "
                               "distlab.launch.run (or under torchrun)")
        self.grid = Grid(dp, pp, tp)
        self.grid.check(dist.get_world_size(), gpus_per_node, num_layers)
        self.rank = dist.get_rank()
        self.coords = self.grid.coords(self.rank)
        self.groups = {}
        for dim in DIMS:  # every rank makes every group, in one order
            for ranks in self.grid.groups(dim):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.groups[dim] = group
        d, p, t = self.coords
        self.prev_stage = self.grid.rank(d, p - 1, t) if p > 0 else None
        self.next_stage = self.grid.rank(d, p + 1, t) if p < pp - 1 else None

    @property
    def dp_group(self):
        return self.groups["dp"]

    @property
    def pp_group(self):
        return self.groups["pp"]

    @property
    def tp_group(self):
        return self.groups["tp"]

    def __str__(self) -> str:
        return f"{self.grid}\nthis rank: {self.rank} at (d, p, t) = {self.coords}"

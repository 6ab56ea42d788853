"""The process groups of a rank grid, built once on every rank: :class:`Mesh`.

Every rank must build every group, in the same order, even the groups it is not in
(``dist.new_group`` is collective over the whole world): :class:`Mesh` does, from a
layout function with lab 09's ``mesh_groups`` contract (default: the library's,
:func:`distlab.mesh.grid.mesh_groups`; lab 09 passes its own).
"""
from __future__ import annotations

import torch.distributed as dist

from distlab.mesh.grid import mesh_groups

DIMS = ("dp", "pp", "tp")  # slowest to fastest


class Mesh:
    """``Mesh(dp=1, pp=1, tp=1, *, gpus_per_node=None, num_layers=None,
    layout=mesh_groups)``: the process groups of a ``dp × pp × tp`` grid over the default
    group, built collectively; ``layout(rank, world_size, dp=, tp=, pp=, gpus_per_node=,
    num_layers=)`` gives each rank's coordinates and groups (and refuses a grid that
    cannot run here).

    ``tp_group``, ``pp_group`` and ``dp_group`` are this rank's groups (``groups`` by
    dimension); ``coords`` its ``(d, p, t)``; ``dp``, ``pp`` and ``tp`` the sizes;
    ``prev_stage`` and ``next_stage`` the global ranks of the neighbouring pipeline
    stages (None at either end)."""

    def __init__(self, dp: int = 1, pp: int = 1, tp: int = 1, *,
                 gpus_per_node: int | None = None, num_layers: int | None = None,
                 layout=mesh_groups):
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs a process group: build it inside a function run by "
                               "distlab.launch.run (or under torchrun)")
        self.dp, self.pp, self.tp = dp, pp, tp
        self.rank = dist.get_rank()
        self._every = [layout(r, dist.get_world_size(), dp=dp, tp=tp, pp=pp,
                              gpus_per_node=gpus_per_node, num_layers=num_layers)
                       for r in range(dist.get_world_size())]
        mine = self._every[self.rank]
        self.coords = tuple(mine["coords"])
        self.groups = {}
        for dim in DIMS:  # every rank makes every group, in one order
            for ranks in dict.fromkeys(tuple(e[dim]) for e in self._every):
                group = dist.new_group(list(ranks))
                if self.rank in ranks:
                    self.groups[dim] = group
        p, stages = self.coords[1], mine["pp"]
        self.prev_stage = stages[p - 1] if p > 0 else None
        self.next_stage = stages[p + 1] if p < pp - 1 else None

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
        """The grid, one line per TP group (a (dp, pp) pair), and this rank."""
        lines = [f"dp={self.dp} × pp={self.pp} × tp={self.tp} ({len(self._every)} ranks, "
                 f"TP fastest)"]
        for ranks in dict.fromkeys(tuple(e["tp"]) for e in self._every):
            d, p, _ = self._every[ranks[0]]["coords"]
            lines.append(f"  dp {d}  stage {p}:  ranks {list(ranks)}")
        lines.append(f"this rank: {self.rank} at (d, p, t) = {self.coords}")
        return "\n".join(lines)

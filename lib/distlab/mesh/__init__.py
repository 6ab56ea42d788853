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
and printed anywhere (:mod:`~distlab.mesh.grid`, lab 09's answer ``mesh_groups``: read
it after your warm-up is graded); :class:`Mesh` builds the groups of a layout once, on
every rank, in the same order (:mod:`~distlab.mesh.groups`). ``DIMS`` names the
dimensions from slowest to fastest varying.
"""
from distlab.mesh.grid import Grid
from distlab.mesh.groups import DIMS, Mesh

__all__ = ["DIMS", "Grid", "Mesh"]

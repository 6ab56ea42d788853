"""The answers' manifest: which library code answers which exercise.

:data:`ANSWERS` maps each exercise to the ``"module:name"`` of every library object that
answers it (in the labs' order, the order of the grader's report). A module named here
holds only answers (docs/design.md, "Where the answers go"), so that it can be absent
whole: from the graded ranks of its exercise (:func:`absent_spec`, carried out by
:mod:`distlab.runtime.absent`), and its source from every graded rank's filesystem
(:func:`hidden_modules`). Read by the grader, the sandbox, each lab's listing of its
exercises (:mod:`distlab.grading.labs`) and the tests of the layout. Nothing here
imports anything.
"""
from __future__ import annotations

_RING = ("distlab.collectives.ring:ring_reduce_scatter", "distlab.collectives.ring:ring_all_gather",
         "distlab.collectives.ring:ring_allreduce", "distlab.collectives.ring:_Ring",
         "distlab.collectives.ring:plain_ring_allreduce")
_SCHEDULES = ("distlab.pp.tables:gpipe_schedule", "distlab.pp.tables:one_f_one_b_schedule",
              "distlab.pp.tables:bubble_fraction", "distlab.pp.tables:build_schedule",
              "distlab.pp.tables:SCHEDULES")
# the two layers and Megatron's operators f and g they are built from (the notebook's warm-ups)
_LAYERS = ("distlab.tp.layers:ColumnParallelLinear", "distlab.tp.layers:RowParallelLinear",
           "distlab.tp.fg:copy_to_group", "distlab.tp.fg:_CopyToGroup",
           "distlab.tp.fg:reduce_from_group", "distlab.tp.fg:_ReduceFromGroup")
# lab 08's bucketed wrapper averages every gradient: it answers lab 04's exercise too
_BUCKETED = ("distlab.dp.bucketed:DataParallel", "distlab.dp.bucketed:_Bucket")

# "module:name" of the library code that answers each exercise. all_reduce_mean has none
# (the library has no mean all-reduce). bus_factor and bus_bandwidth answer bus_bandwidth:
# lab 01 asks for the factor itself (later labs may use them freely).
ANSWERS: dict[str, tuple[str, ...]] = {
    "all_reduce_mean": (),
    "bus_bandwidth": ("distlab.collectives.bandwidth:bus_factor",
                      "distlab.collectives.bandwidth:bus_bandwidth"),
    "pipelined_broadcast": ("distlab.collectives.broadcast:pipelined_broadcast",),
    "ps_sgd_step": ("distlab.collectives.ps:ps_sgd_step",),
    "ring_reduce_scatter": _RING,
    "ring_all_gather": _RING,
    "ring_allreduce": _RING,
    "allreduce_gradients": ("distlab.dp.allreduce:allreduce_gradients", *_BUCKETED),
    "zero_bytes_per_rank": ("distlab.zero.formula:zero_bytes",),
    "shard_range": ("distlab.shards:shard_range", "distlab.shards:shard_sizes"),
    "zero2_step": ("distlab.zero.step:zero2_step", "distlab.zero.step:adamw_",
                   "distlab.zero.flat:reduce_scatter_mean", "distlab.zero.flat:all_gather_shards"),
    "ZeRO3Unit": ("distlab.zero.fsdp:_Unit", "distlab.zero.fsdp:FullyShardedDataParallel",
                  "distlab.zero.flat:FlatParams", "distlab.zero.flat:Layout",
                  "distlab.zero.flat:reduce_scatter_mean", "distlab.zero.flat:all_gather_shards",
                  "distlab.zero.grads:reduce_grads"),
    "ColumnParallelLinear": _LAYERS,
    "RowParallelLinear": _LAYERS,
    # the embedding's forward is the masked lookup and sum the loss needs for the target's logit
    "vocab_parallel_cross_entropy": ("distlab.tp.layers:vocab_parallel_cross_entropy",
                                     "distlab.tp.layers:VocabParallelEmbedding"),
    "gpipe_schedule": _SCHEDULES,
    "one_f_one_b_schedule": _SCHEDULES,
    "bubble_fraction": _SCHEDULES,
    "run_stage": ("distlab.pp.runtime:PipelineRunner", "distlab.pp.runtime:sum_tied_gradients",
                  "distlab.pp.p2p:StageLink"),
    "BucketedDDP": _BUCKETED,
    # the grid's arithmetic; distlab.mesh.Mesh builds process groups from any mesh_groups
    "mesh_groups": ("distlab.mesh.grid:Grid", "distlab.mesh.grid:mesh_groups"),
    # the composed trainer (distlab.train.trainer) is labs 05-08's answers put together; its
    # reduce-scatters issued from backward are this exercise's
    "distributed_train_step": ("distlab.train.overlap:OverlappedTrainer",
                               "distlab.train.overlap:_grad_ready"),
    "ring_attention": ("distlab.cp.ring:ring_attention", "distlab.cp.ring:_RingAttention"),
    # the drop rule (moe.router.kept) and the one-process layer's sum (moe.layer.combine_local)
    # are not answers: the lab's one-process MoE runs on them before the exercise
    "moe_dispatch_combine": ("distlab.moe.dispatch:moe_dispatch_combine",),
    # lab 10: the casts (re-exported by distlab.fp8) are the exercise's own few lines
    "fp8_linear": tuple(f"distlab.fp8.scaling:{n}" for n in (
        "amax", "scale_for", "cast", "dequantize", "quantize", "round_trip", "DelayedScaling")),
    # lab 12: the rule over every rank's flight record; the quorum's commit rule and rejoin
    # (the quorum, its collectives and its vote, distlab.resilience.quorum, are not answers)
    "first_divergence": ("distlab.resilience.divergence:first_divergence",),
    "fault_tolerant_step": ("distlab.resilience.recovery:fault_tolerant_step",),
}

REFUSAL = "this is the library's answer to the exercise being graded"

# The only modules the graded ranks' fork server may import before it forks them, as the
# grader and outside the sandbox (distlab.grading.sandbox.preloads): what the labs' import
# lines and the exercise tests' RANK_IMPORTS name, none of which has an effect at import
# (tests/test_sandbox.py imports each as the server does). A module a student names that
# is not here is imported in the confined rank, by the rank.
PRELOADS = frozenset((
    "IPython.display", "distlab", "distlab.acceptance", "distlab.acceptance.render",
    "distlab.backend", "distlab.bench", "distlab.bench.collectives", "distlab.bench.overlap",
    "distlab.bench.pp", "distlab.bench.ring", "distlab.bench.throughput", "distlab.bench.tp",
    "distlab.bench.trace", "distlab.checkpoint", "distlab.collectives",
    "distlab.collectives.broadcast_model", "distlab.collectives.p2p_check",
    "distlab.collectives.ring_traffic", "distlab.comm", "distlab.cp", "distlab.cp.layout",
    "distlab.data", "distlab.dp", "distlab.dp.channels", "distlab.fp8", "distlab.grading",
    "distlab.launch", "distlab.mesh", "distlab.model", "distlab.moe", "distlab.moe.router",
    "distlab.planner", "distlab.pp", "distlab.resilience",
    "distlab.resilience.failures", "distlab.resilience.flight", "distlab.resilience.quorum",
    "distlab.resilience.replicas", "distlab.resilience.sdc", "distlab.shards", "distlab.tp", "distlab.train",
    "distlab.units", "distlab.viz", "distlab.viz.bandwidth", "distlab.viz.fp8",
    "distlab.viz.pipeline", "distlab.viz.planner", "distlab.viz.ring", "distlab.viz.timeline",
    "distlab.viz.tp", "distlab.viz.training", "distlab.viz.zero", "distlab.zero",
    "distlab.zero.flat", "distlab.zero.kernel", "distlab.zero.memory", "ipywidgets",
    "matplotlib.pyplot", "numpy", "torch", "torch._dynamo", "torch.distributed", "torch.nn",
    "torch.nn.functional", "torch.utils.flop_counter",
))



def hidden_modules() -> list[str]:
    """Every module named in :data:`ANSWERS`: its source is absent from graded ranks."""
    return modules_of(ANSWERS)


def modules_of(exercises) -> list[str]:
    """The modules that hold the answers to ``exercises``: absent from the ranks of a
    grading run of any of them (:mod:`distlab.runtime.absent`)."""
    return sorted({ref.split(":")[0] for name in exercises for ref in ANSWERS.get(name, ())})


def absent_spec(exercises) -> dict:
    """What the graded ranks' fork server makes absent (:data:`distlab.runtime.absent.ENV`):
    the answers to the run's ``exercises`` before it imports anything, then every other
    answer module that the ranks' preloads did not import."""
    return {"modules": modules_of(exercises), "later": hidden_modules(), "message": REFUSAL}

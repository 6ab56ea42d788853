"""Pipeline parallelism: the model cut by layer into stages, one per rank, and
micro-batches flowing through them on a schedule (GPipe, 1F1B).

* :mod:`~distlab.pp.split`: the cut, balanced by FLOPs; tied weights across stages;
* :mod:`~distlab.pp.schedule`: schedule tables, their check, the ideal clock;
* :mod:`~distlab.pp.tables`: GPipe's and 1F1B's tables and their bubble (lab 07's
  answers);
* :mod:`~distlab.pp.p2p`: activations and gradients between stages, NCCL-safe groups,
  each link connected both ways first;
* :mod:`~distlab.pp.runtime`: one stage's training step, driven by a table (lab 07's
  answer to ``run_stage``); :mod:`~distlab.pp.loss`: the last stage's loss;
* :mod:`~distlab.pp.events`: what each stage did and when (:mod:`distlab.pp.bubble`
  measures the bubble from it); :mod:`~distlab.pp.trace`: the same timeline recorded
  from outside any ``run_stage`` (lab 07's exercise).
"""
from distlab.pp.bubble import idle_fraction, peak_live
from distlab.pp.loss import cross_entropy
from distlab.pp.runtime import PipelineRunner
from distlab.pp.schedule import TITLES, check_schedule, peak_in_flight, simulate
from distlab.pp.split import Stage, balance, layer_costs
from distlab.pp.tables import (SCHEDULES, bubble_fraction, build_schedule, gpipe_schedule,
                               one_f_one_b_schedule)
from distlab.pp.trace import traced_step

__all__ = ["SCHEDULES", "TITLES", "PipelineRunner", "Stage", "balance", "bubble_fraction",
           "build_schedule", "check_schedule", "cross_entropy", "gpipe_schedule",
           "idle_fraction", "layer_costs", "one_f_one_b_schedule", "peak_in_flight",
           "peak_live", "simulate", "traced_step"]

"""Lab 07's answers ``gpipe_schedule``, ``one_f_one_b_schedule`` and ``bubble_fraction``:
the schedule tables and their bubble. This module holds only answers: while one of them
is graded it is absent from the graded ranks (:mod:`distlab.grading.answers`); the
format of a table, its check and its ideal clock are in :mod:`distlab.pp.schedule`.

A schedule is a table with one row per stage: the ordered list of that stage's
actions, ``("F", i)`` the forward of micro-batch ``i`` and ``("B", i)`` its backward.

* **GPipe** (Huang et al. 2019, "GPipe"): every stage runs the m forwards, then the m
  backwards, first in first out (the order of torch's ``ScheduleGPipe``). Each stage
  holds the activations of all m micro-batches before its first backward.
* **1F1B**, PipeDream-Flush (Narayanan et al. 2021, "Memory-efficient pipeline-parallel
  DNN training", the schedule of Megatron-LM): stage s of p runs ``min(p-s-1, m)``
  forwards (warm-up), then alternates one forward and one backward (steady state),
  then runs the backwards left (cool-down). Stage s never holds more than
  ``min(p-s, m)`` micro-batches.

With the same forward time and the same backward time on every stage and free
communication, both keep each stage idle for ``(p-1)/(m+p-1)`` of the step (the
*bubble* of the GPipe paper).
"""
from __future__ import annotations

from distlab.pp.schedule import Table


def _check_sizes(num_stages, num_microbatches) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def gpipe_schedule(num_stages: int, num_microbatches: int) -> Table:
    """Per stage: F0 ... F(m-1), then B0 ... B(m-1)."""
    _check_sizes(num_stages, num_microbatches)
    m = num_microbatches
    return [[("F", i) for i in range(m)] + [("B", i) for i in range(m)]
            for _ in range(num_stages)]


def one_f_one_b_schedule(num_stages: int, num_microbatches: int) -> Table:
    """Per stage s: min(p-s-1, m) forwards (warm-up), then one forward and one backward
    alternating (steady state), then the backwards left (cool-down); micro-batches in
    increasing order."""
    _check_sizes(num_stages, num_microbatches)
    p, m = num_stages, num_microbatches
    table = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [("F", warmup + i), ("B", i)]
        actions += [("B", i) for i in range(m - warmup, m)]
        table.append(actions)
    return table


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def build_schedule(name: str, num_stages: int, num_microbatches: int) -> Table:
    """The table of schedule ``name`` ("gpipe" or "1f1b")."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](num_stages, num_microbatches)


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """The idle fraction of GPipe and 1F1B on equal stages: (p-1)/(m+p-1)."""
    _check_sizes(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)

"""Benchmarks, one module per question, each runnable as ``python -m distlab.bench.NAME``:

- :mod:`~distlab.bench.collectives`: nccl-tests-style sweeps of the collectives
  (also ``python -m distlab.bench``);
- :mod:`~distlab.bench.ring`: the ring all-reduce against the backend's own;
- :mod:`~distlab.bench.launch`: what a launch costs, cold and warm;
- :mod:`~distlab.bench.throughput`: tokens/s and MFU of data parallelism;
- :mod:`~distlab.bench.zero`: ZeRO's memory and kernel against the accounting and FSDP2;
- :mod:`~distlab.bench.tp`, :mod:`~distlab.bench.pp`, :mod:`~distlab.bench.overlap`:
  tensor parallelism, pipelines and overlap against torch's own.

Shared pieces: :mod:`~distlab.bench.timing` (how every bench times), :mod:`~distlab.bench.trace`
(profiler traces and step recordings). What the plots need lives below both
(:mod:`distlab.timeline`, :mod:`distlab.alphabeta`, :func:`distlab.backend.peak_flops`):
:mod:`distlab.viz` and :mod:`distlab.train` never import a bench.
"""
from distlab import alphabeta  # noqa: F401  (distlab.bench.alphabeta, as lab 01 imports it)

"""Collectives built by hand, and the tools to check them:

- :mod:`~distlab.collectives.ring`: ring reduce-scatter, all-gather and all-reduce over send/recv;
- :mod:`~distlab.collectives.ring_layout`: a ring's neighbours, chunks and pieces;
- :mod:`~distlab.collectives.ring_traffic`: what a ring sends, checked against a log, step by step;
- :mod:`~distlab.collectives.broadcast`: the chunked, pipelined broadcast;
- :mod:`~distlab.collectives.broadcast_model`: its cost model, and its fit to measured times;
- :mod:`~distlab.collectives.bandwidth`: nccl-tests' bus bandwidth of a collective;
- :mod:`~distlab.collectives.ps`: a parameter server over broadcast and reduce;
- :mod:`~distlab.collectives.ps_sharded`: the parameter sharded over every rank (push a
  reduce-scatter, pull an all-gather), and SGD on stale parameters (bounded delay);
- :mod:`~distlab.collectives.nccl_raw`: NCCL's C API through ``cupy.cuda.nccl`` (GPU only);
- :mod:`~distlab.collectives.p2p_check`: NCCL's point-to-point rules, checked on a CPU.
"""

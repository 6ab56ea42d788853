"""The library's answers that have not yet moved into the package of their parallel
dimension (docs/design.md, "Where the answers go"): lab 01's bus factor
(:mod:`~distlab.reference.bandwidth`); lab 05's shards (:mod:`~distlab.reference.shards`),
bytes per rank (:mod:`~distlab.reference.memory`), ZeRO-2 step, flat units and AdamW
(:mod:`~distlab.reference.zero`) and ZeRO-3 wrapper (:mod:`~distlab.reference.fsdp`);
lab 09's rank grid, composed train step and unit gradients (:mod:`~distlab.reference.mesh`,
:mod:`~distlab.reference.train`, :mod:`~distlab.reference.grads`); and lab 10's FP8 casts
(:mod:`~distlab.reference.fp8`). The answers of labs 04, 06, 07 and 08 are in
:mod:`distlab.dp.ddp`, :mod:`distlab.tp.layers`, :mod:`distlab.pp.tables` and
:mod:`distlab.pp.runtime`. :mod:`distlab.grading.answers` lists every answer's module.
The rest of the library uses them through the modules that re-export them
(:mod:`distlab.comm`, :mod:`distlab.shards`, :mod:`distlab.zero`, :mod:`distlab.mesh`,
:mod:`distlab.train`, :mod:`distlab.fp8`), whose documentation says what they do, not
how.

**Reading this package before your exercise is graded defeats the exercise.** While an
exercise is graded, the modules holding its answers are absent from the processes that
run the student's code (:mod:`distlab.runtime.absent`).

No module here imports a module that re-exports from it (no import cycles), and each
module here imports first (``tests/test_layout.py``).
"""

"""The library's answers to the labs' graded exercises, and the code built on them.

Everything here is what a lab asks a student to write (or its core): lab 01's bus
factor (:mod:`~distlab.reference.bandwidth`); the shards of lab 05
(:mod:`~distlab.reference.shards`), its ZeRO-2 step, flat units and AdamW
(:mod:`~distlab.reference.zero`) and ZeRO-3 wrapper (:mod:`~distlab.reference.fsdp`);
the tensor-parallel operators and layers and the vocabulary-parallel cross-entropy of
lab 06 (:mod:`~distlab.reference.tp`); the pipeline schedules and stage runtime of
lab 07 (:mod:`~distlab.reference.pp`); the data-parallel wrappers of labs 04 and 08
(:mod:`~distlab.reference.dp`); lab 09's rank grid and composed train step
(:mod:`~distlab.reference.mesh`, :mod:`~distlab.reference.train`); and lab 10's FP8 casts
(:mod:`~distlab.reference.fp8`). The rest of the library uses them through the modules
that re-export them (:mod:`distlab.comm`, :mod:`distlab.shards`, :mod:`distlab.zero`,
:mod:`distlab.dp`, :mod:`distlab.tp`, :mod:`distlab.pp`, :mod:`distlab.mesh`,
:mod:`distlab.train`, :mod:`distlab.fp8`), whose documentation says what they do, not
how.

**Reading this package before your exercise is graded defeats the exercise.** The
grader refuses calls to these answers while it grades the exercise they answer.

No module here imports a module that re-exports from it (no import cycles); one that
needs a submodule of a package re-exporting it imports it where it uses it
(:mod:`~distlab.reference.pp`), and each module here imports first
(``tests/test_layout.py``).
"""

"""Lab 09's answer ``distributed_train_step``, grown into the composed trainer: each
ZeRO-2 bucket's reduce-scatter issued from backward, as soon as the bucket's last
gradient of the step's last micro-batch is accumulated, while the pipeline's backward
computes the earlier layers (PyTorch DDP's bucketing, Li et al. 2020, applied to
ZeRO-2's reduce-scatter). Everything else is :class:`distlab.train.trainer.Trainer`'s;
made by ``distlab.train.build(..., overlap=True)``.

A post-accumulate-grad hook counts each parameter's accumulations up to the number of
micro-batches (a parameter's gradient is complete only after its last micro-batch's
backward, not after its first). One exception: a weight tied between the first and the
last stage (the embedding and the head, pp > 1) gets its gradient summed between the
two stages by the runner *after* the pipeline's backward, so its bucket is
reduce-scattered then.
"""
from __future__ import annotations

import functools
import time
import weakref

from distlab.train.trainer import Trainer


class OverlappedTrainer(Trainer):
    """:class:`Trainer` with each bucket's reduce-scatter issued from backward. With
    ``trace = []`` it also records when each gradient was accumulated."""

    def __init__(self, stage, mesh, **options):
        super().__init__(stage, mesh, **options)
        self._seen = [0] * len(self.buckets)
        self._expected = [0] * len(self.buckets)
        me = weakref.ref(self)
        for b, bucket in enumerate(self.buckets):
            if not bucket.late:
                for q in bucket.flat.params:
                    q.register_post_accumulate_grad_hook(functools.partial(_grad_ready, me, b))

    def _begin(self) -> None:
        super()._begin()
        for b, bucket in enumerate(self.buckets):
            self._seen[b] = 0
            self._expected[b] = 0 if bucket.late else self.microbatches * len(bucket.flat.params)

    def _bucket_ready(self, b: int) -> None:
        self._seen[b] += 1
        if self.trace is not None:
            self.trace.append(("grad", time.perf_counter(), b))
        if self._seen[b] == self._expected[b]:
            self.buckets[b].launch(self.trace, b)


def _grad_ready(trainer_ref, index: int, _param) -> None:
    trainer = trainer_ref()
    if trainer is not None:
        trainer._bucket_ready(index)

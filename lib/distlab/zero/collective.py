"""What ZeRO's units need of their process group besides lab 05's collectives
(:mod:`distlab.zero.flat`): a collective in flight (:class:`Pending`) and the group's
source rank."""
from __future__ import annotations

import torch.distributed as dist


class Pending:
    """An issued collective: :meth:`wait` waits for it and returns its finished result.
    The work handle is dropped before the result is finished, so the collective's input
    buffer (which the handle keeps alive) is freed before ``finish`` allocates."""

    def __init__(self, work, finish):
        self.work, self.finish = work, finish

    def wait(self):
        work, self.work = self.work, None
        if work is not None:
            work.wait()
        del work
        return self.finish()


def source_rank(group) -> int:
    """The global rank of ``group``'s first rank (the source of construction-time
    broadcasts)."""
    return dist.get_global_rank(group, 0) if group is not None else 0

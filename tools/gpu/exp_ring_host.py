"""Experiment: is the ring at 64 MiB (2 NCCL ranks) paced by the host? The reference ring
beside variants whose exchange costs the host less: torch's coalescing manager without
P2POp objects, and the process group's own send/recv between _start/_end_coalescing.
Eager and in CUDA graphs. Run: python3 tools/gpu/exp_ring_host.py [sizes...]"""
import functools, sys
import torch.distributed as dist
from distlab import ring, ring_bench
from distlab.bench import parse_size


def coalesced_exchange(self, send, land):
    from torch.distributed.distributed_c10d import _coalescing_manager
    with _coalescing_manager(self.group, send.device, async_ops=True) as cm:
        if send.numel():
            dist.isend(send, self.next, self.group)
        if land.numel():
            dist.irecv(land, self.prev, self.group)
    return [cm]


def pg_exchange(self, send, land):
    pg = self.group or dist.group.WORLD
    nxt, prv = dist.get_group_rank(pg, self.next), dist.get_group_rank(pg, self.prev)
    pg._start_coalescing(send.device)
    if send.numel():
        pg.send([send], nxt, 0)
    if land.numel():
        pg.recv([land], prv, 0)
    return [pg._end_coalescing(send.device)]


def with_exchange(exchange, tensor, group=None):
    saved, ring._Ring._exchange = ring._Ring._exchange, exchange
    try:
        return ring.ring_allreduce(tensor, group)
    finally:
        ring._Ring._exchange = saved


CONTENDERS = {"reference ring": ring.ring_allreduce,
              "coalesced": functools.partial(with_exchange, coalesced_exchange),
              "pg calls": functools.partial(with_exchange, pg_exchange)}

if __name__ == "__main__":
    sizes = [parse_size(s) for s in sys.argv[1:]] or [64 << 20, 128 << 20]
    for graph in (False, True):
        try:
            r = ring_bench.measure("all_reduce", sizes, 2, "nccl", rounds=15, iters=10,
                                   contenders=CONTENDERS, graph=graph, timeout=200)
            print(r.table(), flush=True)
        except Exception as exc:  # noqa: BLE001 - an experiment: say what failed, go on
            print(f"graph={graph}: {type(exc).__name__}: {exc}"[:2000], flush=True)

"""The raw NCCL API through CuPy: a clear error without CuPy; on a GPU, the unique id
through the store, the collectives on raw pointers, grouped send/recv."""
import importlib.util

import pytest
import torch
import torch.distributed as dist

from distlab import launch
from distlab.collectives import nccl_raw
from distlab.grading import expect_close


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
def test_missing_cupy_names_the_install_command():
    with pytest.raises(ImportError, match=r"pip install -e '\.\[gpu\]'"):
        nccl_raw.nccl()


def _raw_collectives():
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    comm = nccl_raw.communicator()
    t = torch.arange(1000, dtype=torch.float32, device=device) * (rank + 1)
    nccl_raw.all_reduce(comm, t)
    for dtype in (torch.bfloat16, torch.int64):
        u = torch.full((17,), rank + 1, dtype=dtype, device=device)
        nccl_raw.all_reduce(comm, u, op="max")
        expect_close(u.cpu(), torch.full((17,), world, dtype=dtype), f"max in {dtype}")
    send = torch.full((513,), float(rank), device=device)
    recv = torch.empty_like(send)
    nccl_raw.sendrecv(comm, send, (rank + 1) % world, recv, (rank - 1) % world)
    torch.cuda.current_stream().synchronize()
    expected = torch.arange(1000, dtype=torch.float32) * world * (world + 1) / 2
    expect_close(t.cpu(), expected, f"rank {rank}: allReduce sum")
    expect_close(recv.cpu(), torch.full((513,), float((rank - 1) % world)),
                 f"rank {rank}: ring shift by grouped send/recv")
    block = torch.full((5,), float(rank + 1), device=device)
    gathered = nccl_raw.all_gather(comm, torch.empty(5 * world, device=device), block)
    scattered = nccl_raw.reduce_scatter(comm, torch.empty(5, device=device),
                                        torch.arange(5.0 * world, device=device))
    root_value = nccl_raw.broadcast(comm, torch.full((3,), float(rank), device=device), root=0)
    reduced = nccl_raw.reduce(comm, torch.full((3,), float(rank + 1), device=device), root=0)
    torch.cuda.current_stream().synchronize()
    expect_close(gathered.cpu(), torch.arange(1, world + 1.0).repeat_interleave(5), "allGather")
    expect_close(scattered.cpu(), torch.arange(5.0 * rank, 5.0 * rank + 5) * world,
                 f"rank {rank}: reduceScatter")
    expect_close(root_value.cpu(), torch.zeros(3), "broadcast from rank 0")
    if rank == 0:
        expect_close(reduced.cpu(), torch.full((3,), world * (world + 1) / 2), "reduce to rank 0")
    with pytest.raises(ValueError, match="world_size"):
        nccl_raw.all_gather(comm, torch.empty(5 * world + 1, device=device), block)
    with pytest.raises(ValueError, match="GPU"):
        nccl_raw.all_reduce(comm, torch.zeros(3))
    with pytest.raises(ValueError, match="contiguous"):
        nccl_raw.all_reduce(comm, torch.zeros(4, 4, device=device).t())
    return world


@pytest.mark.gpu
def test_on_one_gpu():
    assert launch.run(_raw_collectives, 1, backend="nccl", timeout=120) == [1]


@pytest.mark.multigpu
def test_on_every_gpu():
    from distlab import backend

    n = backend.gpu_count()
    assert launch.run(_raw_collectives, n, backend="nccl", timeout=120) == [n] * n

"""Lab 01, exercise pipelined_broadcast: a chunked ring broadcast over send/recv only."""
import pytest
import torch
import torch.distributed as dist

from distlab import launch
from distlab.comm import CommLog
from distlab.grading import expect_close

NOTEBOOK = "01_primitives"
CASES = [((10,), 3, torch.float32), ((7,), 1, torch.float32), ((1,), 4, torch.float32),
         ((3, 5), 4, torch.float64), ((1000,), 16, torch.float32), ((13,), 5, torch.int64)]
RECEIVES = ("recv", "irecv")


def _data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


def _broadcast_cases(pipelined_broadcast, members=None):
    """Every source and case on the ranks of ``members`` (None: all ranks). Returns, per
    case, (src, numel, chunk sizes, bytes this rank sent, its received message sizes,
    collectives it called)."""
    rank = dist.get_rank()
    group = dist.new_group(members) if members is not None else None
    members = members if members is not None else list(range(dist.get_world_size()))
    if rank not in members:
        t = torch.full((5,), -1.0)
        return [("outside", t)]
    where = f"group {members}" if group is not None else f"{len(members)} ranks"
    seen = []
    for src in members:
        for shape, chunks, dtype in CASES:
            expected = _data(shape, dtype, seed=src * 100 + chunks)
            t = expected.clone() if rank == src else torch.zeros(shape, dtype=dtype)
            with CommLog() as log:
                pipelined_broadcast(t, src, chunks, group=group)
            expect_close(t, expected, f"rank {rank} after pipelined_broadcast(src={src}, "
                         f"num_chunks={chunks}) of a {dtype} tensor of shape {shape} on {where} "
                         f"(must equal rank {src}'s tensor, in place)")
            sizes = [c.numel() * t.element_size()
                     for c in torch.tensor_split(t.reshape(-1), chunks) if c.numel()]
            seen.append((src, shape, chunks, sizes, log.bytes_sent(),
                         [e.nbytes for e in log.select(RECEIVES) if e.nbytes],
                         [e.op for e in log.collectives()]))
    return seen


def _check_how(results, members):
    for rank, seen in enumerate(results):
        if rank not in members:
            continue
        for src, shape, chunks, sizes, sent, received, collectives in seen:
            case = f"rank {rank}, src={src}, shape {shape}, num_chunks={chunks}"
            assert not collectives, (
                f"{case}: use only send/recv (or isend/irecv); the log shows {collectives}")
            nbytes = sum(sizes)
            assert sent <= nbytes, (
                f"{case}: this rank sent {sent} bytes for a {nbytes}-byte tensor. In a ring "
                f"broadcast every rank forwards the tensor once, to its successor; it must not "
                f"send to several ranks (that is a star, and the source becomes the bottleneck)")
            if rank == src:
                assert not received, f"{case}: the source received {received}; it must only send"
            else:
                assert received == sizes, (
                    f"{case}: this rank received messages of {received} bytes; expected one "
                    f"message per chunk of torch.tensor_split(tensor.view(-1), num_chunks): "
                    f"{sizes} bytes, in order")
    senders = sum(sum(s[4] for s in results[r]) for r in members)
    expected_total = sum(sum(s[3]) for s in results[members[0]]) * (len(members) - 1)
    assert senders == expected_total, (
        f"the ranks sent {senders} bytes in all; a broadcast to {len(members) - 1} other ranks "
        f"needs exactly {expected_total} (each rank other than the source receives the tensor "
        f"once)")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_equals_broadcast(student, world_size):
    results = launch.run(_broadcast_cases, world_size, student.pipelined_broadcast,
                         backend="gloo", timeout=30)
    _check_how(results, list(range(world_size)))


def test_on_a_subgroup(student):
    members = [0, 2, 3]
    results = launch.run(_broadcast_cases, 4, student.pipelined_broadcast, members,
                         backend="gloo", timeout=30)
    expect_close(results[1][0][1], torch.full((5,), -1.0),
                 "rank 1 is outside the group and must be left alone")
    _check_how(results, members)


def _on_gpu(pipelined_broadcast):
    from distlab import backend

    device = backend.device()
    expected = torch.arange(1000, dtype=torch.float32, device=device)
    t = expected.clone() if dist.get_rank() == 0 else torch.zeros_like(expected)
    pipelined_broadcast(t, 0, 7)
    expect_close(t.cpu(), expected.cpu(), f"rank {dist.get_rank()}: broadcast on the GPU")


@pytest.mark.gpu
def test_on_gpu(student):
    launch.run(_on_gpu, 1, student.pipelined_broadcast, backend="nccl", timeout=60)


@pytest.mark.multigpu
def test_on_several_gpus(student):
    from distlab import backend

    launch.run(_on_gpu, backend.gpu_count(), student.pipelined_broadcast, backend="nccl",
               timeout=60)

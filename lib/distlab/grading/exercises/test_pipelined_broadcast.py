"""Lab 01, exercise pipelined_broadcast: a chunked ring broadcast over send/recv only.

The ranks run the student's function and return plain data (the tensor afterwards,
what the function returned, the CommLog records); every check runs here.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from distlab import launch
from distlab.comm import CommLog
from distlab.grading import expect_close
from distlab.collectives.p2p_check import nccl_deadlock

NOTEBOOK = "01_primitives"
CASES = [((10,), 3, torch.float32), ((7,), 1, torch.float32), ((1,), 4, torch.float32),
         ((3, 5), 4, torch.float64), ((1000,), 16, torch.float32), ((13,), 5, torch.int64)]
SUBGROUP = (0, 2, 3)  # of 4 ranks: src is a global rank; rank 1 is outside
RECEIVES = ("recv", "irecv")
SENDS = ("send", "isend")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get _data


def _data(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


def _cases(members):
    return [(src, shape, chunks, dtype) for src in members for shape, chunks, dtype in CASES]


def _run(pipelined_broadcast, members):
    """Every source and case on the ranks of ``members``; plain data back."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(members)) if len(members) < world else None
    if rank not in members:
        t = torch.full((5,), -1.0)
        try:
            out = pipelined_broadcast(t, members[0], 3, group=group)
        except NotImplementedError:
            raise
        except Exception as exc:
            return {"outside": (f"raised {type(exc).__name__}: {exc}", t)}
        return {"outside": (f"returned a {type(out).__name__}", t)}
    found = []
    for src, shape, chunks, dtype in _cases(members):
        expected = _data(shape, dtype, seed=src * 100 + chunks)
        t = expected.clone() if rank == src else torch.zeros(shape, dtype=dtype)
        with CommLog() as log:
            pipelined_broadcast(t, src, chunks, group=group)
        found.append({"tensor": t, "log": log.records()})
    return {"cases": found}


_runs = {}


def _outcome(student, members, world_size):
    key = (tuple(members), world_size)
    if key not in _runs:
        try:
            _runs[key] = launch.run(_run, world_size, student.pipelined_broadcast,
                                    tuple(members), backend="gloo", timeout=30)
        except launch.LaunchError as exc:
            _runs[key] = exc
    if isinstance(_runs[key], Exception):
        raise _runs[key]
    return _runs[key]


def _case(rank, src, shape, chunks, dtype, members, world_size):
    where = f"group {list(members)}" if len(members) < world_size else f"{world_size} ranks"
    return (f"rank {rank}, pipelined_broadcast(src={src}, num_chunks={chunks}) of a "
            f"{str(dtype).removeprefix('torch.')} tensor of shape {shape} on {where}")


def _check_values(runs, members, world_size):
    for rank in members:
        for (src, shape, chunks, dtype), found in zip(_cases(members), runs[rank]["cases"]):
            expect_close(found["tensor"], _data(shape, dtype, seed=src * 100 + chunks),
                         f"{_case(rank, src, shape, chunks, dtype, members, world_size)} "
                         f"(must equal rank {src}'s tensor, in place)")


def _check_traffic(runs, members, world_size):
    # Self-reported (CommLog only): bytes cannot tell. gloo's broadcast, called behind the
    # tracer's back, moves (K-1)·N in all, as a chain does (and as a star does); who sent
    # to whom only the log shows (wire.py).
    total = 0
    for rank in members:
        for (src, shape, chunks, dtype), found in zip(_cases(members), runs[rank]["cases"]):
            case = _case(rank, src, shape, chunks, dtype, members, world_size)
            log = CommLog.from_records(found["log"], rank)
            collectives = [e.op for e in log.collectives()]
            assert not collectives, (
                f"{case}: use only point-to-point calls; the log shows {collectives}")
            sizes = [c.numel() * c.element_size() for c in
                     torch.tensor_split(torch.empty(shape, dtype=dtype).reshape(-1), chunks)
                     if c.numel()]
            sent, nbytes = log.bytes_sent(), sum(sizes)
            total += sent
            assert sent <= nbytes, (
                f"{case}: this rank sent {sent} bytes for a {nbytes}-byte tensor. In a ring "
                f"broadcast every rank forwards the tensor once, to its successor; it must not "
                f"send to several ranks (that is a star, and the source becomes the bottleneck)")
            received = [e.nbytes for e in log.select(RECEIVES) if e.nbytes]
            if rank == src:
                assert not received, f"{case}: the source received {received}; it must only send"
            else:
                assert received == sizes, (
                    f"{case}: this rank received messages of {received} bytes; expected one "
                    f"message per chunk of torch.tensor_split(tensor.view(-1), num_chunks): "
                    f"{sizes} bytes, in order")
    want = sum(torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
               for _, shape, _, dtype in _cases(members)) * (len(members) - 1)
    assert total == want, (
        f"the ranks sent {total} bytes in all; a broadcast to {len(members) - 1} other ranks "
        f"needs exactly {want} (each rank other than the source receives the tensor once)")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_equals_broadcast(student, world_size):
    members = tuple(range(world_size))
    _check_values(_outcome(student, members, world_size), members, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_chain_traffic(student, world_size):
    members = tuple(range(world_size))
    _check_traffic(_outcome(student, members, world_size), members, world_size)


def test_on_a_subgroup(student):
    runs = _outcome(student, SUBGROUP, 4)
    _check_values(runs, SUBGROUP, 4)
    _check_traffic(runs, SUBGROUP, 4)


def test_outside_the_group(student):
    what, t = _outcome(student, SUBGROUP, 4)[1]["outside"]
    assert what == "returned a NoneType", (
        f"rank 1 is not a member of the group {list(SUBGROUP)}; pipelined_broadcast should "
        f"return None at once there (as torch.distributed's collectives do), but it {what}")
    expect_close(t, torch.full((5,), -1.0), "rank 1's tensor, outside the group (it must be "
                                            "left as it was)")


def test_would_not_hang_on_nccl(student):
    """The calls of every rank, replayed under NCCL's rules (distlab.collectives.p2p_check)."""
    for members, world_size in (((0, 1), 2), ((0, 1, 2, 3), 4), (SUBGROUP, 4)):
        runs = _outcome(student, members, world_size)
        for i, (src, shape, chunks, dtype) in enumerate(_cases(members)):
            logs = [runs[r]["cases"][i]["log"] if r in members else None
                    for r in range(world_size)]
            problem = nccl_deadlock(logs)
            assert problem is None, (
                f"pipelined_broadcast(src={src}, num_chunks={chunks}) on "
                f"{f'group {list(members)}' if len(members) < world_size else f'{world_size} ranks'}"
                f" runs on gloo, but on GPUs it would not: {problem}")


def test_forwards_before_it_has_everything(student):
    """Store and forward (receive every chunk, then send them on) is not a pipeline. On
    NCCL a rank's calls run in the order issued, so the order of its calls in CommLog
    says which it is: a pipelined rank forwards chunk c before it posts the receive of
    chunk c+2 (step c+1 sends chunk c and receives chunk c+1)."""
    members = (0, 1, 2, 3)
    runs = _outcome(student, members, 4)
    for i, (src, shape, chunks, dtype) in enumerate(_cases(members)):
        for rank in members:
            pos = (rank - src) % 4
            if pos in (0, 3):
                continue  # the source only sends, the end of the chain only receives
            calls = [e.op for e in CommLog.from_records(runs[rank]["cases"][i]["log"]).events
                     if e.op in SENDS + RECEIVES and e.nbytes]
            recvs = [k for k, op in enumerate(calls) if op in RECEIVES]
            sends = [k for k, op in enumerate(calls) if op in SENDS]
            for c in range(min(len(sends), len(recvs) - 2)):
                assert sends[c] < recvs[c + 2], (
                    f"{_case(rank, src, shape, chunks, dtype, members, 4)}: this rank posted "
                    f"the receive of chunk {c + 2} before it forwarded chunk {c} (its calls, in "
                    f"order: {', '.join(calls)}). On NCCL a rank's calls run one after the "
                    f"other in the order issued, so it forwards nothing until those receives "
                    f"are done; receiving every chunk before sending any is store and forward, "
                    f"(K-1)·N/B instead of (1+(K-2)/S)·N/B. Forward chunk c together with the "
                    f"receive of chunk c+1 (one batch_isend_irecv per step).")


def test_the_chain_follows_the_group_order(student):
    """The chain is src, then the members that follow it in the order of
    dist.get_process_group_ranks(group), wrapping around: each rank receives only from
    its predecessor and sends only to its successor (global ranks), on 4 ranks and on
    the group [0, 2, 3] of 4."""
    for members, world_size in (((0, 1, 2, 3), 4), (SUBGROUP, 4)):
        runs, k = _outcome(student, members, world_size), len(members)
        for i, (src, shape, chunks, dtype) in enumerate(_cases(members)):
            start = members.index(src)
            chain = [members[(start + j) % k] for j in range(k)]
            for pos, rank in enumerate(chain):
                prev = chain[pos - 1] if pos else None
                succ = chain[pos + 1] if pos < k - 1 else None
                log = CommLog.from_records(runs[rank]["cases"][i]["log"], rank)
                for e in log.select(SENDS + RECEIVES):
                    right = succ if e.op in SENDS else prev
                    assert e.peer == right, (
                        f"{_case(rank, src, shape, chunks, dtype, members, world_size)}: its "
                        f"{e.describe()}; the chain is {' -> '.join(map(str, chain))} (src, "
                        f"then the members that follow it in the order of "
                        f"dist.get_process_group_ranks(group), wrapping around), so this rank "
                        f"receives only from {prev} and sends only to {succ}")


def _on_gpu(pipelined_broadcast):
    from distlab import backend

    device = backend.device()
    expected = torch.arange(1000, dtype=torch.float32, device=device)
    t = expected.clone() if dist.get_rank() == 0 else torch.zeros_like(expected)
    pipelined_broadcast(t, 0, 7)
    return t.cpu()


def _check_gpu(results):
    for rank, t in enumerate(results):
        expect_close(t, torch.arange(1000, dtype=torch.float32),
                     f"rank {rank}: broadcast on the GPU")


@pytest.mark.gpu
def test_on_gpu(student):
    _check_gpu(launch.run(_on_gpu, 1, student.pipelined_broadcast, backend="nccl", timeout=60))


@pytest.mark.multigpu
def test_on_several_gpus(student):
    from distlab import backend

    _check_gpu(launch.run(_on_gpu, backend.gpu_count(), student.pipelined_broadcast,
                          backend="nccl", timeout=60))

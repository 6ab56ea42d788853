"""The C-level NCCL API, from Python, through ``cupy.cuda.nccl`` (GPU only).

torch.distributed hides NCCL behind process groups. Underneath, every NCCL program does
the same few things, which this module does one by one so that a lab can show them:

1. rank 0 calls ``ncclGetUniqueId`` and hands the 128-byte id to every other rank by
   some side channel (here: the launcher's key-value store, :func:`distlab.launch.store`);
2. each rank calls ``ncclCommInitRank(world_size, id, rank)`` on its own GPU: that
   builds the communicator (the topology, the rings and trees);
3. collectives take raw device pointers, an element count, a datatype, a reduction op
   and a CUDA stream, and are asynchronous: they are queued on the stream;
4. point-to-point ``ncclSend``/``ncclRecv`` calls that depend on each other (a rank
   that both sends and receives) go between ``ncclGroupStart``/``ncclGroupEnd``, which
   launches them together; issued one by one, a send waits for a receive that sits
   behind it in the peer's queue, and both ranks hang.

ROCm: AMD's RCCL implements the same API under the same names (``ncclCommInitRank``,
``ncclAllReduce``, ...). CuPy's ROCm packages build this very ``cupy.cuda.nccl`` module
against RCCL, and torch's ROCm builds expose HIP devices and streams as ``torch.cuda``,
so the code below runs unchanged there.

Needs CuPy: ``pip install -e '.[gpu]'`` (cupy-cuda12x; on ROCm a cupy-rocm package).
"""
from __future__ import annotations

import contextlib
import itertools
import pickle

import torch

_ids = itertools.count()  # ranks create communicators in the same order: same keys


def nccl():
    """The ``cupy.cuda.nccl`` module, with a clear error where CuPy is missing."""
    try:
        from cupy.cuda import nccl as module
    except ImportError as exc:
        raise ImportError(
            "distlab.collectives.nccl_raw needs CuPy built with NCCL (or RCCL on ROCm): install it with "
            "pip install -e '.[gpu]' (the cupy-cuda12x package), or pip install "
            f"cupy-rocm-<version> on ROCm. ({exc})") from exc
    if not getattr(module, "available", True):
        raise ImportError("this CuPy build has no NCCL support; install cupy-cuda12x with "
                          "pip install -e '.[gpu]'")
    return module


def _dtypes():
    m = nccl()
    names = {torch.float32: "NCCL_FLOAT32", torch.float64: "NCCL_FLOAT64",
             torch.float16: "NCCL_FLOAT16", torch.bfloat16: "NCCL_BFLOAT16",
             torch.int32: "NCCL_INT32", torch.int64: "NCCL_INT64", torch.uint8: "NCCL_UINT8",
             torch.int8: "NCCL_INT8"}
    return {dtype: getattr(m, name) for dtype, name in names.items() if hasattr(m, name)}


_OPS = {"sum": "NCCL_SUM", "prod": "NCCL_PROD", "max": "NCCL_MAX", "min": "NCCL_MIN",
        "avg": "NCCL_AVG"}


def pointer(tensor: torch.Tensor):
    """(pointer, count, datatype) of a contiguous CUDA tensor."""
    if not tensor.is_cuda:
        raise ValueError(f"NCCL moves GPU memory: the tensor is on {tensor.device}; "
                         f"put it on this rank's GPU (backend.device())")
    if not tensor.is_contiguous():
        raise ValueError("NCCL takes one raw pointer and a count: pass a contiguous tensor "
                         "(tensor.contiguous())")
    dtypes = _dtypes()
    if tensor.dtype not in dtypes:
        raise ValueError(f"no NCCL datatype for {tensor.dtype}; use one of "
                         f"{sorted(str(d) for d in dtypes)}")
    return tensor.data_ptr(), tensor.numel(), dtypes[tensor.dtype]


def _stream(stream) -> int:
    """A raw stream handle: torch's current stream by default, so that NCCL work is
    ordered after the torch kernels that produced the buffers."""
    stream = torch.cuda.current_stream() if stream is None else stream
    return stream.cuda_stream if isinstance(stream, torch.cuda.Stream) else int(stream)


def unique_id(key: str) -> tuple:
    """Rank 0 makes the NCCL unique id and posts it under ``key`` in the launcher's
    store; the other ranks wait for it there."""
    import torch.distributed as dist

    from distlab import launch

    store = launch.store()
    if dist.get_rank() == 0:
        uid = nccl().get_unique_id()
        store.set(key, pickle.dumps(uid))
        return uid
    return pickle.loads(store.get(key))


def communicator(world_size: int | None = None, rank: int | None = None):
    """``ncclCommInitRank(world_size, id, rank)`` on this rank's GPU (call it on every
    rank of the launch, in the same order). Returns a ``cupy.cuda.nccl.NcclCommunicator``."""
    import cupy
    import torch.distributed as dist

    world_size = dist.get_world_size() if world_size is None else world_size
    rank = dist.get_rank() if rank is None else rank
    device = torch.cuda.current_device()
    uid = unique_id(f"distlab/nccl_raw/{next(_ids)}")
    with cupy.cuda.Device(device):
        return nccl().NcclCommunicator(world_size, uid, rank)


def all_reduce(comm, tensor: torch.Tensor, op: str = "sum", stream=None) -> torch.Tensor:
    """``ncclAllReduce(ptr, ptr, count, datatype, op, comm, stream)``, in place (send
    and receive buffers may be the same). Queued on ``stream``; returns at once."""
    ptr, count, datatype = pointer(tensor)
    comm.allReduce(ptr, ptr, count, datatype, _op(op), _stream(stream))
    return tensor


def all_gather(comm, output: torch.Tensor, input: torch.Tensor, stream=None) -> torch.Tensor:
    """``ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream)``: rank r's
    ``input`` lands at block r of ``output`` (``world_size`` times as long)."""
    send, count, datatype = pointer(input)
    recv, total, _ = pointer(output)
    _check_blocks(comm, count, total, "all_gather", "output", "input")
    comm.allGather(send, recv, count, datatype, _stream(stream))
    return output


def reduce_scatter(comm, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                   stream=None) -> torch.Tensor:
    """``ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream)``:
    block r of ``input`` (``world_size`` times ``output``'s length), reduced over the
    ranks, lands in rank r's ``output``."""
    recv, count, datatype = pointer(output)
    send, total, _ = pointer(input)
    _check_blocks(comm, count, total, "reduce_scatter", "input", "output")
    comm.reduceScatter(send, recv, count, datatype, _op(op), _stream(stream))
    return output


def broadcast(comm, tensor: torch.Tensor, root: int = 0, stream=None) -> torch.Tensor:
    """``ncclBroadcast(ptr, ptr, count, datatype, root, comm, stream)``, in place."""
    ptr, count, datatype = pointer(tensor)
    comm.broadcast(ptr, ptr, count, datatype, root, _stream(stream))
    return tensor


def reduce(comm, tensor: torch.Tensor, root: int = 0, op: str = "sum", stream=None) -> torch.Tensor:
    """``ncclReduce(ptr, ptr, count, datatype, op, root, comm, stream)``, in place: the
    result lands in ``root``'s ``tensor``. NCCL only reads the others' (their receive
    buffer is unused), unlike torch's ``dist.reduce`` on gloo, which leaves partial
    sums in them."""
    ptr, count, datatype = pointer(tensor)
    comm.reduce(ptr, ptr, count, datatype, _op(op), root, _stream(stream))
    return tensor


def _op(op: str) -> int:
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    return getattr(nccl(), _OPS[op])


def _check_blocks(comm, count: int, total: int, name: str, big: str, small: str) -> None:
    if total != count * comm.size():
        raise ValueError(f"{name}: {big} must hold world_size ({comm.size()}) x {small} "
                         f"elements, {count * comm.size()}; it has {total}")


@contextlib.contextmanager
def group():
    """``ncclGroupStart()`` ... ``ncclGroupEnd()``: the calls inside launch together."""
    m = nccl()
    m.groupStart()
    try:
        yield
    finally:
        m.groupEnd()


def send(comm, tensor: torch.Tensor, peer: int, stream=None) -> None:
    """``ncclSend(ptr, count, datatype, peer, comm, stream)``."""
    ptr, count, datatype = pointer(tensor)
    comm.send(ptr, count, datatype, peer, _stream(stream))


def recv(comm, tensor: torch.Tensor, peer: int, stream=None) -> None:
    """``ncclRecv(ptr, count, datatype, peer, comm, stream)``."""
    ptr, count, datatype = pointer(tensor)
    comm.recv(ptr, count, datatype, peer, _stream(stream))


def sendrecv(comm, send_tensor: torch.Tensor, send_peer: int, recv_tensor: torch.Tensor,
             recv_peer: int, stream=None) -> None:
    """Send to one peer and receive from another, grouped so that neither waits for
    the other (a ring shift when every rank sends to rank+1)."""
    with group():
        send(comm, send_tensor, send_peer, stream)
        recv(comm, recv_tensor, recv_peer, stream)

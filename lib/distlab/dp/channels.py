"""How data parallelism's bucket all-reduces are issued so that they run while backward
goes on (overlapping communication with computation).

A *channel* launches an averaging all-reduce of a flat buffer without waiting for it,
and later waits for a list of such launches (:class:`distlab.dp.DataParallel` uses one):

- :class:`Handles`, the default on every backend: ``async_op=True`` returns a work handle
  at once. On CPUs (gloo) gloo's own threads run the collective and ``wait()`` blocks the
  caller until it is done; the collective's threads compete with the computation for
  the same cores. On GPUs (NCCL) torch runs each collective on an internal stream of its
  own, ordered after the stream current at the call by an event, and ``wait()`` makes
  the current stream wait for it: the picture below, done in C++.
- :class:`CommStream`, on GPUs: the picture of the course material made explicit. The
  host records an event on the compute stream once a bucket's gradients are written, a
  communication stream waits for that event and the all-reduce is issued there; before
  the optimizer step the compute stream waits for the communication stream. The host
  never blocks; the GPU runs the NCCL kernel beside backward's kernels. (torch's NCCL
  stream then waits for this one.) Its events and stream switches cost the host about
  0.2 ms per bucket in Python, which a host-bound step pays in full (two H200s, 4 x 1024
  tokens a GPU: 1.04-1.14x DDP's step time with it, 1.00-1.04x with handles), so
  :class:`~distlab.dp.DataParallel` uses it only when asked (``channel="stream"``).
- :class:`RawNccl`, on GPUs: ``ncclAllReduce`` called through ``cupy.cuda.nccl``
  (:mod:`distlab.collectives.nccl_raw`) on a stream of our own, ordered by events alone: the
  C-level picture, with no process group in between.

Each averages: ``ReduceOp.AVG`` where the backend has it (NCCL since 2.10; gloo since
torch 2.8, as a sum then a division), else a division of the buffer before a SUM.

"""
from __future__ import annotations

import torch
import torch.distributed as dist


CHANNELS = ("auto", "handles", "stream", "raw-nccl")


def average_op(group=None) -> tuple[dist.ReduceOp, bool]:
    """``(op, divide_first)``: the reduction that averages over ``group`` on this backend,
    and whether the buffer must be divided by the group's size before a SUM instead."""
    name = dist.get_backend(group)
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if name == "nccl" or (name == "gloo" and version >= (2, 8)):
        return dist.ReduceOp.AVG, False
    return dist.ReduceOp.SUM, True


class Handles:
    """Asynchronous all-reduces through torch.distributed's work handles (any backend)."""

    def __init__(self, group=None):
        self.group = group
        self.op, self.divide_first = average_op(group)
        self.world = dist.get_world_size(group)

    def launch(self, flat: torch.Tensor):
        """Start averaging ``flat`` over the group; returns the handle to wait on."""
        if self.divide_first:
            flat.div_(self.world)
        return dist.all_reduce(flat, op=self.op, group=self.group, async_op=True)

    def wait(self, handles) -> None:
        for h in handles:
            h.wait()


class CommStream(Handles):
    """The all-reduces on a CUDA communication stream, ordered by events (see the
    module docstring). ``stream`` is that stream."""

    def __init__(self, group=None, device=None):
        super().__init__(group)
        self.stream = torch.cuda.Stream(device)

    def launch(self, flat: torch.Tensor):
        ready = torch.cuda.Event()
        ready.record()                       # on the compute stream: the bucket is written
        self.stream.wait_event(ready)        # the comm stream starts no earlier
        with torch.cuda.stream(self.stream):
            return super().launch(flat)      # the collective is ordered after the comm stream

    def wait(self, handles) -> None:
        with torch.cuda.stream(self.stream):
            super().wait(handles)            # NCCL: the comm stream waits; the host does not
        done = torch.cuda.Event()
        done.record(self.stream)
        torch.cuda.current_stream().wait_event(done)  # the update waits for the averages


class RawNccl:
    """``ncclAllReduce`` (op ``ncclAvg``) through cupy on our own CUDA stream, over the
    default group's ranks (each builds one NCCL communicator of its own)."""

    def __init__(self, group=None, device=None):
        if group is not None:
            raise ValueError("the raw-nccl channel builds its communicator over every rank of "
                             "the launch; use channel='stream' with a process group")
        from distlab.collectives import nccl_raw

        self.comm = nccl_raw.communicator()
        self.stream = torch.cuda.Stream(device)

    def launch(self, flat: torch.Tensor) -> torch.cuda.Event:
        from distlab.collectives import nccl_raw

        ready = torch.cuda.Event()
        ready.record()
        self.stream.wait_event(ready)
        nccl_raw.all_reduce(self.comm, flat, op="avg", stream=self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        return done

    def wait(self, handles) -> None:
        for done in handles:
            torch.cuda.current_stream().wait_event(done)


def channel(kind: str = "auto", group=None, device: torch.device | None = None):
    """The channel ``kind`` for tensors on ``device``: "auto" and "handles" (Handles),
    "stream" (CommStream) or "raw-nccl" (RawNccl); the last two need CUDA tensors."""
    if kind not in CHANNELS:
        raise ValueError(f"channel must be one of {CHANNELS}, got {kind!r}")
    cuda = device is not None and torch.device(device).type == "cuda"
    if kind in ("stream", "raw-nccl") and not cuda:
        raise ValueError(f"channel={kind!r} needs the model on a CUDA device (it orders CUDA "
                         f"streams); use 'handles' or 'auto' on CPUs")
    if kind == "raw-nccl":
        return RawNccl(group, device)
    if kind == "stream":
        return CommStream(group, device)
    return Handles(group)

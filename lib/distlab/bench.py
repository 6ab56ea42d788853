"""nccl-tests-style sweeps: time, algbw and busbw per message size, and an alpha-beta fit.

    python -m distlab.bench                      # 4 ranks, every op, 4 KiB .. 16 MiB
    python -m distlab.bench --ops all_reduce --world-size 2 --max-bytes 64M

Definitions follow nccl-tests (doc/PERFORMANCE.md): ``size`` is the message in bytes
(the whole buffer of all_reduce/broadcast/reduce, the *output* of all_gather, the
*input* of reduce_scatter), ``algbw = size / time`` and ``busbw = algbw * factor(n)``
with nccl-tests' factors (:func:`distlab.comm.bus_factor`), so that busbw is the
bandwidth one link carried and can be compared with the hardware's peak.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from distlab import backend, comm, launch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn, warmup: int = 5, iters: int = 20, group=None) -> float:
    """Median wall time, in seconds, of ``fn()`` over ``iters`` calls after ``warmup``.

    Call it on every rank of ``group`` (or outside any process group). Each timed call
    starts right after a barrier, so that no rank's clock counts the others' lateness,
    and ends when this rank's device is idle again (GPU work is asynchronous: the clock
    waits for ``torch.cuda.synchronize``). A call's time is the slowest rank's (a
    collective is only done when every rank is done), and the median over calls resists
    the odd slow call. Every rank returns the same number.
    """
    if warmup < 0 or iters < 1:
        raise ValueError(f"need warmup >= 0 and iters >= 1, got {warmup} and {iters}")
    distributed = dist.is_available() and dist.is_initialized()
    device = backend.device()
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if distributed:
            dist.barrier(group=group)
            _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    if distributed:  # one collective for all the calls: the slowest rank's time of each
        slowest = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        times = slowest.tolist()
    return statistics.median(times)


OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "sendrecv")


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of a sweep, as nccl-tests prints it (bandwidths in bytes/s)."""

    op: str
    size: int          # bytes, as nccl-tests counts them (see the module docstring)
    count: int         # elements of that message
    dtype: str
    seconds: float     # median over the timed iterations, slowest rank
    algbw: float
    busbw: float


@dataclasses.dataclass(frozen=True)
class Fit:
    """The alpha-beta (latency-bandwidth) model ``t(size) = alpha + size / bandwidth``.

    Hockney's model; ``bandwidth`` is the algorithm bandwidth the op tends to for large
    messages, ``busbw`` that times the op's bus factor. ``half_size = alpha * bandwidth``
    is the message at which latency and transfer take equal time: below it an op is
    latency-bound, above it bandwidth-bound (it then reaches half its peak algbw).
    """

    op: str
    alpha: float
    bandwidth: float
    busbw: float

    @property
    def half_size(self) -> float:
        return self.alpha * self.bandwidth

    def seconds(self, size):
        return self.alpha + np.asarray(size, dtype=float) / self.bandwidth


def sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """Message sizes min, min*factor, ... up to max (nccl-tests' -b, -e, -f)."""
    if not 0 < min_bytes <= max_bytes or factor < 2:
        raise ValueError(f"need 0 < min_bytes <= max_bytes and factor >= 2, got "
                         f"{min_bytes}, {max_bytes}, {factor}")
    out = [min_bytes]
    while out[-1] * factor <= max_bytes:
        out.append(out[-1] * factor)
    return out


def _op(op: str, nbytes: int, dtype: torch.dtype, group):
    """(call, count): a closure running ``op`` once on buffers made here, and the
    element count of its message. Sizes round down to what the op can split evenly."""
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    device = backend.device()
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = max(nbytes // itemsize, 1)
    if op in ("all_gather", "reduce_scatter"):
        count = max(count // n, 1) * n

    def buffer(numel):
        return torch.ones(numel, dtype=dtype, device=device)

    if op == "all_reduce":
        t = buffer(count)
        call = lambda: dist.all_reduce(t, group=group)  # noqa: E731
    elif op == "all_gather":
        out, inp = buffer(count), buffer(count // n)
        call = lambda: comm.all_gather_into(out, inp, group=group)  # noqa: E731
    elif op == "reduce_scatter":
        out, inp = buffer(count // n), buffer(count)
        call = lambda: comm.reduce_scatter_into(out, inp, group=group)  # noqa: E731
    elif op == "broadcast":
        t = buffer(count)
        root = dist.get_global_rank(group, 0) if group is not None else 0
        call = lambda: dist.broadcast(t, src=root, group=group)  # noqa: E731
    elif op == "reduce":
        t = buffer(count)
        root = dist.get_global_rank(group, 0) if group is not None else 0
        call = lambda: dist.reduce(t, dst=root, group=group)  # noqa: E731
    elif op == "sendrecv":
        if n < 2:
            raise ValueError("sendrecv needs at least 2 ranks (each sends to the next)")
        send, recv = buffer(count), buffer(count)
        peers = dist.get_process_group_ranks(group) if group is not None else list(range(n))

        def call():
            ops = [dist.P2POp(dist.isend, send, peers[(rank + 1) % n], group),
                   dist.P2POp(dist.irecv, recv, peers[(rank - 1) % n], group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    else:
        raise ValueError(f"unknown op {op!r}; choose from {OPS}")
    return call, count


def sweep(ops=OPS, message_sizes=None, dtype: torch.dtype = torch.float32, warmup: int = 5,
          iters: int = 20, group=None) -> list[Row]:
    """Time every op at every size on the ranks of ``group``; call it on each of them
    (inside a launched function). Every rank returns the same rows. sendrecv is left
    out on a single rank (it has no peer)."""
    message_sizes = message_sizes or sizes(4 << 10, 16 << 20)
    n = dist.get_world_size(group)
    ops = [op for op in ops if not (op == "sendrecv" and n < 2)]
    for op in ops:
        if op not in OPS:
            raise ValueError(f"unknown op {op!r}; choose from {OPS}")
    cases = [(op, size) for op in ops for size in message_sizes]
    rows = []
    for op, size in launch.progress(cases, desc=f"bench on {n} rank(s)"):
        call, count = _op(op, size, dtype, group)
        seconds = time_op(call, warmup, iters, group)
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        algbw = nbytes / seconds
        rows.append(Row(op, nbytes, count, str(dtype).removeprefix("torch."), seconds,
                        algbw, algbw * comm.bus_factor(op, n)))
    return rows


def fit(rows: list[Row]) -> Fit:
    """Least-squares alpha-beta fit of one op's rows, in relative error (each size
    weighs the same, small messages included, instead of the largest dominating)."""
    ops = {r.op for r in rows}
    if len(ops) != 1 or len(rows) < 2:
        raise ValueError(f"fit one op over at least 2 sizes, got {len(rows)} rows of {ops}")
    size = np.array([r.size for r in rows], dtype=float)
    t = np.array([r.seconds for r in rows])
    design = np.stack([np.ones_like(size), size], axis=1) / t[:, None]
    (alpha, inv_bw), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    bandwidth = 1.0 / inv_bw if inv_bw > 0 else float("inf")
    factor = rows[0].busbw / rows[0].algbw if rows[0].algbw else 0.0
    return Fit(rows[0].op, float(alpha), float(bandwidth), float(bandwidth * factor))


def fits(rows: list[Row]) -> dict[str, Fit]:
    """One fit per op present in ``rows``."""
    by_op: dict[str, list[Row]] = {}
    for r in rows:
        by_op.setdefault(r.op, []).append(r)
    return {op: fit(rs) for op, rs in by_op.items() if len(rs) >= 2}


def table(rows: list[Row]) -> str:
    """nccl-tests' columns (time in us, bandwidths in GB/s = 1e9 B/s), one block per op,
    each followed by its alpha-beta fit."""
    fitted = fits(rows)
    header = f"{'size':>12} {'count':>12} {'type':>8} {'time(us)':>11} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"
    lines = []
    for op in dict.fromkeys(r.op for r in rows):
        lines += [f"# {op}", "#" + header[1:]]
        lines += [f"{r.size:>12} {r.count:>12} {r.dtype:>8} {r.seconds * 1e6:>11.1f} "
                  f"{r.algbw / 1e9:>12.3f} {r.busbw / 1e9:>12.3f}" for r in rows if r.op == op]
        if op in fitted and fitted[op].bandwidth == float("inf"):
            lines.append(f"# alpha-beta fit: latency {fitted[op].alpha * 1e6:.1f} us and no "
                         f"size dependence: nothing crossed a link (one rank?)")
        elif op in fitted:
            f = fitted[op]
            lines.append(f"# alpha-beta fit: latency {f.alpha * 1e6:.1f} us, algbw "
                         f"{f.bandwidth / 1e9:.3f} GB/s (busbw {f.busbw / 1e9:.3f} GB/s), "
                         f"latency = transfer at {comm.human_bytes(f.half_size)}")
        lines.append("")
    return "\n".join(lines).rstrip()


def run(ops=OPS, message_sizes=None, world_size: int = 4, backend: str = "auto",
        dtype: torch.dtype = torch.float32, warmup: int = 5, iters: int = 20,
        timeout: float = 600.0) -> list[Row]:
    """Launch ``world_size`` ranks and sweep; the rows (from rank 0)."""
    return launch.run(sweep, world_size, tuple(ops), message_sizes, dtype, warmup, iters,
                      backend=backend, timeout=timeout)[0]


def parse_size(text: str) -> int:
    """'4K', '16M', '1G' or a plain number of bytes (powers of 1024, as nccl-tests)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in units else ""
    return int(float(text[: len(text) - len(unit)]) * units[unit])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m distlab.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated ops")
    parser.add_argument("-b", "--min-bytes", default="4K", type=parse_size)
    parser.add_argument("-e", "--max-bytes", default="16M", type=parse_size)
    parser.add_argument("-f", "--factor", default=2, type=int, help="size multiplier per step")
    parser.add_argument("-n", "--world-size", type=int,
                        default=int(os.environ.get("WORLD_SIZE", 4)), help="ranks")
    parser.add_argument("--backend", default="auto", choices=("auto", "nccl", "rccl", "gloo"))
    parser.add_argument("--dtype", default="float32", help="torch dtype name")
    parser.add_argument("-w", "--warmup", default=5, type=int)
    parser.add_argument("-i", "--iters", default=20, type=int)
    parser.add_argument("--plot", default="bench_busbw.png",
                        help="where to save the busbw-vs-size plot ('' for none)")
    args = parser.parse_args(argv)
    from distlab import backend as backends

    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        parser.error(f"--dtype {args.dtype!r} is not a torch dtype (float32, bfloat16, ...)")
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        parser.error(f"unknown op(s) {unknown}; choose from {', '.join(OPS)}")
    print(f"# {backends.explain(args.world_size, args.backend)}; torch {torch.__version__}")
    print(f"# warm-up {args.warmup}, median of {args.iters} iterations, slowest rank")
    if args.world_size == 1:
        print("# one rank: nothing crosses a link, so the times are the per-call latency and "
              "the bandwidths say nothing about the hardware")
    rows = run(ops, sizes(args.min_bytes, args.max_bytes, args.factor), args.world_size,
               args.backend, dtype, args.warmup, args.iters)
    print(table(rows))
    if args.plot:
        from distlab.viz import bandwidth

        title = f"{backends.explain(args.world_size, args.backend)}"
        bandwidth.plot_busbw(rows, title=title).savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"# plot: {args.plot}")


if __name__ == "__main__":
    main()

"""The benchmark: time_op's barrier/median/slowest-rank semantics, the sweep's columns
and nccl-tests busbw factors, the alpha-beta fit, and the command line."""
import time

import numpy as np
import pytest
import torch.distributed as dist

from distlab import bench, launch
from distlab.comm import bus_factor


def _timed_sleeps():
    rank = dist.get_rank()
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.02 * (rank + 1))        # rank 3 is the slowest: 80 ms

    seconds = bench.time_op(fn, warmup=1, iters=3)
    return seconds, len(calls)


def test_time_op_is_the_slowest_rank_and_the_same_everywhere():
    out = launch.run(_timed_sleeps, 4, backend="gloo", timeout=60)
    assert len({s for s, _ in out}) == 1, "every rank returns the same time"
    assert all(calls == 4 for _, calls in out), "1 warm-up + 3 timed calls"
    assert 0.08 <= out[0][0] < 0.5, out


def test_time_op_takes_the_median_outside_a_group():
    durations = iter([0.0, 0.05, 0.0, 0.0, 0.2])   # warm-up, then 4 timed calls
    assert bench.time_op(lambda: time.sleep(next(durations)), warmup=1, iters=4) < 0.05
    with pytest.raises(ValueError):
        bench.time_op(lambda: None, iters=0)


def _sweep(ops, sizes):
    return bench.sweep(ops, sizes, warmup=1, iters=2)


def test_sweep_rows_follow_nccl_tests():
    sizes = [1000, 4096, 1 << 16]
    results = launch.run(_sweep, 4, bench.OPS, sizes, backend="gloo", timeout=120)
    rows = results[0]
    assert all(r == rows for r in results), "every rank returns the same rows"
    assert [(r.op, i) for i, r in enumerate(rows)] == [
        (op, i) for i, op in enumerate(op for op in bench.OPS for _ in sizes)]
    for r, asked in zip(rows, sizes * len(bench.OPS)):
        assert r.size == r.count * 4 and r.dtype == "float32"
        assert asked - 4 * 4 < r.size <= asked, "sizes round down to what splits evenly"
        if r.op in ("all_gather", "reduce_scatter"):
            assert r.count % 4 == 0, "all_gather/reduce_scatter sizes split evenly"
        assert r.algbw == pytest.approx(r.size / r.seconds)
        assert r.busbw == pytest.approx(r.algbw * bus_factor(r.op, 4))
    assert len(bench.table(rows).splitlines()) >= len(rows)
    header = next(line for line in bench.table(rows).splitlines() if "busbw" in line)
    assert header.split() == ["#", "size", "count", "type", "time(us)", "algbw(GB/s)",
                              "busbw(GB/s)"]


def test_a_single_rank_has_no_sendrecv():
    rows = launch.run(_sweep, 1, ("all_reduce", "sendrecv"), [4096], backend="gloo",
                      timeout=60)[0]
    assert [r.op for r in rows] == ["all_reduce"]
    assert rows[0].busbw == 0.0, "all_reduce on one rank moves nothing over a link"


def test_fit_recovers_latency_and_bandwidth():
    rng = np.random.default_rng(0)
    for _ in range(5):
        alpha, bw = rng.uniform(1e-6, 1e-3), rng.uniform(1e8, 1e11)
        rows = [bench.Row("all_gather", s, s // 4, "float32", alpha + s / bw, s / (alpha + s / bw),
                          s / (alpha + s / bw) * 0.75) for s in bench.sizes(1024, 1 << 26)]
        f = bench.fit(rows)
        assert f.alpha == pytest.approx(alpha, rel=1e-6)
        assert f.bandwidth == pytest.approx(bw, rel=1e-6)
        assert f.busbw == pytest.approx(bw * 0.75, rel=1e-6)
        assert f.seconds(f.half_size) == pytest.approx(2 * alpha)
    with pytest.raises(ValueError):
        bench.fit(rows[:1])


def test_sizes_and_size_parsing():
    assert bench.sizes(4096, 65536) == [4096, 8192, 16384, 32768, 65536]
    assert bench.sizes(1000, 9000, 3) == [1000, 3000, 9000]
    assert [bench.parse_size(s) for s in ("4K", "16M", "1G", "512", "2MiB")] == [
        4096, 16 << 20, 1 << 30, 512, 2 << 20]
    with pytest.raises(ValueError):
        bench.sizes(0, 10)


def test_command_line_prints_the_table_and_saves_the_plot(tmp_path, capsys):
    plot = tmp_path / "busbw.png"
    bench.main(["--ops", "all_reduce,broadcast", "-b", "1K", "-e", "8K", "-n", "4",
                "--backend", "gloo", "-w", "1", "-i", "2", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "# all_reduce" in out and "# broadcast" in out and "alpha-beta fit" in out
    assert plot.stat().st_size > 0
    with pytest.raises(SystemExit):
        bench.main(["--ops", "all_to_everyone"])


@pytest.mark.gpu
def test_sweep_on_one_gpu():
    rows = launch.run(_sweep, 1, bench.OPS, [4096, 1 << 20], backend="nccl", timeout=120)[0]
    assert [r.op for r in rows] == [op for op in bench.OPS if op != "sendrecv" for _ in (1, 2)]
    assert all(r.seconds > 0 and r.algbw == pytest.approx(r.size / r.seconds) for r in rows)

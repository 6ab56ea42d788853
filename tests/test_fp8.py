"""distlab.fp8 (formats, scalings, the sharded amax rule) and distlab.bench.fp8's judging,
table and figure, plus its torchao code path emulated on the CPU at a tiny size; the
scaling groups (tensorwise to 128x128 blocks) and the narrow accumulator, emulated."""
import json
import math

import pytest
import torch
import torch.distributed as dist

from distlab import fp8, launch
from distlab.bench import fp8 as bench
from distlab.comm import CommLog
from distlab.fp8.accumulate import limited_matmul, round_significand
from distlab.fp8.groups import grouped_round_trip


def test_the_formats_range_and_precision_come_from_finfo():
    e4m3, e5m2 = fp8.describe("e4m3"), fp8.describe(torch.float8_e5m2)
    assert (e4m3["max"], e4m3["mantissa bits"]) == (448.0, 3)
    assert (e5m2["max"], e5m2["mantissa bits"]) == (57344.0, 2)
    # the smallest subnormal is the smallest normal times eps: 2^-9 and 2^-16
    assert e4m3["smallest subnormal"] == 2.0 ** -9 and e5m2["smallest subnormal"] == 2.0 ** -16
    assert e5m2["binades"] > e4m3["binades"]
    with pytest.raises(ValueError, match="e4m3"):
        fp8.describe("e3m4")


def test_the_scale_puts_the_amax_on_the_largest_value_and_saturates():
    x = torch.tensor([[0.5, -3.0], [1.0, 2.0]])
    q, scale = fp8.quantize(x, "e4m3")
    assert q.dtype == torch.float8_e4m3fn and float(scale) == pytest.approx(448 / 3)
    assert float(q.float().abs().max()) == 448.0
    # beyond the range: the largest value, never inf or nan, in both formats
    for fmt in ("e4m3", "e5m2"):
        top = torch.finfo(fp8.dtype_of(fmt)).max
        assert fp8.cast(torch.tensor([1e30, -1e30]), fmt, torch.tensor(1.0)).float().tolist() == [top, -top]
    # a tensor of zeros casts to zeros with a finite scale
    q, scale = fp8.quantize(torch.zeros(3), "e5m2")
    assert math.isfinite(float(scale)) and not q.float().any()


def test_the_round_trip_error_is_the_formats_precision():
    """Values in the normal range come back within half a step: 2^-4 relative for e4m3,
    2^-3 for e5m2 (round to nearest)."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    for fmt, half_step in (("e4m3", 2.0 ** -4), ("e5m2", 2.0 ** -3)):
        back = fp8.round_trip(x, fmt)
        normal = x.abs() * fp8.scale_for(x.abs().amax(), fmt) >= torch.finfo(fp8.dtype_of(fmt)).tiny
        rel = ((back - x).abs() / x.abs())[normal]
        assert float(rel.max()) <= half_step
        assert float(rel.max()) > half_step / 2   # a cast happened: not float32 in disguise


def test_an_outlier_costs_tensorwise_the_other_rows_but_not_rowwise_or_delayed():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=g)
    x[3, 7] = 1e5          # 2^17: the other rows sink below E4M3's normal range
    others = torch.arange(16) != 3
    tensorwise = fp8.sqnr(x[others], fp8.round_trip(x, "e4m3")[others])
    rowwise = fp8.sqnr(x[others], fp8.round_trip(x, "e4m3", rowwise=True)[others])
    assert rowwise > tensorwise + 6   # at least a bit better: the outlier's scale is its row's
    scaler = fp8.DelayedScaling("e4m3", history=4)
    for _ in range(4):
        scaler(torch.randn(16, 64, generator=g))
    assert len(scaler.amaxes) == 4
    q, scale = scaler(x)
    back = fp8.dequantize(q, scale)
    assert fp8.sqnr(x[others], back[others]) > tensorwise + 6
    assert float(back[3, 7]) < 1e3   # the outlier was clipped to the history's amax
    assert float(scaler.amaxes[-1]) == 1e5   # ... and joined the history after the cast
    with pytest.raises(ValueError, match="history"):
        fp8.DelayedScaling(history=0)


def test_sqnr_is_infinite_for_equal_tensors_and_20_db_for_a_tenth():
    x = torch.randn(100)
    assert fp8.sqnr(x, x) == math.inf
    assert fp8.sqnr(x, 1.1 * x) == pytest.approx(20.0)


def _sharded_cast(rowwise, use_group):
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(2))
    x[1, 4] = 300.0     # the outlier sits in rank 0's rows
    with CommLog() as log:
        q, _ = fp8.quantize(x.tensor_split(world)[rank], "e4m3", rowwise=rowwise,
                            group=dist.group.WORLD if use_group else None)
    return q.view(torch.uint8), [(e.op, e.nbytes) for e in log.events]


def test_a_sharded_cast_equals_the_unsharded_one_bit_for_bit_only_with_the_max_all_reduce():
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(2))
    x[1, 4] = 300.0
    whole = fp8.quantize(x, "e4m3")[0].view(torch.uint8).tensor_split(2)
    with_group = launch.run(_sharded_cast, 2, False, True, backend="gloo")
    for rank, (q, calls) in enumerate(with_group):
        assert torch.equal(q, whole[rank]) and calls == [("all_reduce", 4)]
    without = launch.run(_sharded_cast, 2, False, False, backend="gloo")
    assert torch.equal(without[0][0], whole[0])       # it holds the outlier: same amax
    assert not torch.equal(without[1][0], whole[1])   # its own, smaller amax: other bytes
    # rowwise scales are per row: the shards cast alike, and the all-reduce is per row too
    rows = fp8.quantize(x, "e4m3", rowwise=True)[0].view(torch.uint8).tensor_split(2)
    alone = launch.run(_sharded_cast, 2, True, False, backend="gloo")
    assert all(torch.equal(q, rows[r]) for r, (q, _) in enumerate(alone))


def _result(top_speedup=1.5, gpt_speedup=1.3, gap=0.005, mfu=0.62):
    linear = [{"shape": [64, 64, 64], "bf16_ms": 1.0, "fp8_ms": 2.0, "speedup": 0.5, "gflop": 1.0},
              {"shape": [128, 128, 128], "bf16_ms": 2.0, "fp8_ms": 1.8, "speedup": 1.1,
               "gflop": 8.0},
              {"shape": [256, 256, 256], "bf16_ms": 8.0, "fp8_ms": 8 / top_speedup,
               "speedup": top_speedup, "gflop": 64.0}]
    run = {"tokens_per_s": 1000.0, "mfu": mfu, "losses": [3.0, 2.5, 2.0], "final_loss": 2.0}
    fast = dict(run, tokens_per_s=1000.0 * gpt_speedup, mfu=None, final_loss=2.0 * (1 + gap))
    gpt = [{"config": bench.BIG, "batch": 4, "seq_len": 2048, "bf16": run, "fp8": fast,
            "speedup": gpt_speedup, "final_loss_gap": gap, "loss_floor": 1.5}]
    return {"linear": linear, "crossover": bench.crossover(linear), "gpt": gpt}


def test_the_crossover_is_the_smallest_shape_from_which_fp8_always_wins():
    result = _result()
    assert result["crossover"] == [128, 128, 128]
    assert bench.crossover(result["linear"][:1]) is None
    assert bench.goal_misses(result) == []


@pytest.mark.parametrize("change, words", [
    (dict(top_speedup=1.3), "linear (256, 256, 256): FP8 1.30x"),
    (dict(gpt_speedup=1.1), "below 1.2x"),
    (dict(gap=0.02), "differ by 2.00%"),
    (dict(mfu=0.5), "BF16 MFU 50.0%"),
])
def test_each_missed_goal_is_named(change, words):
    misses = bench.goal_misses(_result(**change))
    assert len(misses) == 1 and words in misses[0], misses


def test_the_table_and_the_figure_show_every_row(tmp_path):
    import matplotlib
    matplotlib.use("Agg")

    result = _result()
    rows = bench.table(result)["rows"]
    assert len(rows) == 4 and rows[1][-1] == "crossover" and "final loss" in rows[3][-1]
    from distlab.viz.fp8 import plot_fp8

    fig = plot_fp8(result)  # the figure lab 10 shows of the check's result
    assert len(fig.axes) == 2 and len(fig.axes[1].lines) == 3   # two curves and the floor
    fig.savefig(tmp_path / "fp8.png")


def test_the_torchao_path_runs_emulated_on_the_cpu():
    """The GPU code, with torchao's emulated FP8 matmuls and no compilation: the GPT's
    block linears are converted (not the head) and both precisions train alike."""
    pytest.importorskip("torchao")
    from distlab.model import GPT, GPTConfig

    model = bench.to_float8(GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2,
                                          d_model=32)), emulate=True)
    kinds = {name: type(m).__name__ for name, m in model.named_modules()}
    assert kinds["blocks.0.mlp.up"] == "Float8Linear" and kinds["head"] == "Linear"
    measured = bench.measure(["linear"], quick=True, emulate=True, compile=False, iters=2,
                             warmup=1)
    assert [r["shape"] for r in measured["linear"]] == [list(s) for s in bench.QUICK_SHAPES]
    assert measured["meta"]["emulate"] and measured["meta"]["torchao"] and "gpt" not in measured
    json.dumps(measured)    # what the bench writes
    (row,) = bench.gpt_rows({"t": (dict(vocab_size=64, seq_len=8, n_layer=1, n_head=2,
                                        d_model=32), 2, 4)},
                            dict(vocab_size=8, order=2), emulate=True, compile=False, warmup=1)
    assert len(row["bf16"]["losses"]) == len(row["fp8"]["losses"]) == 4
    # the same weights and batches: the first losses agree to FP8's precision
    assert row["fp8"]["losses"][0] == pytest.approx(row["bf16"]["losses"][0], rel=0.02)


def test_the_acceptance_check_needs_one_gpu_and_states_the_goals():
    from distlab.acceptance import checks, cli, registry  # noqa: F401  (registers the checks)

    check = registry.REGISTRY["fp8"]
    assert check.gpus == 1 and check.run is checks.fp8
    for words in ("torchao", f"{bench.GOALS['linear speedup']}x", bench.BIG, "60%", "1%"):
        assert words in check.goal, words
    assert any(line.startswith("fp8 ") for line in cli.listing().splitlines())


def test_torchaos_tensorwise_recipe_is_the_exercises_contract():
    """torchao's Float8Linear (tensorwise, emulated) computes what fp8_linear's contract
    says, from distlab.fp8's casts: up to float32 rounding of the same matmuls."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    layer = bench.to_float8(torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False)),
                            emulate=True)
    x, dy = torch.randn(8, 32, requires_grad=True), torch.randn(8, 16)
    y = layer(x)
    y.backward(dy)
    w, xd = layer[0].weight.detach(), x.detach()
    for got, want in ((y, fp8.round_trip(xd, "e4m3") @ fp8.round_trip(w, "e4m3").t()),
                      (x.grad, fp8.round_trip(dy, "e5m2") @ fp8.round_trip(w, "e4m3")),
                      (layer[0].weight.grad,
                       fp8.round_trip(dy, "e5m2").t() @ fp8.round_trip(xd, "e4m3"))):
        assert torch.allclose(got.detach(), want, rtol=1e-5, atol=1e-6)


def test_each_grouping_is_a_rowwise_cast_of_its_groups():
    """Tensorwise, rowwise, 1x128 and 128x128 (DeepSeek-V3, section 3.3.2) equal the
    casts done group by group; an outlier channel costs its own groups only."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 256, generator=g)
    x[:, 17] = 1e5                                       # an outlier channel
    for rows, cols in ((None, None), (1, None), (1, 128), (128, 128)):
        got = grouped_round_trip(x, rows, cols)
        r, c = rows or 256, cols or 256
        for i in range(0, 256, r):
            for j in range(0, 256, c):
                block = x[i:i + r, j:j + c]
                want = fp8.round_trip(block.reshape(1, -1), "e4m3").reshape(block.shape)
                assert torch.equal(got[i:i + r, j:j + c], want), (rows, cols, i, j)
    far = x[:, 128:]                                     # the tile without the channel
    assert fp8.sqnr(far, grouped_round_trip(x, 1, 128)[:, 128:]) > 30
    assert fp8.sqnr(far, grouped_round_trip(x, 1, None)[:, 128:]) < 25
    with pytest.raises(ValueError, match="do not tile"):
        grouped_round_trip(x, 100, 128)


def test_a_narrow_accumulator_loses_what_promotion_every_128_keeps():
    """DeepSeek-V3, section 3.3.2: a 14-bit accumulator over K = 4096 errs far more than
    one promoted to float32 every 128 elements; with 52 bits it is float64's sum."""
    assert float(round_significand(torch.tensor(1 + 2.0 ** -15, dtype=torch.float64), 14)) == 1.0
    assert float(round_significand(torch.tensor(1 + 2.0 ** -14, dtype=torch.float64), 14)) \
        == 1 + 2.0 ** -14
    assert float(round_significand(torch.tensor(1 - 2.0 ** -17, dtype=torch.float64), 14,
                                   "zero")) == 1 - 2.0 ** -15
    g = torch.Generator().manual_seed(0)
    a = torch.rand(4, 4096, generator=g).to(torch.float8_e4m3fn).double()
    b = torch.rand(4096, 4, generator=g).to(torch.float8_e4m3fn).double()
    exact = a @ b

    def error(y):
        return float((y - exact).norm() / exact.norm())

    narrow, promoted = limited_matmul(a, b, 14, rounding="zero"), \
        limited_matmul(a, b, 14, promote_every=128, rounding="zero")
    assert error(narrow) > 0.005 and error(promoted) < error(narrow) / 20
    assert error(limited_matmul(a, b, 52)) < 1e-15
    with pytest.raises(ValueError, match="rounding"):
        round_significand(exact, 14, "up")

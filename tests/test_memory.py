"""distlab.zero.memory: the paper's bytes per rank, the exact accounting of distlab.zero with
uneven shards, counting live storage, and the memory calculator widget. What ranks
really hold is checked against the accounting in tests/test_zero.py."""
import pytest
import torch
import torch.nn as nn

from distlab.zero import memory
from distlab.units import decimal_bytes
from distlab.viz.zero import MemoryCalculator, calculator_table


def test_the_papers_figures():
    gb = [memory.zero_bytes(7.5e9, 64, s) / 1e9 for s in memory.STAGES]
    assert [round(g, 1) for g in gb] == [120.0, 31.4, 16.6, 1.9]
    assert memory.zero_bytes(175e9, 1, 0) == 16 * 175e9 == 2.8e12
    assert decimal_bytes(2.8e12) == "2.8 TB" and decimal_bytes(1.875e9) == "1.88 GB"
    assert memory.zero_bytes(1e6, 4, 1, k=4) == 4e6 + 1e6      # K: the optimizer's bytes
    with pytest.raises(ValueError, match="stage"):
        memory.zero_bytes(1, 1, 4)
    with pytest.raises(ValueError, match="world_size"):
        memory.zero_bytes(1, 0, 1)


def test_accounting_sums_to_the_formula_when_shards_are_even():
    psi, world = 1 << 20, 8
    for stage in memory.STAGES:
        got = memory.accounting([psi], world, 3, stage).total
        formula = memory.zero_bytes(psi, world, stage)
        extra = {2: 2 * psi / world}.get(stage, 0)   # stage 2's gradient shard is fp32
        assert got == formula + extra, stage


def test_accounting_follows_each_units_uneven_shards():
    units = [10, 7]                                  # over 4 ranks: 3,3,2,2 and 2,2,2,1
    shards = [5, 5, 4, 3]
    for rank, shard in enumerate(shards):
        got = memory.accounting(units, 4, rank, 3)
        assert (got.params, got.grads, got.master, got.optimizer) == (0, 4 * shard, 4 * shard,
                                                                      8 * shard)
    assert sum(memory.accounting(units, 4, r, 3).master for r in range(4)) == 4 * 17
    stage1 = memory.accounting(units, 4, 0, 1)
    assert (stage1.params, stage1.grads) == (2 * 17, 2 * 17)
    dp = memory.accounting(units, 4, 2, 0)
    assert dp.total == 16 * 17


def test_accounting_counts_the_units_kept_whole_on_every_rank():
    """5 elements kept whole (norms, biases) beside units of 10 and 7 over 4 ranks: at
    stage 3 every rank holds their weights, and their fp32 gradient, master and moments
    whole, on top of its shards."""
    for rank, shard in enumerate([5, 5, 4, 3]):
        got = memory.accounting([10, 7], 4, rank, 3, whole=5)
        assert (got.params, got.grads, got.master, got.optimizer) == (
            2 * 5, 4 * (shard + 5), 4 * (shard + 5), 8 * (shard + 5)), rank
        assert memory.step_buffers([10, 7], 4, rank, 3, whole=5) == 4 * (shard + 5)
    assert memory.accounting([10, 7], 4, 0, 2, whole=5).params == 2 * 22


def test_live_bytes_counts_each_storage_once():
    flat = torch.zeros(12)
    a, b = flat[:4], flat[4:]                        # two views of one storage
    model = nn.Linear(3, 2)
    model.weight.grad = torch.zeros(2, 3)
    opt = torch.optim.AdamW(model.parameters())
    model.bias.grad = torch.zeros(2)
    opt.step()
    got = memory.live_bytes(params=[a, b, None], grads=[p.grad for p in model.parameters()],
                            optimizer=opt)
    assert got.params == 48 and got.grads == 24 + 8
    assert got.optimizer == 2 * (24 + 8), "the moments; the step counters are left out"
    freed = torch.zeros(5)
    freed.untyped_storage().resize_(0)
    assert memory.live_bytes(params=[freed]).params == 0
    held = memory.held_bytes(model, opt)
    assert (held.params, held.grads, held.master, held.optimizer) == (32, 32, 0, 64)


def test_live_bytes_counts_what_the_tensors_span():
    bucket = torch.zeros(10)                         # 8 gradients, then 2 flags
    grads = [bucket[:5], bucket[5:8]]
    assert memory.live_bytes(grads=grads).grads == 8 * 4, "the flags are not gradients"
    assert memory.live_bytes(grads=grads + [bucket[2:7], bucket]).grads == 10 * 4
    rows = torch.zeros(4, 6)
    assert memory.live_bytes(params=[rows[:, 0]]).params == (3 * 6 + 1) * 4  # a strided view


def test_step_buffers_per_stage_with_even_shards():
    """The optimizer step's buffers in Ψ-multiples (bf16 weights, fp32 master, foreach
    AdamW's one temporary per shard element) when the shards are equal."""
    psi = 12 * 1024
    for world in (2, 4):
        got = [memory.step_buffers([psi], world, 1, stage) / psi for stage in memory.STAGES]
        assert got[0] == 8, "data parallel: fp32 gradients, then AdamW's sqrt(v)"
        # stage 1: the gradients' flat copy and the reduce-scatter output (2 + 2/N), or
        # the fp32 gradient shard and AdamW's temporary (8/N), whichever is larger
        assert got[1] == max(2 + 2 / world, 8 / world)
        assert got[2] == got[3] == 4 / world, "stages 2 and 3: AdamW's temporary only"
    units = [6 * 1024, 4 * 1024]                     # two units: their buffers add up
    assert memory.step_buffers(units, 2, 0, 2) == 4 * 5 * 1024
    assert memory.step_buffers([10], 4, 0, 1) > memory.step_buffers([12], 4, 0, 1), \
        "uneven shards need padded copies"
    with pytest.raises(ValueError, match="stage"):
        memory.step_buffers([psi], 2, 0, 5)


def test_the_storage_tracker_counts_allocations_frees_and_resizes():
    outside, resize = torch.ones(100), torch.UntypedStorage.resize_
    with memory.StorageTracker() as tracker:
        a = torch.cat([outside, outside])           # 800 B, new
        view = a[10:]                                # no new storage
        outside.add_(1)                              # in place, made before: not counted
        assert tracker.allocated() == tracker.peak() == 800
        del a
        assert tracker.allocated() == 800, "a view keeps its storage alive"
        del view
        b = torch.zeros(50)                          # 200 B
        assert (tracker.allocated(), tracker.peak()) == (200, 800)
        tracker.reset_peak()
        b.untyped_storage().resize_(0)               # what FlatParams.free does
        assert tracker.allocated() == 0
        b.untyped_storage().resize_(400)
        assert (tracker.allocated(), tracker.peak()) == (400, 400)
        x = torch.ones(8, requires_grad=True)
        (x * 2).sin().sum().backward()               # saved activations come and go
        assert tracker.allocated() == 400 + 32 + 32, "b, x and x.grad"
    assert torch.UntypedStorage.resize_ is resize, "the resize hook is removed on exit"
    assert tracker.settle(0, timeout=0) == 464


def test_the_calculator_updates_and_has_a_static_view():
    calc = MemoryCalculator(num_params=7.5e9, world_size=64)
    assert "120.0 GB" in calc.table.value and "1.9 GB" in calc.table.value
    text = repr(calc)
    assert "ZeRO-3" in text and "31.4 GB" in text and "16.6 GB" in text
    calc.n.value = 1
    assert calc.table.value.count("120.0 GB") == 4, "one GPU: every stage holds 16 bytes"
    calc.psi.value = 70e9
    calc.n.value = 8
    assert "does not fit" in calc.table.value
    bundle = calc._repr_mimebundle_()
    assert bundle["image/png"].startswith(b"\x89PNG") and "Ψ = 70,000,000,000" in \
        bundle["text/plain"]
    assert [row[0] for row in calculator_table(1e9, 8)] == ["data parallel", "ZeRO-1", "ZeRO-2",
                                                            "ZeRO-3"]

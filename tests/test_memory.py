"""distlab.memory: the paper's bytes per rank, the exact accounting of distlab.zero with
uneven shards, counting live storage, and the memory calculator widget. What ranks
really hold is checked against the accounting in tests/test_zero.py."""
import pytest
import torch
import torch.nn as nn

from distlab import memory
from distlab.viz.zero import MemoryCalculator, calculator_table


def test_the_papers_figures():
    gb = [memory.zero_bytes(7.5e9, 64, s) / 1e9 for s in memory.STAGES]
    assert [round(g, 1) for g in gb] == [120.0, 31.4, 16.6, 1.9]
    assert memory.zero_bytes(175e9, 1, 0) == 16 * 175e9 == 2.8e12
    assert memory.human(2.8e12) == "2.8 TB" and memory.human(1.875e9) == "1.88 GB"
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

"""Exercise zero_bytes_per_rank(num_params, world_size, stage) of lab 05.

Bytes each rank holds for Ψ = ``num_params`` parameters over N = ``world_size`` ranks
with mixed-precision Adam (2 bytes of weights, 2 of gradients, 12 of fp32 master
weights and moments per parameter): stage 0 (data parallel) 16Ψ, stage 1 4Ψ + 12Ψ/N,
stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N. A pure function, called directly."""
import pytest

NOTEBOOK = "05_zero"
# bytes per parameter at (world size, stage), from the formulas above, written out:
# stage 0 keeps all 16 whatever N; at N = 1 nothing is sharded
PER_PARAM = {1: (16, 16, 16, 16), 2: (16, 10, 9, 8), 3: (16, 8, 20 / 3, 16 / 3),
             8: (16, 5.5, 3.75, 2), 1024: (16, 4.01171875, 2.013671875, 0.015625)}


def test_the_papers_example_75b_on_64_gpus(student):
    got = [student.zero_bytes_per_rank(7.5e9, 64, stage) / 1e9 for stage in range(4)]
    want = [120.0, 31.40625, 16.640625, 1.875]
    for stage, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=1e-9), (
            f"stage {stage}, 7.5B parameters on 64 GPUs: {g:.4g} GB per GPU, the paper's figure "
            f"is {w:.4g} GB (16 bytes per parameter: 2 weights, 2 gradients, 12 optimizer state)")


def test_every_stage_at_any_size(student):
    for psi in (1, 1000, 98_425_344, 175e9):
        for world, per_param in PER_PARAM.items():
            for stage in range(4):
                got, want = student.zero_bytes_per_rank(psi, world, stage), psi * per_param[stage]
                assert got == pytest.approx(want, rel=1e-9), (
                    f"zero_bytes_per_rank({psi}, {world}, {stage}) = {got}, expected {want}: "
                    f"stage {stage} shards " + ["nothing", "the 12 bytes of optimizer state",
                                                "the optimizer state and the 2 of gradients",
                                                "all 16 bytes"][stage] + " over the ranks")


def test_one_rank_holds_everything_at_every_stage(student):
    for stage in range(4):
        got = student.zero_bytes_per_rank(1e6, 1, stage)
        assert got == pytest.approx(16e6), (
            f"on one rank nothing can be sharded: stage {stage} gave {got:g} bytes for a million "
            f"parameters, not 16e6")


def test_an_unknown_stage_is_an_error(student):
    try:
        got = student.zero_bytes_per_rank(1e6, 8, 4)
    except ValueError:
        return
    raise AssertionError(f"zero_bytes_per_rank(1e6, 8, stage=4) returned {got!r}: there is no "
                         f"stage 4; raise ValueError for a stage outside 0-3")

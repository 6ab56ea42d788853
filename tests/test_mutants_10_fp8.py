"""Lab 10's warm-up exercise fp8_linear, graded on the wrong answers an FP8 linear layer
is usually written with: each must lose points, with a first failing check that names
the mistake.

Each mutant is the solution's cell with a line or two changed, graded by the real grader
(``runner.grade(path, only=["fp8_linear"], first_failure=True)``), one after the other,
each stopped at its first failing check.
"""
import pytest

from mutants import assert_named, lazy_grades

LAB, NAME = "10_long_context_experts", "fp8_linear"

MUTANTS = {
    # each rank scales its shard by its own amax: the sharded cast is not the whole one
    "local_amax": [("""    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
""", "")],
    # the output's gradient in the forward's format
    "gradient_in_e4m3": [("gq, gs = _cast(dy, torch.float8_e5m2, group)",
                          "gq, gs = _cast(dy, torch.float8_e4m3fn, group)")],
    # the cast without a scale: values keep their place in the format's range
    "no_scale": [("    scale = top / amax.clamp(min=1e-12)", "    scale = torch.ones(())")],
    # max / 0 for a tensor of zeros
    "zero_amax": [("amax.clamp(min=1e-12)", "amax")],
    # the replicated weight's amax all-reduced as well: a collective for nothing
    "weight_amax_reduced": [("wq, ws = _cast(weight, torch.float8_e4m3fn, None)",
                             "wq, ws = _cast(weight, torch.float8_e4m3fn, group)")],
    # the amax all-reduced over every rank: right wherever the group is the world
    "world_amax": [("dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)",
                    "dist.all_reduce(amax, op=dist.ReduceOp.MAX)")],
    # the casts read back in float64: the same values and gradients, a float64 output
    "float64_output": [("y = (xq.float() / xs) @ (wq.float() / ws).t()",
                        "y = (xq.double() / xs) @ (wq.double() / ws).t()")],
}

# name -> (verdict, what its first failing check must say)
EXPECTED = {
    "local_amax": ("partial", ["test_a_sharded_call_equals_the_unsharded_one_bit_for_bit",
                               "scaled by the amax of this rank's rows only",
                               "all-reduce it with MAX"]),
    "gradient_in_e4m3": ("partial", ["test_the_input_gradient_casts_the_output_gradient_to_e5m2",
                                     "cast to e4m3, not e5m2"]),
    "no_scale": ("fail", ["test_the_output_multiplies_the_e4m3_casts_of_x_and_weight",
                          "WITHOUT a scale"]),
    "zero_amax": ("partial", ["test_all_zero_tensors_give_zeros_not_nan", "max/0 is inf"]),
    "weight_amax_reduced": ("partial", ["test_one_max_all_reduce_of_one_number_per_sharded_cast",
                                        "its amax needs none"]),
    "world_amax": ("partial", ["test_the_amax_is_reduced_over_group",
                               "scaled by the amax over every rank", "group=group"]),
    "float64_output": ("partial", ["test_the_output_is_float32", "torch.float64",
                                   "output is float32"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return lazy_grades(tmp_path_factory.mktemp("mutants_10_fp8"), LAB, NAME, MUTANTS)


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_mutant_fails_and_its_mistake_is_named(results, name):
    assert_named(results(name), name, NAME, 11, *EXPECTED[name])

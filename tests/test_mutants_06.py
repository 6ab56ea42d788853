"""The grader as teacher, lab 06: wrong answers a student would plausibly write to the core
exercise ``vocab_parallel_cross_entropy`` each fail with a message that names the mistake.

Each mutant is the solution's cell with one plausible change, graded as a student's
notebook would be (``runner.grade(path, only=[EXERCISE])``): one grade run per mutant,
since the grader reports an exercise's first failing check only, each stopped at that
check (``first_failure=True``), one after the other.
"""
import pytest

from mutants import assert_named, lazy_grades

LAB, EXERCISE = "06_tensor_parallel", "vocab_parallel_cross_entropy"

NO_MAX = ((
    "    peak = logits.detach().amax(dim=-1)\n"
    "    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)\n"
    "    shifted = logits - peak.unsqueeze(-1)\n",
    "    shifted = logits\n"),)

LOCAL_MAX = (("    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)\n", ""),)

UNMASKED = ((
    "picked = shifted.gather(-1, local.masked_fill(outside, 0).unsqueeze(-1)).squeeze(-1)",
    "picked = shifted.gather(-1, local.clamp(0, sizes[rank] - 1).unsqueeze(-1)).squeeze(-1)"), (
    "picked = ReduceFromGroup.apply(picked.masked_fill(outside, 0.0), group)",
    "picked = ReduceFromGroup.apply(picked, group)"))

LOCAL_SUM = (("sum_exp = ReduceFromGroup.apply(shifted.exp().sum(-1), group)",
              "sum_exp = shifted.exp().sum(-1)"),)

FLOOR = ((
    "    if logits.shape[-1] != sizes[rank]:\n",
    "    per = vocab_size // dist.get_world_size(group)  # every rank's width, supposedly\n"
    "    if logits.shape[-1] not in (per, per + 1):\n"), (
    "    start = sum(sizes[:rank])", "    start = rank * per"), (
    "(local >= sizes[rank])", "(local >= per)"))

MEAN_OF_MAXIMA = (("    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)\n",
                   "    dist.all_reduce(peak, group=group)\n"
                   "    peak /= dist.get_world_size(group)\n"),)

SUMMED = (("    return (sum_exp.log() - picked).mean()\n",
           "    return (sum_exp.log() - picked).sum()\n"),)

MAX_IN_GRAPH = (("peak = logits.detach().amax(dim=-1)", "peak = logits.amax(dim=-1)"),)

# (mutant, its change, what the student must read, the test that must be the first to fail)
MUTANTS = [
    ("no max subtracted", NO_MAX, "Overflow: subtract the global max before exp",
     "test_logits_near_1e4_do_not_overflow"),
    ("a local max, not all-reduced", LOCAL_MAX, "each rank subtracted its OWN largest logit",
     "test_the_loss_equals_cross_entropy_of_the_whole_logits"),
    ("the target's logit taken on every rank, unmasked", UNMASKED,
     "the target's logit was taken on EVERY rank",
     "test_the_loss_equals_cross_entropy_of_the_whole_logits"),
    ("the sum of the exponentials not all-reduced", LOCAL_SUM,
     "the sum of the exponentials is this rank's only",
     "test_the_loss_equals_cross_entropy_of_the_whole_logits"),
    ("shards of vocab_size // t", FLOOR, "r * (vocab_size // t)",
     "test_the_loss_equals_cross_entropy_of_the_whole_logits"),
    ("the mean of the ranks' maxima as the shift", MEAN_OF_MAXIMA,
     "the shift of the exponent is below the largest logit",
     "test_one_wide_logit_does_not_overflow"),
    ("the sum over the tokens, not the mean", SUMMED, "is the SUM over the tokens",
     "test_the_loss_equals_cross_entropy_of_the_whole_logits"),
    ("the max kept in autograd's graph", MAX_IN_GRAPH,
     "the max went through dist.all_reduce inside autograd's graph",
     "test_the_gradient_is_this_ranks_slice_of_the_full_one"),
]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """Each mutant graded when a test first asks for it, up to its first failing check
    (each run is its own contained pytest process)."""
    return lazy_grades(tmp_path_factory.mktemp("mutants"), LAB, EXERCISE,
                       {name: change for name, change, *_ in MUTANTS})


@pytest.mark.parametrize("name, says, first", [(m[0], m[2], m[3]) for m in MUTANTS],
                         ids=[m[0] for m in MUTANTS])
def test_a_wrong_vocab_parallel_cross_entropy_fails_naming_its_mistake(verdicts, name, says,
                                                                       first):
    r = verdicts(name)
    assert r.verdict in ("partial", "fail") and r.points < r.max_points, (name, r)
    assert says in r.message, (name, r.message)
    assert r.message.startswith(first), (name, r.message)


# ColumnParallelLinear: each mutant breaks one clause of its statement alone
COLUMN = {
    # the gathered output's pieces sized by the world, not the group: right on the default
    # group, every test of which it passes
    "gather_sized_by_the_world": [
        ("sizes = tp.shard_sizes(self.out_features, dist.get_world_size(self.group))",
         "sizes = tp.shard_sizes(self.out_features, dist.get_world_size())")],
}
COLUMN_EXPECTED = {  # name -> (verdict, what its first failing check must say)
    "gather_sized_by_the_world": ("partial", ["test_gather_output_on_a_group_of_two_ranks",
                                              "on the group of ranks [0, 2]",
                                              "dist.get_world_size(group)"]),
}


@pytest.fixture(scope="module")
def column_verdicts(tmp_path_factory):
    return lazy_grades(tmp_path_factory.mktemp("mutants_column"), LAB, "ColumnParallelLinear",
                       COLUMN)


@pytest.mark.parametrize("name", list(COLUMN))
def test_a_wrong_column_parallel_linear_fails_naming_its_mistake(column_verdicts, name):
    assert_named(column_verdicts(name), name, "ColumnParallelLinear", 29, *COLUMN_EXPECTED[name])

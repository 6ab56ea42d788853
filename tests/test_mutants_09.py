"""Lab 09's core exercise, distributed_train_step, graded on the wrong answers the course
material's own "final train step" makes: each must lose points, with a first failing
check that names the mistake.

Each mutant is the solution's cell with a few lines changed, graded by the real grader
(``runner.grade(path, only=["distributed_train_step"], first_failure=True)``), one after
the other, each stopped at its first failing check.
"""
import pytest

from mutants import assert_named, grade_mutants

LAB, NAME = "09_capstone", "distributed_train_step"

MUTANTS = {
    # the course material: the compute stream synchronised, not the all-gather's event (on
    # gloo: a barrier, and the handles never waited)
    "wrong_stream": [("""    for gather in state.pop("gathers", []):
        gather.wait()""", """    state.pop("gathers", [])
    dist.barrier(group)""")],
    # the gradient averaged over every rank of the world, then reduce-scattered in the group
    "world_mean": [("""            pending[i] = reduce_scatter_mean(flat, bucket.layout, bucket.group, async_op=True)""",
                    """            dist.all_reduce(flat)
            flat /= dist.get_world_size()
            pending[i] = reduce_scatter_mean(flat, bucket.layout, bucket.group, async_op=True)""")],
    # the course material: every reduce-scatter issued after backward, overlap or not
    "after_backward": [("    if overlap:\n        for i, bucket", "    if False:\n        for i, bucket")],
    # the loss scaled for backward and never divided out of the gradients
    "unscaled": [("grad = work.wait().to(bucket.master_dtype) / loss_scale",
                  "grad = work.wait().to(bucket.master_dtype)")],
}

# name -> (verdict, what its first failing check must say)
EXPECTED = {
    "wrong_stream": ("fail", ["test_two_ranks_train_like_one_process", "BEFORE the last update",
                              "were not waited before forward", "event"]),
    "world_mean": ("partial", ["test_one_reduce_scatter_and_one_all_gather_per_bucket",
                               "(the whole world): the gradients all-reduced, averaged"]),
    "after_backward": ("partial", ["test_reduce_scatters_start_during_backward",
                                   "post-accumulate-grad hook", "not after backward"]),
    "unscaled": ("partial", ["test_the_loss_scale_is_divided_out", "1024 times too large",
                             "Divide each reduced shard by loss_scale"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return grade_mutants(tmp_path_factory.mktemp("mutants_09"), LAB, NAME, MUTANTS)


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_mutant_fails_and_its_mistake_is_named(results, name):
    assert_named(results[name], name, NAME, 8, *EXPECTED[name])

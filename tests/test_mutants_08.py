"""The grader as teacher, lab 08: wrong answers a student would plausibly write to the core
exercise ``BucketedDDP`` each fail with a first message that names the mistake.

Each mutant is the solution's cell with one plausible change, graded as a student's
notebook would be (``runner.grade(path, only=[EXERCISE], first_failure=True)``), one
after the other.
"""
import pytest

from mutants import lazy_grades

LAB, EXERCISE = "08_overlap", "BucketedDDP"

# the buckets all-reduced with their sum, never divided by the group's size
SUMMED = (("                flats[i].div_(dist.get_world_size(group))\n", ""),)

# every bucket launched from finish_gradient_synchronization(): right values, no overlap
NO_OVERLAP = (("            ready[i].add(id(p))\n            launch(flush=False)\n",
               "            ready[i].add(id(p))\n"),)

# the parameters broadcast at construction, the buffers not
NO_BUFFERS = (("            for t in list(module.parameters()) + list(module.buffers()):\n",
               "            for t in module.parameters():\n"),)

# a cap of 0 taken for None (one bucket per parameter) instead of refused
ZERO_CAP = (("plan_buckets(params, bucket_cap_mb)]",
             "plan_buckets(params, bucket_cap_mb or None)]"),)

# (mutant, its change, what the student must read, the test that must be the first to fail)
MUTANTS = [
    ("buckets summed, not averaged", SUMMED, "is the SUM over the ranks, not the mean",
     "test_gradients_are_the_mean_over_ranks"),
    ("every bucket launched after backward", NO_OVERLAP, "no overlap",
     "test_the_first_all_reduce_starts_before_the_last_gradient"),
    ("buffers not broadcast", NO_BUFFERS, "broadcast module.buffers() too",
     "test_rank_0_buffers_are_broadcast"),
    ("a cap of 0 taken for None", ZERO_CAP, "bucket_cap_mb=0) built a wrapper",
     "test_a_bad_bucket_cap_mb_is_refused"),
]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    return lazy_grades(tmp_path_factory.mktemp("mutants"), LAB, EXERCISE,
                       {name: change for name, change, *_ in MUTANTS})


@pytest.mark.parametrize("name, says, first", [(m[0], m[2], m[3]) for m in MUTANTS],
                         ids=[m[0] for m in MUTANTS])
def test_a_wrong_bucketed_ddp_fails_naming_its_mistake(verdicts, name, says, first):
    r = verdicts(name)
    assert r.verdict in ("partial", "fail") and r.points < r.max_points, (name, r)
    assert says in r.message, (name, r.message)
    assert r.message.startswith(first), (name, r.message)
    assert r.hint, (name, "a failed check of the kit's own points to a hint")

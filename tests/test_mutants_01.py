"""Lab 01's exercise pipelined_broadcast graded on wrong answers that break one clause of
its statement alone: each must lose points, with a first failing check that names the
mistake.

Each mutant is the solution's cell with a few lines changed, graded by the real grader
(``runner.grade(path, only=["pipelined_broadcast"], first_failure=True)``), stopped at
its first failing check.
"""
import pytest

from mutants import assert_named, lazy_grades

LAB, NAME = "01_primitives", "pipelined_broadcast"

MUTANTS = {
    # the chain run backwards (src, then the member before it, ...): the same values, bytes
    # and pipelining, NCCL's rules kept, the peers the statement names not
    "reversed_chain": [
        ("    pos = (ranks.index(dist.get_rank()) - start) % k       # place in the chain\n"
         "    prev, succ = ranks[(start + pos - 1) % k], ranks[(start + pos + 1) % k]\n",
         "    pos = (start - ranks.index(dist.get_rank())) % k\n"
         "    prev, succ = ranks[(start - pos + 1) % k], ranks[(start - pos - 1) % k]\n")],
}

# name -> (verdict, what its first failing check must say)
EXPECTED = {
    "reversed_chain": ("partial", ["test_the_chain_follows_the_group_order",
                                   "the members that follow it"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return lazy_grades(tmp_path_factory.mktemp("mutants_01"), LAB, NAME, MUTANTS)


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_mutant_fails_and_its_mistake_is_named(results, name):
    assert_named(results(name), name, NAME, 11, *EXPECTED[name])

"""Lab 02's exercise ps_sgd_step graded on wrong answers that break one clause of its
statement alone: each must lose points, with a first failing check that names the
mistake.

Each mutant is the solution's cell with a few lines changed, graded by the real grader
(``runner.grade(path, only=["ps_sgd_step"], first_failure=True)``), stopped at its first
failing check.
"""
import pytest

from mutants import assert_named, lazy_grades

LAB, NAME = "02_parameter_server", "ps_sgd_step"

MUTANTS = {
    # the averaged gradient pulled, each rank stepping its own copy: the same numbers
    # wherever the copies agree, and the same bytes on the wire
    "gradient_pulled": [
        ("""        for p, g in zip(params, torch.split(flat, sizes)):
            p -= lr * g.view_as(p)
        flat = torch.cat([p.reshape(-1) for p in params])
    dist.broadcast(flat, src=server, group=group)                     # pull
    for p, new in zip(params, torch.split(flat, sizes)):
        p.copy_(new.view_as(p))""", """    dist.broadcast(flat, src=server, group=group)
    for p, g in zip(params, torch.split(flat, sizes)):
        p -= lr * g.view_as(p)""")],
}

# name -> (verdict, what its first failing check must say)
EXPECTED = {
    "gradient_pulled": ("partial", ["test_every_rank_gets_the_servers_parameters",
                                    "this rank's own copy stepped", "not the averaged gradient"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return lazy_grades(tmp_path_factory.mktemp("mutants_02"), LAB, NAME, MUTANTS)


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_mutant_fails_and_its_mistake_is_named(results, name):
    assert_named(results(name), name, NAME, 8, *EXPECTED[name])

"""Lab 07's core exercise, run_stage, graded on the wrong answers a student would
plausibly write: each must lose points, with a first failing check that names the
mistake (not just "values differ").

Each mutant is the solution's cell with a few lines changed. All are graded once, by
the real grader (``runner.grade(path, only=["run_stage"], first_failure=True)``), one
after the other, each stopped at its first failing check: the deadlocking one spends most
of its run waiting for its launch's time limit.
"""
import pytest

from mutants import assert_named, lazy_grades

LAB, NAME = "07_pipeline_parallel", "run_stage"

_ONE_GROUP = """        ops = [dist.P2POp(dist.isend, t.contiguous(), ranks[k], group) for t, k in sends]
        ops += [dist.P2POp(dist.irecv, b, ranks[k], group) for b, k in recvs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()"""

# name -> [(solution text, mutant text)]
MUTANTS = {
    # each send and each receive a group of its own, sends first: both neighbours wait in
    # their sends (gloo's sends wait for their receive too, so it hangs there as well)
    "separate_groups": [(_ONE_GROUP, """        for t, k in sends:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t.contiguous(), ranks[k], group)]):
                work.wait()
        for b, k in recvs:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, ranks[k], group)]):
                work.wait()""")],
    # plain isend/irecv, sends waited at the end: runs on gloo, would hang on NCCL
    "unbatched": [(_ONE_GROUP, """        pending.extend(dist.isend(t.contiguous(), ranks[k], group) for t, k in sends)
        for b, k in recvs:
            dist.irecv(b, ranks[k], group).wait()"""),
                  ("    def exchange(sends, recvs):", "    pending = []\n\n    def exchange(sends, recvs):"),
                  ("    return total if s == p - 1 else None",
                   "    for work in pending:\n        work.wait()\n    return total if s == p - 1 else None")],
    # each micro-batch's mean loss backpropagated as it is: gradients m times too large
    "unscaled": [(" * (rows[i] / batch)", "")],
    # the saved activations as a stack: 1F1B's backward then takes another micro-batch's
    "stack": [("    saved, total = {}, torch.zeros(", "    saved, total = [], torch.zeros("),
              ("            saved[i] = (x, out)", "            saved.append((x, out))"),
              ("            x, out = saved.pop(i)", "            x, out = saved.pop()")],
    # the tied embedding's two copies never exchange their gradients
    "untied": [("    for name, holders in sorted(stage.tied.items()):", "    for name, holders in []:")],
    # every receive buffer B // m rows: wrong when m does not divide the batch
    "floor_rows": [("received[kind, i] = torch.empty(rows[i], seq,",
                    "received[kind, i] = torch.empty(batch // m, seq,")],
    # receive buffers in torch.empty's default dtype: float32 where messages are float64
    "float32_buffers": [("stage.d_model, device=device, dtype=dtype)",
                         "stage.d_model, device=device)")],
    # zeros handed to every parameter no backward reached, where one process leaves None
    "zeros_left": [("    return total if s == p - 1 else None",
                    "    for param in stage.parameters():\n"
                    "        if param.requires_grad and param.grad is None:\n"
                    "            param.grad = torch.zeros_like(param)\n"
                    "    return total if s == p - 1 else None")],
    # the batch checked only once the links are open: both stages have sent and received
    "late_errors": [("    if m < 1 or batch < m:\n"
                     "        raise ValueError(f\"a batch of {batch} rows cannot make {m} micro-batches\")\n",
                     ""),
                    ("    received = {}\n",
                     "    if m < 1 or batch < m:\n"
                     "        raise ValueError(f\"a batch of {batch} rows cannot make {m} micro-batches\")\n"
                     "    received = {}\n")],
}

# name -> (verdict, what its first failing check must say)
EXPECTED = {
    "separate_groups": ("deadlock", ["deadlock", "waiting in wait for isend"]),
    "unbatched": ("fail", ["would deadlock on NCCL", "is stuck in", "posts only later"]),
    "unscaled": ("fail", ["SUM of the 3 micro-batches' mean losses", "rows_i / B"]),
    "stack": ("partial", ["1F1B", "another micro-batch's stored output",
                          "saved under i"]),
    "untied": ("fail", ["tied to the token embedding", "stage 0's tok_emb.weight",
                           "stage 1's head.weight"]),
    "floor_rows": ("partial", ["test_micro_batches_of_unequal_sizes", "another size than the "
                               "buffer", "3, 2, 2 rows"]),
    "float32_buffers": ("fail", ["test_gpipe_on_2_stages", "the likely cause is a receive buffer "
                                 "of another dtype", "dtype="]),
    "zeros_left": ("fail", ["test_gpipe_on_2_stages", "of zeros where one process leaves "
                               ".grad None", "blocks.1.unused"]),
    "late_errors": ("partial", ["test_a_batch_smaller_than_m_raises_value_error",
                                "raised ValueError after", "before any transfer"]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Mutant name -> its grade, each graded when a test first asks for it (so that
    ``-k`` runs only the mutants it selects)."""
    return lazy_grades(tmp_path_factory.mktemp("mutants_07"), LAB, NAME, MUTANTS)


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_mutant_fails_and_its_mistake_is_named(results, name):
    assert_named(results(name), name, NAME, 11, *EXPECTED[name])


@pytest.mark.parametrize("name", ["separate_groups"])  # a unit with that mutant's case:
def test_the_deadlock_is_reported_within_a_launch_timeout(results, name):  # graded once
    r = results(name)
    assert r.seconds < 120, f"the deadlocking answer took {r.seconds:.0f} s to grade"

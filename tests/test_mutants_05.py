"""The grader as teacher, lab 05: wrong answers a student would plausibly write to the core
exercise ``ZeRO3Unit`` (and to ``zero2_step``) each fail with a message that names the
mistake.

Each mutant is the solution's cell with one plausible change; each is graded as a student's
notebook would be (``runner.grade(path, only=["ZeRO3Unit"], first_failure=True)``): one grade run per mutant
(the grader reports an exercise's first failing check, so mutants of one exercise cannot
share a run), one after the other (``ast.parse``, which the grader calls, is not
thread-safe in CPython 3.11).
"""
import subprocess
import sys

import pytest

from mutants import assert_named, lazy_grades

EXERCISE = "ZeRO3Unit"


NOT_FREED = ((
    "        def after_forward(mod, args, output):\n            free()\n",
    "        def after_forward(mod, args, output):\n"),)

NO_REGATHER = ((
    "            if output.requires_grad:        # its gradient comes just before the module's "
    "backward\n                output.register_hook(lambda grad: gather())\n", ""),)

SUMMED = (("mean = summed[:sizes[rank]] / world", "mean = summed[:sizes[rank]]"),)

ALL_REDUCE = ((
    "                rows = grad.new_zeros(world, chunk)\n"
    "                for r, piece in enumerate(grad.tensor_split(world)):\n"
    "                    rows[r, :len(piece)] = piece\n"
    "                summed = grad.new_empty(chunk)\n"
    "                reduce_scatter_into(summed, rows.view(-1), group=group)\n"
    "                mean = summed[:sizes[rank]] / world\n",
    "                dist.all_reduce(grad, group=group)\n"
    "                mean = grad.tensor_split(world)[rank] / world\n"),)

FLOOR = ((
    "        sizes = [len(piece) for piece in flat.tensor_split(world)]\n"
    "        chunk = sizes[0]                    # ceil(numel / world): the collectives' pieces\n"
    "        self.shard = nn.Parameter(flat.tensor_split(world)[rank].clone())\n",
    "        chunk = flat.numel() // world\n"
    "        sizes = [chunk] * world\n"
    "        self.shard = nn.Parameter(flat[rank * chunk:(rank + 1) * chunk].clone())\n"), (
    "                full.data.copy_(torch.cat([rows[r, :n] for r, n in enumerate(sizes)]))\n",
    "                full.data[:world * chunk].copy_(rows.view(-1))\n"), (
    "                rows = grad.new_zeros(world, chunk)\n"
    "                for r, piece in enumerate(grad.tensor_split(world)):\n"
    "                    rows[r, :len(piece)] = piece\n",
    "                rows = grad[:world * chunk].reshape(world, chunk)\n"))

ASSIGNED = ((
    "            if self.shard.grad is None:\n                self.shard.grad = mean\n"
    "            else:\n                self.shard.grad += mean\n",
    "            self.shard.grad = mean\n"),)

# the trial's first failure (issue 32): views of the full buffer built before it is gathered,
# on a storage of 0 bytes: torch raises "setStorage ... out of bounds" in the student's line
VIEWS_FIRST = ((
    "            gather()\n            for owner, attr, offset, shape in slots:\n"
    "                setattr(owner, attr, full[offset:offset + shape.numel()].view(shape))\n",
    "            for owner, attr, offset, shape in slots:\n"
    "                setattr(owner, attr, full[offset:offset + shape.numel()].view(shape))\n"
    "            gather()\n"),)

# a frozen parameter taken into the unit (the statement: a ValueError at construction)
FROZEN_TAKEN = ((
    "        if not all(p.requires_grad for p in params):\n"
    "            raise ValueError(\"ZeRO3Unit trains every parameter of its module; this module "
    "has \"\n                             \"a frozen one (requires_grad=False)\")\n", ""),)
# a tied weight flattened once per place it is registered
TIED_TWICE = ((
    "        params = list(module.parameters())  # a tied parameter once\n",
    "        params = [p for _, p in module.named_parameters(remove_duplicate=False)]\n"),)
# (mutant, its change, what the student must read, the test that must be the first to fail)
MUTANTS = [
    ("the full parameters kept after forward", NOT_FREED,
     "the full parameters stay allocated after forward", "test_frees_the_full_parameters"),
    ("no gather before backward", NO_REGATHER,
     "backward used parameters that were freed: re-gather before backward",
     "test_frees_the_full_parameters"),
    ("gradients summed, not averaged", SUMMED,
     "gradients were summed over the ranks, not averaged", "test_the_shard_gradient"),
    ("an all-reduce for the reduce-scatter", ALL_REDUCE,
     "a reduce-scatter (half an all-reduce's traffic) belongs there", "test_three_psi"),
    ("shards of numel // world_size", FLOOR,
     "uneven shards lost", "test_keeps_only_this_ranks_shard"),
    ("a second backward's gradient assigned, not added", ASSIGNED,
     "the second backward replaced the first one's gradient",
     "test_the_shard_gradient_is_the_mean_gradient"),
    ("a frozen parameter taken in", FROZEN_TAKEN,
     "a frozen one is a ValueError at construction", "test_a_frozen_parameter_raises_value_error"),
    ("a tied weight flattened twice", TIED_TWICE,
     "the tied weight counted once", "test_a_tied_parameter_is_one_parameter"),
]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """Each mutant graded when a test first asks for it, up to its first failing check
    (each run is its own contained pytest process)."""
    return lazy_grades(tmp_path_factory.mktemp("mutants"), "05_zero", EXERCISE,
                       {**{name: change for name, change, *_ in MUTANTS},
                        "views before the gather": VIEWS_FIRST})


@pytest.mark.parametrize("name, says, first", [(m[0], m[2], m[3]) for m in MUTANTS],
                         ids=[m[0] for m in MUTANTS])
def test_a_wrong_zero3_unit_fails_naming_its_mistake(verdicts, name, says, first):
    r = verdicts(name)
    assert r.verdict in ("partial", "fail") and r.points < r.max_points, (name, r)
    assert says in r.message, (name, r.message)
    assert r.message.startswith(first), (name, r.message)


def test_the_students_own_exception_names_their_line_and_no_hint(verdicts):
    """The trial's first failure: the student's own exception inside their code gets no
    hint pointer, and the report names the student's line in the ZeRO3Unit cell (not
    torch's frame)."""
    r = verdicts("views before the gather")
    assert r.verdict in ("partial", "fail") and r.points < r.max_points, r
    assert "your code raised RuntimeError: setStorage" in r.message, r.message
    assert "of the ZeRO3Unit cell, in before_forward: setattr(owner, attr, full[offset" in \
        r.message, r.message
    assert "torch/" not in r.message and r.hint == "", (r.message, r.hint)


REFUSED = """
from distlab.grading import answers
from distlab.runtime import absent
absent.install(answers.modules_of(["ZeRO3Unit"]), answers.REFUSAL)  # as the ranks' server does
import torch, torch.nn as nn
from distlab.zero import flat, memory
calls = {"FlatParams": lambda: flat.FlatParams([("w", nn.Parameter(torch.ones(2)))]),
         "Layout": lambda: flat.Layout(5, 2),
         "reduce_scatter_mean": lambda: flat.reduce_scatter_mean(torch.ones(4), None),
         "all_gather_shards": lambda: flat.all_gather_shards(torch.ones(2), None, torch.ones(4))}
for name, call in calls.items():
    try:
        call()
        print(name, "ran")
    except RuntimeError as e:
        print(name, "refused" if answers.REFUSAL in str(e) else f"failed otherwise: {e}")
with memory.StorageTracker() as tracker:   # what the exercise's tests use still works
    torch.ones(3)
print("StorageTracker", "works" if tracker.peak() else "broken")
"""


def test_the_flat_units_helpers_refuse_while_zero3_unit_is_graded():
    """A student who builds ZeRO3Unit from the library's FlatParams (or its padded layout
    and collectives) scores 0: in a graded rank they refuse, with the grader's message,
    their modules absent (as in its graded ranks); the StorageTracker the tests measure
    with still works."""
    out = subprocess.run([sys.executable, "-c", REFUSED], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:5] == [
        "FlatParams refused", "Layout refused", "reduce_scatter_mean refused",
        "all_gather_shards refused", "StorageTracker works"], out.stdout


# zero2_step: each mutant breaks one clause of its statement alone
ZERO2 = {
    # the gradients divided in place before the reduce-scatter: the mean is right, the
    # caller's flat_grads is not left as it was
    "grads_divided_in_place": [
        ("    padded = flat_grads.new_zeros(world, chunk)\n",
         "    flat_grads /= world\n    padded = flat_grads.new_zeros(world, chunk)\n"),
        ("    grad = summed[:end - start] / world\n", "    grad = summed[:end - start]\n")],
}
ZERO2_EXPECTED = {  # name -> (verdict, what its first failing check must say)
    "grads_divided_in_place": ("partial", ["test_flat_grads_is_left_as_it_was",
                                           "changed the caller's flat_grads"]),
}


@pytest.fixture(scope="module")
def zero2_verdicts(tmp_path_factory):
    return lazy_grades(tmp_path_factory.mktemp("mutants_zero2"), "05_zero", "zero2_step", ZERO2)


@pytest.mark.parametrize("name", list(ZERO2))
def test_a_wrong_zero2_step_fails_naming_its_mistake(zero2_verdicts, name):
    assert_named(zero2_verdicts(name), name, "zero2_step", 25, *ZERO2_EXPECTED[name])

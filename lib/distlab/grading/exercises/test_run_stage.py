"""Exercise run_stage(stage, table, inputs, targets, group=None) of lab 07.

One training step of one pipeline stage: the stage's row of a schedule table, run in
order, with activations sent to the next stage and gradients to the previous one over
point-to-point calls in NCCL-safe groups, the last stage's loss weighed by each
micro-batch's share of the batch, and the tied embedding's gradient summed between the
first and the last stage.

Each case is one launch on gloo ranks: the awkward tiny GPT (tied head, a frozen
parameter, one the loss never uses; float64) cut by ``pp.Stage``, trained for two SGD
steps with the library's GPipe or 1F1B table and the student's ``run_stage``. Back come,
as plain data, every rank's returned losses, its gradients after the first step, its
final weights and its CommLog. Here they are held to one process on the whole batch
(computed in this process), and the logs to NCCL's rules
(:func:`distlab.collectives.p2p_check.nccl_deadlock`). A wrong answer is named where it
can be: gradients m times too large, micro-batches weighed 1/m, the tied gradient not
summed, a backward on another micro-batch's activations, a receive buffer of the wrong
shape, groups that would hang on NCCL. After one launch deadlocks, the others are not
tried (each would cost its timeout): they report the same deadlock.
"""
import copy
import functools
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab import launch, pp
from distlab.collectives.p2p_check import nccl_deadlock
from distlab.comm import CommLog
from distlab.data import NGramLanguage
from distlab.grading import expect_close
from distlab.model import GPT, config
from pp_cases import expected_table

NOTEBOOK = "07_pipeline_parallel"
CORE = True  # one of its lab's core exercises (listed so in the lab and the README)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers

# The hint to open (lab 07, section 4), by the words of the check that failed: 1 what each
# action needs, 2 the loss and the backward, 3 grouping the transfers, 4 the first exchange
# with each neighbour, 5 the tied embedding, 6 the whole recipe (with the argument checks).
HINTS = {"*": {
    'raised ValueError after': 6,
    'raise ValueError on every stage': 6,
    'waited for each other': 6,
    'SUM of the': 2,
    'weighed 1/m': 2,
    "times one process's gradient": 2,
    'tied to the token embedding': 5,
    "another micro-batch's": 1,
    'on NCCL': 3,
    'where one process leaves .grad None': 6,
    'returned': 2,
    'is not in the group': 6,
    'another size than the buffer': 1,
    "differ from one process's": 1,
    'against one process': 1,
    'deadlock': 4,
}}
TIMEOUT = 30  # seconds per launch; a correct one takes one or two (a few on a loaded machine)
VOCAB, SEQ, STEPS, LR = 13, 8, 2, 0.5
LANG = NGramLanguage(VOCAB, 3, seed=0)
CFG = config("test", vocab_size=VOCAB, n_layer=2)
FROZEN, UNUSED = "blocks.0.ln1.bias", "blocks.1.unused"
TIED = ("tok_emb.weight", "head.weight")  # one tensor: the first stage's and the last's
TITLE = {"gpipe": "GPipe", "1f1b": "1F1B"}
RTOL, ATOL = 1e-5, 1e-7  # float64, loose enough for a loss taken in float32 (pp.cross_entropy)
# schedule -> stages -> (micro-batches, batch rows): m < p, m not a multiple of p
RUNS = {"gpipe": {2: (3, 6), 4: (2, 6)}, "1f1b": {2: (3, 6), 4: (5, 10)}}


def make_model():
    torch.manual_seed(0)
    model = GPT(CFG).double()
    model.get_parameter(FROZEN).requires_grad_(False)
    model.blocks[1].unused = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    return model


def named(module):
    return module.named_parameters(remove_duplicate=False)


def sgd(module, lr):
    """One SGD step of ``module``, gradients cleared."""
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


# ---------------------------------------------------------------------- in the ranks


def train(run_stage, table, m, batch, members=None):
    """STEPS SGD steps of this rank's stage with the student's ``run_stage`` on ``table``
    (written out in pp_cases.TABLES: the schedules answer this lab's other exercises,
    absent here and in the ranks); plain data back. With ``members`` (global ranks),
    the pipeline is the group of those ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(members)) if members else None
    members = list(members or range(world))
    p = len(members)
    stage = pp.Stage(make_model(), members.index(rank) if rank in members else 0, p)
    before = {n: t.detach().clone() for n, t in named(stage.module)}
    losses, grads = [], None
    with CommLog() as log:
        for step in range(STEPS):
            loss = run_stage(stage, table, *LANG.batch(step, batch, SEQ), group)
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                losses.append(float(loss))
            else:
                losses.append(None if loss is None else f"a {type(loss).__name__}")
            if grads is None:
                grads = {n: None if t.grad is None else t.grad.detach().clone()
                         for n, t in named(stage.module)}
            sgd(stage, LR)
    params = {n: t.detach().clone() for n, t in named(stage.module)}
    return {"member": rank in members, "losses": losses, "grads": grads, "params": params,
            "untouched": all(torch.equal(params[n], before[n]) for n in params),
            "log": log.records()}


# Each promised ValueError, one launch of 2 ranks per case; every rank sees the same
# mistake, so a correct answer raises on both before any call.
ERRORS = {
    "a batch of 2 rows in 3 micro-batches": "batch",
    "targets of another shape than the inputs, (6, 8) and (6, 7)": "shape",
    "inputs and targets of one dimension, (48,)": "shape",
    "a stage of a 3-stage cut on a group of 2 ranks": "group",
    "stage 1 on group rank 0 and stage 0 on group rank 1": "group",
}


def error_sizes(case: str) -> tuple[int, int]:
    """(stages, micro-batches) of ``case`` (of :data:`ERRORS`)."""
    return (3 if case.startswith("a stage of a 3-stage cut") else 2,
            3 if case.startswith("a batch of 2 rows") else 2)


def error_case(run_stage, case, table):
    """What run_stage does in ``case`` (of :data:`ERRORS`) with the GPipe ``table`` of its
    sizes (:func:`error_sizes`) on this rank: ("ValueError", the name of another
    exception, or what it returned; the calls it made first)."""
    rank = dist.get_rank()
    inputs, targets = LANG.batch(0, 6, SEQ)
    index, (stages, _) = rank, error_sizes(case)
    if case.startswith("a batch of 2 rows"):
        inputs, targets = LANG.batch(0, 2, SEQ)
    elif case.startswith("targets of another shape"):
        targets = targets[:, 1:]
    elif case.startswith("inputs and targets of one dimension"):
        inputs, targets = inputs.flatten(), targets.flatten()
    elif not case.startswith("a stage of a 3-stage cut"):
        index = 1 - rank
    stage = pp.Stage(make_model(), index, stages)
    with CommLog() as log:
        try:
            got = run_stage(stage, table, inputs, targets)
        except NotImplementedError:
            raise
        except Exception as exc:
            return type(exc).__name__, [e.op for e in log.events]
    return f"returned {type(got).__name__}", [e.op for e in log.events]


def check_raises(student, kind):
    """Each case of ``kind`` raises ValueError on both ranks, before any transfer. Counted
    only for an answer that runs a step (GPipe on 2 stages, the first test's launch,
    cached): one that raises whatever it is given, or calls the library's refused
    answer, earns nothing here."""
    outcome(student, "gpipe", 2, *RUNS["gpipe"][2])
    for case in (c for c, k in ERRORS.items() if k == kind):
        what = f"run_stage on 2 ranks with {case}"
        try:
            ranks = launch.run(error_case, 2, student.run_stage, case,
                               expected_table("gpipe", *error_sizes(case)), backend="gloo",
                               timeout=TIMEOUT / 2)
        except launch.LaunchTimeout:
            raise AssertionError(f"{what}: the stages waited for each other until the time "
                                 f"limit; check the arguments and raise ValueError on every "
                                 f"stage before any transfer") from None
        except launch.RankError as exc:
            if exc.exc_type == "NotImplementedError":
                raise
            raise AssertionError(f"{what}: {str(exc).splitlines()[0]}") from None
        for rank, (got, calls) in enumerate(ranks):
            assert got == "ValueError", (f"{what}: rank {rank}: {got}; raise ValueError on "
                                         f"every stage, before any transfer")
            assert not calls, (f"{what}: rank {rank} raised ValueError after {len(calls)} "
                               f"call(s) ({', '.join(calls[:4])}): check the arguments before "
                               f"any transfer, so that no stage waits for a peer that gave up")


# ----------------------------------------------------------------- in the test process


def _micro_grads(model, x, y, m, weight):
    """The gradients of sum_i weight(rows_i) * loss(micro-batch i), on a copy."""
    model = copy.deepcopy(model)
    for xi, yi in zip(x.tensor_split(m), y.tensor_split(m)):
        loss = F.cross_entropy(model(xi).flatten(0, 1), yi.flatten())
        (loss * weight(len(xi))).backward()
    return {n: t.grad for n, t in named(model) if t.grad is not None}


@functools.cache
def one_process(batch, m):
    """One process on the whole batch: the loss of each step, the first step's gradients,
    the final weights."""
    model = make_model()
    losses, grads = [], None
    for step in range(STEPS):
        x, y = LANG.batch(step, batch, SEQ)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if step == 0:
            grads = {n: t.grad.clone() for n, t in named(model) if t.grad is not None}
        losses.append(loss.item())
        sgd(model, LR)
    return losses, grads, {n: t.detach().clone() for n, t in named(model)}


@functools.cache
def wrong_weighings(batch, m):
    """The first step's gradients when micro-batch i's loss is weighed 1 or 1/m instead of
    rows_i / B (computed only for a wrong answer)."""
    model = make_model()
    x, y = LANG.batch(0, batch, SEQ)
    return {"unscaled": _micro_grads(model, x, y, m, lambda rows: 1.0),
            "1/m": _micro_grads(model, x, y, m, lambda rows: 1.0 / m)}


def rows_of(batch, m):
    return [len(r) for r in torch.arange(batch).tensor_split(m)]


def shapes_hint(batch, m):
    rows = rows_of(batch, m)
    return (f"a batch of {batch} rows makes micro-batches of {', '.join(map(str, rows))} rows "
            f"(torch.tensor_split), so the activation of micro-batch i and its gradient are "
            f"(rows_i, {SEQ}, {CFG.d_model}): allocate each receive buffer for the micro-batch "
            f"it receives")


MIXUP = ("a backward must have run on another micro-batch's stored output, or with another "
         "micro-batch's gradient: keep what (\"F\", i) saved under i, and run (\"B\", i) on "
         "micro-batch i's saved output with the gradient received for micro-batch i")

_runs: dict = {}
_deadlock: list = []  # the first launch that hung: the later ones are not tried


def outcome(student, schedule, p, m, batch, members=None, world=None):
    """Every rank's findings for one case, from one launch (cached, errors too)."""
    key = (schedule, p, m, batch, members)
    what = describe(schedule, p, m, batch, members)
    if key not in _runs:
        if _deadlock:
            first = _deadlock[0]
            _runs[key] = launch.LaunchTimeout(str(first), first.timeout, first.where,
                                              first.stacks)
        else:
            try:
                _runs[key] = launch.run(train, world or p, student.run_stage,
                                        expected_table(schedule, p, m), m, batch, members,
                                        backend="gloo", timeout=TIMEOUT)
            except launch.LaunchTimeout as exc:
                _deadlock.append(exc)
                _runs[key] = exc
            except launch.RankError as exc:
                _runs[key] = exc if exc.exc_type == "NotImplementedError" else AssertionError(
                    _rank_error(exc, what, batch, m))
            except launch.LaunchError as exc:
                _runs[key] = AssertionError(_crash(exc, what, batch, m))
    if isinstance(_runs[key], BaseException):
        raise _runs[key]
    return _runs[key]


def describe(schedule, p, m, batch, members=None):
    where = f" of the group of global ranks {list(members)}" if members else ""
    return (f"run_stage with {TITLE[schedule]} on {p} stages{where}, a batch of {batch} rows "
            f"in m = {m} micro-batches")


def _rank_error(exc, what, batch, m):
    from distlab.grading.output import rank_error

    text = str(exc)
    hint = ""
    if "Mismatch in shape" in text:
        hint = f"; {MIXUP}"
    elif batch % m and ("size" in text or "shape" in text):
        hint = f"; {shapes_hint(batch, m)}"
    return f"{what}: {rank_error(exc)}" + hint


def _crash(exc, what, batch, m):
    text = str(exc)
    if "doesn't match expected size" in text:
        dtype = ("a receive buffer of another dtype than the message: messages carry the "
                 "parameters' dtype (float64 here), and torch.empty makes float32 unless told "
                 "dtype=; ")
        return (f"{what}: a rank received a message of another size than the buffer it "
                f"posted for it (gloo aborted: \"Received data size doesn't match expected "
                f"size\"; NCCL needs the same size on both sides). " + (
                    f"The micro-batches' rows are equal here, so the likely cause is {dtype}"
                    f"otherwise the buffer's shape" if not batch % m else
                    f"Either {dtype}or {shapes_hint(batch, m)}"))
    return f"{what}: {text.splitlines()[0]}"


def check_training(student, schedule, p, m, batch, members=None, world=None):
    """The student's run against one process: returns, gradients, losses, weights, then
    NCCL's rules."""
    ranks = outcome(student, schedule, p, m, batch, members, world)
    what = describe(schedule, p, m, batch, members)
    members = list(members or range(p))
    losses, grads, params = one_process(batch, m)
    for rank, got in enumerate(ranks):
        if rank not in members:
            assert all(v is None for v in got["losses"]) and not got["log"] and got["untouched"], (
                f"{what}: global rank {rank} is not in the group, so run_stage must return None "
                f"at once, with no call and no change to its stage")
            continue
        s = members.index(rank)
        last = s == len(members) - 1
        for step, loss in enumerate(got["losses"]):
            if last:
                assert isinstance(loss, float), (
                    f"{what}: the last stage returned {loss or 'None'} at step {step}; it returns "
                    f"the batch's mean loss, a one-element tensor")
            else:
                assert loss is None, (f"{what}: stage {s} returned {loss!r}; only the last "
                                      f"stage returns the loss, the others None")
    check_gradients(ranks, members, grads, losses[0], what, m, batch)
    got_losses = torch.tensor(ranks[members[-1]]["losses"], dtype=torch.float64)
    want = torch.tensor(losses, dtype=torch.float64)
    if not torch.allclose(got_losses, want, rtol=RTOL, atol=ATOL):
        ratio = float(got_losses[0] / want[0])
        assert abs(ratio - m) > 1e-6 * m, (
            f"{what}: the loss returned is {m} times the batch's mean loss: each micro-batch's "
            f"mean loss counts for its share of the batch, rows_i / B (1/m here)")
        expect_close(got_losses, want, f"{what}: the loss the last stage returned at each of "
                     f"{STEPS} steps, against one process on the whole batch", RTOL, ATOL)
    for rank in members:
        for n, value in ranks[rank]["params"].items():
            expect_close(value, params[n], f"{what}: stage {members.index(rank)}'s {n} after "
                         f"{STEPS} SGD steps, against one process", RTOL, ATOL)
    # self-reported (CommLog only): NCCL's rules are about the order and grouping of the
    # calls, which bytes on the wire cannot show (wire.py)
    problem = nccl_deadlock([r["log"] for r in ranks])
    assert problem is None, f"{what}: ran on gloo, but {on_nccl(problem)}"


def on_nccl(problem: str) -> str:
    """nccl_deadlock's account on one line, the hang first."""
    sections: list[list[str]] = [[]]
    for line in problem.splitlines():
        if line.startswith("On NCCL") and sections[-1]:
            sections.append([])
        sections[-1].append(line)
    flat = lambda lines: " ".join(line.strip().removeprefix("- ") for line in lines)
    hang = [sec for sec in sections if sec[0].startswith("On NCCL this would hang")]
    rest = " ".join(flat(sec) for sec in sections if sec not in hang)
    if not hang:
        return f"would fail on NCCL: {rest}"
    return f"would deadlock on NCCL: {flat(hang[0][1:])}" + (f" Besides: {rest}" if rest else "")


def _close(a, b):
    return a is not None and b is not None and a.shape == b.shape and torch.allclose(
        a, b, rtol=RTOL, atol=ATOL)


def check_gradients(ranks, members, want, first_loss, what, m, batch):
    """The first step's gradients, stage by stage, the mistakes named."""
    bad = []  # (stage, name, got, want)
    for s, rank in enumerate(members):
        for n, g in ranks[rank]["grads"].items():
            w = want.get(n)
            if w is None:
                assert g is None, (
                    f"{what}: stage {s}'s {n} has a gradient"
                    + (" of zeros" if not g.any() else "") + f" where one process leaves .grad "
                    f"None ({'frozen' if n == FROZEN else 'the loss never uses it'}): leave "
                    f"None where no backward reached a parameter (an optimizer treats a zero "
                    f"gradient as a step: weight decay and momentum still move it)")
            elif not _close(g, w):
                bad.append((s, n, g, w))
    if not bad:
        return
    for label, grads in wrong_weighings(batch, m).items():
        if all(_close(g, grads.get(n)) for _, n, g, _ in bad):
            if label == "unscaled":
                raise AssertionError(
                    f"{what}: the gradients are those of the SUM of the {m} micro-batches' mean "
                    f"losses ({m} times one process's when m divides the batch): scale each "
                    f"micro-batch's loss by its share of the batch, rows_i / B, before its "
                    f"backward")
            raise AssertionError(
                f"{what}: each micro-batch's loss was weighed 1/m, but the micro-batches hold "
                f"{', '.join(map(str, rows_of(batch, m)))} of the {batch} rows: weigh micro-batch "
                f"i by rows_i / B, its share of the batch, so the gradients are those of the "
                f"batch's mean loss")
    if len(members) > 1 and all(n in TIED for _, n, _, _ in bad):
        names = " and ".join(sorted({f"stage {s}'s {n}" for s, n, _, _ in bad}))
        raise AssertionError(
            f"{what}: every gradient matches one process's except {names}: the head is tied to "
            f"the token embedding, one tensor held by the first and the last stage "
            f"(stage.tied), and each stage has only its own part of its gradient; sum the two "
            f"between those stages after the backwards, so that both copies take one process's "
            f"step")
    own = [b for b in bad if b[1] not in TIED] or bad  # a tied copy shows the other's error
    s, n, g, w = max(own, key=lambda b: b[0])
    later = f", while stages {s + 1} and after match" if s + 1 < len(members) else ""
    if g is not None and w is not None and g.shape == w.shape and torch.allclose(
            g, m * w, rtol=RTOL, atol=ATOL) and m > 1:
        raise AssertionError(f"{what}: stage {s}'s {n} is {m} times one process's gradient: "
                             f"scale each micro-batch's loss by its share of the batch, "
                             f"rows_i / B")
    loss = ranks[members[-1]]["losses"][0]
    forward = isinstance(loss, float) and abs(loss - first_loss) <= ATOL + RTOL * abs(first_loss)
    expect_close(g if g is not None else torch.zeros_like(w), w,
                 f"{what}: stage {s}'s gradients after the first step differ from one "
                 f"process's{later}" + (
                     f"; the loss is right, so the forward is, and {MIXUP}" if forward else "")
                 + f". {n}", RTOL, ATOL)


# ---------------------------------------------------------------------------- tests
# In the order of their world sizes, 2 then 4: the warm ranks of one size serve its tests
# (a new size starts new ranks, each importing the notebook's module: seconds). Three
# stages run inside a group of 4 ranks.


def test_gpipe_on_2_stages(student):
    check_training(student, "gpipe", 2, *RUNS["gpipe"][2])


def test_1f1b_on_2_stages(student):
    check_training(student, "1f1b", 2, *RUNS["1f1b"][2])


def test_one_micro_batch(student):
    """GPipe with m = 1: stage 0 sends its activation and then waits for a gradient, where
    NCCL's lazy connection setup needs both sides' first groups to agree."""
    check_training(student, "gpipe", 2, 1, 4)


def test_a_batch_smaller_than_m_raises_value_error(student):
    check_raises(student, "batch")


def test_mismatched_shapes_raise_value_error(student):
    check_raises(student, "shape")


def test_a_wrong_group_raises_value_error(student):
    check_raises(student, "group")


def test_gpipe_on_4_stages(student):
    check_training(student, "gpipe", 4, *RUNS["gpipe"][4])


def test_1f1b_on_4_stages(student):
    check_training(student, "1f1b", 4, *RUNS["1f1b"][4])


def test_micro_batches_of_unequal_sizes(student):
    """7 rows in 3 micro-batches: 3, 2 and 2 rows."""
    check_training(student, "1f1b", 4, 3, 7)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_3_stages_inside_a_group(student, schedule):
    """Global ranks 1, 2 and 3 of 4 are a pipeline of three (stage s is group rank s,
    global rank s + 1); rank 0 is outside it."""
    check_training(student, schedule, 3, 4, 8, members=(1, 2, 3), world=4)

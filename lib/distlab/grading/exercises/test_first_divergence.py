"""Exercise first_divergence(records, groups) of lab 12.

Every rank's flight record of a run that hung (or did not), generated at world sizes 2
to 8 by running each rank's program of collectives until every rank finished or waits
for ever (lab12_cases.simulate, in the recorder's own dump format), with one rank's
call changed: skipped, resized, of another op, or a call too many. The answer expected
is where we changed it (the culprit, the group, the sequence number), and where
PyTorch's analyzer (torch.distributed.flight_recorder) names one culprit in a group of
three ranks or more, the analyzer's. Every case is answered in one sandboxed rank (one
launch) and checked here.
"""
import sys

import cloudpickle

from distlab import launch
from distlab.resilience import flight
import lab12_cases

NOTEBOOK = "12_failures_at_scale"
CORE = True  # one of its lab's core exercises (listed so in the lab and the README)
# the hint to open (1: which entries to compare; 2: what a dropped entry says; 3: the
# culprit; 4: a hang that causes another)
HINTS = {"test_runs_that_agree_give_none": 2,
         "test_the_rank_and_the_collective_where_the_ranks_part": 3,
         "test_entries_the_buffer_dropped_are_unknown_not_missing": 2,
         "test_only_the_members_of_a_group_are_compared": 1,
         "test_a_hang_that_another_caused_is_not_the_first": 4,
         "test_the_analyzer_agrees_where_it_names_one_culprit": 3,
         "test_a_group_of_ranks_without_records_raises_value_error": 1}
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers


def answer_all(first_divergence, cases):
    """Each case's answer, or ("raised", exception class name, message)."""
    out = []
    for records, groups in cases:
        try:
            out.append(first_divergence(records, groups))
        except Exception as exc:  # noqa: BLE001 (the student's exception is the answer)
            out.append(("raised", type(exc).__name__, str(exc)))
    return out


_cache = {}


def answers(student):
    """[(scenario, the student's answer)] for every generated scenario (one launch)."""
    if "all" not in _cache:
        cases = lab12_cases.scenarios()
        got = launch.run(answer_all, 1, student.first_divergence,
                         [(c["records"], c["groups"]) for c in cases], backend="gloo",
                         timeout=60)[0]
        _cache["all"] = list(zip(cases, got))
    return _cache["all"]


def check(student, kind):
    checked = 0
    for case, got in answers(student):
        if case["kind"] != kind:
            continue
        assert not (isinstance(got, tuple) and got[:1] == ("raised",)), (
            f"{case['what']}: first_divergence raised {got[1]}: {got[2]}")
        want = case["expected"]
        assert got == want, (
            f"{case['what']}: first_divergence returned {got!r}; expected {want!r}"
            + ("" if want else ": every group's members agree on every entry they all kept"))
        checked += 1
    assert checked, f"no scenario of kind {kind!r}"


def test_runs_that_agree_give_none(student):
    check(student, "agree")


def test_the_rank_and_the_collective_where_the_ranks_part(student):
    check(student, "dp")


def test_entries_the_buffer_dropped_are_unknown_not_missing(student):
    check(student, "dropped")


def test_only_the_members_of_a_group_are_compared(student):
    check(student, "member")


def test_a_hang_that_another_caused_is_not_the_first(student):
    check(student, "consequence")


def test_the_analyzer_agrees_where_it_names_one_culprit(student):
    compared = 0
    for case, got in answers(student):
        for verdict in flight.analyze(case["dumps"]):
            members = case["groups"][verdict["group"]]
            if len(verdict["culprits"]) != 1 or len(members) < 3 or case["kind"] == "dropped":
                continue
            if case["kind"] == "consequence" and verdict["group"] != "tp":
                continue   # the analyzer reports every group's first mismatch
            want = {"rank": verdict["culprits"][0], "group": verdict["group"],
                    "seq": verdict["seq"]}
            assert got == want, (f"{case['what']}: first_divergence returned {got!r}; PyTorch's "
                                 f"analyzer says {want!r} ({verdict['message']})")
            compared += 1
    assert compared >= 10, f"the analyzer named one culprit in only {compared} scenarios"


def test_a_group_of_ranks_without_records_raises_value_error(student):
    case = next(c for c, _ in answers(student) if c["kind"] == "dp")
    groups = dict(case["groups"], extra=[0, len(case["records"])])
    got = launch.run(answer_all, 1, student.first_divergence, [(case["records"], groups)],
                     backend="gloo", timeout=60)[0][0]
    assert isinstance(got, tuple) and got[:2] == ("raised", "ValueError"), (
        f"groups naming rank {len(case['records'])} of {len(case['records'])} records: "
        f"first_divergence returned {got!r}; raise ValueError")

"""Exercise mesh_groups(rank, world_size, dp=1, tp=1, pp=1, gpus_per_node=None,
num_layers=None) of lab 09.

A rank's coordinates (d, p, t) on a dp × pp × tp grid, TP fastest, then PP, then DP
(rank = (d pp + p) tp + t), and the global ranks of its DP, PP and TP groups in
increasing order; ValueError for a layout that cannot run. Every case is answered in one
sandboxed rank (one launch) and checked here against the formula written out.
"""
import sys

import cloudpickle

from distlab import launch

NOTEBOOK = "09_capstone"
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get these helpers

# The hint to open (lab 09, section 1): 1 rank to coordinates, 2 the groups, 3 the checks.
HINTS = {"test_coordinates_of_every_rank": 1, "test_groups_of_every_rank": 2,
         "test_bad_layouts_raise_value_error": 3, "test_limits_that_hold_are_accepted": 3}
LAYOUTS = [(w, dp, tp, w // (dp * tp)) for w in (1, 6, 8, 12) for dp in range(1, w + 1)
           for tp in range(1, w + 1) if w % (dp * tp) == 0]
BAD = {  # what is wrong -> the call's keyword arguments
    "dp × tp × pp = 2 × 2 × 3 = 12 on 8 ranks": dict(rank=0, world_size=8, dp=2, tp=2, pp=3),
    "dp = 0": dict(rank=0, world_size=8, dp=0, tp=8, pp=1),
    "tp = -2": dict(rank=0, world_size=8, dp=-4, tp=-2, pp=1),
    "dp = True (a bool is not a size)": dict(rank=0, world_size=8, dp=True, tp=8, pp=1),
    "pp = True (a bool is not a size)": dict(rank=0, world_size=8, dp=8, tp=1, pp=True),
    "tp = 2.0 (a float is not a size)": dict(rank=0, world_size=8, dp=4, tp=2.0, pp=1),
    "tp = 8 with 4 GPUs per node": dict(rank=0, world_size=8, dp=1, tp=8, pp=1, gpus_per_node=4),
    "pp = 8 stages for 4 layers": dict(rank=0, world_size=8, dp=1, tp=1, pp=8, num_layers=4),
    "rank 8 of a world of 8": dict(rank=8, world_size=8, dp=2, tp=2, pp=2),
    "rank -1": dict(rank=-1, world_size=8, dp=2, tp=2, pp=2),
}
GOOD = {  # valid layouts at the limits -> the call's keyword arguments
    "tp = 4 with 4 GPUs per node": dict(rank=5, world_size=8, dp=2, tp=4, pp=1, gpus_per_node=4),
    "pp = 4 stages for 4 layers": dict(rank=3, world_size=8, dp=2, tp=1, pp=4, num_layers=4),
    "pp = 3 stages for 4 layers (pp need not divide the layers)":
        dict(rank=4, world_size=6, dp=2, tp=1, pp=3, num_layers=4),
    "tp · pp = 16 ranks beyond a node of 4, tp = 4 inside it (only tp must fit a node)":
        dict(rank=13, world_size=16, dp=1, tp=4, pp=4, gpus_per_node=4, num_layers=4),
}


def answer_all(mesh_groups, calls):
    """Each call's answer, or ("raised", exception class name, message)."""
    out = []
    for kwargs in calls:
        try:
            out.append(mesh_groups(**kwargs))
        except Exception as exc:  # noqa: BLE001 (the student's exception is the answer)
            out.append(("raised", type(exc).__name__, str(exc)))
    return out


_answers = {}


def answers(student):
    if "all" not in _answers:
        calls = [dict(rank=r, world_size=w, dp=dp, tp=tp, pp=pp)
                 for w, dp, tp, pp in LAYOUTS for r in range(w)]
        calls += list(BAD.values()) + list(GOOD.values())
        got = launch.run(answer_all, 1, student.mesh_groups, calls, backend="gloo", timeout=60)[0]
        _answers["all"] = dict(zip(map(_key, calls), got))
    return _answers["all"]


def _key(kwargs):
    return _args(kwargs)    # by repr: dp=True and dp=1 are different calls


def asked(student, **kwargs):
    """The answer to a call that must not raise."""
    got = answers(student)[_key(kwargs)]
    if isinstance(got, tuple) and got[:1] == ("raised",):
        raise AssertionError(f"mesh_groups({_args(kwargs)}) raised {got[1]}: {got[2]}; this "
                             f"layout is valid")
    return got


def _args(kwargs):
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def expected(rank, dp, tp, pp):
    t, rest = rank % tp, rank // tp
    p, d = rest % pp, rest // pp

    def at(d, p, t):
        return (d * pp + p) * tp + t
    return {"coords": (d, p, t), "dp": [at(i, p, t) for i in range(dp)],
            "pp": [at(d, i, t) for i in range(pp)], "tp": [at(d, p, i) for i in range(tp)]}


def _shape(got, kwargs):
    assert isinstance(got, dict) and set(got) >= {"coords", "dp", "pp", "tp"}, (
        f"mesh_groups({_args(kwargs)}) returned {got!r}; return a dict with keys 'coords', "
        f"'dp', 'pp' and 'tp'")


def _every_rank(student):
    """(arguments, the answer, the expected answer) for every rank of every layout."""
    for w, dp, tp, pp in LAYOUTS:
        for rank in range(w):
            kwargs = dict(rank=rank, world_size=w, dp=dp, tp=tp, pp=pp)
            got = asked(student, **kwargs)
            _shape(got, kwargs)
            yield kwargs, got, expected(rank, dp, tp, pp)


def test_coordinates_of_every_rank(student):
    for kwargs, got, want in _every_rank(student):
        rank, dp, tp, pp = (kwargs[k] for k in ("rank", "dp", "tp", "pp"))
        want = want["coords"]
        if tuple(got["coords"]) != want:
            order = next((name for name, perm in (("pp fastest", (1, 0, 2)),
                                                  ("dp fastest", (2, 1, 0)))
                          if tuple(got["coords"]) == _other_order(rank, dp, tp, pp, perm)), None)
            raise AssertionError(
                f"mesh_groups({_args(kwargs)})['coords'] is {tuple(got['coords'])}, expected "
                f"(d, p, t) = {want}: TP varies fastest, then PP, then DP, so rank = "
                f"(d·pp + p)·tp + t" + (f" (your grid has {order})" if order else ""))


def _other_order(rank, dp, tp, pp, perm):
    """(d, p, t) of ``rank`` when the dimensions vary in another order, slowest first."""
    sizes = [dp, pp, tp]
    order = [sizes[i] for i in perm]
    digits = []
    for size in reversed(order):
        rank, digit = divmod(rank, size)
        digits.append(digit)
    values = dict(zip(perm, reversed(digits)))
    return values[0], values[1], values[2]


def test_groups_of_every_rank(student):
    for kwargs, got, want in _every_rank(student):
        for dim in ("dp", "pp", "tp"):
            members = list(got[dim]) if isinstance(got[dim], (list, tuple)) else got[dim]
            if members != want[dim]:
                hint = (" (the right ranks, but in increasing order please)"
                        if isinstance(members, list) and sorted(members) == want[dim] else "")
                raise AssertionError(
                    f"mesh_groups({_args(kwargs)})['{dim}'] is {members!r}, expected "
                    f"{want[dim]}: the {dim.upper()} group holds the ranks that share this "
                    f"rank's other two coordinates{hint}")


def test_bad_layouts_raise_value_error(student):
    for what, kwargs in BAD.items():
        got = answers(student)[_key(kwargs)]
        assert isinstance(got, tuple) and got[:2] == ("raised", "ValueError"), (
            f"mesh_groups({_args(kwargs)}) ({what}) "
            + (f"raised {got[1]}: {got[2]}" if isinstance(got, tuple) and got[:1] == ("raised",)
               else f"returned {got!r}") + "; raise ValueError, saying what to change")
        assert got[2].strip(), f"mesh_groups({_args(kwargs)}) ({what}): the ValueError is empty"


def test_limits_that_hold_are_accepted(student):
    for what, kwargs in GOOD.items():
        got = answers(student)[_key(kwargs)]
        if isinstance(got, tuple) and got[:1] == ("raised",):
            raise AssertionError(f"a valid layout refused: {what}. mesh_groups({_args(kwargs)}) "
                                 f"raised {got[1]}: {got[2]}")
        _shape(got, kwargs)
        want = expected(kwargs["rank"], kwargs["dp"], kwargs["tp"], kwargs["pp"])
        assert got == want or (tuple(got["coords"]) == want["coords"] and all(
            list(got[k]) == want[k] for k in ("dp", "pp", "tp"))), (
            f"mesh_groups({_args(kwargs)}) ({what}): {got}, expected {want}")

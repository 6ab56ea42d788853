"""The kit's own account of the labs: each lab's exercises, and the library's answers.

The grader takes every maximum from the kit, never from the student's notebook: a lab's
exercises are those whose test file (``exercises/test_<name>.py``, installed with the
package, out of the student's reach) declares ``NOTEBOOK = "<lab>"`` (:func:`exercises`).
A notebook is the lab whose name its file name starts with (``05_zero.ipynb``,
``05_zero-alice.ipynb``, ``05_zero (1).ipynb``); a file name that starts with no lab's
name is not graded at all (:func:`lab_of` gives None; the grader reports an error).

:data:`ANSWERS` names, per exercise, the library code that answers it (in the labs'
order, which is the order of the report). In a graded rank, while that exercise is
graded, each of them refuses (:func:`disarm`): calling it, instantiating it or
subclassing it raises :data:`REFUSAL`; and where graded ranks are sandboxed the source
files of every module named here are absent from their filesystem (:func:`hidden_modules`,
left out by :mod:`distlab.runtime.confine`).

``python -m distlab.grading.labs check solutions`` exits 1 when the exercise tests,
``solutions/`` and :data:`ANSWERS` disagree (:func:`problems`).
"""
from __future__ import annotations

import ast
import importlib
import sys
import types
from pathlib import Path

TESTS = Path(__file__).resolve().parent / "exercises"

_RING = ("distlab.collectives.ring:ring_reduce_scatter", "distlab.collectives.ring:ring_all_gather",
         "distlab.collectives.ring:ring_allreduce", "distlab.collectives.ring:_Ring")
_SCHEDULES = ("distlab.reference.pp:gpipe_schedule", "distlab.reference.pp:one_f_one_b_schedule",
              "distlab.reference.pp:bubble_fraction", "distlab.reference.pp:build_schedule")
_DP = ("distlab.reference.dp:DataParallel", "distlab.reference.dp:_Bucket",
       "distlab.reference.dp:OneShotDataParallel", "distlab.reference.dp:allreduce_gradients")

# "module:name" of the library code that answers each exercise. all_reduce_mean has none
# (the library has no mean all-reduce). bus_factor answers bus_bandwidth: lab 01 asks for
# the factor itself (later labs may use it freely; only bus_bandwidth's grading refuses it).
ANSWERS: dict[str, tuple[str, ...]] = {
    "all_reduce_mean": (),
    "bus_bandwidth": ("distlab.reference.bandwidth:bus_factor",),
    "pipelined_broadcast": ("distlab.collectives.broadcast:pipelined_broadcast",),
    "ps_sgd_step": ("distlab.collectives.ps:ps_sgd_step",),
    "ring_reduce_scatter": _RING,
    "ring_all_gather": _RING,
    "ring_allreduce": _RING,
    "allreduce_gradients": _DP,
    "zero_bytes_per_rank": ("distlab.reference.memory:zero_bytes",),
    "shard_range": ("distlab.reference.shards:shard_range", "distlab.reference.shards:shard_sizes"),
    "zero2_step": ("distlab.reference.zero:zero2_step", "distlab.reference.zero:adamw_",
                   "distlab.reference.zero:reduce_scatter_mean",
                   "distlab.reference.zero:all_gather_shards"),
    "ZeRO3Unit": ("distlab.reference.fsdp:_Unit",
                  "distlab.reference.fsdp:FullyShardedDataParallel",
                  "distlab.reference.zero:FlatParams", "distlab.reference.zero:Layout",
                  "distlab.reference.zero:reduce_scatter_mean",
                  "distlab.reference.zero:all_gather_shards"),
    "ColumnParallelLinear": ("distlab.reference.tp:ColumnParallelLinear",
                             "distlab.reference.tp:RowParallelLinear"),
    "RowParallelLinear": ("distlab.reference.tp:ColumnParallelLinear",
                          "distlab.reference.tp:RowParallelLinear"),
    # the embedding's forward is the masked lookup and sum the loss needs for the target's logit
    "vocab_parallel_cross_entropy": ("distlab.reference.tp:vocab_parallel_cross_entropy",
                                     "distlab.reference.tp:VocabParallelEmbedding"),
    "gpipe_schedule": _SCHEDULES,
    "one_f_one_b_schedule": _SCHEDULES,
    "bubble_fraction": _SCHEDULES,
    "run_stage": ("distlab.reference.pp:PipelineRunner", "distlab.reference.pp:sum_tied_gradients",
                  "distlab.pp.p2p:StageLink"),
    "BucketedDDP": _DP,
    "mesh_groups": ("distlab.reference.mesh:Grid", "distlab.reference.mesh:Mesh"),
    "distributed_train_step": ("distlab.reference.train:Trainer", "distlab.reference.train:build",
                               "distlab.reference.train:train", "distlab.reference.train:_Bucket",
                               "distlab.reference.train:_Shards", "distlab.reference.zero:reduce_grads"),
    "ring_attention": ("distlab.cp._reference:ring_attention",
                       "distlab.cp._reference:_RingAttention"),
    # kept() is the contract's drop rule, combine_local the one-process layer's sum
    "moe_dispatch_combine": ("distlab.moe._reference:moe_dispatch_combine",
                             "distlab.moe._reference:kept", "distlab.moe._reference:combine_local"),
    # lab 10: the casts (re-exported by distlab.fp8) are the exercise's own few lines
    "fp8_linear": tuple(f"distlab.reference.fp8:{n}" for n in (
        "amax", "scale_for", "cast", "dequantize", "quantize", "round_trip", "DelayedScaling")),
}

REFUSAL = "this is the library's answer to the exercise being graded"


def exercises(tests_dir: Path = TESTS) -> dict[str, tuple[str, ...]]:
    """Lab → its exercises: every ``test_<name>.py`` of ``tests_dir`` whose ``NOTEBOOK``
    names the lab, in the order of :data:`ANSWERS` (others after, by name)."""
    order = {name: i for i, name in enumerate(ANSWERS)}
    found: dict[str, list[str]] = {}
    for test in sorted(Path(tests_dir).glob("test_*.py")):
        lab = _test_notebook(test)
        if lab:
            found.setdefault(lab, []).append(test.stem.removeprefix("test_"))
    return {lab: tuple(sorted(names, key=lambda n: (order.get(n, len(order)), n)))
            for lab, names in sorted(found.items())}


def lab_of(path, labs=None) -> str | None:
    """The lab a notebook file is (its file name starts with the lab's name, then
    anything but a letter or digit), or None. ``labs``: :func:`exercises`'s answer."""
    stem = Path(path).stem
    for lab in sorted(labs if labs is not None else exercises(), key=len, reverse=True):
        if stem == lab or (stem.startswith(lab) and not stem[len(lab)].isalnum()):
            return lab
    return None


def unknown_lab_message(path, labs=None) -> str:
    labs = labs if labs is not None else exercises()
    return (f"{Path(path).name} is not one of the labs: the file name must start with a lab's "
            f"name ({', '.join(f'{lab}.ipynb' for lab in labs)}); nothing was graded. Keep the "
            f"name the lab was handed out with")


# ------------------------------------------------------------------- refusing answers


def _refusing_code(code: types.CodeType, what: str) -> types.CodeType:
    """Code that raises the refusal, with as many free variables as ``code`` (so that it
    can replace it in a function whose closure has them, e.g. ``__class__``)."""
    free = [f"_free{i}" for i in range(len(code.co_freevars))]
    name = code.co_name if code.co_name.isidentifier() else "refused"
    body = (f"def _outer():\n    {' = '.join(free) + ' = None' if free else 'pass'}\n"
            f"    def {name}(*args, **kwargs):\n"
            f"        {'; '.join(free) if free else 'pass'}\n"
            f"        raise RuntimeError({f'{REFUSAL} ({what}): write your own'!r})\n"
            f"    return {name}\n")
    namespace: dict = {}
    exec(compile(body, "<the library's answer, refused while grading>", "exec"),
         {"__builtins__": __builtins__}, namespace)
    return namespace["_outer"]().__code__


def _disarm_function(fn, what: str) -> None:
    if isinstance(fn, types.FunctionType) and "refused" not in fn.__dict__:
        fn.__code__ = _refusing_code(fn.__code__, what)
        fn.__defaults__ = fn.__kwdefaults__ = None
        fn.__dict__["refused"] = True


def _disarm_class(cls: type, what: str) -> None:
    for value in list(vars(cls).values()):
        for fn in (value, getattr(value, "__func__", None), getattr(value, "fget", None),
                   getattr(value, "fset", None)):
            if isinstance(fn, types.FunctionType) and fn.__module__ == cls.__module__ and \
                    fn.__qualname__.startswith(cls.__qualname__ + "."):
                _disarm_function(fn, what)

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{REFUSAL} ({what}): write your own")

    cls.__init_subclass__ = classmethod(refuse)
    cls.__new__ = refuse
    cls.__init__ = refuse


def _target(reference: str):
    module_name, name = reference.split(":")
    return importlib.import_module(module_name), name


def disarm(exercise: str) -> list[str]:
    """In a graded rank, before the student's module is imported: every library object
    that answers ``exercise`` refuses from now on, through whatever name reaches it (its
    code is replaced, not just its name, so an alias taken at import refuses too). The
    original code is not kept anywhere in this process. Returns what was disarmed."""
    done = []
    for reference in ANSWERS.get(exercise, ()):
        module, name = _target(reference)
        obj = getattr(module, name)
        what = f"{module.__name__}.{name}"
        if isinstance(obj, type):
            _disarm_class(obj, what)
        else:
            _disarm_function(obj, what)
        done.append(what)
    return done


def hidden_modules() -> list[str]:
    """Every module named in :data:`ANSWERS`: imported, then hidden, in graded ranks."""
    return sorted({ref.split(":")[0] for refs in ANSWERS.values() for ref in refs})


# ----------------------------------------------------------------- the kit agrees


def _declared(test_file: Path, name: str):
    """The literal a test file assigns to ``name`` at its top level (read, never
    imported), or None."""
    for node in ast.parse(test_file.read_text()).body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return None
    return None


def _test_notebook(test_file: Path) -> str | None:
    """The ``NOTEBOOK = "..."`` a test file declares."""
    lab = _declared(test_file, "NOTEBOOK")
    return lab if isinstance(lab, str) else None


def rank_imports(test_file: Path) -> tuple[str, ...]:
    """The modules a test file's ranks import after they start (``RANK_IMPORTS = (...)``:
    torch's optimizers import ``torch._dynamo``, ~1 CPU-s, at their first step), which
    the graded ranks' fork server imports once for all of them
    (:func:`distlab.grading.sandbox.rank_sandbox`)."""
    names = _declared(test_file, "RANK_IMPORTS") or ()
    return tuple(n for n in names if isinstance(n, str))


def problems(solutions: Path, tests_dir: Path = TESTS) -> list[str]:
    """Where the exercise tests, ``solutions/`` and :data:`ANSWERS` disagree (empty: none)."""
    import nbformat

    from distlab.grading import notebook

    found = []
    labs = exercises(tests_dir)
    books = {p.stem: p for p in sorted(Path(solutions).glob("*.ipynb"))}
    for lab in sorted(set(books) | set(labs)):
        if lab not in books:
            found.append(f"tests declare NOTEBOOK = {lab!r}, but solutions/ has no {lab}.ipynb")
            continue
        names = set(notebook.exercises(nbformat.read(books[lab], as_version=4)))
        graded = set(labs.get(lab, ()))
        for name in sorted(names - graded):
            found.append(f"{lab}: solutions/ has the exercise {name}, but no test file of the "
                         f"kit declares it (test_{name}.py with NOTEBOOK = {lab!r}): it would "
                         f"not be graded")
        for name in sorted(graded - names):
            found.append(f"{lab}: test_{name}.py declares NOTEBOOK = {lab!r}, but "
                         f"solutions/{lab}.ipynb has no exercise cell {name}")
    for lab, names in labs.items():
        for name in names:
            if name not in ANSWERS:
                found.append(f"{name} ({lab}) has no entry in distlab.grading.labs.ANSWERS: "
                             f"name the library code that answers it, or () for none")
    for refs in ANSWERS.values():
        for ref in refs:
            module, name = _target(ref)
            if not hasattr(module, name):
                found.append(f"ANSWERS names {ref}, which does not exist")
    return found


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "check":
        print("usage: python -m distlab.grading.labs check SOLUTIONS_DIR", file=sys.stderr)
        return 2
    found = problems(Path(argv[1]))
    for line in found:
        print(line, file=sys.stderr)
    if not found:
        print("distlab.grading.labs agrees with solutions/ and the exercise tests")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())

"""The library's answers are absent from the ranks that grade them (issue "answers out
of the students' reach"): while each exercise is graded, a walk of every object of the
graded rank's interpreter finds no code object whose bytecode, constants and names equal
one of that exercise's answers, nor a module that holds them; and each way a cheating
cell would reach an answer scores 0, "refused".

The walk is the notebook's own code: each lab's solution with its first exercise cell
replaced by :data:`WALK`, which runs at import in every graded rank (the grader imports
the module once per exercise, in that exercise's ranks) and raises with what it found.
"""
from __future__ import annotations

import importlib
import inspect
import types
from pathlib import Path

import nbformat
import pytest

from distlab.grading import answers, labs, notebook, runner

ROOT = Path(__file__).resolve().parents[1]
TRIVIAL = 32  # bytes of bytecode: a shorter body (``return grad, None``) is no answer and is
#               shared by unrelated functions

# The walk, as a student's cell would write it: every object the collector knows (the
# frozen ones too), each module's and class's namespace, closures, __wrapped__ chains,
# bound and static methods, properties, and the code objects nested in constants.
WALK = '''
import gc as _gc, hashlib as _hashlib, sys as _sys, types as _types

_MINE = globals().get("__file__")  # the notebook's own code is not the library's


def _fingerprint(code):
    consts = tuple(_fingerprint(c) if isinstance(c, _types.CodeType) else repr(c)
                   for c in code.co_consts)
    return _hashlib.sha256(repr((code.co_code, consts, code.co_names)).encode()).hexdigest()


def _codes(sizes=None):
    """Fingerprint → qualified name of every code object reachable (of those whose
    bytecode has one of ``sizes`` bytes, when given: the others cannot match)."""
    _gc.unfreeze()
    seen, codes, todo = set(), {}, list(_gc.get_objects())
    todo += [vars(m) for m in list(_sys.modules.values()) if isinstance(m, _types.ModuleType)]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, _types.CodeType):
            if (sizes is None or len(obj.co_code) in sizes) and obj.co_filename != _MINE:
                codes[_fingerprint(obj)] = obj.co_qualname
            todo += [c for c in obj.co_consts if isinstance(c, _types.CodeType)]
        elif isinstance(obj, _types.FunctionType):
            todo.append(obj.__code__)
            todo += [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            todo += [v for v in vars(obj).values()]
        elif isinstance(obj, (_types.MethodType, classmethod, staticmethod)):
            todo.append(obj.__func__)
        elif isinstance(obj, property):
            todo += [obj.fget, obj.fset, obj.fdel]
        elif isinstance(obj, type):
            todo += list(vars(obj).values())
        elif isinstance(obj, dict):
            todo += list(obj.values())
    return codes


def _filled(cell):
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


def walk(wanted):
    import warnings

    with warnings.catch_warnings():  # reading some deprecated objects warns
        warnings.simplefilter("ignore")
        codes = _codes({size for size, _ in wanted})
    found = sorted(codes[f] for _, f in wanted if f in codes)
    return len(codes), found
'''

_REPORT = '''

_graded = _sys.modules["distlab.grading.student"]._graded[0]
_n, _found = walk(WANTED[_graded])
raise RuntimeError(f"walk of {_graded}: {_n} code objects of an answer's size, answers "
                   f"found: {_found}")
'''


def _answer_codes(exercise: str) -> dict[str, tuple[str, int]]:
    """Fingerprint → (qualified name, bytes of bytecode), of every code object of
    ``exercise``'s answers
    (computed here, where they are loaded: this process never runs student code)."""
    namespace: dict = {}
    exec(WALK, namespace)
    found = {}
    for reference in answers.ANSWERS[exercise]:
        module, name = reference.split(":")
        todo = [getattr(importlib.import_module(module), name)]
        while todo:
            obj = inspect.unwrap(todo.pop()) if callable(todo[-1]) else todo.pop()
            if isinstance(obj, type):
                todo += [v for v in vars(obj).values()
                         if getattr(v, "__module__", module) == module]
            for fn in (obj, getattr(obj, "__func__", None), getattr(obj, "fget", None)):
                if isinstance(fn, types.FunctionType):
                    stack = [fn.__code__]
                    while stack:  # nested functions too; a comprehension or lambda goes
                        code = stack.pop()  # with its function (alone, it is too generic)
                        if not code.co_name.startswith("<") and len(code.co_code) >= TRIVIAL:
                            found[namespace["_fingerprint"](code)] = (
                                f"{module}:{code.co_qualname}", len(code.co_code))
                        stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return found


def _walk_source(lab: str) -> str:
    wanted = {name: sorted((size, f) for f, (_, size) in _answer_codes(name).items())
              for name in labs.exercises()[lab]}
    return WALK + f"\nWANTED = {wanted!r}\n" + _REPORT


def test_the_walk_finds_the_answers_where_they_are_loaded():
    """The walk can fail: in this process, where the library is loaded, it finds every
    code object of every exercise's answers."""
    namespace: dict = {}
    exec(WALK, namespace)
    wanted = {exercise: _answer_codes(exercise) for exercise in answers.ANSWERS}
    codes = namespace["_codes"]()
    assert len(codes) > 1000
    for exercise, refs in answers.ANSWERS.items():
        assert bool(wanted[exercise]) == bool(refs), exercise
        missed = [q for f, (q, _) in wanted[exercise].items() if f not in codes]
        assert not missed, (exercise, missed)


@pytest.mark.parametrize("lab", [lab for lab, names in labs.exercises().items()
                                 if any(answers.ANSWERS.get(n) for n in names)])
def test_a_graded_rank_holds_no_code_of_its_exercises_answers(tmp_path, lab):
    nb = nbformat.read(ROOT / "solutions" / f"{lab}.ipynb", as_version=4)
    first = next(c for c in nb.cells if notebook.grade_id(c))
    first.source = _walk_source(lab) + first.source
    path = tmp_path / f"{lab}.ipynb"
    nbformat.write(nb, path)
    results = runner.grade(path, first_failure=True)
    for r in results:
        if not answers.ANSWERS.get(r.exercise):
            continue
        assert f"walk of {r.exercise}:" in r.message, r
        assert r.message.rstrip().endswith("answers found: []"), r.message
        n = int(r.message.split(f"walk of {r.exercise}: ")[1].split()[0])
        assert n > 0, f"{r.exercise}: the walk hashed no code object: {r.message}"

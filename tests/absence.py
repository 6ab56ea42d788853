"""The walk that proves the library's answers absent from graded ranks: a student's cell
could run it, and the kit's tests do (tests/test_grading_solutions.py prepends it to each
solution's first exercise cell, so that every exercise's graded ranks run it; a rank that
finds a code object of the exercise's answers fails the grade; tests/test_answers_absent.py
checks that the walk finds them where they are loaded)."""
from __future__ import annotations

import importlib
import inspect
import types

from distlab.grading import answers, labs

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

def _checking_the_import():
    """Whether this import is the grader's check of it: once per exercise, one rank."""
    frame = _sys._getframe()
    while frame is not None:
        if (frame.f_code.co_name == "_import"
                and frame.f_globals.get("__name__") == "distlab.grading.student"):
            return True
        frame = frame.f_back
    return False


_graded = _sys.modules["distlab.grading.student"]._graded[0]
if WANTED.get(_graded) and _checking_the_import():
    _n, _found = walk(WANTED[_graded])
    if _found or not _n:
        raise RuntimeError(f"walk of {_graded}: {_n} code objects of an answer's size, "
                           f"answers found: {_found}")
'''


def answer_codes(exercise: str) -> dict[str, tuple[str, int]]:
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
            obj = todo.pop()
            if callable(obj):
                obj = inspect.unwrap(obj)
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


def walk_source(lab: str) -> str:
    wanted = {name: sorted((size, f) for f, (_, size) in answer_codes(name).items())
              for name in labs.exercises()[lab]}
    return WALK + f"\nWANTED = {wanted!r}\n" + _REPORT



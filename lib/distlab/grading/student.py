"""The student's module, seen from the processes that grade it and reached only inside
sandboxed ranks (what the sandbox is: :mod:`distlab.grading.sandbox`).

:class:`Student` reads the names a module defines from its source, never executing it;
each :class:`StudentRef` resolves in the rank that unpickles it (:func:`_module`), where
the rank first caps its memory, then imports the module. The library's answers to the
exercise are absent from that rank from its start (:mod:`distlab.runtime.absent`).
"""
from __future__ import annotations

import ast
import builtins
import functools
import os
import sys
from pathlib import Path

IMPORT_TIMEOUT = float(os.environ.get("DISTLAB_IMPORT_TIMEOUT", 60))  # seconds to import it
CALL_TIMEOUT = 60.0    # seconds for one direct call of a student's function


class StudentImportError(AssertionError):
    """The student's module could not be imported in a rank (every test of it fails)."""


class Student:
    """The student's exercise module, seen from a process that must not import it.

    ``student.NAME`` is a :class:`StudentRef` for each top-level name the module defines
    (read from its source, never executed here). ``exercise`` is the exercise being
    graded: the ranks that import the module for it never hold the library's answers to
    it (:mod:`distlab.runtime.absent`)."""

    def __init__(self, path, exercise: str = ""):
        self.path, self.exercise = str(path), exercise
        self.names = _defined_names(Path(path).read_text())

    def __getattr__(self, name: str) -> "StudentRef":
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in self.names:
            raise AttributeError(f"your notebook defines no {name!r}: its exercise cell must "
                                 f"define a function or class of exactly that name")
        return StudentRef(self.path, name, self.exercise)

    def check_import(self, timeout: float = IMPORT_TIMEOUT) -> None:
        """Import the module once in a sandboxed rank; :class:`StudentImportError` says
        in plain words why it failed (an error, an endless loop, an exit at import)."""
        from distlab import launch

        try:
            launch.run(_import, 1, self.path, self.exercise, backend="gloo", timeout=timeout)
        except launch.LaunchTimeout:
            raise StudentImportError(
                f"your notebook's exercise cells did not finish importing within "
                f"{timeout:g} s: a cell runs something endless at the top level (code that "
                f"should sit inside a function?)") from None
        except launch.RankError as exc:
            raise StudentImportError(
                f"importing your notebook's exercise cells raised {exc.exc_type}: "
                f"{exc.message}") from None
        except launch.LaunchError as exc:
            raise StudentImportError(
                f"importing your notebook's exercise cells ended the process: "
                f"{str(exc).splitlines()[0]}") from None


class StudentRef:
    """One name of the student's module: pickled, it resolves in the rank that loads it;
    called here, the call runs in a sandboxed one-rank launch and returns plain data.
    An exception the student's code raises comes back as the builtin exception of the
    same class where there is one (ValueError, TypeError, NotImplementedError, ...)."""

    def __init__(self, path: str, name: str, exercise: str = ""):
        self.path, self.name, self.exercise = path, name, exercise

    def __reduce__(self):
        return _resolve, (self.path, self.name, self.exercise)

    def __repr__(self) -> str:
        return f"<the student's {self.name}>"

    def __call__(self, *args, **kwargs):
        from distlab import launch

        try:
            return launch.run(_call, 1, self, args, kwargs, backend="gloo",
                              timeout=CALL_TIMEOUT)[0]
        except launch.RankError as exc:
            raise _as_builtin(exc) from None


def _defined_names(source: str) -> set[str]:
    from distlab.grading.notebook import UNPARSABLE

    try:
        tree = ast.parse(source)
    except UNPARSABLE:
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _as_builtin(exc) -> BaseException:
    cls = getattr(builtins, exc.exc_type, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls(exc.message)
    return exc


_graded: list[str] = []  # the exercise this rank imported the student's module for


@functools.lru_cache(maxsize=None)
def _module(path: str, exercise: str = ""):
    """The student's module, imported once per rank (inside the rank only), in a rank
    without the library's answers to ``exercise``. A rank serves one exercise: the
    grader's plugin starts fresh ranks for each (what the student's code did in a rank,
    such as keeping a library function aside, must not reach another exercise)."""
    import importlib.util

    if _graded and _graded[0] != exercise:
        raise RuntimeError(f"this rank imported the student's module for {_graded[0]!r} and "
                           f"cannot grade {exercise!r} (the grader starts fresh ranks for "
                           f"each exercise)")
    _graded.append(exercise)
    _limit_memory()
    name = f"student_{Path(path).stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _limit_memory() -> None:
    """Cap this rank's data (RLIMIT_DATA: heap and private writable mappings, which is
    where tensors live) at what it holds now plus DISTLAB_GRADE_MEMORY_MB, soft and hard,
    so the student's code cannot raise it again; on a gloo rank also every new mapping,
    shared memory included (RLIMIT_AS: the address space in use now plus the same amount;
    not with CUDA, which reserves address space by the terabyte). What the rank inherits
    from its fork server (torch, CUDA's libraries, the modules preloaded for it) is not
    the student's to pay for."""
    import resource

    mb = os.environ.get("DISTLAB_GRADE_MEMORY_MB")
    if mb:
        limit = int(mb) * 2**20
        caps = [(resource.RLIMIT_DATA, _status_bytes("VmData") + limit)]
        if os.environ.get("DISTLAB_BACKEND") == "gloo":
            caps.append((resource.RLIMIT_AS, _address_space() + limit))
        for kind, cap in caps:
            soft, hard = resource.getrlimit(kind)
            if hard == resource.RLIM_INFINITY or hard > cap:
                resource.setrlimit(kind, (cap, cap))


def _status_bytes(field: str) -> int:
    """A size of this process's /proc/self/status (``VmData``: its data, as RLIMIT_DATA
    counts it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def _address_space() -> int:
    """Bytes of address space this process maps now (VmSize)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _resolve(path: str, name: str, exercise: str = ""):
    return getattr(_module(path, exercise), name)


def _import(path: str, exercise: str = "") -> None:
    _module(path, exercise)


def _call(fn, args, kwargs):
    return fn(*args, **kwargs)

"""Modules absent from a process: importing one gives a stand-in whose every name refuses.

The autograder's fork server installs this (:func:`install`, from :data:`ENV`) before it
imports anything its graded ranks will hold, so that the library's answers to the lab
being graded are never loaded there, nor in any rank forked from it: no source, no
bytecode, no module object, no function or code object that a student's code could find
by walking the heap (``gc.get_objects()``), a decorator's ``__wrapped__`` or a closure.
Library code that imports an absent module still imports: each name it takes from it is
a stand-in (:func:`stand_in`) that raises the refusal when it is called, instantiated,
subclassed, indexed or asked for an attribute (:class:`AbsentAttribute`, which
``hasattr`` takes for a missing one), and a test that reaches one scores "refused".

A name set by :func:`install` is absent from the moment of the call; one already imported
cannot be made absent (its objects are live): :func:`install` raises rather than pretend.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path

ENV = "DISTLAB_ABSENT"  # JSON: {"modules": [...], "later": [...], "message": "..."}
EDITION = Path(__file__).resolve().parents[1] / "edition.json"  # a student edition's


# what a function or module would answer about its code: a stand-in refuses these too
# (other special names stay missing, as Python's own machinery expects of a class)
_INTROSPECTION = frozenset({"__wrapped__", "__closure__", "__code__", "__globals__", "__func__",
                            "__self__", "__defaults__", "__kwdefaults__", "__file__", "__cached__"})


def _special(name: str) -> bool:
    return name.startswith("__") and name.endswith("__") and name not in _INTROSPECTION


class AbsentAttribute(AttributeError):
    """An attribute of an absent module or of a stand-in: missing, and saying why. An
    AttributeError, so that ``hasattr`` and ``getattr(x, name, default)`` (which
    :func:`inspect.getmodule` and :func:`inspect.unwrap` use on every module and
    function) see it as missing rather than fail."""


class _Refusing(type):
    """The type of a stand-in: calling it, indexing or iterating it (a table), or any
    attribute it lacks, raises."""

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(cls._refusal)

    def __getattr__(cls, name: str):
        if _special(name):
            raise AttributeError(name)
        raise AbsentAttribute(cls._refusal)

    __getitem__ = __iter__ = __len__ = __contains__ = __call__


def stand_in(module: str, name: str, message: str) -> type:
    """What ``from module import name`` gives while ``module`` is absent."""
    refusal = f"{message} ({module}.{name}): write your own"

    def refuse(*args, **kwargs):
        raise RuntimeError(refusal)

    return _Refusing(name, (), {"_refusal": refusal, "__module__": module,
                                "__init_subclass__": classmethod(refuse)})


class AbsentModule(types.ModuleType):
    """A module that is not there: each name read from it is a :func:`stand_in`."""

    def __getattr__(self, name: str):
        if _special(name):
            raise AttributeError(name)
        if name in _INTROSPECTION:  # where its file would be: nowhere to read
            raise AbsentAttribute(f"{self.__dict__['_refusal']} ({self.__name__}): write "
                                  f"your own")
        value = stand_in(self.__name__, name, self.__dict__["_refusal"])
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """First on ``sys.meta_path``: the absent names resolve to :class:`AbsentModule`."""

    def __init__(self):
        self.names: dict[str, str] = {}  # absent module → why

    def find_spec(self, name, path=None, target=None):
        if name in self.names:
            return importlib.machinery.ModuleSpec(name, self, is_package=False)
        return None

    def create_module(self, spec):
        module = AbsentModule(spec.name)
        module.__dict__["_refusal"] = self.names[spec.name]
        return module

    def exec_module(self, module) -> None:
        pass


_finder: _Finder | None = None


def install(names, message: str) -> None:
    """Make the modules ``names`` absent from this process from now on (and from every
    process it forks), refusing with ``message``. Raises RuntimeError naming any of them
    already imported."""
    global _finder
    loaded = sorted(n for n in names if n in sys.modules
                    and not isinstance(sys.modules[n], AbsentModule))
    if loaded:
        raise RuntimeError(f"cannot make {', '.join(loaded)} absent: already imported here")
    if _finder is None:
        _finder = _Finder()
        sys.meta_path.insert(0, _finder)
    _finder.names.update(dict.fromkeys(names, message))


def install_from_env(stage: str, env=os.environ) -> None:
    """Install what :data:`ENV` names for ``stage``: "modules", the graded exercises'
    answers, before anything is imported for the ranks; "later", every other answer
    module not imported by then (its source is absent from the ranks' filesystem too)."""
    if env.get(ENV):
        spec = json.loads(env[ENV])
        names = spec[stage] if stage == "modules" else [
            n for n in spec[stage] if n not in sys.modules]
        install(names, spec["message"])


def install_edition(manifest: Path = EDITION) -> None:
    """In a student edition (:mod:`distlab.grading.edition`), make the answer modules it
    withholds absent: their files are not there, and importing one gives a module whose
    names refuse, saying which lab they answer. Nothing in the full kit."""
    if manifest.is_file():
        for module, lab in json.loads(manifest.read_text())["withheld"].items():
            install([module], f"not in this edition of the kit: it answers lab {lab}, whose "
                              f"answers your instructor hands out after its deadline")

"""What a launch raises when it returns no results (re-exported by :mod:`distlab.launch`)."""
from __future__ import annotations

import os
import re
import sys


class LaunchError(RuntimeError):
    """A launch that returned no results."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows in a notebook: the message alone, which says which rank
        failed, how and at which line of the student's code, and what the others were
        doing, without the launcher's own frames above it."""
        return [f"{type(self).__name__}: {self}"]


class RankError(LaunchError):
    """A rank raised. ``exc_type`` and ``message`` are its exception's class name and text;
    ``original`` is the exception itself, where it could travel (never in a sandbox)."""

    def __init__(self, text, rank, exc_type, remote_traceback, original=None, message=""):
        super().__init__(text)
        self.rank, self.exc_type, self.remote_traceback = rank, exc_type, remote_traceback
        self.original, self.message = original, message


class RankCrashed(LaunchError):
    """A rank process died without an answer (killed by a signal, or exited)."""

    def __init__(self, message, rank, returncode):
        super().__init__(message)
        self.rank, self.returncode = rank, returncode


class LaunchTimeout(LaunchError):
    """No answer from every rank within the timeout: a deadlock, or far too slow.

    ``where`` maps each unfinished rank to the collective it was in; ``stacks`` to its
    Python stack.
    """

    def __init__(self, message, timeout, where, stacks):
        super().__init__(message)
        self.timeout, self.where, self.stacks = timeout, where, stacks


def exception_line(etype: str, message: str) -> str:
    """"ValueError: bad shape", or just the type where the exception says nothing."""
    return f"{etype}: {message}" if message else etype


_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>.+)$')


def _library_folders() -> tuple[str, ...]:
    """Where code that is not the caller's own lives: distlab, the standard library, and
    the installed packages (torch among them)."""
    import site
    import sysconfig

    import distlab

    folders = {os.path.dirname(os.path.abspath(distlab.__file__)),
               *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
               *site.getsitepackages(), site.getusersitepackages()}
    return tuple(os.path.join(folder, "") for folder in folders)


def own_frame(traceback_text: str) -> str:
    """The last frame of a rank's traceback in the caller's own code (a notebook cell, a
    script: not distlab, torch or the standard library), as "Cell In[5], line 3, in f:
    <its line>" (IPython's name for a cell); "" when there is none."""
    lines = traceback_text.splitlines()
    library = _library_folders()
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME.match(lines[i])
        if not m or m["file"].startswith(library) or m["file"].startswith("<frozen "):
            continue
        code = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith("    ") \
            else ""
        return f"{_cell_name(m['file'])}, line {m['line']}, in {m['fn']}" + (
            f": {code}" if code else "")
    return ""


def _cell_name(filename: str) -> str:
    """IPython's name for the code of a cell ("Cell In[5]"), or ``filename``."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    name = getattr(getattr(shell, "compile", None), "format_code_name", lambda _: None)(filename)
    return " ".join(name) if name else filename

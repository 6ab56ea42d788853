"""What a launch raises when it returns no results (re-exported by :mod:`distlab.launch`)."""
from __future__ import annotations


class LaunchError(RuntimeError):
    """A launch that returned no results."""


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

"""The guard that kill, interrupt and crash tests install in every Python process they
start (as its ``sitecustomize``): with ``DISTLAB_GUARD_LOG`` set, ``os.kill`` and
``os.killpg`` refuse any PID <= 1 (on Linux, 0 and -1 mean "every process we may
signal", 1 is init) and log the attempt, so that a wrong PID fails the test instead of
ending every process on a machine where tests run as root."""

SITECUSTOMIZE = """
import os

_log = os.environ.get("DISTLAB_GUARD_LOG")


def _guarded(name, real):
    def call(pid, sig, *rest):
        if pid <= 1:
            with open(_log, "a") as f:
                f.write(f"{name}({pid}, {sig}) from pid {os.getpid()}\\n")
            raise PermissionError(f"guard: refused {name}({pid}, {sig})")
        return real(pid, sig, *rest)
    return call


if _log:
    os.kill = _guarded("kill", os.kill)
    os.killpg = _guarded("killpg", os.killpg)
"""

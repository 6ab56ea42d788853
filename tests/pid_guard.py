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

# The tail of a driver script run as the init of a PID namespace: reap what was
# re-parented to it until no other process is left (or 60 s: a fork server exits once it
# sees its launcher's socket closed, which on a machine loaded past its cores takes tens
# of seconds), leaving their command lines in ``left``.
SETTLE = """
def _others():
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                found.append(open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\\0", b" ").decode())
            except OSError:
                pass
    return found


_deadline = time.monotonic() + 60
while True:
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    left = _others()
    if not left or time.monotonic() > _deadline:
        break
    time.sleep(0.2)
"""


def run_guarded(tmp_path, scripts: dict, argv: list, timeout: float):
    """Write ``scripts`` (file name → source) to ``tmp_path`` and run ``argv`` (its first
    item a script's name) under the guard, as the init of a PID namespace of its own
    where one can be made. Returns (the finished process, whether it ran in a namespace,
    the guard's log: it exists only if a signal to PID <= 1 was attempted)."""
    import os
    import subprocess
    import sys

    from distlab.grading import sandbox

    (tmp_path / "guard").mkdir()
    (tmp_path / "guard" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    for name, source in scripts.items():
        (tmp_path / name).write_text(source)
    log = tmp_path / "signals.log"
    env = dict(os.environ, DISTLAB_GUARD_LOG=str(log), PYTHONPATH=os.pathsep.join(
        [str(tmp_path / "guard")] + [p for p in sys.path if p]))
    cmd = [sys.executable, str(tmp_path / argv[0]), *map(str, argv[1:])]
    namespace = sandbox.containment() == "pidns"
    if namespace:
        cmd = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"] + cmd
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout), namespace, log

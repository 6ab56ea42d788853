"""Who a rank runs as: dropping root for an unprivileged user, and keeping other
processes of that user out of ours (Linux ``prctl`` and ``capset``; no-ops elsewhere).

A leaf module: the fork server calls it for the autograder's ranks, and the grader
calls it for itself."""
from __future__ import annotations

import ctypes
import functools
import os
import sys

PR_SET_DUMPABLE, PR_SET_KEEPCAPS, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 4, 8, 36, 38
PR_SET_PDEATHSIG = 1
CAP_DAC_READ_SEARCH = 2


def probe(check) -> str:
    """Run ``check()`` in a forked child, which exits at once after it: "" when it returned,
    else what it raised (or that the child died). What a check changes in its process
    (privileges dropped, namespaces entered) stays in the child."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            check()
            os.write(write, b"ok")
        except BaseException as exc:  # noqa: BLE001 — reported to the parent
            os.write(write, f"{type(exc).__name__}: {exc}".encode()[:500])
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        answer = f.read().decode(errors="replace")
    os.waitpid(pid, 0)
    return "" if answer == "ok" else (answer or "the probe died")


@functools.lru_cache(maxsize=None)
def unprivileged_user() -> tuple[str, str]:
    """("uid:gid", "") of the user students' code runs as, or ("", why there is none).

    Only root changes user (``nobody``, or ``DISTLAB_SANDBOX_USER`` as a name or
    "uid:gid"); a forked probe checks that :func:`drop_privileges` works here."""
    if os.geteuid() != 0:
        return "", "the grader does not run as root, so students' code runs as its user"
    wanted = os.environ.get("DISTLAB_SANDBOX_USER", "nobody")
    try:
        if ":" in wanted:
            uid, gid = (int(x) for x in wanted.split(":"))
        else:
            import pwd

            entry = pwd.getpwnam(wanted)
            uid, gid = entry.pw_uid, entry.pw_gid
    except (KeyError, ValueError):
        return "", f"no user {wanted!r} on this machine (DISTLAB_SANDBOX_USER)"
    if uid == 0:
        return "", "DISTLAB_SANDBOX_USER names root"
    def check():  # drop, then the interpreter's files must still be readable
        drop_privileges(uid, gid)
        os.listdir(os.path.dirname(os.__file__))

    answer = probe(check)
    if answer:
        return "", f"cannot switch to uid {uid} here ({answer})"
    return f"{uid}:{gid}", ""


def drop_privileges(uid: int, gid: int) -> None:
    """Become ``uid``:``gid`` with no supplementary groups and no way back (no new
    privileges). One capability is kept, CAP_DAC_READ_SEARCH (read any file): the Python
    installation may sit in a folder only root can enter (``/root/.pyenv``), and the rank
    must still import from it. This is the fallback where graded ranks cannot be confined
    (:mod:`distlab.runtime.confine`, which mounts the installation in instead); the fork
    server then installs confine's seccomp filter, which refuses open_by_handle_at, the
    one call that would turn read-search into reading what a path cannot reach. The
    capability is lost on exec."""
    prctl(PR_SET_KEEPCAPS, 1)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    prctl(PR_SET_KEEPCAPS, 0)
    if not _capset(1 << CAP_DAC_READ_SEARCH):
        raise OSError(ctypes.get_errno(), "capset failed")
    if not prctl(PR_SET_NO_NEW_PRIVS, 1):
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")


def _capset(caps: int) -> bool:
    """Set the effective and permitted capabilities to ``caps``, none inheritable."""
    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    data = (Data * 2)(Data(caps, caps, 0), Data(0, 0, 0))
    return libc.capset(ctypes.byref(Header(0x20080522, 0)), data) == 0  # version 3


def make_non_dumpable() -> None:
    """Processes of the same user can then neither ptrace this one nor open its file
    descriptors through /proc (Linux; a no-op elsewhere)."""
    prctl(PR_SET_DUMPABLE, 0)


def prctl(option: int, value: int) -> bool:
    if sys.platform != "linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0

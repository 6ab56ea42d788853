"""Who a rank runs as: dropping root for an unprivileged user, and keeping other
processes of that user out of ours (Linux ``prctl`` and ``capset``; no-ops elsewhere).

A leaf module: the fork server calls it for the autograder's ranks, and the grader
calls it for itself."""
from __future__ import annotations

import ctypes
import functools
import glob
import importlib
import json
import os
import sys

PR_SET_DUMPABLE, PR_SET_KEEPCAPS, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 4, 8, 36, 38
CAP_DAC_READ_SEARCH = 2


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
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the probe: drop, then check that the interpreter's files are still readable
        try:
            os.close(read)
            drop_privileges(uid, gid)
            os.listdir(os.path.dirname(os.__file__))
            os.write(write, b"ok")
        except BaseException as exc:  # noqa: BLE001 — reported to the parent
            os.write(write, f"{type(exc).__name__}: {exc}".encode()[:500])
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        answer = f.read().decode(errors="replace")
    os.waitpid(pid, 0)
    if answer != "ok":
        return "", f"cannot switch to uid {uid} here ({answer})"
    return f"{uid}:{gid}", ""


def drop_privileges(uid: int, gid: int) -> None:
    """Become ``uid``:``gid`` with no supplementary groups and no way back (no new
    privileges). One capability is kept, CAP_DAC_READ_SEARCH (read any file): the Python
    installation may sit in a folder only root can enter (``/root/.pyenv``), and the rank
    must still import from it. Reading is not what the sandbox guards against: the user
    cannot write the grader's files, nor signal or trace its processes. The capability is
    lost on exec.

    Where ``DISTLAB_SANDBOX_HIDE`` is set (the autograder, as root), files are hidden
    first: see :func:`hide_sources`."""
    spec = os.environ.get("DISTLAB_SANDBOX_HIDE")
    if spec:
        hide_sources(json.loads(spec))
    prctl(PR_SET_KEEPCAPS, 1)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    prctl(PR_SET_KEEPCAPS, 0)
    if not _capset(1 << CAP_DAC_READ_SEARCH):
        raise OSError(ctypes.get_errno(), "capset failed")
    if not prctl(PR_SET_NO_NEW_PRIVS, 1):
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS failed")


CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 4096, 16384, 1 << 18


def hide_sources(spec: dict) -> None:
    """As root, in a process about to drop root: import ``spec["modules"]``, then, in a
    mount namespace of this process's own, bind ``spec["stub"]`` (a root-owned file) over
    each one's source file and its cached bytecode, and ``spec["empty"]`` (a root-owned
    empty folder) over each folder of ``spec["paths"]``. The modules stay usable (they
    are imported); reading their files, even with CAP_DAC_READ_SEARCH, gives the stub.
    The unprivileged user cannot unmount them (no CAP_SYS_ADMIN here, and in a user
    namespace of its own they would be locked). Raises OSError when the kernel refuses."""
    files = []
    for name in spec.get("modules", ()):
        path = getattr(importlib.import_module(name), "__file__", None)
        if path:
            folder, base = os.path.split(path)
            stem = os.path.splitext(base)[0]
            files += [path] + glob.glob(os.path.join(folder, "__pycache__", f"{stem}.*.pyc"))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS) failed: {os.strerror(err)}")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount leaks out
    for path in files:
        mount(spec["stub"], path, None, MS_BIND)
    for path in spec.get("paths", ()):
        if os.path.isdir(path):
            mount(spec["empty"], path, None, MS_BIND | MS_REC)


def mount(source: str | None, target: str, fstype: str | None, flags: int,
          data: str | None = None) -> None:
    """mount(2) (Linux, root); OSError when the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    args = [None if x is None else os.fsencode(x) for x in (source, target, fstype, data)]
    if libc.mount(args[0], args[1], args[2], flags, args[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount on {target!r} failed: {os.strerror(err)}")


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

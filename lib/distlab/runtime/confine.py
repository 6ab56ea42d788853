"""The sandbox a graded rank runs in: namespaces, a root made of what the rank may see, no
capability, a seccomp filter, limits. Linux kernel interfaces only, called through ctypes
from the forked rank (milliseconds: no interpreter is started, nothing is installed).

What bubblewrap (``bwrap``) does for Flatpak, done in the fork server's child, because a
rank must start from the fork server's warm interpreter (``bwrap`` would exec a fresh
Python, seconds of importing torch per rank): :func:`enter`, given a :func:`spec`,

1. **namespaces**: a mount, PID and IPC namespace of the rank's own (and, for a grader
   that is not root, a user namespace that owns them). The rank's process becomes PID 1
   of its PID namespace: when it ends, the kernel kills every process it started, so
   nothing a student's code forks outlives its exercise. The process left outside only
   relays signals and the exit status.
2. **a root of its own** (``pivot_root``): a tmpfs holding read-only binds of the
   system's top-level folders (:data:`SYSTEM`: programs, libraries, settings, devices,
   sysfs) and of the paths the rank needs wherever they are (the Python installation,
   site-packages); every other top-level folder (home folders, other checkouts of the
   kit, data) is absent. Read-only reaches the last mount below each bind
   (:func:`_read_only`), so no writable mount of the host shows through. The kit's
   package is bound from a copy without the exercise tests and the library's answer
   modules; ``solutions/``, the tests, ``.git`` and other checkouts beside it are simply
   not in that root. /tmp, /var/tmp and /dev/shm are fresh tmpfs of a capped size; /proc
   is the rank's PID namespace's own. Writable: those tmpfs, and of the pool's folder
   (on the host's disk) only the rank's own files, each bound alone
   (:func:`distlab.runtime.worker.rank_files`: its status board, its stack dumps, the
   rendezvous store); the folder itself is not there, so nothing new can be made in it.
3. **no privilege**: the user switched to (root grader) with no supplementary groups, in
   a user namespace of its own (so its process count is the rank's alone), with every
   capability dropped (effective, permitted, inheritable, ambient and the bounding set)
   and no new privileges.
4. **seccomp** (x86-64, aarch64): :data:`DENIED` system calls fail with EPERM — opening
   files by handle, tracing or reading other processes' memory, taking their
   descriptors, mounting, making namespaces, loading BPF, io_uring, memfd, the kernel
   log (syslog), modify_ldt and uselib (x86-64); clone3 answers ENOSYS so that libc falls back to clone, whose namespace
   flags are refused. ``socket`` and ``socketpair`` of any family but AF_UNIX, AF_INET
   and AF_INET6 fail with EAFNOSUPPORT (AF_VSOCK, AF_PACKET, AF_NETLINK's many
   protocols...), with one exception: ``socket(AF_NETLINK, *, NETLINK_ROUTE)``, through
   which glibc's getifaddrs() lists the interfaces, as gloo (and NCCL) must to find the
   one they were told to use (refused, gloo's ranks do not start). ``personality``
   answers only its query, ``personality(0xffffffff)``, and changes nothing.
5. **limits**: processes (RLIMIT_NPROC, counted in the rank's user namespace), the size
   of any file the rank writes (RLIMIT_FSIZE: a write past it fails with EFBIG), and the
   tmpfs sizes; memory is capped by the grader when the student's module is imported
   (:func:`distlab.grading.student._limit_memory`).
6. **an environment of its own**: the launcher gives a graded rank the launch's
   variables and, of the grader's environment, only what :data:`RANK_ENV` allows; the
   fork server's child reads the sandbox's spec (:data:`ENV`) and drops it before
   anything else runs, and :func:`forget_environment` zeroes the environment strings
   the rank's memory holds from the exec of the process it was forked from (what
   /proc/self/environ shows). That process, the grading run's pytest, inherits only
   :data:`distlab.grading.sandbox.RUN_ENV` too, so a variable of the grader's outside
   both lists (an instructor's token) is nowhere in a rank's memory.

Where any of this is unavailable (not Linux, a kernel or container that refuses a
namespace), :func:`available` says why and the grader falls back to what
:mod:`distlab.grading.sandbox` states for that case.
"""
from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import select
import signal
import struct
import sys

from distlab.runtime.privileges import probe

ENV = "DISTLAB_SANDBOX_SPEC"

# What a graded rank's environment holds of the grader's (fnmatch patterns): the locale,
# the search path for programs, and the settings of CUDA, NCCL, gloo, torch and the thread
# pools. The launcher adds the launch's own variables (RANK, WORLD_SIZE, LOCAL_*,
# DISTLAB_DIR...) and :data:`RANK_SETUP`; nothing else of the grader's environment (an
# instructor's token, the grader's paths) reaches a rank (:func:`forget_environment`).
RANK_ENV = ("PATH", "LANG", "LANGUAGE", "LC_*", "TZ", "TERM", "CUDA_*", "NCCL_*", "GLOO_*",
            "TORCH_*", "TORCHINDUCTOR_*", "TRITON_*", "LD_LIBRARY_PATH", "OMP_NUM_THREADS",
            "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MPLBACKEND", "PYTHONHASHSEED",
            "PYTHONIOENCODING", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE")
# read by the rank before the student's code runs: this sandbox's spec (taken out of the
# environment before anything runs) and the memory cap (distlab.grading.student)
RANK_SETUP = (ENV, "DISTLAB_GRADE_MEMORY_MB")

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID = 0x20000, 0x08000000, 0x10000000, 0x20000000
NAMESPACE_FLAGS = 0x7E020080  # every CLONE_NEW* flag (ns, cgroup, uts, ipc, user, pid, net, time)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 4096, 16384, 1 << 18, 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 24, 38, 22
PR_SET_DUMPABLE = 4
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, SECCOMP_MODE_FILTER = 47, 4, 2

# system calls a rank has no use for, by architecture (name → number)
_CALLS = {
    "x86_64": dict(ptrace=101, process_vm_readv=310, process_vm_writev=311, kcmp=312,
                   name_to_handle_at=303, open_by_handle_at=304, pidfd_getfd=438,
                   process_madvise=440, mount=165, umount2=166, pivot_root=155, chroot=161,
                   unshare=272, setns=308, bpf=321, perf_event_open=298, userfaultfd=323,
                   add_key=248, request_key=249, keyctl=250, memfd_create=319,
                   memfd_secret=447, io_uring_setup=425, io_uring_enter=426,
                   io_uring_register=427, open_tree=428, move_mount=429, fsopen=430,
                   fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
                   modify_ldt=154, syslog=103, uselib=134, clone=56, clone3=435,
                   personality=135, socket=41, socketpair=53),
    "aarch64": dict(ptrace=117, process_vm_readv=270, process_vm_writev=271, kcmp=272,
                    name_to_handle_at=264, open_by_handle_at=265, pidfd_getfd=438,
                    process_madvise=440, mount=40, umount2=39, pivot_root=41, chroot=51,
                    unshare=97, setns=268, bpf=280, perf_event_open=241, userfaultfd=282,
                    add_key=217, request_key=218, keyctl=219, memfd_create=279,
                    memfd_secret=447, io_uring_setup=425, io_uring_enter=426,
                    io_uring_register=427, open_tree=428, move_mount=429, fsopen=430,
                    fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
                    syslog=116, clone=220, clone3=435, personality=92, socket=198,
                    socketpair=199),
}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# the calls the filter looks into (their arguments), rather than refusing them outright
_SCREENED = ("clone", "clone3", "personality", "socket", "socketpair")
# modify_ldt and uselib: x86-64 only
DENIED = tuple(n for n in _CALLS["x86_64"] if n not in _SCREENED)
# socket families a rank may open (AF_UNIX, AF_INET, AF_INET6), and AF_NETLINK with
# NETLINK_ROUTE alone: glibc's getifaddrs() reads the interfaces through one, and gloo
# (and NCCL) call it to find the interface they were told to use
SOCKET_FAMILIES = (1, 2, 10)
AF_NETLINK, NETLINK_ROUTE = 16, 0
PERSONALITY_QUERY = 0xFFFFFFFF  # personality(0xffffffff) reads the persona, changes nothing

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    args = [None if x is None else os.fsencode(x) for x in (source, target, fstype, data)]
    _check(_libc.mount(args[0], args[1], args[2], ctypes.c_ulong(flags), args[3]),
           f"mount on {target}")


def _prctl(option: int, *args: int) -> None:
    values = [ctypes.c_ulong(a) for a in (list(args) + [0, 0, 0, 0])[:4]]
    _check(_libc.prctl(option, *values), f"prctl({option})")


# ------------------------------------------------------------------------ the filter


def seccomp_program(arch: str | None = None) -> bytes:
    """The BPF program (struct sock_filter[]) that refuses :data:`DENIED` with EPERM,
    clone with a namespace flag with EPERM, clone3 with ENOSYS, ``personality`` with
    EPERM but for its query (:data:`PERSONALITY_QUERY`), ``socket`` and ``socketpair``
    of a family outside :data:`SOCKET_FAMILIES` with EAFNOSUPPORT (``socket`` allows
    AF_NETLINK with NETLINK_ROUTE, for getifaddrs), kills a process that uses another
    architecture's calling convention, and allows everything else. Arguments are
    compared on their low 32 bits, all the kernel reads of an int."""
    arch = arch or platform.machine()
    calls = _CALLS[arch]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, kill = 0x7FFF0000, 0x80000000
    eperm, enosys, eafnosupport = 0x00050000 | 1, 0x00050000 | 38, 0x00050000 | 97

    def arg(i: int) -> tuple:  # load args[i]'s low word (struct seccomp_data, little-endian)
        return (ld, 0, 0, 16 + 8 * i)

    def screened(name: str, body: list) -> list:  # body returns on every path
        return [(jeq, 0, len(body), calls[name])] + body

    def families(netlink: bool) -> list:
        tail = [(jeq, 0, 2, AF_NETLINK), arg(2), (jeq, 1, 0, NETLINK_ROUTE)] if netlink else []
        at_allow = len(SOCKET_FAMILIES) + len(tail) + 1  # from the first family's test
        return [arg(0)] + [(jeq, at_allow - i - 1, 0, family)
                           for i, family in enumerate(SOCKET_FAMILIES)] + tail + [
            (ret, 0, 0, eafnosupport), (ret, 0, 0, allow)]

    prog = [(ld, 0, 0, 4), (jeq, 1, 0, _AUDIT_ARCH[arch]), (ret, 0, 0, kill), (ld, 0, 0, 0)]
    if arch == "x86_64":  # the x32 ABI reaches the same calls under other numbers
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, eperm)]
    for name in DENIED:
        if name in calls:  # modify_ldt is x86's alone
            prog += [(jeq, 0, 1, calls[name]), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 1, calls["clone3"]), (ret, 0, 0, enosys)]
    prog += screened("clone", [arg(0), (jset, 0, 1, NAMESPACE_FLAGS), (ret, 0, 0, eperm),
                               (ret, 0, 0, allow)])
    prog += screened("personality", [arg(0), (jeq, 1, 0, PERSONALITY_QUERY),
                                     (ret, 0, 0, eperm), (ret, 0, 0, allow)])
    prog += screened("socket", families(netlink=True))
    prog += screened("socketpair", families(netlink=False))
    prog += [(ret, 0, 0, allow)]
    return b"".join(struct.pack("<HBBI", *op) for op in prog)


def install_seccomp() -> None:
    """Load :func:`seccomp_program` into this process (no new privileges must be set)."""
    program = seccomp_program()
    buffer = ctypes.create_string_buffer(program, len(program))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    _check(_libc.prctl(PR_SET_SECCOMP, ctypes.c_ulong(SECCOMP_MODE_FILTER),
                       ctypes.byref(fprog), ctypes.c_ulong(0), ctypes.c_ulong(0)), "seccomp")


# ---------------------------------------------------------------------- the rank's root


def spec(*, package: str, package_view: str, readable: list[str], hidden_roots: list[str],
         new_root: str, files: list[str], tmpfs_mb: int, processes: int, fsize_mb: int,
         preload: list[str] = ()) -> dict:
    """What :func:`enter` builds (all paths absolute, made by the grader, which sees all):
    ``package`` is bound from ``package_view``; ``readable`` are bound read-only;
    top-level folders holding one of ``hidden_roots`` or an unreachable readable path are
    rebuilt from the readable paths alone; ``files`` (the student's module) are bound
    read-only; ``new_root`` is an empty folder to build on; ``tmpfs_mb``, ``processes``
    and ``fsize_mb`` are the limits (:func:`enter`); ``preload`` are imported by
    the fork server before it forks a rank, where importing one fails too
    (:func:`distlab.grading.sandbox.preloads` chooses them)."""
    def unreachable(path: str) -> bool:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            try:
                if not os.stat("/" + "/".join(parts[:i])).st_mode & 0o001:
                    return True
            except OSError:
                return True
        return False

    skeleton = sorted({p.strip("/").split("/")[0] for p in hidden_roots} |
                      {p.strip("/").split("/")[0] for p in readable if unreachable(p)})
    return {"package": package, "package_view": package_view, "readable": sorted(set(readable)),
            "skeleton": skeleton, "new_root": new_root, "files": files, "tmpfs_mb": tmpfs_mb,
            "processes": processes, "fsize_mb": fsize_mb, "preload": list(preload)}


AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 1


def _mounts_below(target: str) -> list[str]:
    """Every mount point at or below ``target`` (/proc/self/mountinfo's fifth field, its
    octal escapes undone), parents first."""
    below = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            point = line.split()[4].decode("unicode_escape").encode("latin-1").decode()
            if point == target or point.startswith(target.rstrip("/") + "/"):
                below.append(point)
    return sorted(set(below), key=len)


def _read_only(target: str) -> None:
    """Make the mount at ``target`` and every mount below it read-only: mount_setattr
    with AT_RECURSIVE (Linux 5.12), else a remount of each one mountinfo lists. A bind's
    remount read-only covers its top mount only, and a writable mount below a bound
    folder (a host's /run/lock, /dev/mqueue) would stay writable and outlive the rank."""
    attr = struct.pack("QQQQ", MOUNT_ATTR_RDONLY, 0, 0, 0)
    if _libc.syscall(_CALLS[platform.machine()]["mount_setattr"], ctypes.c_int(AT_FDCWD),
                     os.fsencode(target), ctypes.c_uint(AT_RECURSIVE), attr,
                     ctypes.c_size_t(len(attr))) == 0:
        return
    for point in _mounts_below(target):
        # a user namespace may not clear the flags a bind carries: keep them (statvfs's
        # ST_* equal the MS_* flags but for relatime)
        have = os.statvfs(point).f_flag
        flags = have & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
        flags |= MS_RELATIME if have & os.ST_RELATIME else 0
        _mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)


def _bind(source: str, target: str, writable: bool = False) -> None:
    _mount(source, target, None, MS_BIND | MS_REC)
    if not writable:
        _read_only(target)


def _place(root: str, path: str, is_dir: bool) -> str:
    """Create ``path``'s place under ``root`` (parents 0755) and return it."""
    target = root + path
    os.makedirs(target if is_dir else os.path.dirname(target), mode=0o755, exist_ok=True)
    if not is_dir and not os.path.exists(target):
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    return target


# The top-level folders a rank's root binds whole (read-only): the system's programs,
# libraries and settings, devices and sysfs (NCCL reads the topology there). Any other
# (home folders, other checkouts of the kit, data) is absent, but for the paths the spec
# names readable (the Python installation, its site-packages), bound alone.
SYSTEM = ("bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "sys")


def _build_root(sp: dict, writable: list[str]) -> None:
    """Mount the rank's root on ``sp["new_root"]`` and pivot into it."""
    root = sp["new_root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here leaks out
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
    size = f"size={int(sp['tmpfs_mb'])}m"
    for entry in sorted(os.listdir("/")):
        source, target = "/" + entry, f"{root}/{entry}"
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
        elif os.path.isdir(source):
            os.mkdir(target, 0o755)
            if entry == "tmp":
                _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,{size}")
            elif entry in SYSTEM and entry not in sp["skeleton"]:
                _bind(source, target)  # /dev too: a device node opens for writing anyway
    for path in sorted(sp["readable"], key=len):
        if os.path.isdir(path):
            _bind(path, _place(root, path, True))
    _bind(sp["package_view"], _place(root, sp["package"], True))
    for path in sp["files"]:
        _bind(path, _place(root, path, False))
    for path in writable:
        _bind(path, _place(root, path, os.path.isdir(path)), writable=True)
    for place in ("/dev/shm", "/var/tmp"):
        _mount("tmpfs", _place(root, place, True), "tmpfs", MS_NOSUID | MS_NODEV,
               f"mode=1777,{size}")
    try:  # the rank's own PID namespace: no other process of the machine is listed
        _mount("proc", _place(root, "/proc", True), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:  # a container that masks parts of /proc refuses a fresh one
        _bind("/proc", root + "/proc", writable=True)
    os.chdir(root)
    _check(_libc.syscall(155 if platform.machine() == "x86_64" else 41, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount of the old root")
    os.chdir("/")


# ------------------------------------------------------------------------- privileges


def _drop_everything(run_as: tuple[int, int] | None) -> None:
    """Become ``run_as`` (as root) in a user namespace of its own, holding no capability."""
    uid, gid = os.getuid(), os.getgid()
    if run_as is not None:
        uid, gid = run_as
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)  # root → another user: the capabilities go
        try:  # a user namespace of its own: its process count is this rank's alone
            _check(_libc.unshare(CLONE_NEWUSER), "unshare(user)")
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
            _write("/proc/self/gid_map", f"{gid} {gid} 1")
        except OSError:
            pass  # the count is then the user's, machine-wide; nothing else depends on it
    for cap in range(64):  # the bounding set (the namespace's root held them)
        if _libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0) != 0 and \
                ctypes.get_errno() == 22:
            break  # EINVAL: past the last capability this kernel knows
    _libc.prctl(PR_CAP_AMBIENT, ctypes.c_ulong(PR_CAP_AMBIENT_CLEAR_ALL), 0, 0, 0)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    data = (ctypes.c_uint32 * 6)()
    _check(_libc.capset(ctypes.byref(Header(0x20080522, 0)), data), "capset")
    _prctl(PR_SET_NO_NEW_PRIVS, 1)


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- entering


def enter(sp: dict, run_as: tuple[int, int] | None, writable: list[str]) -> None:
    """In a freshly forked rank (before it runs anything of the student's): returns in a
    process confined as the module docstring says; the process that called it stays
    outside as a relay and never returns (it exits with the confined process's status).
    ``run_as``: (uid, gid) to become when root; ``writable``: the files the rank writes
    outside its tmpfs (its own in the pool's folder), each bound alone, writable."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC
    uid, gid = os.getuid(), os.getgid()
    if os.geteuid() != 0:
        flags |= CLONE_NEWUSER
    _check(_libc.unshare(flags), "unshare")
    if flags & CLONE_NEWUSER:
        # The fork server is non-dumpable, and so is this fork of it: its /proc/self files
        # then belong to root, and the maps cannot be written. Dumpable only while they
        # are: a process of the grader's user could trace this one in that moment, but no
        # student code runs yet, and the ranks already running are in namespaces of
        # their own, under a filter that refuses ptrace.
        _prctl(PR_SET_DUMPABLE, 1)
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
        _prctl(PR_SET_DUMPABLE, 0)
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(alive_r)
        _relay(pid, alive_w)
    os.close(alive_w)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if select.select([alive_r], [], [], 0)[0]:  # the relay ended before we could die with it
        os._exit(1)
    os.close(alive_r)
    _build_root(sp, writable)
    procs, fsize = int(sp["processes"]), int(sp["fsize_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_NPROC, (procs, procs))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))  # EFBIG past it in Python,
    #                                                    which ignores SIGXFSZ
    _drop_everything(run_as if os.geteuid() == 0 else None)
    install_seccomp()


def _relay(pid: int, alive: int) -> None:
    """Outside the rank's PID namespace: pass the launcher's signals on (a PID 1 ignores
    those it has no handler for, so stopping becomes SIGKILL), then exit as it did. It
    holds nothing of the rank's but ``alive`` (whose closing tells the rank it is gone)."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, alive)
    os.closerange(alive + 1, 1 << 16)
    for sig in (signal.SIGUSR1,):
        signal.signal(sig, lambda s, f: os.kill(pid, s))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: os.kill(pid, signal.SIGKILL))
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # whose handling cannot be set
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def from_env(env: dict) -> dict | None:
    text = env.get(ENV)
    return json.loads(text) if text else None


# ------------------------------------------------------------------- the environment


def allowed(env: dict, patterns) -> dict:
    """The variables of ``env`` whose names match one of ``patterns`` (fnmatch, case kept)."""
    import fnmatch

    return {k: v for k, v in env.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}


def forget_environment(env: dict) -> None:
    """Make ``env`` this process's whole environment, and forget the one it inherited:
    ``os.environ`` and libc's are emptied, and the strings the process was started with
    (the exec of an ancestor that this process was forked from: what /proc/self/environ
    shows) are overwritten with zeros, since a rank may read its own memory."""
    os.environ.clear()
    if hasattr(_libc, "clearenv"):  # glibc, musl
        _libc.clearenv()
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (proc(5))
    except (OSError, IndexError, ValueError):
        start = end = 0
    if 0 < start < end:
        ctypes.memset(start, 0, end - start)
    os.environ.update(env)


def available(sp: dict) -> str:
    """"" when :func:`enter` works here with ``sp`` (checked in a forked probe), else why."""
    if sys.platform != "linux" or platform.machine() not in _CALLS:
        return f"no sandbox on {sys.platform}/{platform.machine()} (Linux x86-64 or aarch64)"
    def check():
        user = sp.get("probe_user")
        enter(sp, tuple(user) if user else None, [])
        if os.path.exists(os.path.join(sp["package"], "grading", "exercises")):
            raise RuntimeError("the exercise tests are still visible")

    return probe(check)


def filter_available() -> bool:
    """Whether :func:`install_seccomp` has a program for this machine."""
    return sys.platform == "linux" and platform.machine() in _CALLS

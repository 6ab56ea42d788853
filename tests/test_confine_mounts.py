"""The graded rank's root (issue 43, rows 2 and 3): read-only to the last submount (a
writable mount below a folder the sandbox binds is read-only in the rank, where a bind's
own remount would have left it writable, to outlive the rank on the host), and built
from an allow-list (another checkout of the kit, and the folder an editable install of
it puts on the path, are absent)."""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from distlab.grading import sandbox

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# In a mount namespace of its own: a world-writable tmpfs under a top-level folder that
# the rank's root binds whole, then a rank confined as the grader confines one tries to
# create a file there and in every other mount point it sees.
_SCRIPT = r"""
import errno, json, os, sys, tempfile
from pathlib import Path
from distlab.grading import sandbox
from distlab.runtime import confine, privileges

point, how, other = sys.argv[1:]
sys.path.append(os.path.join(other, "lib"))  # as an editable install's .pth does
if how == "walk":  # a kernel before 5.12: no mount_setattr, so each mount is remounted


    class _Without:
        def __getattr__(self, name):
            return getattr(libc, name)

        def syscall(self, number, *args):
            wanted = confine._CALLS[__import__("platform").machine()]["mount_setattr"]
            return -1 if number == wanted else libc.syscall(number, *args)

    libc, confine._libc = confine._libc, _Without()
confine._mount("tmpfs", point, "tmpfs", 0, "mode=1777,size=1m")
user, _ = privileges.unprivileged_user()
run_as = tuple(int(x) for x in user.split(":")) if user else None
tmp = Path(tempfile.mkdtemp())
os.chmod(tmp, 0o755)
spec = sandbox._spec(tmp, [], run_as)
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(read)
    confine.enter(spec, run_as, [])
    found = {}
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for where in [point, *points]:
        if where in ("/tmp", "/var/tmp", "/dev/shm", "/proc") or where.startswith("/proc/"):
            continue  # the rank's own capped tmpfs and its proc
        try:
            fd = os.open(os.path.join(where, "canary"), os.O_CREAT | os.O_WRONLY, 0o644)
            os.close(fd)
            found[where] = "written"
        except OSError as exc:
            found[where] = errno.errorcode.get(exc.errno, str(exc.errno))
    found["visible"] = [p for p in (other, os.path.join(other, "lib"), os.path.join(
        other, "solutions", "05_zero.ipynb")) if os.path.exists(p)]
    os.write(write, json.dumps(found).encode())
    os._exit(0)
os.close(write)
data = b""
while chunk := os.read(read, 65536):
    data += chunk
os.waitpid(pid, 0)
print(data.decode())
"""


def _second_checkout(top: str) -> str:
    """A copy of the kit's answers and solutions in a folder of its own below ``top``."""
    other = tempfile.mkdtemp(prefix="distlab-other-", dir=top)
    for path in ("lib/distlab/__init__.py", "solutions/05_zero.ipynb"):
        os.makedirs(os.path.dirname(os.path.join(other, path)), exist_ok=True)
        with open(os.path.join(other, path), "w") as f:
            f.write("# a second checkout\n")
    return other


@pytest.mark.skipif(sandbox.containment() != "pidns", reason="needs root and namespaces")
@pytest.mark.parametrize("how", ["mount_setattr", "walk"])
def test_the_ranks_root_is_read_only_to_the_last_submount_and_holds_no_other_kit(how):
    # below /usr, which every rank's root binds whole
    point = tempfile.mkdtemp(prefix="distlab-submount-",
                             dir="/usr/local" if os.path.isdir("/usr/local") else "/usr")
    top = next(t for t in ("/srv", "/mnt", "/opt", "/media", "/var/lib") if os.path.isdir(t))
    other = _second_checkout(top)
    try:
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--pid", "--fork",
             "--mount-proc", "--kill-child", sys.executable, "-c", _SCRIPT, point, how, other],
            capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        found = __import__("json").loads(done.stdout.strip().splitlines()[-1])
    finally:
        os.rmdir(point)
        shutil.rmtree(other)
    assert found.pop("visible") == [], "another checkout of the kit is visible in a rank"
    assert found[point] == "EROFS", found
    assert not [p for p, what in found.items() if what == "written"], found

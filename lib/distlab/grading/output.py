"""What the grader prints and writes: every student-controlled string escaped
(:func:`shown`), the report table with each exercise's hint and self-reported points
(:func:`table`), where the traffic evidence comes from (:func:`traffic_evidence`), the
student's own line in a rank's traceback (:func:`student_line`), and the JSON written
without following a planted link (:func:`write_report`); files replaced whole
(:func:`replace_file`: the labs a release writes)."""
from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

RAISED = "your code raised "   # how a message from the student's own exception starts
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>.+?)\s*$')
_CELL = re.compile(r"^# --- exercise (\w+)$")


# gloo's words when a call names a rank that is not its peer in the group
_GLOO_PEER = ("Pair is not connected", "invalid tensor size")
PEER_MIXUP = ("gloo says this when a call names the wrong peer: a rank of the group passed "
              "where torch.distributed expects a global rank (send/recv's dst/src, "
              "broadcast's src), or the reverse; dist.get_global_rank(group, r) converts")


def rank_error(exc) -> str:
    """The first message of a rank's exception (a :class:`distlab.launch.RankError`): the
    exception, and where the student's code raised it ("rank 1: your code raised
    RuntimeError: ... (line 12 of the ZeRO3Unit cell, in gather: ...)"), or, when no frame
    is the student's, the deepest frame; gloo's raw peer errors explained."""
    first = str(exc).splitlines()[0]
    if exc.exc_type == "AssertionError":
        return first
    mine = student_line(exc.remote_traceback)
    if mine:
        rank, _, rest = first.partition(" raised ")
        text = f"{rank}: {RAISED}{rest} ({mine})"
    else:
        tb = exc.remote_traceback.strip().splitlines()
        place = next((line.strip() for line in reversed(tb) if line.strip().startswith("File")), "")
        text = f"{first} ({place})" if place else first
    return text + (f"; {PEER_MIXUP}" if any(s in str(exc) for s in _GLOO_PEER) else "")


def student_line(traceback_text: str) -> str:
    """Where the student's code raised: the deepest frame of ``traceback_text`` in the
    student's module (``student_*.py``, which the grader writes from the notebook's
    exercise cells, :func:`distlab.grading.notebook.module_source`), as "line 12 of the
    ZeRO3Unit cell, in before_forward: <code>" (the module's line where its file cannot
    be read); "" when no frame is the student's (a torch frame is never named)."""
    lines = traceback_text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME.match(lines[i])
        if not m or not os.path.basename(m["file"]).startswith("student_"):
            continue
        number = int(m["line"])
        code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) \
            else ""
        where = f"line {number} of your exercise cells"
        with contextlib.suppress(OSError, UnicodeDecodeError):
            source = Path(m["file"]).read_text().splitlines()[:number]
            for at in range(len(source) - 1, -1, -1):
                cell = _CELL.match(source[at])
                if cell:
                    where = f"line {number - at - 1} of the {cell[1]} cell"
                    break
        return f"{where}, in {m['fn']}" + (f": {code}" if code else "")
    return ""


def shown(text: str) -> str:
    """``text`` safe to print on a terminal: control and formatting characters (escape
    sequences, carriage returns, bidirectional overrides) written as Python escapes."""
    import unicodedata

    return "".join(ch if ch == " " or unicodedata.category(ch) not in (
        "Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs") else
        ascii(ch)[1:-1] for ch in str(text))


def traffic_evidence() -> str:
    """Where this grader's traffic checks can get their bytes, in words: counted on a
    private loopback (root, an unprivileged user, namespaces; :mod:`distlab.grading.wire`)
    or only from the ranks' own CommLogs, and why."""
    from distlab.grading import sandbox
    from distlab.runtime import privileges

    if os.geteuid() != 0:
        return "self-reported: the grader is not root, so the ranks get no network of their own"
    if not privileges.unprivileged_user()[0]:
        return "self-reported: no unprivileged user, so students' code runs as root"
    if not sandbox.network_namespace():
        return "self-reported: no network namespace (unshare --net failed)"
    return "wire: bytes counted on a loopback of the run's own, outside the ranks"


def table(results: list, title: str = "") -> str:
    """The report, every student-controlled string escaped (:func:`shown`): per exercise
    its points (how many rest on self-reported traffic), verdict, first failing check (a
    message's further lines, as a syntax error's line and caret, under its first: never
    at the start of a line, where rows and totals are) and the hint to open."""
    rows = [("exercise", "points", "verdict", "first failing check")]
    for r in results:
        pts = f"{r.points}/{r.max_points}" + (f" (+{r.blocked} blocked)" if r.blocked else "") + (
            f" ({r.self_reported} self-reported)" if r.self_reported else "")
        first, *more = str(r.message).split("\n")
        rows.append((shown(r.exercise), pts, shown(r.verdict), shown(first)))
        rows += [("", "", "", shown(line)) for line in more]
        if r.hint:
            rows.append(("", "", "", f"\u2192 {shown(r.hint)}"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["\n".join(shown(line) for line in title.split("\n"))] if title else []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 20)
    total = sum(r.points for r in results), sum(r.max_points for r in results)
    lines.append(f"total: {total[0]}/{total[1]}")
    from distlab.grading import sandbox

    unconfined = sandbox.confinement()  # said, rather than grade unconfined in silence
    if unconfined:
        lines.append(f"not confined: {shown(unconfined)}; the graded code ran without the "
                     f"sandbox, so the guarantees README.md marks (sandbox) did not hold")
    mine = sum(r.self_reported for r in results)
    if mine:
        why = traffic_evidence()
        lines.append(f"self-reported: {mine} of these points rest on traffic the ranks reported "
                     f"themselves (CommLog), which their code could forge; " + (
                         "the tests behind them count no bytes on the wire (the other traffic "
                         "points do)" if why.startswith("wire")
                         else why.removeprefix("self-reported: ")))
    blocked = sum(r.blocked for r in results)
    if blocked:
        one = blocked == 1
        lines.append(f"blocked: {blocked} " + ("test needs" if one else "tests need") +
                     " GPUs this machine lacks (the gpu tier one, multigpu two or more): "
                     + ("it is" if one else "they are") + " left out of the points above "
                     "and run where the GPUs are")
    return "\n".join(lines)


class UnsafeTarget(OSError):
    """The report's folder is writable by others: a file written there could be swapped."""


def write_report(target: Path, text: str) -> None:
    """Write ``text`` to ``target`` whole or not at all, without following a link anyone
    planted: a fresh name in the target's folder (created with O_CREAT|O_EXCL|O_NOFOLLOW,
    as ``mkstemp`` does), renamed over ``target``, both through a descriptor of the folder
    checked first. A folder writable by another user is refused (:class:`UnsafeTarget`)
    unless it is sticky and owned by the grader's user or root (as /tmp)."""
    import stat

    folder = os.path.dirname(os.path.abspath(target)) or "/"
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstat(dfd)
        shared = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_uid not in (os.geteuid(), 0)
        if shared and not (st.st_mode & stat.S_ISVTX and st.st_uid in (os.geteuid(), 0)):
            raise UnsafeTarget(f"refusing to write {target}: its folder {folder} is writable by "
                               f"other users (mode {stat.filemode(st.st_mode)}, owner uid "
                               f"{st.st_uid}); write the report into a folder of your own")
        _replace_in(dfd, os.path.basename(target), text.encode(), 0o644)
    finally:
        os.close(dfd)


def replace_file(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` whole or not at all: a fresh file in its folder (mode
    0o666 less the umask, as ``open`` gives) renamed over it."""
    dfd = os.open(os.path.dirname(os.path.abspath(target)) or "/",
                  os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _replace_in(dfd, os.path.basename(target), data, 0o666)
    finally:
        os.close(dfd)


def _replace_in(dfd: int, name: str, data: bytes, mode: int) -> None:
    """``data`` under a fresh name in the folder ``dfd`` (O_CREAT|O_EXCL|O_NOFOLLOW),
    synced, then renamed over ``name``; the fresh file is removed if anything fails."""
    import secrets

    fresh = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode, dir_fd=dfd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(fresh, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(fresh, dir_fd=dfd)
        raise

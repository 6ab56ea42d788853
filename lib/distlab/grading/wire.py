"""Traffic evidence the student's code cannot forge: bytes counted on the network.

A CommLog is kept by the rank that ran the student's code, so a student can forge it
(undo the tracer's depth, append events). Where the grader is root and can make
namespaces, each contained pytest run gets a network namespace of its own with only
``lo`` up (:func:`distlab.grading.sandbox.run_contained`), gloo is told to use ``lo``
(``GLOO_SOCKET_IFNAME``), and the test process, which never runs the student's code,
reads that loopback's transmit counters (``/proc/self/net/dev``) before and after the
graded call (:func:`measure`). Every byte gloo moves between ranks crosses ``lo`` once;
the launcher talks to its ranks over Unix sockets and the rendezvous is a file, so they
add nothing. :func:`measure` first warms the ranks of the world size and counts a no-op
launch on them (``allowance``; measured: 0 bytes); should the graded call start fresh
ranks after all, their gloo handshakes (measured: 1.8 KiB at 4 ranks) fall within
:data:`SLACK`.

The payload is the transmitted bytes less :data:`HEADER` bytes per packet (Ethernet,
IPv4 and TCP with timestamps, as Linux counts them on ``lo``; ACKs are pure header),
less what TCP retransmitted on the sockets open at the end (``ss``'s ``bytes_retrans``:
on a loaded machine a 64 KiB segment on ``lo`` is now and then resent, counted twice).
:func:`at_most` checks it against an upper bound with a stated tolerance
(:data:`TOLERANCE` of the expected bytes plus :data:`SLACK` for gloo's own message
headers). Bytes a student adds can only raise the count, so upper bounds ("you moved
twice what a reduce-scatter moves") hold against any forgery. Lower bounds do not: ranks
can also exchange data through files, so none is checked here.

What bytes cannot tell: which collective moved them, where two cost the same. Measured
under gloo (torch 2.13), ``reduce_scatter_tensor`` moves exactly what ``all_reduce``
moves (2(n-1)/n of the buffer per rank), so "all-reduce instead of reduce-scatter"
through torch's calls is invisible on the wire; it shows when the student's reduce-scatter
is a ring of sends (n-1)/n. :func:`gloo_bytes` gives gloo's measured cost per call.

Without namespaces (not root, or no ``unshare``) there is no private loopback to count:
:func:`measure` yields a reading whose ``payload`` is None, :func:`at_most` checks
nothing, and the grader marks the points of tests that read a CommLog, or made such an
empty wire check, "self-reported" (:func:`evidence_of`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os

HEADER = 66        # bytes per packet on lo: Ethernet 14 + IPv4 20 + TCP 32 (timestamps)
TOLERANCE = 0.10   # of the expected bytes
SLACK = 16 << 10   # bytes: gloo's own headers (about 4 KiB per all-reduce at 4 ranks)
ENV = "DISTLAB_WIRE"  # set to "lo" by the contained run's supervisor once lo is up alone

# total bytes on the wire of one call over n ranks, per byte of the message as CommLog
# counts it (the whole buffer; the output of an all-gather; the input of a reduce-scatter),
# measured with gloo at 2 and 4 ranks on 4 KiB to 4 MiB
_GLOO = {
    "all_reduce": lambda n: 2 * (n - 1),
    "reduce_scatter": lambda n: 2 * (n - 1),  # gloo reduces the whole buffer, then slices
    "all_gather": lambda n: n - 1,
    "broadcast": lambda n: n - 1,
    "send": lambda n: 1,
}
# messages gloo's ranks send, all together, in one call: a step of a ring per rank
# (2(n-1) steps in an all-reduce or gloo's reduce-scatter, n-1 in an all-gather), a
# broadcast's n-1 transfers; each carries at most MESSAGE bytes of gloo's headers and
# notifications (measured with gloo at 2 to 4 ranks on 48 B to 480 KB, 20 calls each:
# all_reduce 784, 2222, 4329 B a call at 2, 3, 4 ranks; send about 100 B)
MESSAGE = 200
_MESSAGES = {
    "all_reduce": lambda n: 2 * (n - 1) * n,
    "reduce_scatter": lambda n: 2 * (n - 1) * n,
    "all_gather": lambda n: (n - 1) * n,
    "broadcast": lambda n: n - 1,
    "send": lambda n: 1,
}

_checks = [0, 0]  # wire checks made in this process: with bytes counted, without


def private_loopback() -> bool:
    """Whether this process counts in a network namespace of its own whose only
    interface is ``lo`` (set up by the grader's supervisor)."""
    if os.environ.get(ENV) != "lo":
        return False
    counters = interfaces()
    return counters is not None and set(counters) == {"lo"}


def interfaces() -> dict[str, tuple[int, int]] | None:
    """interface → (transmitted bytes, transmitted packets), from /proc/self/net/dev."""
    try:
        with open("/proc/self/net/dev") as f:
            lines = f.read().splitlines()[2:]
    except OSError:
        return None
    out = {}
    for line in lines:
        name, _, fields = line.partition(":")
        values = fields.split()
        if len(values) >= 10:
            out[name.strip()] = (int(values[8]), int(values[9]))
    return out


SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> bool:
    """In a fresh network namespace (its PID 1, as root): bring ``lo`` up, the only
    interface there, so that gloo's ranks reach each other and nothing else; True when
    this namespace holds ``lo`` alone, up."""
    import fcntl
    import socket
    import struct

    found = interfaces() or {}
    if set(found) != {"lo"}:
        return False
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack(
                "16sh", b"lo", 0)))[1]
            fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))
    except OSError:
        return False
    return True


def counters() -> tuple[int, int]:
    """(bytes, packets) transmitted on ``lo`` so far in this network namespace."""
    found = (interfaces() or {}).get("lo")
    if found is None:
        raise RuntimeError("no loopback counters in /proc/self/net/dev")
    return found


@dataclasses.dataclass
class Reading:
    """What crossed the loopback during a :func:`measure` block (None: not counted)."""

    bytes: int | None = None
    packets: int | None = None
    allowance: int = 0  # bytes fresh ranks' handshakes may add

    retransmitted: int = 0  # bytes TCP sent again (counted twice on lo)

    @property
    def payload(self) -> int | None:
        """Bytes of TCP payload: transmitted bytes less a header per packet, less what
        TCP retransmitted (a loaded machine drops and resends segments even on lo)."""
        return None if self.bytes is None else (
            self.bytes - HEADER * self.packets - self.retransmitted)


def retransmissions() -> dict[tuple[str, str], int]:
    """(local, peer) address → bytes TCP retransmitted on that socket so far, for the
    sockets of this network namespace (``ss -tin``'s ``bytes_retrans``; {} without ss)."""
    import re
    import subprocess

    try:
        out = subprocess.run(["ss", "-tinH"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found, key = {}, None
    for line in out.splitlines():
        fields = line.split()
        if line[:1].strip() and len(fields) >= 5:  # a socket: state, queues, local, peer
            key = (fields[3], fields[4])
        elif key is not None:
            m = re.search(r"\bbytes_retrans:(\d+)", line)
            found[key] = found.get(key, 0) + (int(m[1]) if m else 0)
    return found


def _noop() -> None:
    return None


@contextlib.contextmanager
def measure(world_size: int, backend: str = "gloo"):
    """``with measure(n) as reading: launch.run(...)``: what crossed the loopback during
    the block. Counted only on a private loopback (:func:`private_loopback`; else
    ``reading.payload`` stays None). First the warm ranks of ``n`` are started, and what a
    no-op launch on them costs is measured (``reading.allowance``; 0 bytes when measured),
    so that only the graded call is counted."""
    reading = Reading()
    if not private_loopback():
        yield reading
        return
    from distlab import launch

    launch.run(_noop, world_size, backend=backend)  # the graded call finds warm ranks
    before = counters()
    launch.run(_noop, world_size, backend=backend)
    after = counters()
    reading.allowance = max(0, after[0] - before[0] - HEADER * (after[1] - before[1]))
    resent = retransmissions()
    start = counters()
    try:
        yield reading
    finally:
        end = counters()
        reading.bytes, reading.packets = end[0] - start[0], end[1] - start[1]
        # only what sockets still open show: a closed socket's resends stay counted
        reading.retransmitted = sum(max(0, n - resent.get(k, 0))
                                    for k, n in retransmissions().items())


def gloo_bytes(op: str, nbytes: int, world_size: int, calls: int = 0) -> int:
    """Bytes gloo puts on the wire, all ranks together, for ``op`` on messages of
    ``nbytes`` in all as CommLog counts them (:data:`_GLOO`, measured), plus the headers
    of ``calls`` such calls (:data:`MESSAGE` per message of :data:`_MESSAGES`): what many
    small calls add beyond :data:`SLACK`."""
    return _GLOO[op](world_size) * nbytes + calls * _MESSAGES[op](world_size) * MESSAGE


def at_most(reading: Reading, expected: int, what: str) -> None:
    """Fail (AssertionError, in words a student reads) when more than ``expected`` bytes
    of payload crossed the wire during ``reading``, beyond :data:`TOLERANCE` and
    :data:`SLACK`. Checks nothing when the bytes were not counted."""
    from distlab.units import human_bytes

    if reading.payload is None:
        _checks[1] += 1
        return
    _checks[0] += 1
    moved = reading.payload - reading.allowance
    limit = int(expected * (1 + TOLERANCE)) + SLACK
    if moved > limit:
        raise AssertionError(
            f"{what}: your ranks moved {human_bytes(moved)} over the network (counted by the "
            f"grader, outside your processes), {moved / max(expected, 1):.1f}x the "
            f"{human_bytes(expected)} expected (allowed: {TOLERANCE:.0%} more, plus "
            f"{human_bytes(SLACK)} of headers)")


def checks_made() -> tuple[int, int]:
    """Wire checks made in this process so far: (with bytes counted, without any)."""
    return _checks[0], _checks[1]


def evidence_of(read_commlog: bool, wire_checked: bool, uncounted: bool = False) -> str:
    """How a test's traffic was evidenced: "wire" (bytes counted outside the ranks),
    "self-reported" (only a CommLog the ranks returned, or a wire check that had no
    bytes to count), or "" (no traffic checked)."""
    return "wire" if wire_checked else "self-reported" if read_commlog or uncounted else ""

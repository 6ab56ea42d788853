"""Lab 01, exercise bus_bandwidth: nccl-tests' bus bandwidth in bytes/s."""
import pytest

NOTEBOOK = "01_primitives"
NBYTES, SECONDS = 3 * 2**20, 0.0015   # 3 MiB in 1.5 ms: algbw = 2.097 GB/s
# busbw / algbw per world size 1, 2, 3, 4, 8, as nccl-tests' doc/PERFORMANCE.md gives them:
# 2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter, 1 for the others
FACTORS = {
    "all_reduce": {1: 0.0, 2: 1.0, 3: 4 / 3, 4: 1.5, 8: 1.75},
    "all_gather": {1: 0.0, 2: 0.5, 3: 2 / 3, 4: 0.75, 8: 0.875},
    "reduce_scatter": {1: 0.0, 2: 0.5, 3: 2 / 3, 4: 0.75, 8: 0.875},
    **{op: {1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 8: 1.0} for op in ("broadcast", "reduce", "sendrecv")},
}


def _check(bus_bandwidth, op, why):
    for n, factor in FACTORS[op].items():
        got = bus_bandwidth(op, NBYTES, SECONDS, n)
        algbw = NBYTES / SECONDS
        want = algbw * factor
        assert isinstance(got, (int, float)) and not isinstance(got, bool), (
            f"bus_bandwidth({op!r}, ...) should return a number (bytes/s), got "
            f"{type(got).__name__}")
        assert got == pytest.approx(want, rel=1e-9, abs=1e-6), (
            f"bus_bandwidth({op!r}, nbytes={NBYTES}, seconds={SECONDS}, world_size={n}) is "
            f"{got:.4g} bytes/s, expected {want:.4g} bytes/s: {why} (algbw = nbytes / "
            f"seconds = {algbw:.4g} bytes/s)")


def test_all_reduce(student):
    _check(student.bus_bandwidth, "all_reduce",
           "all_reduce's busbw is algbw x 2(n-1)/n (a ring sends each byte out 2(n-1)/n times)")


def test_all_gather_and_reduce_scatter(student):
    for op in ("all_gather", "reduce_scatter"):
        _check(student.bus_bandwidth, op, f"{op}'s busbw is algbw x (n-1)/n, where nbytes is "
               f"the whole buffer (the output of all_gather, the input of reduce_scatter)")


def test_broadcast_reduce_sendrecv(student):
    for op in ("broadcast", "reduce", "sendrecv"):
        _check(student.bus_bandwidth, op, f"{op}'s busbw equals its algbw (factor 1): each "
               f"byte crosses one link once per rank")


def test_units_are_bytes_per_second(student):
    got = student.bus_bandwidth("broadcast", 10**9, 2.0, 4)
    assert got == pytest.approx(5e8), (
        f"1e9 bytes broadcast in 2 s should give 5e8 bytes/s, got {got!r}: return bytes per "
        f"second (not GB/s, not bits), computed as nbytes / seconds x factor")


def test_unknown_op_is_an_error(student):
    with pytest.raises(ValueError):
        student.bus_bandwidth("all_to_everyone", NBYTES, SECONDS, 4)


def test_no_ranks_is_an_error(student):
    for n in (0, -2):
        try:
            got = student.bus_bandwidth("all_reduce", NBYTES, SECONDS, n)
        except ValueError:
            continue
        except Exception as exc:
            raise AssertionError(f"bus_bandwidth('all_reduce', ..., world_size={n}) raised "
                                 f"{type(exc).__name__}; raise ValueError for a world_size "
                                 f"below 1") from None
        raise AssertionError(f"bus_bandwidth('all_reduce', ..., world_size={n}) returned "
                             f"{got!r}; raise ValueError for a world_size below 1")

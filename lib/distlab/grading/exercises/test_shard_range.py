"""Exercise shard_range(numel, rank, world_size) of lab 05.

``(start, end)`` of this rank's shard of a flat buffer of ``numel`` elements: the pieces
of ``torch.tensor_split``, the first ``numel % world_size`` ranks one element longer. A
pure function of plain numbers, so the tests call it directly."""
import torch

NOTEBOOK = "05_zero"

CASES = [(10, 4), (1001, 3)] + [(numel, world) for world in (1, 2, 3, 4, 7, 8)
                                 for numel in (0, 1, 5, 10, 11, 64, 1001)]


def shards(student, numel, world):
    return [tuple(student.shard_range(numel, rank, world)) for rank in range(world)]


def test_the_shards_cover_every_element_once(student):
    for numel, world in CASES:
        got = shards(student, numel, world)
        where = f"shard_range({numel}, rank, {world}) for ranks 0..{world - 1} gave {got}"
        assert got[0][0] == 0, f"{where}: rank 0's shard must start at 0"
        for (_, end), (start, _) in zip(got, got[1:]):
            assert start == end, (f"{where}: each shard must start where the previous one "
                                  f"ends (a gap loses elements, an overlap updates them twice)")
        assert got[-1][1] == numel, (
            f"{where}: the last shard ends at {got[-1][1]}, not at numel={numel}; the "
            f"{numel - got[-1][1]} remaining element(s) belong to no rank (the lost remainder "
            f"of rank * (numel // world_size)): give one more to each of the first "
            f"numel % world_size ranks")


def test_the_first_ranks_get_the_extra_elements_as_tensor_split_does(student):
    for numel, world in CASES:
        want = []
        for piece in torch.arange(numel).tensor_split(world):
            start = piece[0].item() if len(piece) else (want[-1][1] if want else 0)
            want.append((start, start + len(piece)))
        got = shards(student, numel, world)
        assert got == want, (f"shard_range({numel}, rank, {world}) for each rank gave {got}; "
                             f"torch.tensor_split's pieces are {want} (sizes differ by at most "
                             f"one, the longer ones first)")


def test_more_ranks_than_elements_gives_empty_shards(student):
    got = shards(student, 3, 5)
    assert got == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)], (
        f"3 elements over 5 ranks gave {got}: ranks 3 and 4 hold nothing, an empty shard "
        f"(start == end) where rank 2's ends")


def test_it_returns_two_ints(student):
    got = student.shard_range(10, 1, 4)
    assert isinstance(got, tuple) and len(got) == 2 and all(
        isinstance(v, int) for v in got), f"shard_range(10, 1, 4) returned {got!r}: return a " \
        f"tuple (start, end) of two Python ints"

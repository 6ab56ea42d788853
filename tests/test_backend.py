"""Backend choice: NCCL only with a GPU per rank, gloo otherwise, and errors that say so."""
import pytest

from distlab import backend


@pytest.fixture
def gpus(monkeypatch):
    def set_count(n):
        monkeypatch.setattr(backend, "gpu_count", lambda: n)
        monkeypatch.setattr(backend.dist, "is_nccl_available", lambda: True)
        monkeypatch.setattr(backend, "_collective_library", lambda: "NCCL 2.28.9")
    return set_count


@pytest.mark.parametrize("count,world,expected", [(0, 1, "gloo"), (0, 4, "gloo"),
                                                   (1, 1, "nccl"), (1, 2, "gloo"),
                                                   (8, 8, "nccl"), (8, 2, "nccl")])
def test_auto_takes_nccl_only_with_a_gpu_per_rank(gpus, count, world, expected):
    gpus(count)
    assert backend.choose(world, "auto") == expected
    assert backend.explain(world).split(" on ")[1].startswith("gloo" if expected == "gloo" else "NCCL")


def test_nccl_with_too_few_gpus_names_the_fix(gpus):
    gpus(1)
    with pytest.raises(ValueError) as info:
        backend.choose(2, "nccl")
    message = str(info.value)
    assert "world_size=2" in message and "1 GPU" in message
    assert "Duplicate GPU" in message and "backend='gloo'" in message
    gpus(0)
    with pytest.raises(ValueError, match="no GPU.*backend='gloo'"):
        backend.choose(1, "rccl")


def test_gloo_is_always_available_and_names_are_checked(gpus):
    gpus(4)
    assert backend.choose(2, "gloo") == "gloo"
    with pytest.raises(ValueError, match="backend must be one of"):
        backend.choose(2, "NCCL")


def test_info_describes_this_machine():
    info = backend.info()
    text = str(info)
    assert info.torch_version in text and info.gloo
    if info.gpus:
        assert info.collective_library.split()[0] in ("NCCL", "RCCL")
    else:
        assert "no GPU" in text and info.collective_library is None

"""distlab.mesh: the rank grid (TP fastest, then PP, then DP), its groups, and errors
that say what to change."""
import pytest
import torch
import torch.distributed as dist

from distlab import launch
from distlab.mesh import Grid, Mesh


def test_tp_is_fastest_then_pp_then_dp():
    g = Grid(dp=2, pp=2, tp=2)
    assert [g.coords(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(g.rank(*g.coords(r)) == r for r in range(8))
    assert g.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("dp,pp,tp", [(1, 1, 1), (3, 1, 1), (1, 3, 2), (2, 3, 2), (4, 1, 3)])
def test_every_dimension_partitions_the_world(dp, pp, tp):
    g = Grid(dp, pp, tp)
    for dim in ("dp", "pp", "tp"):
        groups = g.groups(dim)
        assert sorted(r for ranks in groups for r in ranks) == list(range(g.size))
        assert all(len(ranks) == getattr(g, dim) for ranks in groups)
        for ranks in groups:  # the other two coordinates are shared
            kept = {tuple(c for c, d in zip(g.coords(r), ("dp", "pp", "tp")) if d != dim)
                    for r in ranks}
            assert len(kept) == 1


def test_bad_layouts_say_what_to_change():
    with pytest.raises(ValueError, match="product is 8"):
        Grid(2, 2, 1).check(8)
    with pytest.raises(ValueError, match="inside a node"):
        Grid(1, 1, 16).check(16, gpus_per_node=8)
    with pytest.raises(ValueError, match="pp <= 2"):
        Grid(1, 4, 1).check(4, num_layers=2)
    with pytest.raises(ValueError, match="positive integer"):
        Grid(0, 1, 1)
    assert "ranks [2, 3]" in str(Grid(2, 1, 2))


def _mesh_sums():
    mesh = Mesh(dp=2, pp=1, tp=2)
    sums = {}
    for dim in ("dp", "tp"):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mesh.groups[dim])
        sums[dim] = t.item()
    return mesh.coords, sums, mesh.prev_stage, mesh.next_stage


def test_each_rank_gets_its_own_groups():
    out = launch.run(_mesh_sums, 4, backend="gloo", timeout=60)
    grid = Grid(2, 1, 2)
    for rank, (coords, sums, prev, nxt) in enumerate(out):
        assert coords == grid.coords(rank)
        for dim in ("dp", "tp"):
            (mine,) = [g for g in grid.groups(dim) if rank in g]
            assert sums[dim] == sum(mine), (rank, dim)
        assert prev is None and nxt is None


def _stages():
    mesh = Mesh(pp=3)
    return mesh.prev_stage, mesh.next_stage


def test_stage_neighbours_and_a_wrong_world_size():
    assert launch.run(_stages, 3, backend="gloo", timeout=60) == [(None, 1), (0, 2), (1, None)]
    with pytest.raises(launch.RankError, match="product is 3"):
        launch.run(Mesh, 3, 2, backend="gloo", timeout=60)

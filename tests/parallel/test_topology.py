"""The process grid: layout validation, TP adjacency, group membership, the mpu interface, and launchers."""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from zoo.parallel.topology import LayoutError, check_layout, initialize_model_parallel

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("world,tp,pp,dp", [(1, 1, 1, 1), (4, 2, 1, 2), (4, 2, 2, 1), (8, 2, 2, 2), (12, 3, 2, 2)])
def test_check_layout_gives_dp(world, tp, pp, dp):
    assert check_layout(world, tp, pp) == dp


def test_bad_layouts_fail_with_one_line():
    with pytest.raises(LayoutError, match=r"^world size 6 is not divisible by tp\*pp = 4; .*") as e:
        check_layout(6, 2, 2)
    assert "\n" not in str(e.value)
    with pytest.raises(LayoutError, match="tp must be a positive integer, got 0"):
        check_layout(4, 0, 1)
    with pytest.raises(LayoutError, match="pp must be a positive integer"):
        check_layout(4, 1, -2)


def grid_case(tp, pp):
    grid = initialize_model_parallel(tp, pp)
    rank = dist.get_rank()
    # TP ranks are adjacent; the grid order is (pipe, data, tp) with tp fastest.
    expected_tp_ranks = tuple(range(rank - rank % tp, rank - rank % tp + tp))
    assert grid.tp_ranks == expected_tp_ranks, (grid.tp_ranks, expected_tp_ranks)
    assert grid.tp_rank == rank % tp
    assert grid.pp_rank == rank // (tp * grid.dp)
    assert grid.dp_rank == (rank // tp) % grid.dp
    # Groups really connect those ranks: the sum of global ranks over each group.
    for group, members in ((grid.tp_group, grid.tp_ranks), (grid.dp_group, grid.dp_ranks),
                           (grid.pp_group, grid.pp_ranks)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(members)
    # mpu interface as DeepSpeed reads it.
    assert grid.get_tensor_model_parallel_world_size() == tp and grid.get_pipe_parallel_world_size() == pp
    assert grid.get_data_parallel_world_size() == grid.dp and grid.get_model_parallel_world_size() == tp * pp
    assert grid.get_slice_parallel_rank() == grid.tp_rank and grid.get_data_parallel_rank() == grid.dp_rank
    assert initialize_model_parallel(tp, pp) is grid, "one grid per layout per process"
    return grid.tp_rank, grid.pp_rank, grid.dp_rank


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)])
def test_grid_groups_on_four_ranks(dist_run, tp, pp):
    coords = dist_run(4, grid_case, tp, pp)
    assert len(set(coords)) == 4, "every rank has its own (tp, pp, dp) coordinate"


def bad_grid_case():
    with pytest.raises(LayoutError, match=r"world size 4 is not divisible by tp\*pp = 3"):
        initialize_model_parallel(3, 1)
    return True


def test_bad_grid_under_a_launch(dist_run):
    assert all(dist_run(4, bad_grid_case))


@pytest.mark.parametrize("world,tp,pp,cp,dp", [(4, 1, 1, 2, 2), (8, 2, 1, 2, 2), (8, 1, 2, 4, 1), (16, 2, 2, 2, 2)])
def test_check_layout_with_context_parallelism(world, tp, pp, cp, dp):
    assert check_layout(world, tp, pp, cp) == dp


def test_bad_context_layouts_fail_with_one_line():
    with pytest.raises(LayoutError, match=r"^world size 4 is not divisible by tp\*cp\*pp = 8 \(tp=2, cp=2, pp=2\); "
                                          r"launch a multiple of 8 processes$"):
        check_layout(4, 2, 2, 2)
    with pytest.raises(LayoutError, match=r"^cp must be a positive integer, got 0$"):
        check_layout(4, 1, 1, 0)


def context_grid_case(tp, pp, cp):
    grid = initialize_model_parallel(tp, pp, cp)
    rank, dp = dist.get_rank(), grid.dp
    # Rank order: tp fastest, then cp, then dp, then pp.
    assert (grid.tp_rank, grid.cp_rank, grid.dp_rank, grid.pp_rank) == (
        rank % tp, rank // tp % cp, rank // (tp * cp) % dp, rank // (tp * cp * dp))
    base = rank - grid.cp_rank * tp  # cp rank 0 of this rank's CP group
    assert grid.cp_ranks == tuple(base + c * tp for c in range(cp))
    assert grid.dp_ranks == tuple(rank - (grid.dp_rank - d) * tp * cp for d in range(dp))
    for group, members in ((grid.cp_group, grid.cp_ranks), (grid.dp_group, grid.dp_ranks),
                           (grid.tp_group, grid.tp_ranks), (grid.pp_group, grid.pp_ranks),
                           (grid.get_data_parallel_group(), None)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        if members is not None:
            assert t.item() == sum(members), (members, t.item())
    # DeepSpeed sees dp x cp as its data parallelism; the model-parallel group stays pipe x tensor.
    assert grid.get_data_parallel_world_size() == dp * cp
    assert grid.get_data_parallel_rank() == grid.dp_rank * cp + grid.cp_rank
    assert grid.get_model_parallel_world_size() == tp * pp
    assert grid.topology.get_dim("data") == dp * cp
    return grid.tp_rank, grid.cp_rank, grid.dp_rank, grid.pp_rank


@pytest.mark.parametrize("tp,pp,cp", [(1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2)])
def test_context_parallel_grid_on_four_ranks(dist_run, tp, pp, cp):
    coords = dist_run(4, context_grid_case, tp, pp, cp)
    assert len(set(coords)) == 4, "every rank has its own (tp, cp, dp, pp) coordinate"


def no_context_group_case():
    grid = initialize_model_parallel(2, 1)
    return grid.cp, grid.cp_group, grid.cp_ranks == (dist.get_rank(),), grid.dp_group is grid.get_data_parallel_group()


def test_cp1_grid_has_no_context_group(dist_run):
    assert dist_run(2, no_context_group_case) == [(1, None, True, True)] * 2


SCRIPT = """
import torch, torch.distributed as dist
from zoo.parallel import initialize_model_parallel, destroy_model_parallel
g = initialize_model_parallel(tp={tp}, pp=1)
t = torch.ones(1); dist.all_reduce(t, group=g.tp_group)
print(f"GRID rank={{g.rank}} world={{g.world_size}} tp={{g.tp}} dp={{g.dp}} sum={{t.item():.0f}}", flush=True)
destroy_model_parallel()
"""


def _launch(cmd, tmp_path, tp):
    script = tmp_path / "grid.py"
    script.write_text(SCRIPT.format(tp=tp))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    out = subprocess.run([*cmd, str(script)], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    # Ranks share stdout, so two prints may land on one line: match records, not lines.
    lines = re.findall(r"GRID rank=\d+ world=\d+ tp=\d+ dp=\d+ sum=\d+", out.stdout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return sorted(lines)


def test_plain_process_is_a_world_of_one(tmp_path):
    lines = _launch([sys.executable], tmp_path, tp=1)
    assert lines == ["GRID rank=0 world=1 tp=1 dp=1 sum=1"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun(tmp_path):
    lines = _launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                     "--master_port", str(_free_port())], tmp_path, tp=2)
    assert lines == [f"GRID rank={r} world=2 tp=2 dp=1 sum=2" for r in range(2)]


def test_deepspeed_launcher(tmp_path):
    lines = _launch([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                     "--master_port", str(_free_port())], tmp_path, tp=1)
    assert lines == [f"GRID rank={r} world=2 tp=1 dp=2 sum=1" for r in range(2)]

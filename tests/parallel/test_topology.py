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

from zoo.parallel.topology import LayoutError, check_layout, expert_parallel_rank_lists, initialize_model_parallel

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


@pytest.mark.parametrize("world,tp,pp,ep,dp", [(4, 1, 1, 2, 4), (4, 1, 1, 4, 4), (8, 2, 2, 2, 2), (12, 3, 1, 4, 4)])
def test_check_layout_with_ep(world, tp, pp, ep, dp):
    assert check_layout(world, tp, pp, ep) == dp


def test_ep_that_does_not_divide_dp_fails_with_one_line():
    message = (r"^ep 4 does not divide the data-parallel size 2 \(world size 8 / tp\*pp 4\); expert-parallel groups "
               r"are carved out of the data-parallel ranks: pick ep in \[1, 2\] "
               r"or launch a multiple of tp\*pp\*ep = 16 "
               r"processes, or set parallel.ep_spans_tp: true or --ep-spans-tp \(EP groups over the TP ranks "
               r"too\)$")
    with pytest.raises(LayoutError, match=message) as e:
        check_layout(8, 2, 2, 4)
    assert "\n" not in str(e.value)
    with pytest.raises(LayoutError, match="ep must be a positive integer, got 0"):
        check_layout(4, 1, 1, 0)


@pytest.mark.parametrize("world,tp,pp,ep", [(8, 2, 1, 2), (8, 1, 1, 2), (8, 1, 2, 2), (16, 2, 2, 2), (16, 1, 2, 4)])
def test_expert_groups_are_deepspeeds(world, tp, pp, ep):
    """EP groups: consecutive chunks of each DP group; EDP groups: the strided rest, as deepspeed.utils.groups."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from deepspeed.utils.groups import _get_expert_parallel_ranks

    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (tp * pp))
    ep_lists, edp_lists = expert_parallel_rank_lists(topology.get_axis_comm_lists("data"), ep)
    ds_ep, ds_edp = _get_expert_parallel_ranks(world, tp, ep, pp)
    assert sorted(ep_lists) == sorted(ds_ep) and sorted(edp_lists) == sorted(ds_edp)
    if (world, tp, pp, ep) == (8, 2, 1, 2):  # the table in zoo/parallel/topology.py's docstring
        assert sorted(ep_lists) == [[0, 2], [1, 3], [4, 6], [5, 7]]
        assert sorted(edp_lists) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def expert_grid_case(tp, pp, ep):
    from deepspeed.utils import groups as ds_groups

    grid = initialize_model_parallel(tp, pp, ep)
    rank = dist.get_rank()
    assert rank in grid.ep_ranks and rank in grid.edp_ranks and rank in grid.dp_ranks
    assert set(grid.ep_ranks) | set(grid.edp_ranks) <= set(grid.dp_ranks)
    assert len(grid.ep_ranks) == ep and len(grid.edp_ranks) == grid.dp // ep
    assert grid.ep_ranks == tuple(grid.dp_ranks[grid.dp_rank // ep * ep:][:ep]), "consecutive chunk of the DP group"
    assert (grid.ep_rank, grid.edp_rank) == (grid.dp_rank % ep, grid.dp_rank // ep)
    for group, members in ((grid.ep_group, grid.ep_ranks), (grid.edp_group, grid.edp_ranks)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(members)
    # DeepSpeed's own caches hold exactly these groups, under the name its MoE parameters carry.
    name = grid.expert_group_name
    assert name == f"ep_size_{ep}"
    assert ds_groups._get_expert_parallel_group(name) is grid.ep_group is grid.get_expert_parallel_group()
    assert ds_groups._get_expert_data_parallel_group(name) is grid.edp_group is grid.get_expert_data_parallel_group()
    assert ds_groups._get_expert_parallel_group_ranks(name) == list(grid.ep_ranks)
    assert ds_groups._get_expert_data_parallel_group_ranks(name) == list(grid.edp_ranks)
    assert grid.get_expert_parallel_world_size() == ep and grid.get_expert_data_parallel_rank() == grid.edp_rank
    assert initialize_model_parallel(tp, pp, ep) is grid and initialize_model_parallel(tp, pp) is not grid
    return grid.ep_ranks, grid.edp_ranks


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2)])
def test_expert_groups_on_four_ranks(dist_run, tp, pp, ep):
    groups = dist_run(4, expert_grid_case, tp, pp, ep)
    assert len({g for g, _ in groups}) == 4 // ep and len({g for _, g in groups}) == 4 // (4 // (tp * pp) // ep)


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
    assert check_layout(world, tp, pp, cp=cp) == dp


def test_bad_context_layouts_fail_with_one_line():
    with pytest.raises(LayoutError, match=r"^world size 4 is not divisible by tp\*cp\*pp = 8 \(tp=2, cp=2, pp=2\); "
                                          r"launch a multiple of 8 processes$"):
        check_layout(4, 2, 2, cp=2)
    with pytest.raises(LayoutError, match=r"^cp must be a positive integer, got 0$"):
        check_layout(4, 1, 1, cp=0)


def context_grid_case(tp, pp, cp):
    grid = initialize_model_parallel(tp, pp, cp=cp)
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


@pytest.mark.parametrize("world,tp,cp,ep", [(4, 1, 2, 2), (16, 2, 2, 2), (16, 1, 2, 4), (16, 1, 4, 2)])
def test_expert_data_parallel_groups_take_in_the_context_ranks(world, tp, cp, ep):
    """With CP the EP groups stay chunks of the true DP groups; an EDP group holds the (dp / ep) x cp ranks with the
    same experts: EP x EDP covers each of DeepSpeed's dp x cp groups once."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    dp = world // (tp * cp)
    data_lists = PipeModelDataParallelTopology(num_pp=1, num_mp=tp, num_dp=dp * cp).get_axis_comm_lists("data")
    dp_lists = [ranks[c::cp] for ranks in data_lists for c in range(cp)]  # as ParallelGrid carves them
    ep_lists, edp_lists = expert_parallel_rank_lists(dp_lists, ep, cp)
    assert all(len(g) == ep for g in ep_lists) and all(len(g) == dp // ep * cp for g in edp_lists)
    for ranks in data_lists:
        eps = [g for g in ep_lists if set(g) <= set(ranks)]
        edps = [g for g in edp_lists if set(g) <= set(ranks)]
        assert sorted(r for g in edps for r in g) == sorted(ranks) == sorted(r for g in eps for r in g)
        assert all(len(set(a) & set(b)) == 1 for a in eps for b in edps)
        for d in range(dp):  # replica d's CP ranks (data indices d x cp + c) sit in one EDP group
            assert any(set(ranks[d * cp:(d + 1) * cp]) <= set(g) for g in edps)
    if (world, tp, cp, ep) == (4, 1, 2, 2):  # the example in zoo/parallel/topology.py's docstring
        assert sorted(ep_lists) == [[0, 2], [1, 3]] and sorted(edp_lists) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("world,tp,pp,cp,ep", [(2, 2, 1, 1, 2), (4, 2, 1, 1, 4), (8, 2, 1, 1, 2), (8, 2, 2, 1, 4),
                                              (8, 2, 1, 2, 2), (16, 2, 1, 2, 4), (16, 4, 1, 1, 8)])
def test_expert_groups_spanning_tp(world, tp, pp, cp, ep):
    """``ep_spans_tp``: an EP group is ep / tp data-parallel places of one stage and CP rank, each with its whole TP
    group, and an EDP group the ranks of one stage and TP rank at the same place of their EP groups: every rank in
    one of each, EP x EDP the stage's ranks."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    dp = world // (tp * pp * cp)
    topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp * cp)
    data_lists = topology.get_axis_comm_lists("data")
    dp_lists = [ranks[c::cp] for ranks in data_lists for c in range(cp)]  # as ParallelGrid carves them
    ep_lists, edp_lists = expert_parallel_rank_lists(dp_lists, ep, cp, tp)
    coord = {r: topology.get_coord(r) for r in range(world)}  # (pipe, data = dp x cp + cp rank, model)
    assert sorted(r for g in ep_lists for r in g) == list(range(world)) == sorted(r for g in edp_lists for r in g)
    for g in ep_lists:
        assert len(g) == ep and len({coord[r].pipe for r in g}) == 1 and len({coord[r].data % cp for r in g}) == 1
        for r in g:  # whole TP groups, TP rank fastest: EP rank = place x tp + TP rank
            assert {s for s in range(world)
                    if (coord[s].pipe, coord[s].data) == (coord[r].pipe, coord[r].data)} <= set(g)
            assert g.index(r) % tp == coord[r].model
    for g in edp_lists:
        assert len(g) == dp * tp * cp // ep and len({(coord[r].pipe, coord[r].model) for r in g}) == 1
        assert all(len(set(g) & set(e)) <= 1 for e in ep_lists)
    if (world, tp, pp, cp, ep) == (8, 2, 1, 1, 2):
        assert sorted(ep_lists) == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert sorted(edp_lists) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_ep_spanning_tp_layout_errors_name_the_fix():
    assert check_layout(8, 2, 1, 4, ep_spans_tp=True) == 4  # ep / tp = 2 divides dp 4
    with pytest.raises(LayoutError, match=r"^ep 3 is not a multiple of tp 2: .* pick ep in \[2, 4, 8\]$"):
        check_layout(8, 2, 1, 3, ep_spans_tp=True)
    with pytest.raises(LayoutError, match=r"^ep / tp = 4 does not divide the data-parallel size 2 .* pick ep in "
                                          r"\[2, 4\]$"):
        check_layout(8, 2, 2, 8, ep_spans_tp=True)


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


EXIT_SCRIPT = """
import atexit, os, sys
def gloo_threads():
    return sorted(n for n in (open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
                  if "gloo" in n)
atexit.register(lambda: print("AT EXIT", gloo_threads(), flush=True))  # runs after zoo's own (LIFO)
import torch, torch.distributed as dist
from zoo.parallel import initialize_model_parallel, destroy_model_parallel
g = initialize_model_parallel(tp=1, pp=1)
print("RUNNING", gloo_threads(), flush=True)
import torch.distributed.nn  # what DeepSpeed's Ulysses module imports lazily, once the world group exists
if sys.argv[1] == "destroy":
    destroy_model_parallel()  # while the caller still holds the grid
    print("DESTROYED", gloo_threads(), g.tp_group, flush=True)
"""


@pytest.mark.parametrize("how", ["destroy", "atexit"])
def test_no_gloo_thread_outlives_the_process_groups(tmp_path, how):
    """The clean-exit abort (``terminate called without an active exception`` after a plain process printed its
    result) came from gloo threads still running at interpreter exit, kept by a grid the caller held and by the
    default arguments of torch.distributed.nn.functional. Whether the script tears down itself or leaves it to
    exit, they end before the interpreter starts to finalize."""
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    out = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"RUNNING \[.*'pt_gloo_runloop'", out.stdout), out.stdout  # the probe sees gloo's threads
    if how == "destroy":
        assert "DESTROYED [] None" in out.stdout, out.stdout
    assert "AT EXIT []" in out.stdout, out.stdout


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torchrun itself: every torchrun test of the suite (tests/training/test_main_job.py at pp=2,
# test_checkpoint.py's tp=2 and ep=2 runs, test_cp_layouts.py's cp=2) builds its grid the same way.


def test_deepspeed_launcher(tmp_path):
    lines = _launch([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                     "--master_port", str(_free_port())], tmp_path, tp=1)
    assert lines == [f"GRID rank={r} world=2 tp=1 dp=2 sum=1" for r in range(2)]

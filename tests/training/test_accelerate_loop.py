"""launch/accelerate_loop.py, a zoo model in a user's own Accelerate loop (ZeRO-2 through accelerate's DeepSpeed
plugin), trains what launch/train.py trains at dp2 ZeRO-2: the same loss at every step, to 1e-5.

Both run on the 2-rank gloo pool, whose workers carry the environment torchrun gives (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT), which is also what ``accelerate launch --multi_gpu`` gives; gradient accumulation (2 micro-batches
per step here) goes through ``accelerator.accumulate``.
"""

import importlib.util
import os
from pathlib import Path

import torch

from tests.training.test_gpt_layouts import COMMON, layout_run

ROOT = Path(__file__).resolve().parents[2]


def accelerate_loop(overrides):
    """The loop of launch/accelerate_loop.py in this worker; leaves no Accelerate state or environment behind."""
    import torch.distributed as dist

    from zoo.compat.accelerate import reset_state

    spec = importlib.util.spec_from_file_location("accelerate_loop", ROOT / "launch/accelerate_loop.py")
    loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop)
    env = dict(os.environ)
    try:
        args = loop.parse_args(["--zero", "2", "--set", *overrides])
        cfg, model_cfg = loop.plan(args, dist.get_world_size())
        return loop.train_loop(cfg, model_cfg, log=lambda line: None)
    finally:
        reset_state()
        os.environ.clear()
        os.environ.update(env)


def test_accelerate_loop_equals_zoo_dp2_zero2(dist_run):
    expected = layout_run(dist_run, "gpt2", "dp2-zero2")[0][0]  # launch/train.py's loop, dp2 ZeRO-2
    for losses in dist_run(2, accelerate_loop, COMMON):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert expected[-1] < expected[0], expected


def test_parallel_layout_is_refused_in_one_line(capsys):
    spec = importlib.util.spec_from_file_location("accelerate_loop", ROOT / "launch/accelerate_loop.py")
    loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop)
    assert loop.main(["--set", "parallel.tp=2"]) == 2
    assert capsys.readouterr().err.startswith("error: this loop trains the plain model (tp, pp, cp, ep all 1), "
                                               "the config asks for tp=2")

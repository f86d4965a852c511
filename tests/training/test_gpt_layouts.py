"""The core promise: every (tp, pp, dp, ZeRO, SP, recompute) layout trains the same model as one process.

Each run trains 5 steps from the same seed on the same global batch; losses must agree with the single-process
run within 1e-5 relative at every step (fp32). The runs execute on long-lived gloo pools of 1, 2 and 4 ranks.
"""

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"gpt2": ROOT / "configs/gpt/tiny.yaml", "llama": ROOT / "configs/gpt/tiny-llama.yaml"}
STEPS = 5
COMMON = [f"training.steps={STEPS}", "training.micro_batch_size=2", "training.global_batch_size=8",
          "training.seq_length=32", "training.lr=3e-3", "training.warmup_steps=1", "data.source=synthetic",
          "training.save=false", "training.eval_interval=0", "training.log_interval=1", "parallel.zero_stage=0"]


def train_case(model, overrides, out):
    """Train in this worker with the layout given by overrides; returns the per-step losses."""
    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training.config import load, validate
    from zoo.training.train import train

    import torch.distributed as dist

    cfg = load(CONFIGS[model], COMMON + list(overrides) + [f"out={out}"])
    model_cfg = validate(cfg, dist.get_world_size())
    grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp)
    return train(cfg, model_cfg, grid, log=lambda s: None)


LAYOUTS = {  # name: (world size, overrides)
    "tp2": (2, ["parallel.tp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "dp2": (2, []),
    "dp2-zero1": (2, ["parallel.zero_stage=1"]),
    "dp2-zero2": (2, ["parallel.zero_stage=2"]),
    "dp2-zero3": (2, ["parallel.zero_stage=3"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2-recompute": (2, ["parallel.pp=2", "parallel.activation_checkpointing=true"]),
    "tp2-pp2": (4, ["parallel.tp=2", "parallel.pp=2"]),
    "tp2-pp2-sp-recompute-zero1": (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true",
                                       "parallel.activation_checkpointing=true", "parallel.zero_stage=1"]),
    "tp2-dp2-zero2-recompute": (4, ["parallel.tp=2", "parallel.zero_stage=2", "parallel.activation_checkpointing=true"]),
}

_reference_cache = {}


def runner(dist_run, layout):
    """ZeRO-3 engines keep their process groups after destroy (tests/conftest.py): their pool is retired after."""
    return dist_run.retire if "zero3" in layout else dist_run


def reference(dist_run, model, precision="fp32", tmp="/tmp/zoo-ref"):
    key = (model, precision)
    if key not in _reference_cache:
        _reference_cache[key] = dist_run(1, train_case, model, [f"training.precision={precision}"], f"{tmp}-{model}")[0]
    return _reference_cache[key]


_layout_cache = {}


def layout_losses(dist_run, model, layout, tmp):
    """Every rank's losses of ``layout`` (fp32), run once per session (tests/training/test_accelerate_loop.py holds
    its loop against dp2-zero2)."""
    if (model, layout) not in _layout_cache:
        world, overrides = LAYOUTS[layout]
        _layout_cache[model, layout] = runner(dist_run, layout)(world, train_case, model, overrides, str(tmp))
    return _layout_cache[model, layout]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_layout_matches_single_process(dist_run, tmp_path, model, layout):
    expected = reference(dist_run, model)
    for rank_losses in layout_losses(dist_run, model, layout, tmp_path):
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert expected[-1] < expected[0], f"the reference run must learn: {expected}"


# Every layout with the Llama blocks; GPT-2's blocks (LayerNorm, GELU, learned positions) in one process and in the
# layout that combines the most (the fp32 tests above cover every layout of both).
BF16_CASES = [("llama", layout) for layout in ["single", *LAYOUTS]] + \
    [("gpt2", "single"), ("gpt2", "tp2-pp2-sp-recompute-zero1")]


@pytest.mark.parametrize("model,layout", BF16_CASES)
def test_bf16_trains_in_every_layout(dist_run, tmp_path, model, layout):
    fp32 = reference(dist_run, model)
    world, overrides = LAYOUTS.get(layout, (1, []))
    losses = runner(dist_run, layout)(world, train_case, model, overrides + ["training.precision=bf16"],
                                      str(tmp_path))[0]
    assert all(torch.isfinite(torch.tensor(losses)))
    # bf16 keeps ~3 significant digits; the losses of a 5-step run stay within 2% of fp32.
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32), rtol=2e-2, atol=0)

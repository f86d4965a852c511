"""Context parallelism in the training run: every layout with cp > 1 trains the same model as one process.

As tests/training/test_gpt_layouts.py: 5 steps from the same seed on the same global batch (2 sequences of 256
synthetic tokens), fp32; the losses of every rank must agree with the single-process run within 1e-5 relative at
every step. One reference run per model serves every layout. Ulysses and ring at cp=2 and cp=4, and cp=2 with tp=2 +
sequence parallelism, with pp=2, with dp=2 under ZeRO-2, with ZeRO-3, and with activation checkpointing; bf16 at cp=2
stays within 2% of fp32. Then a checkpoint saved
at cp=2 (ZeRO-1) resumes at cp=1 (DeepSpeed's data-parallel size 2 -> 1: the universal checkpoint), one saved with
dropout resumes at cp=2 exactly (each CP rank's RNG), and the CLI (``--cp 2``, its main as torchrun runs it) trains
the same losses.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from tests.mains import run_main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"gpt2": ROOT / "configs/gpt/tiny.yaml", "llama": ROOT / "configs/gpt/tiny-llama.yaml"}
STEPS = 5
COMMON = [f"training.steps={STEPS}", "training.micro_batch_size=1", "training.global_batch_size=2",
          "training.seq_length=256", "model.max_position_embeddings=256", "training.lr=3e-3",
          "training.warmup_steps=1", "data.source=synthetic", "training.save=false", "training.eval_interval=0",
          "training.log_interval=1", "parallel.zero_stage=0"]


def train_case(model, overrides, out, resume_step=None, same_layout=False):
    """Train in this worker with the layout given by overrides (resume ``out``'s checkpoint ``resume_step``, through
    the universal checkpoint unless ``same_layout``); returns the per-step losses."""
    import torch.distributed as dist

    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training.checkpoint import find_checkpoint
    from zoo.training.config import load, validate
    from zoo.training.trainer import Trainer

    cfg = load(CONFIGS[model], COMMON + list(overrides) + [f"out={out}"])
    model_cfg = validate(cfg, dist.get_world_size())
    grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp, cp=cfg.parallel.cp)
    resume = None if resume_step is None else find_checkpoint(out, resume_step)
    universal = resume is not None and not same_layout
    with Trainer(cfg, model_cfg, grid, log=lambda s: None, resume=resume, universal=universal) as trainer:
        return trainer.fit().losses


LAYOUTS = {  # name: (world size, overrides)
    "cp2-ulysses": (2, ["parallel.cp=2"]),
    "cp2-ring": (2, ["parallel.cp=2", "parallel.cp_algorithm=ring"]),
    "cp4-ulysses": (4, ["parallel.cp=4"]),
    "cp4-ring": (4, ["parallel.cp=4", "parallel.cp_algorithm=ring"]),
    "cp2-tp2-sp-ring": (4, ["parallel.cp=2", "parallel.cp_algorithm=ring", "parallel.tp=2",
                            "parallel.sequence_parallel=true"]),
    "cp2-pp2": (4, ["parallel.cp=2", "parallel.pp=2"]),
    "cp2-dp2-zero2": (4, ["parallel.cp=2", "parallel.zero_stage=2"]),
    "cp2-recompute-ring": (2, ["parallel.cp=2", "parallel.cp_algorithm=ring",
                               "parallel.activation_checkpointing=true"]),
}

_reference_cache = {}


def reference(dist_run, model, tmp_path_factory=None):
    """The single-process losses (and, with ``tmp_path_factory`` on first use, the folder of its metrics.jsonl)."""
    if model not in _reference_cache:
        out = tmp_path_factory.mktemp(f"ref-{model}") if tmp_path_factory else Path(f"/tmp/zoo-cp-ref-{os.getpid()}")
        _reference_cache[model] = dist_run(1, train_case, model, [], str(out))[0], out
    return _reference_cache[model][0]


def grad_norms(out) -> list:
    return [r["grad_norm"] for r in map(json.loads, (Path(out) / "metrics.jsonl").read_text().splitlines())]


# Each algorithm at cp=2 and cp=4 (ring: GPT-2's blocks, Ulysses: Llama's, with RoPE at global positions) and each
# composite layout for one model (the blocks differ only in what CP does not touch: norms, activation).
CASES = [("gpt2", "cp2-ring"), ("gpt2", "cp4-ring"), ("gpt2", "cp2-pp2"), ("gpt2", "cp2-recompute-ring"),
         ("llama", "cp2-ulysses"), ("llama", "cp4-ulysses"), ("llama", "cp2-tp2-sp-ring"), ("llama", "cp2-dp2-zero2")]


@pytest.mark.parametrize("model,layout", CASES)
def test_cp_layout_matches_single_process(dist_run, tmp_path, tmp_path_factory, model, layout):
    expected = reference(dist_run, model, tmp_path_factory)
    world, overrides = LAYOUTS[layout]
    for rank_losses in dist_run(world, train_case, model, overrides, str(tmp_path)):
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert expected[-1] < expected[0], f"the reference run must learn: {expected}"
    # The gradient too: Adam and clipping would hide a gradient summed over CP instead of averaged; its norm shows it.
    torch.testing.assert_close(torch.tensor(grad_norms(tmp_path)), torch.tensor(grad_norms(_reference_cache[model][1])),
                               rtol=1e-4, atol=0)


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_cp2_checkpoint_resumes_at_cp1(dist_run, tmp_path, model):
    """Saved at cp=2 (ZeRO-1, DeepSpeed's data-parallel size 2), resumed at cp=1 (size 1): the next losses are the
    unbroken run's, which is the single-process run's."""
    out = str(tmp_path / "run")
    zero1 = ["parallel.zero_stage=1"]
    unbroken = dist_run(2, train_case, model, zero1 + ["parallel.cp=2", "training.save=true",
                                                       "training.save_interval=3"], out)[0]
    torch.testing.assert_close(torch.tensor(unbroken), torch.tensor(reference(dist_run, model)), rtol=1e-5, atol=0)
    resumed = dist_run(1, train_case, model, zero1, out, 3)[0]
    assert len(resumed) == STEPS - 3
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(unbroken[3:]), rtol=1e-5, atol=0)
    assert (Path(out) / "checkpoints" / "step_00000003_universal" / "zoo.json").is_file()


def test_cp2_resume_with_dropout_restores_every_cp_ranks_rng(dist_run, tmp_path):
    """Dropout draws per CP rank (other tokens): resumed in the same layout, each CP rank gets its own streams back,
    so the remaining losses are the unbroken run's exactly (a rank given another's streams would draw other masks)."""
    out = str(tmp_path / "run")
    dropout = ["parallel.cp=2", "model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    unbroken = dist_run(2, train_case, "llama", dropout + ["training.save=true", "training.save_interval=3"], out)[0]
    resumed = dist_run(2, train_case, "llama", dropout, out, 3, same_layout=True)[0]
    assert resumed == unbroken[3:]


def test_launch_train_cp2_matches_single_process(dist_run, tmp_path):
    """launch/train.py --cp 2 (its main in the 2-rank pool as torchrun runs it, tests/mains.py): training and
    validation losses of one process, tokens counted once, and the exported model (written by one rank of the CP
    group) loads."""
    evaluation = ["training.eval_interval=5", "training.eval_iters=1"]
    expected = dist_run(1, train_case, "llama", evaluation, str(tmp_path / "reference"))[0]
    out = tmp_path / "run"
    ranks = dist_run(2, run_main, "zoo.training.train:main", [
        "--config", CONFIGS["llama"], "--out", out, "--cp", "2", "--cp-algorithm", "ring", "--set", *COMMON,
        *evaluation, "training.save=true"])
    stdout = "".join(r[1] for r in ranks)
    assert [r[0] for r in ranks] == [0, 0] and "done: metrics in" in stdout, stdout[-3000:] + ranks[0][2][-3000:]
    assert "dp=1 cp=2 (ring)" in stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in train]), torch.tensor(expected), rtol=1e-5, atol=0)
    ref_records = [json.loads(line) for line in (tmp_path / "reference/metrics.jsonl").read_text().splitlines()]
    val, ref_val = ([(r["step"], r["val_loss"]) for r in rs if "val_loss" in r] for rs in (records, ref_records))
    assert [s for s, _ in val] == [s for s, _ in ref_val] == [0, 5]
    torch.testing.assert_close(torch.tensor([v for _, v in val]), torch.tensor([v for _, v in ref_val]), rtol=1e-5,
                               atol=0)
    # Throughput counts the global batch's tokens once: 2 sequences x 256 per step, whatever cp is.
    for r in train:
        assert r["tokens_per_s"] == pytest.approx(2 * 256 / r["step_time_s"], rel=1e-6)

    from zoo.convert.io import load_model, read_config
    from zoo.models.gpt import GPTConfig, ParallelOptions, layer_specs
    from zoo.models.specs import SpecSequential

    model = SpecSequential(layer_specs(GPTConfig.from_dict(read_config(out / "model")[1]), ParallelOptions()))
    load_model(out / "model", model)


def test_cp2_with_zero3_matches_single_process(dist_run, tmp_path, tmp_path_factory):
    """ZeRO-3 partitions the parameters over DeepSpeed's data-parallel group, dp x cp. ZeRO-3 engines keep their
    groups after destroy (tests/conftest.py), so the pool is retired after the run."""
    expected = reference(dist_run, "llama", tmp_path_factory)
    for rank_losses in dist_run.retire(2, train_case, "llama", ["parallel.cp=2", "parallel.zero_stage=3"],
                                       str(tmp_path)):
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=1e-5, atol=0)


def test_cp2_bf16_trains_like_fp32(dist_run, tmp_path, tmp_path_factory):
    fp32 = reference(dist_run, "llama", tmp_path_factory)
    # ring only: its bf16 blocks' partial outputs are merged rank by rank (log-sum-exp in fp32), the path with the
    # most bf16 roundings; Ulysses runs whole-sequence attention after its all-to-all, as the dense bf16 layouts do
    # (the fp32 tests hold both algorithms to one process)
    for algorithm in ("ring",):
        losses = dist_run(2, train_case, "llama", ["parallel.cp=2", f"parallel.cp_algorithm={algorithm}",
                                                  "training.precision=bf16"], str(tmp_path / algorithm))[0]
        assert all(torch.isfinite(torch.tensor(losses)))
        # bf16 keeps ~3 significant digits; the losses of a 5-step run stay within 2% of fp32 (as the dense layouts).
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32), rtol=2e-2, atol=0, msg=algorithm)

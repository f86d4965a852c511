"""Fewer kv heads than TP ranks (each kv head replicated over the ranks that split its query heads,
zoo.parallel.layers.GroupedQKVLinear) trains the one-process model (fp32, 1e-5 relative, 3 steps, clipping at 1.0,
the gradient norm too): the tiny Llama with one kv head at tp2+SP, tp2 x dp2 under ZeRO-2 with recompute, tp2 x pp2,
tp2 x dp2 under ZeRO-3 with the fused LM head + loss, cp2 x tp2 with Ulysses (each TP rank's query heads split over
CP too) and with ring attention; with its own two kv heads at tp4; in bf16 loosely. The runs of
tests/training/test_gpt_layouts.py and test_cp_layouts.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.training import test_cp_layouts as cp_layouts
from tests.training import test_gpt_layouts as gpt_layouts

ONE_KV = ["model.num_key_value_heads=1"]
LAYOUTS = {  # name: (world size, overrides, extra model overrides)
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"], ONE_KV),
    "tp2-dp2-zero2-recompute": (4, ["parallel.tp=2", "parallel.zero_stage=2", "parallel.activation_checkpointing=true"],
                                ONE_KV),
    "tp2-pp2": (4, ["parallel.tp=2", "parallel.pp=2"], ONE_KV),
    "tp2-dp2-zero3-fused": (4, ["parallel.tp=2", "parallel.zero_stage=3", "training.fused_cross_entropy=true"],
                            ONE_KV),
    "tp4": (4, ["parallel.tp=4"], []),  # tiny-llama's own 2 kv heads
}


def _norms(records):
    return [r["grad_norm"] for r in records if "grad_norm" in r]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replicated_kv_heads_train_like_one_process(dist_run, layout):
    world, overrides, model = LAYOUTS[layout]
    gpt_layouts.LAYOUTS.setdefault(f"kvrep-{layout}", (world, overrides))
    expected, ref_records = gpt_layouts.layout_run(dist_run, "llama", "single", model)
    losses, records = gpt_layouts.layout_run(dist_run, "llama", f"kvrep-{layout}", model)  # ZeRO-3: a retired pool
    for rank_losses in losses:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected[0]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(_norms(records)), torch.tensor(_norms(ref_records)), rtol=1e-5, atol=0)
    assert expected[0][-1] < expected[0][0], f"the reference run must learn: {expected[0]}"
    assert max(_norms(ref_records)) > 1.0, "clipping must act for the norm to matter"
    if layout == "tp4":  # the k/v weight gradients summed over each pair of ranks sharing a kv head, per micro-batch
        nbytes, calls = records[-1]["comm_bytes"], records[-1]["comm_calls"]
        m, layers, d, h = 4, 4, 16, 64  # micro-batches per step (dp 1), tiny-llama's blocks, head dim, hidden
        assert nbytes["tpsub2/all_reduce"] == m * layers * 2 * d * h * 4 and calls["tpsub2/all_reduce"] == m * layers



def test_replicated_kv_heads_train_in_bf16(dist_run, tmp_path):
    """DeepSpeed's bf16 optimizer (its own gradient norm) at tp2 x dp2 ZeRO-1 with one kv head: within bf16's 2% of
    the fp32 single process, as tests/training/test_gpt_layouts.py's bf16 runs."""
    expected = gpt_layouts.layout_run(dist_run, "llama", "single", ONE_KV)[0][0]
    losses = dist_run(4, gpt_layouts.train_case, "llama", ["parallel.tp=2", "parallel.zero_stage=1",
                                                           "training.precision=bf16"] + ONE_KV, str(tmp_path))
    for rank_losses in losses:
        assert all(torch.isfinite(torch.tensor(rank_losses)))
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=2e-2, atol=0)


_cp_reference: dict = {}


@pytest.mark.parametrize("algorithm", ["ulysses", "ring"])
def test_replicated_kv_heads_under_context_and_tensor_parallelism(dist_run, tmp_path_factory, algorithm):
    if "ref" not in _cp_reference:
        _cp_reference["ref"] = str(tmp_path_factory.mktemp("ref"))
        _cp_reference["losses"] = dist_run(1, cp_layouts.train_case, "llama", ONE_KV, _cp_reference["ref"])[0]
    ref, expected = _cp_reference["ref"], _cp_reference["losses"]
    out = str(tmp_path_factory.mktemp(f"cp2-tp2-{algorithm}"))
    layout = ["parallel.cp=2", "parallel.tp=2", f"parallel.cp_algorithm={algorithm}"]
    for rank_losses in dist_run(4, cp_layouts.train_case, "llama", layout + ONE_KV, out):
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(cp_layouts.grad_norms(out)), torch.tensor(cp_layouts.grad_norms(ref)),
                               rtol=1e-5, atol=0)
    assert expected[-1] < expected[0], f"the reference run must learn: {expected}"


def test_ulysses_needs_the_query_heads_of_a_tp_rank_to_split_over_cp():
    """tp4 leaves one query head per rank (its kv head replicated): Ulysses cannot split it over cp 2, said in one
    line before any process group (ring can)."""
    from zoo.training.config import ConfigError, load, validate

    base = gpt_layouts.COMMON + ONE_KV + ["parallel.tp=4", "parallel.cp=2"]
    with pytest.raises(ConfigError, match=r"^Ulysses splits the 1 query heads \(of one TP rank\) over cp=2 ranks"):
        validate(load(gpt_layouts.CONFIGS["llama"], base), 8)
    validate(load(gpt_layouts.CONFIGS["llama"], base + ["parallel.cp_algorithm=ring"]), 8)


def test_resharding_a_checkpoint_of_replicated_kv_heads_is_refused_in_one_line(tmp_path, monkeypatch):
    """DeepSpeed's universal checkpoint cannot reshard a kv weight replicated over TP: refused, before any process
    group, saved at tp2 with one kv head and resumed at tp1 (the way back is the exported folder); the same layout
    resumes as any other."""
    from types import SimpleNamespace

    from zoo.training import checkpoint as ckpt
    from zoo.training.config import ConfigError, load, validate
    from zoo.training.train import resume_plan

    overrides = gpt_layouts.COMMON + ONE_KV + ["parallel.zero_stage=1", f"out={tmp_path}"]
    cfg = load(gpt_layouts.CONFIGS["llama"], overrides)
    model_cfg = validate(cfg, 1)
    meta = {"model": model_cfg.to_dict(), "global_batch_size": cfg.global_batch_size,
            "seq_length": cfg.training.seq_length, "step": 3,
            "layout": {"tp": 2, "pp": 1, "dp": 1, "cp": 1, "zero_stage": 1}}
    found = ckpt.Found(tmp_path, "step_00000003", meta)
    monkeypatch.setattr(ckpt, "find_checkpoint", lambda *a, **k: found)
    args = SimpleNamespace(load=str(tmp_path), load_step=None)
    with pytest.raises(ConfigError, match=r"cannot reshard the replicated kv heads of tp > num_key_value_heads 1; "
                                          r"resume in the saved layout"):
        resume_plan(cfg, model_cfg, args)
    same = load(gpt_layouts.CONFIGS["llama"], overrides + ["parallel.tp=2"])
    assert resume_plan(same, validate(same, 2), args) == (found, False)


def train_and_export(overrides, folder):
    """Train (tests/training/test_checkpoint.py's runs, no checkpoints) and export the model to ``folder``."""
    import tempfile

    import torch.distributed as dist

    from tests.training.test_checkpoint import COMMON, CONFIG
    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training.config import load, validate
    from zoo.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = load(CONFIG, COMMON + list(overrides) + ["training.save=false", f"out={out}"])
        grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp)
        with Trainer(cfg, validate(cfg, dist.get_world_size()), grid, log=lambda s: None) as trainer:
            trainer.fit()
            trainer.export(folder)


def test_checkpoints_and_exports_of_replicated_kv_heads(dist_run, tmp_path):
    """zoo's own checkpoint at tp2 with one kv head (ZeRO-1, every rank's rows) resumes in the same layout to the
    unbroken run's next loss; the model folder a tp2 x dp2 ZeRO-3 run exports (the replicated k/v rows once, gathered
    over ZeRO-3) holds the model the single process trains, tensor by tensor."""
    from tests.training.test_checkpoint import run_case
    from zoo.convert import io

    llama = ["model.preset=tiny-llama", *ONE_KV, "training.steps=4"]
    out = str(tmp_path / "tp2")
    base = llama + ["parallel.tp=2", "parallel.zero_stage=1"]
    unbroken = dist_run(2, run_case, base + ["training.save_interval=3"], out)[0]
    resumed = dist_run(2, run_case, base + ["training.save=false"], out, 3)[0]
    assert len(resumed) == 1
    torch.testing.assert_close(resumed[0], unbroken[3], rtol=1e-5, atol=0)

    single, zero3 = str(tmp_path / "single"), str(tmp_path / "zero3")
    dist_run(1, train_and_export, llama, single)
    dist_run.retire(4, train_and_export, llama + ["parallel.tp=2", "parallel.zero_stage=3"], zero3)
    ours, theirs = (dict(io.iter_tensors(f)) for f in (zero3, single))
    assert sorted(ours) == sorted(theirs) and any(k.endswith("attention.qkv.weight") for k in ours)
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-5, msg=key)

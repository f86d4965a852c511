"""LoRA / DoRA training (``finetune.lora``) in every layout equals the single process.

Each run trains 3 steps from the same seed on the same global batch (the dense layouts' batch,
tests/training/test_gpt_layouts.py), the base frozen: tiny Llama (GQA, untied head, adapters on the head too) at
tp2 + SP, cp2, ZeRO-2 and ZeRO-3; its DoRA form at tp2 + SP (the row-parallel norm summed over TP, the magnitude's
gradient over the sequence shards), also with one kv head (GroupedQKVLinear: B's k/v rows replicated over the kv
group); GPT-2 (tied embeddings, frozen) at pp2 with recomputation; the tiny Mixtral-like MoE with adapters on its
experts at ep2, at tp2 + SP (tokens split over TP) and with EP spanning TP (each TP rank its own experts). Losses
and gradient norms agree to 1e-5 relative at every step, and so do the adapter gradients of the second step (after
the first step's B is no longer zero, so A's gradient is too), gathered whole over TP / EP and ZeRO: all together
to 1e-5, each tensor to 1e-4. The base weights get no gradient and no optimizer state.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.training.test_gpt_layouts import COMMON, CONFIGS
from zoo.convert.io import stored_key
from zoo.models.lora import is_adapter

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {**CONFIGS, "moe": ROOT / "configs/gpt/tiny-moe.yaml"}
LORA = ["finetune.lora.r=4", "finetune.lora.alpha=8", "training.lr=1e-2"]
MODELS = {  # name: (config, overrides)
    "llama": ("llama", LORA + ["finetune.lora.targets=[qkv, dense, fc1, fc2, lm_head]"]),
    "llama-dora": ("llama", LORA + ["finetune.lora.dora=true"]),
    "gpt2": ("gpt2", LORA),
    "moe": ("moe", LORA + ["finetune.lora.targets=[qkv, dense, experts]"]),
    # one kv head: at tp2 GroupedQKVLinear, B's k/v rows replicated over the kv group (their gradient summed there)
    "llama-kv1-dora": ("llama", LORA + ["finetune.lora.dora=true", "model.num_key_value_heads=1"]),
    # lora dropout, its mask made a function of the input (x -> 2 x [x > 0]) so that every layout draws the same:
    # DoRA's three sums (W x, W x', s B A x') in one row-parallel reduction
    "llama-dora-dropout": ("llama", LORA + ["finetune.lora.dora=true", "finetune.lora.dropout=0.5"]),
}
LAYOUTS = {
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "cp2": (2, ["parallel.cp=2"]),
    "dp2-zero2": (2, ["parallel.zero_stage=2"]),
    "dp2-zero3": (2, ["parallel.zero_stage=3"]),
    "pp2-recompute": (2, ["parallel.pp=2", "parallel.activation_checkpointing=true"]),
    "ep2": (2, ["parallel.ep=2"]),
    "ep2-tp2-spans": (2, ["parallel.ep=2", "parallel.tp=2", "parallel.ep_spans_tp=true"]),  # experts differ per TP rank
}
CASES = [("llama", "tp2-sp"), ("llama", "cp2"), ("llama", "dp2-zero2"), ("llama", "dp2-zero3"),
         ("llama-dora", "tp2-sp"), ("llama-kv1-dora", "tp2-sp"), ("gpt2", "pp2-recompute"), ("moe", "ep2"),
         ("moe", "tp2-sp"), ("moe", "ep2-tp2-spans"), ("llama-dora-dropout", "tp2-sp")]


def input_dropout(x, p=0.5, training=True, inplace=False):
    """A dropout whose mask is a function of its input (for the lora-dropout runs): the same in every layout."""
    return x if p == 0 or not training else x * 2 * (x > 0)


def _full_grads(engine, grid) -> dict:
    """Every trainable tensor's gradient, whole: ZeRO's partitions joined (DeepSpeed), TP shards and EP experts
    gathered."""
    from deepspeed.utils import safe_get_full_grad

    from zoo.parallel.shards import full_tensor

    out = {}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        g = safe_get_full_grad(p).detach().float().clone()
        if hasattr(p, "stored_rows"):  # GroupedQKVLinear's query or k/v rows of the stored tensor, from every rank
            parts = full_tensor(g, 0, 1, grid.tp_group).chunk(grid.tp)
            whole = out.setdefault(stored_key(name, p), g.new_zeros((p.stored_size, *g.shape[1:])))
            for part, rows in zip(parts, p.stored_rows):
                offset = 0
                for start, stop in rows:
                    whole[start:stop] = part[offset:offset + stop - start]
                    offset += stop - start
            continue
        if getattr(p, "expert_parallel", False):
            g = full_tensor(g, 0, 1, grid.ep_group)
        elif getattr(p, "tensor_model_parallel", False):
            g = full_tensor(g, p.partition_dim, getattr(p, "partition_stride", 1), grid.tp_group)
        out[name] = g
    return out


def train_case(model, overrides, out):
    """Train in this worker: (per-step losses, rank 0's metrics, the second step's gradients, what trained)."""
    import torch.distributed as dist

    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training import trainer as run
    from zoo.training.config import load, validate

    config, extra = MODELS[model]
    cfg = load(CONFIGS[config], COMMON + extra + list(overrides) + [f"out={out}"])
    model_cfg = validate(cfg, dist.get_world_size())
    grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.cp,
                                     ep_spans_tp=cfg.parallel.ep_spans_tp)
    grads, frozen, build_engine = {}, {"grads": []}, run.build_engine

    def capturing_build_engine(*args, **kwargs):
        engine, loss_fn = build_engine(*args, **kwargs)
        take_step, calls = engine._take_model_step, []

        def second_step_grads(*a, **k):  # reduced over DP, before clipping and the optimizer
            calls.append(1)
            if len(calls) == 2 and cfg.training.precision == "fp32":
                grads.update(_full_grads(engine, grid))
                frozen["grads"] = [n for n, p in engine.module.named_parameters()
                                   if not p.requires_grad and p.grad is not None]
            return take_step(*a, **k)

        engine._take_model_step = second_step_grads
        frozen["trainable"] = sorted({stored_key(n, p) for n, p in engine.module.named_parameters()
                                      if p.requires_grad})  # as a model folder names them
        return engine, loss_fn

    run.build_engine = capturing_build_engine
    dropout = torch.nn.functional.dropout
    if model.endswith("-dropout"):
        torch.nn.functional.dropout = input_dropout
    try:
        with run.Trainer(cfg, model_cfg, grid, log=lambda s: None) as trainer:
            losses = trainer.fit().losses
    finally:
        run.build_engine = build_engine
        torch.nn.functional.dropout = dropout
    metrics = None
    if grid.rank == 0:
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        metrics = {"grad_norm": [r["grad_norm"] for r in records if "grad_norm" in r],
                   "memory_bytes": records[0].get("memory_bytes")}
    return losses, metrics, grads, frozen


_runs = {}


def run(dist_run, model, layout, extra=()):
    key = (model, layout, tuple(extra))
    if key not in _runs:
        world, overrides = LAYOUTS.get(layout, (1, []))
        pool = dist_run.retire if "zero3" in layout else dist_run
        import tempfile

        with tempfile.TemporaryDirectory() as out:
            results = pool(world, train_case, model, overrides + list(extra), out)
        grads, trainable = {}, set()
        for _, _, g, f in results:
            grads.update(g)
            trainable.update(f["trainable"])
            assert not f["grads"], f"frozen weights got gradients: {f['grads'][:3]}"
        _runs[key] = [r[0] for r in results], results[0][1], grads, trainable
    return _runs[key]


@pytest.mark.parametrize("model,layout", CASES)
def test_lora_layout_trains_as_single_process(dist_run, model, layout):
    (expected,), ref_metrics, ref_grads, ref_trainable = run(dist_run, model, "single")
    rank_losses, metrics, grads, trainable = run(dist_run, model, layout)
    for losses in rank_losses:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(metrics["grad_norm"]), torch.tensor(ref_metrics["grad_norm"]),
                               rtol=1e-5, atol=0)
    assert expected[-1] < expected[0], f"the reference run must learn: {expected}"
    # only adapters train, the same ones in every layout
    assert ref_trainable and all(is_adapter(n) for n in ref_trainable), sorted(ref_trainable)[:5]
    assert trainable == ref_trainable
    assert sorted(grads) == sorted(ref_grads)
    # all adapter gradients together to 1e-5; each tensor to 1e-4 (the second step's A gradients are small products
    # of a B one step from zero, where fp32 sums taken in another order differ by ~1e-5 of the tensor)
    total = sum(float((grads[n] - g).square().sum()) for n, g in ref_grads.items()) ** 0.5
    assert total < 1e-5 * sum(float(g.square().sum()) for g in ref_grads.values()) ** 0.5
    for name, g in ref_grads.items():
        err = float((grads[name] - g).norm() / g.norm().clamp(min=1e-30))
        assert err < 1e-4, (name, err)
    assert any(n.endswith("lora_A") and g.norm() > 0 for n, g in ref_grads.items())  # the second step's A moves
    if model == "moe":
        assert any("experts.gate_up_proj_lora_B" in n for n in ref_grads)


@pytest.mark.parametrize("model,layout", [("llama", "single"), ("gpt2", "pp2-recompute")])
def test_lora_bf16_trains_like_fp32(dist_run, model, layout):
    """DeepSpeed's bf16 optimizers (one process: FP16_UnfusedOptimizer; pp2: BF16_Optimizer) with a frozen base."""
    fp32 = run(dist_run, model, "single")[0][0]
    for losses in run(dist_run, model, layout, ["training.precision=bf16"])[0]:
        assert all(torch.isfinite(torch.tensor(losses)))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32), rtol=2e-2, atol=0)


@pytest.mark.parametrize("layout", ["single", "dp2-zero2"])
def test_lora_state_memory_is_the_adapters_and_priced(dist_run, layout):
    """The first step's measured gradient + optimizer bytes (zoo.training.memory) hold the adapters alone: the
    planner's price of them (the frozen base: parameters only), and a small part of full fine-tuning's (the dense
    layout run of tests/training/test_gpt_layouts.py)."""
    from tests.training import test_gpt_layouts as dense_runs
    from zoo.plan import Job, Layout, estimate
    from zoo.plan.hardware import CPU
    from zoo.training.config import lora_config, validate

    lora = run(dist_run, "llama", layout)[1]["memory_bytes"]
    full = dense_runs.layout_run(dist_run, "llama", layout)[1][0]["memory_bytes"]
    world, overrides = LAYOUTS.get(layout, (1, []))
    from zoo.training.config import load

    cfg = load(CONFIGS["llama"], COMMON + MODELS["llama"][1] + overrides)
    model = validate(cfg, world)
    est = estimate(Job(model, world, cfg.training.seq_length, cfg.global_batch_size, dtype="fp32",
                       lora=lora_config(cfg)),
                   Layout(dp=cfg.dp, zero=cfg.parallel.zero_stage, micro_batch=cfg.training.micro_batch_size), CPU)
    for rank in range(world):
        state = lora["grads"][rank] - lora["grad_buckets"][rank] + lora["optimizer"][rank]
        predicted = est.memory["grads"] + est.memory["optimizer"]
        assert abs(predicted / state - 1) < 0.10, (rank, predicted, state)
        full_state = full["grads"][rank] - full["grad_buckets"][rank] + full["optimizer"][rank]
        assert state < 0.15 * full_state, (state, full_state)  # r = 4 of a 64-wide model: ~8% of its weights
        assert lora["params"][rank] > 0.9 * full["params"][rank]  # the base is all there, frozen


@pytest.mark.parametrize("layout", ["single", "tp2-sp"])
def test_lora_head_with_the_fused_loss_trains_as_unfused(dist_run, layout):
    """training.fused_cross_entropy: the loss reads the head's weight itself, here W + s B A (gradients to A, summed
    over TP, and B): the unfused runs' losses and gradients."""
    expected = run(dist_run, "llama", "single")
    losses, _, grads, _ = run(dist_run, "llama", layout, ["training.fused_cross_entropy=true"])
    for rank_losses in losses:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected[0][0]), rtol=1e-5, atol=0)
    head = [n for n in expected[2] if n.endswith("linear.lora_A")]
    assert head and all(float((grads[n] - expected[2][n]).norm() / expected[2][n].norm()) < 1e-4 for n in head)


def test_lora_dropout_runs_drop(dist_run):
    """The dropout case above has teeth: its losses are not those of the same run without dropout."""
    dropped = run(dist_run, "llama-dora-dropout", "single")[0][0]
    plain = run(dist_run, "llama-dora", "single")[0][0]
    assert abs(dropped[-1] - plain[-1]) > 1e-3 * abs(plain[-1]), (dropped, plain)

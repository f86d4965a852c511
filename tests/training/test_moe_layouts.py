"""Expert parallelism in the training run: every EP layout trains the same mixture-of-experts model as one process.

Each run trains 5 steps (fp32, dropless) from the same seed on the same global batch, with both router losses on
(load balancing and z-loss), for the tiny Mixtral-like and the tiny shared-expert (Qwen2-MoE-like) presets. Every
step's loss, aux loss, z-loss and gradient norm must agree with the single process within 1e-5 relative, and after
the first step's backward every expert tensor's gradient, gathered over the EP group, and every router's, must
equal the one-process gradient (an expert gradient ep times too large fails it; Adam's update, nearly blind to a
gradient's scale, would let the losses pass). The one-process gradient itself is checked against plain autograd
over the step's micro-batches, which shows the router losses get the engine's own 1/gradient_accumulation_steps.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.training.test_gpt_layouts import COMMON as DENSE_COMMON

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/gpt/tiny-moe.yaml"
COMMON = DENSE_COMMON + ["model.router_aux_loss_coef=0.1", "model.router_z_loss_coef=0.01"]  # the dense runs' batch
MODELS = {"moe": ["model.preset=tiny-moe"], "moe-shared": ["model.preset=tiny-moe-shared"],
          # DeepSeek-V3's balancing bias, stepped after every optimizer step from the global batch's load.
          "moe-bias": ["model.preset=tiny-moe", "model.moe_expert_bias=true", "model.expert_bias_update_rate=0.01"],
          # DeepSeek-V2/V3's per-sequence balancing loss: under CP each sequence's statistics span the CP ranks.
          "moe-seq": ["model.preset=tiny-moe", "model.router_aux_loss_type=seq"]}
METRICS = ("aux_loss", "z_loss", "grad_norm")

LAYOUTS = {  # name: (world size, overrides)
    "ep2": (2, ["parallel.ep=2"]),
    "ep4": (4, ["parallel.ep=4"]),
    "ep2-tp2": (4, ["parallel.ep=2", "parallel.tp=2"]),
    "ep2-pp2": (4, ["parallel.ep=2", "parallel.pp=2"]),
    "ep2-pp2-zero1": (4, ["parallel.ep=2", "parallel.pp=2", "parallel.zero_stage=1"]),
    "ep2-dp4-zero2": (4, ["parallel.ep=2", "parallel.zero_stage=2"]),  # experts' ZeRO partitions over EDP of 2
    "ep2-tp2-sp-recompute": (4, ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true",
                                 "parallel.activation_checkpointing=true"]),
    # ep 1: the experts are weights like any other, which ZeRO-3 partitions (DeepSpeed refuses it at ep > 1).
    "dp2-zero3": (2, ["parallel.zero_stage=3"]),
    # Context parallelism: router statistics summed over CP, EDP groups over (dp/ep) x cp ranks.
    "ep2-cp2": (4, ["parallel.ep=2", "parallel.cp=2"]),
    "ep2-cp2-ring-zero2": (4, ["parallel.ep=2", "parallel.cp=2", "parallel.cp_algorithm=ring",
                               "parallel.zero_stage=2"]),  # experts' ZeRO partitions over the 2 CP ranks
    "cp2-ring-tp2-sp-zero1": (4, ["parallel.cp=2", "parallel.cp_algorithm=ring", "parallel.tp=2",
                                  "parallel.sequence_parallel=true", "parallel.zero_stage=1"]),
    "cp2-pp2-zero1": (4, ["parallel.cp=2", "parallel.pp=2", "parallel.zero_stage=1"]),
    # with the fused LM head + loss (under ZeRO-3 it gathers the head's weight itself)
    "ep2-cp2-fused-zero2": (4, ["parallel.ep=2", "parallel.cp=2", "training.fused_cross_entropy=true",
                                "parallel.zero_stage=2"]),
    "cp2-dp2-zero3-fused": (4, ["parallel.cp=2", "parallel.zero_stage=3", "training.fused_cross_entropy=true"]),
    # EP spanning TP ("parallel folding"): the TP ranks hold different experts (ZeRO-0: zoo's own norm; ZeRO-1/2:
    # DeepSpeed's, which counts them on every TP rank as model-parallel parameters)
    "ep2-tp2-spans": (2, ["parallel.ep=2", "parallel.tp=2", "parallel.ep_spans_tp=true"]),
    "ep4-tp2-spans-sp-zero1": (4, ["parallel.ep=4", "parallel.tp=2", "parallel.ep_spans_tp=true",
                                   "parallel.sequence_parallel=true", "parallel.zero_stage=1"]),
    "ep2-tp2-dp2-spans-zero2": (4, ["parallel.ep=2", "parallel.tp=2", "parallel.ep_spans_tp=true",
                                    "parallel.zero_stage=2"]),  # experts' ZeRO partitions over the EDP = dp ranks
    "ep2-tp2-pp2-spans-sp": (4, ["parallel.ep=2", "parallel.tp=2", "parallel.pp=2", "parallel.ep_spans_tp=true",
                                 "parallel.sequence_parallel=true"]),
    "ep2-tp2-cp2-spans-zero1": (4, ["parallel.ep=2", "parallel.tp=2", "parallel.cp=2", "parallel.ep_spans_tp=true",
                                    "parallel.zero_stage=1"]),
}
SPANS_LAYOUTS = ("ep2-tp2-spans", "ep4-tp2-spans-sp-zero1", "ep2-tp2-dp2-spans-zero2", "ep2-tp2-pp2-spans-sp",
                 "ep2-tp2-cp2-spans-zero1")
CONTEXT_LAYOUTS = ("ep2-cp2", "ep2-cp2-ring-zero2", "cp2-ring-tp2-sp-zero1", "cp2-pp2-zero1", "ep2-cp2-fused-zero2",
                   "cp2-dp2-zero3-fused")


def _full_grads(engine, grid) -> dict:
    """Gradient of every expert tensor (gathered over EP into the full [E, ...]) and router weight, by name."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for name, p in engine.module.named_parameters():
        if not (getattr(p, "expert_parallel", False) or name.endswith("router.weight")):
            continue
        g = safe_get_full_grad(p).detach().float().clone()
        if getattr(p, "expert_parallel", False) and grid.ep > 1:
            parts = [torch.empty_like(g) for _ in range(grid.ep)]
            dist.all_gather(parts, g, group=grid.ep_group)
            g = torch.cat(parts)
        out[name] = g
    return out


def train_case(model, overrides, out):
    """Train in this worker; returns (per-step losses, per-step metrics on rank 0, first step's gradients, final
    expert biases)."""
    import torch.distributed as dist

    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training import trainer as run
    from zoo.training.config import load, validate

    cfg = load(CONFIG, COMMON + MODELS[model] + list(overrides) + [f"out={out}"])
    model_cfg = validate(cfg, dist.get_world_size())
    grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.cp,
                                     ep_spans_tp=cfg.parallel.ep_spans_tp)
    grads, engines = {}, []
    build_engine = run.build_engine

    def capturing_build_engine(*args, **kwargs):
        engine, loss_fn = build_engine(*args, **kwargs)
        engines.append(engine)
        take_step = engine._take_model_step

        def first_step_grads(*a, **k):  # reduced over DP/EDP, before clipping and the optimizer
            if not grads:
                grads.update(_full_grads(engine, grid))
            return take_step(*a, **k)

        engine._take_model_step = first_step_grads
        return engine, loss_fn

    run.build_engine = capturing_build_engine
    try:
        with run.Trainer(cfg, model_cfg, grid, log=lambda s: None) as trainer:
            losses = trainer.fit().losses
    finally:
        run.build_engine = build_engine
    metrics = None
    if grid.rank == 0:
        records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        metrics = {k: [r[k] for r in records] for k in METRICS}
        metrics["memory_bytes"] = records[0]["memory_bytes"]  # the planner's memory model is held to it (tests/plan)
    biases = {name: b.clone() for name, b in engines[0].module.named_buffers() if name.endswith("expert_bias")}
    from zoo.models.moe import GPTMoE

    # Assignments in the last layer call's load (summed over the EP group's replicas): a count, not a ratio.
    loads = [float(m.last_stats["tokens_per_expert"].sum()) for m in engines[0].module.modules()
             if isinstance(m, GPTMoE)]
    return losses, metrics, grads, biases, loads


_runs = {}


def run(dist_run, model, layout, tmp="/tmp/zoo-moe"):
    """One run per (model, layout), shared by the tests below; ranks' gradients merged (stages hold parts)."""
    key = (model, layout)
    if key not in _runs:
        world, overrides = LAYOUTS.get(layout, (1, []))
        # ZeRO-3 engines keep their process groups after destroy (tests/conftest.py): their pool is retired after.
        results = (dist_run.retire if "zero3" in layout else dist_run)(world, train_case, model, overrides,
                                                                        f"{tmp}-{model}-{layout}")
        grads, biases = {}, {}
        for _, _, g, b, _ in results:
            grads.update(g)
            biases.update(b)
        _runs[key] = ([r[0] for r in results], results[0][1], grads, biases, [r[4] for r in results])
    return _runs[key]


def _relative_error(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


CASES = [(model, layout) for model in ("moe", "moe-shared") for layout in LAYOUTS
         if layout not in CONTEXT_LAYOUTS + SPANS_LAYOUTS]
CASES += [("moe", layout) for layout in SPANS_LAYOUTS] + [("moe-shared", "ep4-tp2-spans-sp-zero1"),
                                                          ("moe-bias", "ep2-tp2-dp2-spans-zero2")]
CASES += [("moe-bias", "ep2-dp4-zero2"), ("moe-bias", "ep2-tp2-sp-recompute"), ("moe", "ep2-cp2"),
          ("moe-shared", "ep2-cp2-ring-zero2"), ("moe-shared", "cp2-ring-tp2-sp-zero1"), ("moe-bias", "ep2-cp2"),
          ("moe-seq", "ep2-cp2"), ("moe-shared", "cp2-pp2-zero1"), ("moe-shared", "ep2-cp2-fused-zero2"),
          ("moe-shared", "cp2-dp2-zero3-fused")]


@pytest.mark.parametrize("model,layout", CASES)
def test_ep_layout_matches_single_process(dist_run, model, layout):
    (expected,), ref_metrics, *_ = run(dist_run, model, "single")
    rank_losses, metrics, *_ = run(dist_run, model, layout)
    for losses in rank_losses:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    for key in METRICS:
        torch.testing.assert_close(torch.tensor(metrics[key]), torch.tensor(ref_metrics[key]), rtol=1e-5, atol=0,
                                   msg=lambda m: f"{key}: {m}")
    assert expected[-1] < expected[0], f"the reference run must learn: {expected}"


@pytest.mark.parametrize("model,layout", CASES)
def test_expert_gradients_match_single_process(dist_run, model, layout):
    expected = run(dist_run, model, "single")[2]
    grads = run(dist_run, model, layout)[2]
    assert sorted(grads) == sorted(expected) and any(".experts." in name for name in expected)
    errors = {name: _relative_error(grads[name], expected[name]) for name in expected}
    assert max(errors.values()) < 1e-5, {name: e for name, e in errors.items() if e >= 1e-5}


@pytest.mark.parametrize("layout", ["ep2-dp4-zero2", "ep2-tp2-sp-recompute", "ep2-cp2", "ep2-tp2-dp2-spans-zero2"])
def test_expert_bias_steps_like_single_process(dist_run, layout):
    """Every rank holding a layer steps its bias with the load of the whole global batch (all DP ranks, all
    micro-batches), so the biases, which change the routing, stay those of the one-process run."""
    expected = run(dist_run, "moe-bias", "single")[3]
    biases = run(dist_run, "moe-bias", layout)[3]
    assert sorted(biases) == sorted(expected) and len(expected) == 4
    for name, bias in expected.items():
        assert bias.abs().sum() > 0, f"{name} never moved"
        torch.testing.assert_close(biases[name], bias, rtol=0, atol=1e-7)


@pytest.mark.parametrize("layout,replicas", [("ep2-tp2-sp-recompute", 2), ("ep2-tp2-spans", 1),
                                             ("ep4-tp2-spans-sp-zero1", 2), ("ep2-tp2-cp2-spans-zero1", 1)])
def test_layer_load_counts_each_assignment_once(dist_run, layout, replicas):
    """A layer's load (``last_stats["tokens_per_expert"]``) holds each of the k assignments of every token of the
    call once, over the data-parallel replicas of the EP group: micro_batch x seq x k x replicas. An EP group that
    spans TP holds tp ranks per replica (each routes its share of the tokens); counting them each would give tp
    times that."""
    loads = run(dist_run, "moe", layout)[4]
    micro_batch, seq, k = 2, 32, 2  # COMMON's batch, tiny-moe's experts per token
    for rank_loads in loads:
        assert rank_loads, "no MoE layer on this rank"
        assert rank_loads == [micro_batch * seq * k * replicas] * len(rank_loads)


def plain_autograd_grads(model, router_scale_factor=1.0):
    """The first step's gradients by plain autograd, no DeepSpeed: the mean over the step's micro-batches of
    (cross entropy + the router losses), the router losses injected with ``router_scale_factor`` / gas."""
    from zoo.data.batches import micro_batch
    from zoo.models.gpt import ParallelOptions
    from zoo.models.moe import GPTMoE
    from zoo.models.specs import SpecSequential
    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training.config import load, validate
    from zoo.training.families import get_family

    cfg = load(CONFIG, COMMON + MODELS[model])
    model_cfg = validate(cfg, 1)
    grid = initialize_model_parallel(1, 1)
    family, tr, gas = get_family("gpt"), cfg.training, cfg.gradient_accumulation_steps
    module = SpecSequential(family.layer_specs(model_cfg, ParallelOptions()), base_seed=tr.seed)
    loss_fn = family.loss(model_cfg)
    for m in module.modules():
        if isinstance(m, GPTMoE):
            m.aux_loss_scale = router_scale_factor / gas
    data = family.build_data(cfg, model_cfg, grid)
    for micro in range(gas):
        ids, labels = micro_batch(data.train, 0, micro, micro_batch_size=tr.micro_batch_size, accumulation=gas,
                                  dp_rank=0, dp=1)
        (loss_fn(module(ids), labels) / gas).backward()
    return {name: p.grad.detach().clone() for name, p in module.named_parameters()
            if getattr(p, "expert_parallel", False) or name.endswith("router.weight")}


@pytest.mark.parametrize("model", ["moe", "moe-shared"])
def test_single_process_gradient_is_plain_autograd(dist_run, model):
    engine_grads = run(dist_run, model, "single")[2]
    plain = dist_run(1, plain_autograd_grads, model)[0]
    errors = {name: _relative_error(engine_grads[name], plain[name]) for name in plain}
    assert max(errors.values()) < 1e-5, errors
    # The router losses matter: a scale other than 1/gas (here none) moves the routers' gradients well past that.
    wrong = dist_run(1, plain_autograd_grads, model, float(4))[0]
    router = [name for name in plain if name.endswith("router.weight")]
    assert min(_relative_error(wrong[name], plain[name]) for name in router) > 1e-3


@pytest.mark.parametrize("layout", ["ep2", "ep2-dp4-zero2", "ep2-cp2-ring-zero2"])
def test_bf16_trains_with_expert_parallelism(dist_run, layout):
    """bf16 goes through DeepSpeed's BF16 optimizer (ZeRO-0) or ZeRO's bf16 path with the experts' own groups."""
    (fp32,), *_ = run(dist_run, "moe", "single")
    world, overrides = LAYOUTS[layout]
    losses = dist_run(world, train_case, "moe", overrides + ["training.precision=bf16"], f"/tmp/zoo-moe-bf16-{layout}")
    for rank_losses, *_ in losses:
        assert all(torch.isfinite(torch.tensor(rank_losses)))
        # bf16 keeps ~3 significant digits; the losses of a 5-step run stay within 2% of fp32.
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(fp32), rtol=2e-2, atol=0)


@pytest.mark.parametrize("layout", ["single", "ep2"])
def test_compiled_moe_blocks_train_like_eager(dist_run, layout):
    """training.compile with MoE blocks: the data-dependent dispatch (per-expert token counts, the all-to-alls'
    split sizes) runs eager inside the compiled block, so the losses are the eager run's and no graph is made after
    the first step (compiled_graphs stays flat: nothing recompiles as the counts change)."""
    (expected,), *_ = run(dist_run, "moe-shared", "single")
    world, overrides = LAYOUTS.get(layout, (1, []))
    out = f"/tmp/zoo-moe-compiled-{layout}"
    losses = dist_run(world, train_case, "moe-shared", overrides + ["training.compile=true",
                                                                    "training.compile_backend=aot_eager"], out)
    for rank_losses, *_ in losses:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=1e-5, atol=0)
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    graphs = [r["compiled_graphs"] for r in records if "compiled_graphs" in r]
    assert len(graphs) == len(expected) and graphs[0] > 0 and len(set(graphs)) == 1, graphs


def test_ep_flag_refused_before_anything_starts(capsys, tmp_path):
    from zoo.training.train import main

    out = tmp_path / "run"
    assert main(["--config", str(CONFIG), "--ep", "2", "--out", str(out), "--no-sample"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: ep 2 does not divide the data-parallel size 1 (world size 1 / tp*pp 1); expert-parallel "
                   "groups are carved out of the data-parallel ranks: pick ep in [1] or launch a multiple of "
                   "tp*pp*ep = 2 processes"]
    assert not out.exists()

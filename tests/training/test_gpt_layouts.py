"""The core promise: every (tp, pp, dp, ZeRO, SP, recompute) layout trains the same model as one process.

Each run trains 3 steps (the last two use Adam's moments) from the same seed on the same global batch; losses must agree
with the single-process run within 1e-5 relative at every step (fp32). The runs execute on long-lived gloo pools of 1, 2
and 4 ranks.
Every fp32 run is kept (``layout_run``): the communication counts below and the planner's memory model
(tests/plan) are held against the same runs' metrics.jsonl, so they cost no training of their own.
"""

import json
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {"gpt2": ROOT / "configs/gpt/tiny.yaml", "llama": ROOT / "configs/gpt/tiny-llama.yaml"}
STEPS = 3
COMMON = [f"training.steps={STEPS}", "training.micro_batch_size=2", "training.global_batch_size=8",
          "training.seq_length=32", "training.lr=3e-3", "training.warmup_steps=1", "data.source=synthetic",
          "training.save=false", "training.eval_interval=0", "training.log_interval=1", "parallel.zero_stage=0"]


def train_case(model, overrides, out):
    """Train in this worker with the layout given by overrides; returns the per-step losses."""
    import torch.distributed as dist

    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training.config import load, validate
    from zoo.training.trainer import Trainer

    cfg = load(CONFIGS[model], COMMON + list(overrides) + [f"out={out}"])
    model_cfg = validate(cfg, dist.get_world_size())
    grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp)
    with Trainer(cfg, model_cfg, grid, log=lambda s: None) as trainer:
        return trainer.fit().losses


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
    "tp2-dp2-zero2-recompute": (4, ["parallel.tp=2", "parallel.zero_stage=2",
                                    "parallel.activation_checkpointing=true"]),
}

_reference_cache = {}
_runs = {}  # (model, layout, extra overrides) -> (rank 0's losses, metrics.jsonl records)


def runner(dist_run, layout):
    """ZeRO-3 engines keep their process groups after destroy (tests/conftest.py): their pool is retired after."""
    return dist_run.retire if "zero3" in layout else dist_run


def layout_run(dist_run, model, layout, extra=()):
    """``(losses of every rank, rank 0's metrics.jsonl records)`` of a layout ("single": one process), run once."""
    key = (model, layout, tuple(extra))
    if key not in _runs:
        world, overrides = LAYOUTS.get(layout, (1, []))
        with tempfile.TemporaryDirectory() as out:
            losses = runner(dist_run, layout)(world, train_case, model, overrides + list(extra), out)
            records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
        _runs[key] = losses, records
    return _runs[key]


def reference(dist_run, model, precision="fp32"):
    key = (model, precision)
    if key not in _reference_cache:
        extra = () if precision == "fp32" else (f"training.precision={precision}",)
        _reference_cache[key] = layout_run(dist_run, model, "single", extra)[0][0]
    return _reference_cache[key]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_layout_matches_single_process(dist_run, tmp_path, model, layout):
    expected = reference(dist_run, model)
    for rank_losses in layout_run(dist_run, model, layout)[0]:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert expected[-1] < expected[0], f"the reference run must learn: {expected}"


# bf16 (DeepSpeed's bf16 optimizers, zoo's fp32 statistics) in one process, under ZeRO-3 and in the layout that
# combines tp, pp, SP, recomputation and ZeRO-1, with the Llama blocks and GPT-2's (LayerNorm, GELU, learned
# positions); the fp32 tests above cover every layout of both.
BF16_CASES = [("llama", layout) for layout in ["single", "dp2-zero3", "tp2-pp2-sp-recompute-zero1"]] + \
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


# Communication: rank 0's bytes per step by group/kind (zoo.parallel.comm_count) against the closed forms of the
# tiny GPT-2 (h=64, 4 blocks, vocabulary 512, micro batch b=2 of s=32 tokens, global batch 8, fp32: 4 bytes).
H, L, B, S, V, FP32 = 64, 4, 2, 32, 512, 4
ACT = B * S * H * FP32  # one activation [b, s, h]
ROW = B * S * FP32  # one fp32 number per token (the cross entropy's max, sum of exponentials, target logit)
PARAMS = L * (12 * H * H + 13 * H) + V * H + 128 * H + 2 * H  # blocks, tied embedding, positions, final norm
SP_PARAMS = L * (4 + 2) + 2  # per block: 2 norms (weight, bias), 2 row-parallel biases; the final norm


def comm(dist_run, layout):
    """The last step's counts (the first also holds one-time exchanges: pipeline shapes, ZeRO-3's first gathers)."""
    record = layout_run(dist_run, "gpt2", layout)[1][-1]
    return record["comm_bytes"], record["comm_calls"]


def scalars(nbytes, calls, key, closed_form, closed_calls):
    """The closed form exactly, plus at most a few 4-byte scalars (gradient-norm and loss reductions, the stop
    agreement): a stray activation-sized collective fails."""
    extra = nbytes[key] - closed_form
    assert 0 <= extra <= 16 and extra % 4 == 0 and 0 <= calls[key] - closed_calls <= 4, (key, nbytes, calls)


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp", "pp2", "dp2", "dp2-zero1", "dp2-zero2", "dp2-zero3"])
def test_communication_equals_the_closed_form(dist_run, layout):
    nbytes, calls = comm(dist_run, layout)
    m = 4 if layout in ("tp2", "tp2-sp", "pp2") else 2  # micro-batches per step on a rank (dp 1 or 2)
    if layout == "tp2":
        # per block: 2 all-reduces forward (attention and MLP outputs), 2 backward (their inputs' gradients);
        # the vocab-parallel embedding, the LM head's input gradient; 3 rows of the vocab-parallel cross entropy
        scalars(nbytes, calls, "tp/all_reduce", m * ((4 * L + 2) * ACT + 3 * ROW), m * (4 * L + 2 + 3))
        assert set(nbytes) == {"tp/all_reduce", "dp/all_reduce"}
    elif layout == "tp2-sp":
        # sequence parallelism: each all-reduce becomes an all-gather + a reduce-scatter (forward, and the
        # conjugate backward); the LM head gathers forward and reduce-scatters back, the embedding's gradient is
        # gathered; the embedding's forward stays an all-reduce, and the replicated norm weights and row biases
        # sum their gradients over TP per micro-batch
        assert nbytes["tp/all_gather"] == m * (4 * L + 2) * ACT and calls["tp/all_gather"] == m * (4 * L + 2)
        assert nbytes["tp/reduce_scatter"] == m * (4 * L + 1) * ACT
        scalars(nbytes, calls, "tp/all_reduce", m * (ACT + SP_PARAMS * H * FP32 + 3 * ROW), m * (1 + SP_PARAMS + 3))
    elif layout == "pp2":
        # stage 0 sends each micro-batch's activations and receives their gradients; the two copies of the tied
        # embedding sum their gradients once per step
        assert nbytes["pp/send"] == m * ACT and nbytes["pp/recv"] == m * ACT
        scalars(nbytes, calls, "pp/all_reduce", V * H * FP32, 1)
    else:
        grads = PARAMS * FP32
        zero = {"dp2": 0, "dp2-zero1": 1, "dp2-zero2": 2, "dp2-zero3": 3}[layout]
        if zero < 3:  # DeepSpeed all-reduces the gradients (ZeRO-2: every micro-batch), then (1, 2) gathers
            scalars(nbytes, calls, "dp/all_reduce", grads * (m if zero == 2 else 1), m if zero == 2 else 1)
            assert nbytes.get("dp/all_gather", 0) == (0 if zero == 0 else grads)
        else:  # reduce-scatter every micro-batch; the tiny model's tensors are all below DeepSpeed's
            # stage3_param_persistence_threshold (1e5 elements), so they are gathered once, after the step
            assert nbytes["dp/reduce_scatter"] == m * grads and nbytes["dp/all_gather"] == grads
    assert all(not key.startswith(("ranks", "world", "p2p")) or nbytes[key] <= 16 for key in nbytes), nbytes


# torch.compile (training.compile): every block compiled, the losses of the eager runs above, and no graph made
# after the first step (metrics.jsonl's compiled_graphs stays flat, so nothing recompiles). Inductor's C++ kernels
# take a cold machine ~20 s per block shape, so the layouts beyond one process capture with aot_eager: what a
# layout can break (DeepSpeed's hooks around the compiled forward, SP's collectives, the pipeline's calls,
# recompilation) is in the capture; the kernels are the same for a block of the same shapes.
# tp2+SP and ZeRO-3 cost ~30 s more (SP's collectives break the graph into 26 pieces, each traced on both ranks).


@pytest.mark.parametrize("layout,backend", [("single", "inductor"), ("pp2", "aot_eager"), ("tp2-sp", "aot_eager"),
                                            ("dp2-zero3", "aot_eager")])
def test_compiled_blocks_train_like_eager(dist_run, layout, backend):
    expected = reference(dist_run, "gpt2")
    losses, records = layout_run(dist_run, "gpt2", layout, ["training.compile=true",
                                                            f"training.compile_backend={backend}"])
    for rank_losses in losses:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=1e-5, atol=0)
    graphs = [r["compiled_graphs"] for r in records if "compiled_graphs" in r]
    assert len(graphs) == STEPS and graphs[0] > 0 and len(set(graphs)) == 1, graphs


# training.fused_cross_entropy: the LM head and the loss in chunks of tokens (zoo.parallel.cross_entropy) train
# the model of the unfused runs above: one process (untied Llama head; bf16 too), the tied GPT-2 head on the last
# pipeline stage, and TP with SP (the head's SP gather, vocabulary shards). The tiny runs fit in one chunk, so
# TP+SP makes exactly the unfused run's collectives.
# Under ZeRO-3 the loss gathers the head's weight itself (the model's forward has partitioned it again): the tied
# GPT-2 head there, with the single process's gradient norms too (the weight's two gradients, embedding and loss).
@pytest.mark.parametrize("model,layout,precision", [("llama", "single", "fp32"), ("gpt2", "pp2", "fp32"),
                                                    ("gpt2", "tp2-sp", "fp32"), ("llama", "single", "bf16"),
                                                    ("gpt2", "dp2-zero3", "fp32")])
def test_fused_cross_entropy_trains_like_unfused(dist_run, model, layout, precision):
    expected = reference(dist_run, model)
    losses, records = layout_run(dist_run, model, layout, ["training.fused_cross_entropy=true",
                                                           f"training.precision={precision}"])
    for rank_losses in losses:  # bf16: within 2% of fp32, as the bf16 runs above
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected),
                                   rtol=1e-5 if precision == "fp32" else 2e-2, atol=0)
    if layout == "dp2-zero3":
        single = layout_run(dist_run, model, "single")[1]
        norms = [[r["grad_norm"] for r in run if "grad_norm" in r] for run in (records, single)]
        torch.testing.assert_close(torch.tensor(norms[0]), torch.tensor(norms[1]), rtol=1e-5, atol=0)
    if layout == "tp2-sp":
        unfused = layout_run(dist_run, model, layout)[1]
        assert [r["comm_bytes"] for r in records if "comm_bytes" in r] == \
            [r["comm_bytes"] for r in unfused if "comm_bytes" in r]


def test_fused_cross_entropy_is_refused_where_it_cannot_work():
    from zoo.training.config import ConfigError, load, validate

    cfg = load(ROOT / "configs/bert/tiny.yaml", ["training.fused_cross_entropy=true"])
    with pytest.raises(ConfigError, match="gpt family"):
        validate(cfg, 1)

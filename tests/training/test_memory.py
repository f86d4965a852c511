"""Measured memory (zoo.training.memory) against closed forms.

The activation counter on a plain stack of layers whose saved tensors are known by hand, with and without DeepSpeed's
activation checkpointing; the engine's bytes of a tiny GPT trained for one step against its parameter count and
DeepSpeed's partitioning rules (ZeRO-1/2: each parameter group flattened, padded to a multiple of 2 x dp elements,
split in dp equal partitions; ZeRO-3: each parameter split in dp parts of ceil(n / dp) elements).
"""

import itertools
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from zoo.training.memory import activations_held

ROOT = Path(__file__).resolve().parents[2]
FP32 = 4
COMMON = ["training.micro_batch_size=2", "training.global_batch_size=8", "training.seq_length=32",
          "data.source=synthetic", "training.save=false", "training.eval_interval=0", "training.log_interval=100"]


def mlp(d_in, d_h, d_out):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, d_h), nn.ReLU(), nn.Linear(d_h, d_out))


def test_saved_activations_are_the_closed_form_without_parameters():
    b, d_in, d_h, d_out = 3, 8, 16, 4
    model = mlp(d_in, d_h, d_out)
    x = torch.randn(b, d_in, requires_grad=True)
    with activations_held(model) as live:
        model(x).pow(2).sum().backward()
    # Saved: x (first matmul, for its weight's gradient), the ReLU output (ReLU's backward and the second matmul's:
    # one storage), the output (pow). The weights and their transposed views are saved too, and are parameters.
    assert live.peak == FP32 * b * (d_in + d_h + d_out)
    assert live.now == 0 and not live.held, "backward frees every saved tensor"


def test_checkpointed_block_counts_its_inputs_and_generator_states_then_its_recomputation():
    from deepspeed.accelerator import get_accelerator

    from zoo.parallel.random import checkpoint, get_rng_tracker

    b, d_in, d_h, d_out = 3, 8, 16, 4
    model = mlp(d_in, d_h, d_out)
    x = torch.randn(b, d_in, requires_grad=True)
    with activations_held(model) as live:
        y = checkpoint(model, x)
        y.pow(2).sum().backward()
    # DeepSpeed keeps the block's input and three generator states in its ctx, outside autograd, until the block's
    # backward. Forward: those + the output saved by pow. Backward: pow's output is freed, then the recomputation
    # saves x again (the same storage) and the ReLU output: the peak.
    states = torch.get_rng_state().nbytes + get_accelerator().get_rng_state().nbytes + \
        sum(s.nbytes for s in get_rng_tracker().get_states().values())
    assert live.peak == FP32 * b * d_in + states + FP32 * b * d_h
    assert live.now == 0


def saved_by_graph(loss, parameters) -> int:
    """Bytes of the distinct storages the autograd graph of ``loss`` has saved, found by walking its nodes (their
    ``_saved_*`` attributes and custom Functions' ``saved_tensors``), parameters left out: an independent count."""
    params = {p.untyped_storage().data_ptr() for p in parameters}
    seen, found, todo = set(), {}, [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        saved = [getattr(node, name) for name in dir(node) if name.startswith("_saved_")]
        saved += list(node.saved_tensors) if hasattr(node, "saved_tensors") else []
        for t in (t for v in saved for t in (v if isinstance(v, (tuple, list)) else [v])):
            if (isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)
                    and not isinstance(t._base, nn.Parameter)):
                storage = t.untyped_storage()
                if storage.data_ptr() not in params:
                    found[storage.data_ptr()] = storage.nbytes()
        todo += [fn for fn, _ in node.next_functions]
    return sum(found.values())


def one_forward_saves(engine, cfg, model_cfg, grid) -> int:
    """What one micro-batch's forward saves (ZeRO-0, no pipeline, no recomputation: the peak of a step)."""
    from deepspeed.accelerator import get_accelerator

    from zoo.training import trainer as training
    from zoo.training.families import get_family

    data = training.build_data(cfg, model_cfg, grid)
    ids, labels = training.local_micro_batch(data.train, 0, 0, cfg, grid, get_accelerator().current_device_name())
    loss = get_family(cfg.model.family).loss(model_cfg)(engine(ids), labels)
    return saved_by_graph(loss, engine.module.parameters())


def train_measured(overrides, out, persistence_threshold=None):
    """One rank's run of the tiny GPT: its measured bytes, what metrics.jsonl holds, the log and the parameter
    shapes (full ones: ZeRO-3 keeps them as ``ds_shape``)."""
    import torch.distributed as dist

    from zoo.parallel.topology import initialize_model_parallel
    from zoo.training import engine as training
    from zoo.training.config import load, validate
    from zoo.training.memory import read_memory
    from zoo.training.trainer import Trainer

    cfg = load(ROOT / "configs/gpt/tiny.yaml", COMMON + list(overrides) + [f"out={out}"])
    model_cfg = validate(cfg, dist.get_world_size())
    grid = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp)
    make_config = training.deepspeed_config
    if persistence_threshold is not None:  # ZeRO-3 keeps parameters under it gathered: every one of the tiny GPT
        training.deepspeed_config = lambda c, **kw: {**make_config(c, **kw), "zero_optimization": {
            **make_config(c, **kw)["zero_optimization"], "stage3_param_persistence_threshold": persistence_threshold}}
    lines = []
    trainer = Trainer(cfg, model_cfg, grid, log=lines.append)
    try:
        result = trainer.fit()
    finally:
        training.deepspeed_config = make_config
    with trainer:
        shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in trainer.engine.module.parameters()]
        walked = one_forward_saves(trainer.engine, cfg, model_cfg, grid) if cfg.parallel.zero_stage == 0 else None
    records = (Path(out) / "metrics.jsonl").read_text().splitlines() if grid.rank == 0 else []
    return {"memory": result.memory, "read": read_memory(out) if grid.rank == 0 else None, "lines": lines,
            "records": records, "shapes": shapes, "params": model_cfg.num_parameters(), "walked": walked}


@pytest.fixture(scope="module")
def single(dist_run, tmp_path_factory):
    return dist_run(1, train_measured, ["parallel.zero_stage=0", "training.steps=2"],
                    str(tmp_path_factory.mktemp("zero0")))[0]


def test_zero0_holds_4_bytes_per_parameter_and_adam_8(single):
    n = single["params"]  # HF's count of the tiny GPT (vocab 512 needs no padding)
    tensors = 2 + 12 * 4 + 2  # embeddings, 4 blocks of 12, the final norm
    assert len(single["shapes"]) == tensors and sum(math.prod(s) for s in single["shapes"]) == n
    memory = single["memory"]
    assert memory["params"] == [FP32 * n] and memory["grads"] == [FP32 * n] and memory["grad_buckets"] == [0]
    assert memory["optimizer"] == [2 * FP32 * n + 4 * tensors]  # exp_avg, exp_avg_sq, a float step per tensor
    assert memory["allocator_peak"] is None  # CPU
    # one micro-batch's forward saves the peak: the counter and a walk over the autograd graph agree to the byte
    assert memory["activations"] == [single["walked"]] and single["walked"] > FP32 * 2 * 32 * 512  # > softmax


def test_the_weight_average_counts_4_bytes_per_parameter_with_the_optimizer_as_the_planner_prices_it(
        dist_run, tmp_path, single):
    """training.ema_decay: the average's fp32 copy of every parameter counts under "optimizer" (nothing else moves),
    the 4 bytes per parameter the planner adds to the optimizer state."""
    from zoo.models.gpt import GPTConfig
    from zoo.plan import Job, Layout, estimate
    from zoo.plan.hardware import CPU

    ema = dist_run(1, train_measured, ["parallel.zero_stage=0", "training.steps=2", "training.ema_decay=0.9"],
                   str(tmp_path))[0]
    n = single["params"]
    want = dict(single["memory"], optimizer=[single["memory"]["optimizer"][0] + FP32 * n])
    assert ema["memory"] == want
    job = dict(config=GPTConfig.from_preset("tiny"), gpus=1, seq_length=32, global_batch=8, dtype="fp32")
    lay = Layout(tp=1, pp=1, dp=1, zero=0, micro_batch=2)
    with_ema, plain = (estimate(Job(**job, ema=e), lay, CPU).stage_memory[0] for e in (True, False))
    assert with_ema - plain == FP32 * n


def test_metrics_jsonl_holds_the_first_step_only_and_the_end_says_it(single):
    import json

    first, second = (json.loads(line) for line in single["records"])
    assert first["memory_bytes"] == single["memory"] == single["read"] and "memory_bytes" not in second
    assert [line for line in single["lines"] if line.startswith("memory of rank 0 (the largest of 1")]


def zero12_partitions(shapes, dp):
    """ZeRO-1/2 per parameter group (matrices, then vectors: zoo's weight-decay groups, in the module's order): the
    partition size, and per rank the elements of the parameters its partition overlaps (ZeRO-2 copies their whole
    gradients into its contiguous ``grads_in_partition``)."""
    sizes, overlapped = [], [0] * dp
    for group in ([s for s in shapes if len(s) > 1], [s for s in shapes if len(s) <= 1]):
        numels = [math.prod(s) for s in group]
        size = math.ceil(sum(numels) / (2 * dp)) * 2 * dp // dp
        sizes.append(size)
        for start, n in zip(itertools.accumulate([0] + numels), numels):
            for r in range(dp):
                overlapped[r] += n if start < (r + 1) * size and start + n > r * size else 0
    return sizes, overlapped


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_partitions_masters_and_adam_over_dp(dist_run, tmp_path, stage, single):
    ranks = dist_run(2, train_measured, [f"parallel.zero_stage={stage}", "training.steps=1"], str(tmp_path))
    memory = ranks[0]["memory"]
    n, (parts, overlapped) = single["params"], zero12_partitions(single["shapes"], 2)
    assert memory["params"] == [FP32 * 2 * sum(parts)] * 2  # the flat buffers, whole on every rank
    assert memory["optimizer"] == [3 * FP32 * sum(parts) + 4 * len(parts)] * 2  # fp32 masters, exp_avg, exp_avg_sq
    assert memory["grad_buckets"] == [FP32 * n] * 2  # zoo's reduce_bucket_size: the rank's parameters (n < 5e8)
    if stage == 1:  # before the second (last) micro-batch's reduction: the bucket and every full gradient
        assert memory["grads"] == [FP32 * (n + n)] * 2
    else:  # the bucket, the first micro-batch's reduced gradients of this rank's partition and the second's
        assert memory["grads"] == [FP32 * (n + 2 * o) for o in overlapped]
    assert memory["activations"] == single["memory"]["activations"] * 2  # the same micro-batch on every rank


def test_zero3_partitions_parameters_and_excludes_gathered_ones_from_activations(dist_run, tmp_path, single):
    ranks = dist_run.retire(2, train_measured, ["parallel.zero_stage=3", "training.steps=1"], str(tmp_path),
                            persistence_threshold=0)
    memory = ranks[0]["memory"]
    partition = sum(math.ceil(math.prod(s) / 2) for s in ranks[0]["shapes"])  # every parameter split in two
    assert memory["params"] == [FP32 * partition] * 2
    assert memory["optimizer"] == [3 * FP32 * partition + 4 * 2] * 2  # two parameter groups
    assert memory["grad_buckets"] == [FP32 * sum(math.prod(s) for s in ranks[0]["shapes"])] * 2  # the rank's params
    assert memory["activations"] == single["memory"]["activations"] * 2

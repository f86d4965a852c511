"""The planner's memory model against what zoo's own runs measure (zoo.training.memory, metrics.jsonl's first step).

For every rank: predicted parameters + gradients + optimizer state + activations within 10% of the measured sum
(DeepSpeed's reduction buckets are compared on their own: the planner counts them as buffers). The tiny GPT-2 and
Llama runs are the layout-equivalence runs of tests/training/test_gpt_layouts.py (shared, not trained twice); the
~20M-parameter GPT trains one step in eight layouts of its own.
"""

import pytest

from tests.training.test_gpt_layouts import LAYOUTS, layout_run
from zoo.models.gpt import GPTConfig
from zoo.plan import Job, Layout, estimate
from zoo.plan.estimate import DEEPSPEED_BUCKET
from zoo.plan.hardware import CPU

TINY = {"gpt2": GPTConfig.from_preset("tiny"), "llama": GPTConfig.from_preset("tiny-llama")}
MICRO, BATCH, SEQ = 2, 8, 32  # test_gpt_layouts' runs
MID = dict(hidden_size=384, num_hidden_layers=10, num_attention_heads=6, vocab_size=8192)  # ~21M parameters
MID_RUN = [f"model.{k}={v}" for k, v in MID.items()] + ["training.steps=1"]


def layout_of(name: str, world: int) -> Layout:
    over = dict(o.removeprefix("parallel.").split("=") for o in LAYOUTS.get(name, (1, []))[1])
    tp, pp = int(over.get("tp", 1)), int(over.get("pp", 1))
    return Layout(tp=tp, pp=pp, dp=world // (tp * pp), zero=int(over.get("zero_stage", 0)), micro_batch=MICRO,
                  sp=over.get("sequence_parallel") == "true",
                  recompute="full" if over.get("activation_checkpointing") == "true" else "none")


def check(config, name: str, records) -> None:
    world = LAYOUTS.get(name, (1, []))[0]
    lay = layout_of(name, world)
    est = estimate(Job(config, world, SEQ, BATCH, dtype="fp32"), lay, CPU)
    measured = records[0]["memory_bytes"]
    for rank in range(world):
        stage = rank // (lay.tp * lay.dp)  # the grid: tp fastest, then dp, then pp
        got = sum(measured[k][rank] for k in ("params", "grads", "optimizer", "activations"))
        buckets = measured["grad_buckets"][rank]
        predicted = est.stage_memory[stage]
        assert abs(predicted / (got - buckets) - 1) < 0.10, (name, rank, predicted, got - buckets, measured)
        expect_buckets = 0 if lay.zero == 0 else DEEPSPEED_BUCKET * 4 * (2 if lay.pp > 1 and lay.zero < 3 else 1)
        assert buckets == expect_buckets, (name, rank, buckets)


@pytest.mark.parametrize("name", ["single", *LAYOUTS])
@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_tiny_gpt_memory_is_predicted(dist_run, model, name):
    check(TINY[model], name, layout_run(dist_run, model, name)[1])


@pytest.mark.parametrize("name", ["single", "tp2", "pp2", "dp2-zero1", "dp2-zero2", "dp2-zero3", "tp2-sp",
                                  "pp2-recompute"])
def test_20m_gpt_memory_is_predicted(dist_run, name):
    config = GPTConfig.from_preset("tiny", **MID)
    assert 19e6 < config.num_parameters() < 23e6
    check(config, name, layout_run(dist_run, "gpt2", name, MID_RUN)[1])

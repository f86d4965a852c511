"""TP layers inside DeepSpeed's PipelineModule on a (pp=2, tp=2) grid train like one plain process."""

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.utils import set_random_seed
from torch import nn

from tests.parallel.helpers import gen, grid_for
from zoo.parallel.layers import ColumnParallelLinear, RowParallelLinear, init_method_normal
from zoo.training.engine import destroy_engine

HIDDEN, FFN, OUT, BLOCKS = 8, 16, 4, 4
MICRO, ACCUM, STEPS, LR, CLIP, BASE_SEED = 4, 2, 3, 1e-2, 0.05, 4321


class MLPBlock(nn.Module):
    """x + W2 gelu(W1 x): column-parallel W1, row-parallel W2 (two all-reduces: f and g)."""

    def __init__(self):
        super().__init__()
        self.fc1 = ColumnParallelLinear(HIDDEN, FFN, init_method=init_method_normal(0.3))
        self.fc2 = RowParallelLinear(FFN, HIDDEN, input_is_parallel=True, init_method=init_method_normal(0.3))

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def layer_specs():
    return [*(LayerSpec(MLPBlock) for _ in range(BLOCKS)), LayerSpec(nn.Linear, HIDDEN, OUT)]


def batches():
    """STEPS x ACCUM micro-batches of (input, target)."""
    g = gen(0)
    return [(torch.randn(MICRO, HIDDEN, generator=g), torch.randn(MICRO, OUT, generator=g))
            for _ in range(STEPS * ACCUM)]


def loss_fn(out, target):
    return F.mse_loss(out, target)


def reference_losses():
    """One process, plain torch: same per-layer seeds, gradient accumulation, global-norm clipping, AdamW."""
    layers = []
    for idx, spec in enumerate(layer_specs()):
        set_random_seed(BASE_SEED + idx)
        layers.append(spec.build())
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    data, losses = batches(), []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for x, y in data[step * ACCUM:(step + 1) * ACCUM]:
            loss = loss_fn(model(x), y) / ACCUM
            loss.backward()
            total += loss.item()
        norm = nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert norm > CLIP, "the test must exercise clipping"
        opt.step()
        losses.append(total)
    return losses


def pipeline_case(tp, pp):
    grid = grid_for(tp, pp)
    module = PipelineModule(layers=layer_specs(), topology=grid.topology, loss_fn=loss_fn, seed_layers=True,
                            base_seed=BASE_SEED, partition_method="uniform")
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
        "gradient_clipping": CLIP, "zero_optimization": {"stage": 1}, "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters()], config=config)
    data = iter(batches())
    losses = [engine.train_batch(data_iter=data).item() for _ in range(STEPS)]
    destroy_engine(engine)
    return losses


def test_tp2_pp2_pipeline_trains_like_one_process(dist_run):
    expected = reference_losses()
    for rank_losses in dist_run(4, pipeline_case, 2, 2):
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected), rtol=1e-5, atol=0)
    assert expected[-1] < expected[0]

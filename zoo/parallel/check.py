"""A column/row-parallel MLP checked against the unsharded math on every rank (``launch/check_parallel.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zoo.flags import Parser
from zoo.parallel.layers import ColumnParallelLinear, RowParallelLinear, init_method_normal, shard_master_weight
from zoo.parallel.topology import LayoutError, destroy_model_parallel, initialize_model_parallel


def main(argv=None) -> int:
    parser = Parser(prog="launch/check_parallel.py", description=__doc__)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (must divide the world size)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args(argv)
    try:
        grid = initialize_model_parallel(args.tp, 1)
    except LayoutError as e:
        print(f"error: {e}")
        return 2
    from deepspeed.accelerator import get_accelerator

    device = get_accelerator().current_device_name()
    h, f = args.hidden, 4 * args.hidden
    torch.manual_seed(0)
    fc1 = ColumnParallelLinear(h, f, init_method=init_method_normal(0.02), device=device)
    fc2 = RowParallelLinear(f, h, input_is_parallel=True, init_method=init_method_normal(0.02), device=device)
    torch.manual_seed(0)  # rebuild the same master weights, unsharded
    w1, w2 = torch.empty(f, h), torch.empty(h, f)
    init_method_normal(0.02)(w1)
    init_method_normal(0.02)(w2)
    w1, w2 = w1.to(device).requires_grad_(), w2.to(device).requires_grad_()

    x = torch.randn(4, 32, h, generator=torch.Generator().manual_seed(1)).to(device)
    y = fc2(F.gelu(fc1(x)))
    y.square().sum().backward()
    y_ref = F.linear(F.gelu(F.linear(x, w1)), w2)
    y_ref.square().sum().backward()

    diffs = {
        "output": (y - y_ref).abs().max().item(),
        "fc1 grad": (fc1.weight.grad - shard_master_weight(w1.grad, 0, grid.tp_rank, grid.tp)).abs().max().item(),
        "fc2 grad": (fc2.weight.grad - shard_master_weight(w2.grad, 1, grid.tp_rank, grid.tp)).abs().max().item(),
    }
    worst = max(diffs.values())
    if grid.rank == 0:
        print(f"world={grid.world_size} tp={grid.tp} dp={grid.dp} device={device} "
              + " ".join(f"{k.replace(' ', '_')}={v:.2e}" for k, v in diffs.items()))
        print(f"max_abs_diff={worst:.3e}")
    destroy_model_parallel()
    return 0 if worst <= args.tolerance else 1

"""Global gradient-norm clipping over a tensor x pipeline parallel model.

The norm of the whole model's gradient is sqrt(sum over parameters of |g|^2), each parameter counted once:
a TP-sharded parameter contributes its shard on every TP rank; a replicated one only on TP rank 0; a tied copy on
a later pipeline stage (DeepSpeed marks it ``ds_pipe_replicated``) not at all. The partial sums are all-reduced
over the pipe x tensor group of this replica (data-parallel replicas hold the same, already averaged, gradients).
Expert-parallel parameters (``allreduce = False``, as DeepSpeed marks MoE parameters) differ between the ranks of
an EP group, which are data-parallel replicas: their partial sum is first summed over the EP group, so every
expert counts once, whichever EP rank holds it. Where the EP group spans TP (``grid.ep_spans_tp``) each TP rank
holds other experts: all of them count, and the EP group's sum joins the total on TP rank 0 only.

DeepSpeed's own fp32 path (``deepspeed.runtime.utils.clip_grad_norm_``, used without ZeRO) keeps replicated
parameters only where the pipe x tensor rank is 0, which drops every replicated parameter of pipeline stages after
the first, so the zoo engine uses this function instead (ZeRO and bf16 optimizers compute their norms correctly).
"""

import torch
import torch.distributed as dist


def clip_grad_norm_(parameters, max_norm: float, grid=None) -> float:
    """Clip gradients in place to a global L2 norm of ``max_norm``; returns the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    tp_rank = 0 if grid is None else grid.tp_rank
    spans = getattr(grid, "ep_spans_tp", False)
    counted = [p for p in params
               if not getattr(p, "ds_pipe_replicated", False)
               and (tp_rank == 0 or getattr(p, "tensor_model_parallel", False)
                    or (spans and getattr(p, "allreduce", True) is False))]
    device = params[0].grad.device if params else torch.device("cpu")
    total, experts = (torch.zeros((), dtype=torch.float32, device=device) for _ in range(2))
    for p in counted:
        (experts if getattr(p, "allreduce", True) is False else total).add_(p.grad.detach().float().pow(2).sum())
    if grid is not None and getattr(grid, "ep", 1) > 1:
        dist.all_reduce(experts, group=grid.ep_group)
    if tp_rank == 0:  # the same sum on every TP rank of the EP group (zero there unless it spans TP)
        total += experts
    if grid is not None and grid.get_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=grid.get_model_parallel_group())
    norm = total.sqrt().item()
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for p in params:
            p.grad.detach().mul_(coef)
    return norm

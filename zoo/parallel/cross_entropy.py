"""Cross entropy over logits split along the vocabulary, without ever gathering them (Megatron-LM, Sec. 3).

For logits z (vocabulary V, split in p shards) and target t:

    loss = log(sum_k exp(z_k - m)) - (z_t - m),      m = max_k z_k

Each rank computes its shard's max, its part of the sum of exponentials and, if it owns t, z_t; three
all-reduces of ``[b, s]``-sized tensors (max, sum, sum) replace a gather of ``[b, s, V]``. Subtracting the
global max keeps exp() finite. With label smoothing eps (as ``F.cross_entropy``):

    loss = (1 - eps) * nll + eps * (log(sum_k exp(z_k - m)) - mean_k (z_k - m))

The backward pass is the closed form ``softmax - (1 - eps) * onehot(t) - eps / K``, computed from the softmax
saved in the forward pass, so no autograd graph over the vocabulary is kept.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zoo.parallel.topology import get_tensor_model_parallel_group, group_rank_and_size


def _all_reduce(x, op, group, world):
    if world > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, vocab_size, group):
        rank, world = group_rank_and_size(group)
        local_v = logits.shape[-1]
        start = rank * local_v
        num_classes = local_v * world if vocab_size is None else vocab_size
        z = logits.float()

        # Columns past the true vocabulary (padding) take no part: probability 0, excluded from smoothing.
        valid = None
        if num_classes < start + local_v:
            valid = torch.arange(start, start + local_v, device=z.device) < num_classes
            z = z.masked_fill(~valid, float("-inf"))

        z_max = z.max(dim=-1).values
        _all_reduce(z_max, dist.ReduceOp.MAX, group, world)
        z = z - z_max.unsqueeze(-1)  # [..., V/p], max 0

        ignored = target == ignore_index
        outside = (target < start) | (target >= start + local_v) | ignored
        local_t = (target - start).masked_fill(outside, 0)
        z_t = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        _all_reduce(z_t, dist.ReduceOp.SUM, group, world)

        exp_z = z.exp()
        sum_exp = exp_z.sum(dim=-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group, world)
        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - z_t

        if label_smoothing > 0:
            z_sum = (z if valid is None else z.masked_fill(~valid, 0.0)).sum(dim=-1)
            _all_reduce(z_sum, dist.ReduceOp.SUM, group, world)
            smooth = log_sum_exp - z_sum / num_classes
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp_z.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside, ignored, valid if valid is not None else torch.empty(0))
        ctx.label_smoothing, ctx.num_classes, ctx.has_valid = label_smoothing, num_classes, valid is not None
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, outside, ignored, valid = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # reused in place: the saved softmax is not needed after this
        rows = grad.view(-1, grad.shape[-1])
        own = (~outside).view(-1)
        idx = torch.arange(rows.shape[0], device=rows.device)
        rows[idx[own], local_t.view(-1)[own]] -= 1.0 - eps
        if eps > 0:
            if ctx.has_valid:
                grad -= (eps / ctx.num_classes) * valid.to(grad.dtype)
            else:
                grad -= eps / ctx.num_classes
        grad.mul_((grad_loss * (~ignored)).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, *, label_smoothing: float = 0.0,
                                 ignore_index: int = -100, vocab_size: int | None = None, tp_group=None) -> torch.Tensor:
    """Per-token cross entropy from vocab-sharded logits.

    Args:
        logits_shard: ``[..., V/tp]``, this rank's contiguous slice of the vocabulary (rank r owns
            ``[r*V/tp, (r+1)*V/tp)``, as ``VocabParallelEmbedding``).
        target: ``[...]`` global token ids; positions equal to ``ignore_index`` get loss 0 and no gradient.
        label_smoothing: as in ``F.cross_entropy``, spread over the ``vocab_size`` real classes.
        vocab_size: the true vocabulary when the sharded one is padded (Megatron's ``make_vocab_size_divisible_by``);
            padding columns get probability zero. Default: no padding.
    Returns:
        ``[...]`` float32 losses, equal to ``F.cross_entropy(full_logits, target, reduction="none", ...)``.
        Reduce (mean over non-ignored tokens) in the caller.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits_shard.shape)} and target {tuple(target.shape)} disagree: "
                         "logits must be target's shape plus a vocabulary dimension")
    group = get_tensor_model_parallel_group() if tp_group is None else tp_group
    return _VocabParallelCrossEntropy.apply(logits_shard, target, label_smoothing, ignore_index, vocab_size, group)

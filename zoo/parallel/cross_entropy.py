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
                                 ignore_index: int = -100, vocab_size: int | None = None,
                                 tp_group=None) -> torch.Tensor:
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


# ---------------------------------------------------------------------------------------------------------------
# The LM head and the cross entropy in one pass over token chunks (no [tokens, V] logits kept)
# ---------------------------------------------------------------------------------------------------------------

# Logit elements per chunk: on a CPU the chunk's logits stay in the last-level cache (8 MB in fp32) while the loss
# and its gradient are computed; on an accelerator the chunk only bounds memory, so it is larger (fewer launches).
CPU_CHUNK_ELEMENTS = 1 << 21
ACCELERATOR_CHUNK_ELEMENTS = 1 << 26


class _LinearCrossEntropySum(torch.autograd.Function):
    """Sum over the tokens of ``cross_entropy(hidden @ weight.T, target)`` with vocab-sharded ``weight``.

    The gradients are computed in the forward pass, chunk by chunk, while each chunk's logits are at hand: a summed
    loss has the same upstream gradient for every token, so ``d loss / d logits`` of a chunk is known there and the
    two backward GEMMs follow at once. Backward only scales the stored gradients by the upstream scalar.
    """

    @staticmethod
    def forward(ctx, hidden, weight, target, label_smoothing, ignore_index, vocab_size, group, chunk, need_grad):
        rank, world = group_rank_and_size(group)
        local_v, width = weight.shape
        start = rank * local_v
        num_classes = local_v * world if vocab_size is None else vocab_size
        pad_from = max(0, min(local_v, num_classes - start))  # local columns >= pad_from are vocabulary padding
        h2 = hidden.reshape(-1, width)
        t1 = target.reshape(-1)
        n = h2.shape[0]
        eps = label_smoothing
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32  # the loss's dtype (fp32 at most)
        total = torch.zeros((), dtype=acc, device=hidden.device)
        grad_hidden = torch.empty_like(h2) if need_grad else None
        # in the loss's dtype the first chunk's GEMM writes it and later ones add into it (beta=1: no separate
        # pass over [V/p, h]); 16-bit weights' products are added to zeros
        in_place = n > 0 and weight.dtype == acc
        grad_weight = (torch.empty if in_place else torch.zeros)(weight.shape, dtype=acc, device=weight.device) \
            if need_grad else None
        for lo in range(0, n, chunk):
            hc, tc = h2[lo:lo + chunk], t1[lo:lo + chunk]
            z = torch.mm(hc, weight.t()).to(acc)  # [c, V/p]
            if pad_from < local_v:
                z[:, pad_from:] = float("-inf")
            z_max = z.amax(dim=-1)
            _all_reduce(z_max, dist.ReduceOp.MAX, group, world)
            z -= z_max.unsqueeze(-1)
            ignored = tc == ignore_index
            outside = (tc < start) | (tc >= start + local_v) | ignored
            local_t = (tc - start).masked_fill(outside, 0)
            z_t = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
            _all_reduce(z_t, dist.ReduceOp.SUM, group, world)
            if eps > 0:
                z_sum = z[:, :pad_from].sum(dim=-1)
                _all_reduce(z_sum, dist.ReduceOp.SUM, group, world)
            z.exp_()
            sum_exp = z.sum(dim=-1)
            _all_reduce(sum_exp, dist.ReduceOp.SUM, group, world)
            log_sum_exp = sum_exp.log()
            loss = log_sum_exp - z_t
            if eps > 0:
                loss = (1.0 - eps) * loss + eps * (log_sum_exp - z_sum / num_classes)
            total += loss.masked_fill(ignored, 0.0).sum()
            if not need_grad:
                continue
            # now d loss / d logits of the chunk, in place: the softmax (0 on ignored rows), minus (1 - eps) at the
            # target where this shard owns it (``outside`` holds the ignored rows: nothing added there); no host
            # sync (no nonzero/any) on GPUs
            if eps > 0:
                z /= sum_exp.unsqueeze(-1)
                z[:, :pad_from] -= eps / num_classes
                z *= (~ignored).to(acc).unsqueeze(-1)
            else:  # the division and the mask in one pass
                z *= ((~ignored).to(acc) / sum_exp).unsqueeze(-1)
            z.scatter_add_(-1, local_t.unsqueeze(-1), (~outside).to(acc).unsqueeze(-1) * -(1.0 - eps))
            g = z.to(weight.dtype)
            torch.mm(g, weight, out=grad_hidden[lo:lo + chunk])
            if not in_place:  # bf16/fp16 weights: the product in their dtype, accumulated in fp32
                grad_weight += torch.mm(g.t(), hc).to(acc)
            elif lo == 0:
                torch.mm(g.t(), hc, out=grad_weight)
            else:
                grad_weight.addmm_(g.t(), hc)
        if need_grad:
            ctx.save_for_backward(grad_hidden.view(hidden.shape), grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_total.to(grad_weight.dtype)
        return ((grad_hidden.to(scale.dtype) * scale).to(grad_hidden.dtype),
                (grad_weight * scale).to(ctx.weight_dtype), None, None, None, None, None, None, None)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                             label_smoothing: float = 0.0, ignore_index: int = -100, vocab_size: int | None = None,
                             tp_group=None, chunk_tokens: int | None = None) -> torch.Tensor:
    """``vocab_parallel_cross_entropy(hidden @ weight.T, target, ...)`` summed over the tokens, computed in chunks
    of tokens so that the ``[tokens, V/tp]`` logits are never held (Liger-Kernel's and Megatron's fused linear cross
    entropy do the same on GPUs).

    Args:
        hidden: ``[..., h]``, the LM head's input as the head sees it (after any TP copy / SP gather).
        weight: ``[V/tp, h]``, this rank's vocabulary rows (tied or untied head).
        target: ``[...]`` global token ids; ``ignore_index`` positions add 0 and get no gradient.
        chunk_tokens: tokens per chunk (default: :data:`CPU_CHUNK_ELEMENTS` or :data:`ACCELERATOR_CHUNK_ELEMENTS`
            logits per chunk, by the device).
    Returns:
        a float32 scalar (float64 for a float64 weight), the sum of the per-token losses. Its gradient is only right for
        a scalar upstream gradient (the loss of a mean is), which is all autograd ever passes to a scalar. With TP each
        chunk makes three all-reduces of ``[chunk]`` tensors (four with label smoothing), where the unfused loss makes
        three of ``[tokens]``.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if hidden.shape[:-1] != target.shape or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and target "
                         f"{tuple(target.shape)} disagree: hidden must be target's shape plus weight's last dimension")
    group = get_tensor_model_parallel_group() if tp_group is None else tp_group
    if chunk_tokens is None:
        elements = CPU_CHUNK_ELEMENTS if hidden.device.type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS
        chunk_tokens = max(1, elements // weight.shape[0])
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropySum.apply(hidden, weight, target, label_smoothing, ignore_index, vocab_size, group,
                                        chunk_tokens, need_grad)

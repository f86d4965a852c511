"""Vocab-parallel cross entropy against F.cross_entropy on the full logits, forward and backward; the fused LM head +
cross entropy (chunks of tokens, no logits held) against F.cross_entropy of the full hidden @ weight.T."""

import pytest
import torch
import torch.nn.functional as F

from tests.parallel.helpers import assert_close, chunk, gen, grid_for
from zoo.parallel.cross_entropy import linear_cross_entropy_sum, vocab_parallel_cross_entropy

B, S, V = 3, 5, 24


def ce_case(tp, label_smoothing, ignore_index, vocab_size, scale):
    grid = grid_for(tp)
    rank = 0 if grid is None else grid.tp_rank
    real_v = V if vocab_size is None else vocab_size
    logits = torch.randn(B, S, V, generator=gen(11), dtype=torch.float64).float() * scale
    target = torch.randint(0, real_v, (B, S), generator=gen(12))
    per = V // 4
    target[0, :4] = torch.tensor([per - 1, per, 2 * per - 1, 2 * per])  # ids at shard boundaries
    target[1, 1] = ignore_index
    target[2, 3] = ignore_index
    dloss = torch.rand(B, S, generator=gen(13))

    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full[..., :real_v].transpose(1, 2), target, reduction="none",
                          label_smoothing=label_smoothing, ignore_index=ignore_index)
    ref.backward(dloss)

    shard = chunk(logits, -1, rank, tp).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, label_smoothing=label_smoothing, ignore_index=ignore_index,
                                        vocab_size=vocab_size)
    loss.backward(dloss)
    assert torch.isfinite(loss).all()
    assert_close(loss, ref, "loss")
    assert_close(shard.grad, chunk(full.grad, -1, rank, tp), "logit grad")
    assert (loss[target == ignore_index] == 0).all()
    return True


CASES = [
    (0.0, -100, None, 1.0),
    (0.1, -100, None, 1.0),
    (0.0, 5, None, 1.0),       # an ignore_index that is a real token id
    (0.1, -100, 21, 1.0),      # padded vocabulary: the last 3 columns are never predicted
    (0.0, -100, None, 1e4),    # huge logits: stability needs the max subtracted
]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("label_smoothing,ignore_index,vocab_size,scale", CASES)
def test_matches_full_cross_entropy(dist_run, tp, label_smoothing, ignore_index, vocab_size, scale):
    args = (tp, label_smoothing, ignore_index, vocab_size, scale)
    assert ce_case(*args) if tp == 1 else all(dist_run(tp, ce_case, *args))


def test_bad_arguments():
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), label_smoothing=1.5)
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(3, dtype=torch.long))


H = 6


def fused_case(tp, label_smoothing, ignore_index, vocab_size, scale, chunk_tokens):
    """float64 throughout, so the chunked sum must equal the reference to rounding."""
    import torch.distributed as dist

    grid = grid_for(tp)
    rank = 0 if grid is None else grid.tp_rank
    real_v = V if vocab_size is None else vocab_size
    hidden = torch.randn(B, S, H, generator=gen(21), dtype=torch.float64) * scale
    weight = torch.randn(V, H, generator=gen(22), dtype=torch.float64)
    target = torch.randint(0, real_v, (B, S), generator=gen(23))
    per = V // 4
    target[0, :4] = torch.tensor([per - 1, per, 2 * per - 1, 2 * per])  # ids at shard boundaries
    target[1, 1] = ignore_index
    target[2, 3] = ignore_index

    full_h, full_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy((full_h @ full_w.t())[..., :real_v].transpose(1, 2), target, reduction="sum",
                          label_smoothing=label_smoothing, ignore_index=ignore_index)
    (0.37 * ref).backward()

    h, w = hidden.clone().requires_grad_(), chunk(weight, 0, rank, tp).clone().requires_grad_()
    total = linear_cross_entropy_sum(h, w, target, label_smoothing=label_smoothing, ignore_index=ignore_index,
                                     vocab_size=vocab_size, chunk_tokens=chunk_tokens)
    (0.37 * total).backward()
    grad_h = h.grad.clone()
    if tp > 1:  # each rank holds its vocabulary shard's part; the model's TP copy all-reduces it in backward
        dist.all_reduce(grad_h, group=grid.tp_group)
    TIGHT = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(total, ref.detach(), **TIGHT)
    torch.testing.assert_close(grad_h, full_h.grad, **TIGHT)
    torch.testing.assert_close(w.grad, chunk(full_w.grad, 0, rank, tp), **TIGHT)
    with torch.no_grad():  # evaluation: the same loss, no gradient work
        torch.testing.assert_close(linear_cross_entropy_sum(hidden, w.detach(), target, label_smoothing=label_smoothing,
                                                            ignore_index=ignore_index, vocab_size=vocab_size,
                                                            chunk_tokens=chunk_tokens), ref.detach(), **TIGHT)
    return True


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("label_smoothing,ignore_index,vocab_size,scale", CASES)
def test_fused_head_and_loss_match_full_cross_entropy(dist_run, tp, label_smoothing, ignore_index, vocab_size, scale):
    chunk_tokens = 4  # 15 tokens: three full chunks and a short one
    args = (tp, label_smoothing, ignore_index, vocab_size, scale, chunk_tokens)
    assert fused_case(*args) if tp == 1 else all(dist_run(tp, fused_case, *args))


def test_fused_bad_arguments():
    with pytest.raises(ValueError, match="disagree"):
        linear_cross_entropy_sum(torch.zeros(2, 4), torch.zeros(8, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        linear_cross_entropy_sum(torch.zeros(2, 4), torch.zeros(8, 4), torch.zeros(2, dtype=torch.long),
                                 label_smoothing=-0.1)


def test_fused_head_and_loss_in_bf16_match_the_fp64_loss():
    """bf16 weights: each chunk's weight-gradient product is added to an fp32 accumulator started at zero; the
    loss and both gradients stay within bf16's precision of the fp64 computation on the same (bf16) values."""
    hidden = (torch.randn(B, S, H, generator=gen(31)) * 0.5).to(torch.bfloat16)
    weight = torch.randn(V, H, generator=gen(32)).to(torch.bfloat16)
    target = torch.randint(0, V, (B, S), generator=gen(33))
    full_h, full_w = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = F.cross_entropy((full_h @ full_w.t()).transpose(1, 2), target, reduction="sum")
    ref.backward()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    total = linear_cross_entropy_sum(h, w, target, chunk_tokens=4)
    total.backward()
    assert total.dtype == torch.float32 and w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(total.double(), ref.detach(), rtol=1e-2, atol=0)
    for got, want in ((h.grad, full_h.grad), (w.grad, full_w.grad)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=3e-2 * want.abs().max().item())

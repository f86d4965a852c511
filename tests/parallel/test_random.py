"""The tensor-parallel RNG stream: per-TP-rank masks, DP agreement, reproducibility, activation checkpointing."""

import torch
import torch.nn.functional as F

from tests.parallel.helpers import grid_for
from zoo.parallel.random import checkpoint, configure_activation_checkpointing, model_parallel_seed, tensor_parallel_rng


def masks_case(tp, seed):
    grid = grid_for(tp)
    model_parallel_seed(seed, grid.tp_rank)
    ones = torch.ones(4096)
    with tensor_parallel_rng():
        tp_mask = F.dropout(ones, 0.5) > 0
    default_mask = F.dropout(ones, 0.5) > 0
    return grid.tp_rank, grid.dp_rank, tp_mask, default_mask


def test_masks_differ_across_tp_agree_across_dp_and_repeat(dist_run):
    first = dist_run(4, masks_case, 2, 7)  # tp=2, dp=2
    again = dist_run(4, masks_case, 2, 7)
    other_seed = dist_run(4, masks_case, 2, 8)
    by_tp = {}
    for (tp_rank, _dp_rank, tp_mask, default_mask), (_, _, tp_again, def_again), (_, _, tp_other, _) in zip(
            first, again, other_seed):
        assert torch.equal(tp_mask, tp_again) and torch.equal(default_mask, def_again), "same seed, same masks"
        assert not torch.equal(tp_mask, tp_other), "another seed, other masks"
        by_tp.setdefault(tp_rank, []).append(tp_mask)
    assert torch.equal(by_tp[0][0], by_tp[0][1]) and torch.equal(by_tp[1][0], by_tp[1][1]), "DP replicas agree"
    assert not torch.equal(by_tp[0][0], by_tp[1][0]), "TP ranks draw different masks"
    defaults = [r[3] for r in first]
    assert all(torch.equal(d, defaults[0]) for d in defaults), "default stream is shared by all ranks"


def _block(x, w):
    h = x @ w
    with tensor_parallel_rng():
        h = F.dropout(h, 0.3)
    return F.dropout(torch.tanh(h), 0.2)


def checkpoint_case(tp):
    grid = grid_for(tp)
    configure_activation_checkpointing(grid)
    results = []
    for use_checkpoint in (False, True):
        model_parallel_seed(3, grid.tp_rank)
        w = torch.randn(16, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(2)).requires_grad_()
        y = checkpoint(_block, x, w) if use_checkpoint else _block(x, w)
        y.sum().backward()
        results.append((y.detach(), w.grad, x.grad))
    (y0, gw0, gx0), (y1, gw1, gx1) = results
    # Recomputation must redraw the very same masks, or the gradients would differ.
    assert torch.equal(y0, y1) and torch.equal(gw0, gw1) and torch.equal(gx0, gx1)
    return True


def test_activation_checkpointing_replays_both_streams(dist_run):
    assert all(dist_run(2, checkpoint_case, 2))


def cp_masks_case(seed):
    from zoo.parallel.topology import initialize_model_parallel

    grid = initialize_model_parallel(tp=2, cp=2)  # 4 ranks: tp2 x cp2
    masks = []
    for cp_rank in (grid.cp_rank, 0):  # this rank's streams, then those the same rank has without CP
        model_parallel_seed(seed, grid.tp_rank, cp_rank)
        ones = torch.ones(4096)
        with tensor_parallel_rng():
            tp_mask = F.dropout(ones, 0.5) > 0
        masks += [tp_mask, F.dropout(ones, 0.5) > 0]
    model_parallel_seed(seed, grid.tp_rank)
    with tensor_parallel_rng():
        plain = F.dropout(torch.ones(4096), 0.5) > 0
    return grid.tp_rank, grid.cp_rank, masks, plain


def test_masks_differ_across_cp_and_cp_rank_0_is_unchanged(dist_run):
    results = dist_run(4, cp_masks_case, 7)
    tp_masks = {(t, c): m[0] for t, c, m, _ in results}
    default_masks = {(t, c): m[1] for t, c, m, _ in results}
    assert len({tuple(m.tolist()) for m in tp_masks.values()}) == 4, "every (tp, cp) rank has its own TP stream"
    assert torch.equal(default_masks[0, 0], default_masks[1, 0]), "the default stream is shared over TP"
    assert not torch.equal(default_masks[0, 0], default_masks[0, 1]), "CP ranks hold other tokens: other masks"
    for _, _, (_, _, tp_at_0, _), plain in results:
        assert torch.equal(tp_at_0, plain), "cp_rank 0 seeds exactly as before"

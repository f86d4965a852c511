"""The GPT model with context parallelism against the one-process model built from the same seed.

The tiny GPT-2-style and Llama-style (RoPE, GQA) presets on 256 positions, at cp=2, cp=4 and cp=2 x tp=2 (with and
without sequence parallelism), Ulysses and ring: the loss of every CP rank equals the one-process loss, and each
parameter gradient averaged over the CP ranks (the loss convention of ``GPTLoss``: a trainer averages over dp x cp)
equals the one-process gradient to 1e-5 relative. Some labels are ignored, unevenly over the ranks, so a per-rank
token count would be caught. Weights start at std 0.15 (not 0.02), so attention is far from uniform and a wrong
position or mask shows.

Rank layout on the 4-rank pool: tp fastest, then cp (then dp): cp=2 x tp=2 has TP groups {0, 1}, {2, 3} and CP groups
{0, 2}, {1, 3}; cp=2 alone runs twice, on {0, 1} and {2, 3}.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.parallel.helpers import gen
from zoo.models.gpt import GPTAttention, GPTConfig, GPTEmbedding, GPTLoss, KVCache, ParallelOptions, layer_specs
from zoo.models.specs import SpecSequential
from zoo.parallel.context_parallel import split_sequence
from zoo.parallel.layers import scaled_init_method_normal
from zoo.parallel.shards import full_tensor

B, S, SEED = 2, 256, 1234
WORLD = 4
CASES = [(preset, algorithm) for preset in ("tiny", "tiny-llama") for algorithm in ("ulysses", "ring")]


def _config(preset: str) -> GPTConfig:
    return GPTConfig.from_preset(preset, max_position_embeddings=S, initializer_range=0.15)


def _groups(cp: int, tp: int):
    """TP groups of adjacent ranks, CP groups of ranks tp apart, per replica. -> (tp_group, cp_group, all made)."""
    rank, made, mine = dist.get_rank(), [], {}
    for replica in range(WORLD // (cp * tp)):
        base = replica * cp * tp
        lists = {("tp", c): [base + c * tp + t for t in range(tp)] for c in range(cp)}
        lists |= {("cp", t): [base + c * tp + t for c in range(cp)] for t in range(tp)}
        for (kind, _), ranks in lists.items():
            group = dist.new_group(ranks)
            made.append(group)
            if rank in ranks:
                mine[kind] = group
    return mine["tp"], mine["cp"], made


def _batch(vocab: int):
    tokens = torch.randint(0, vocab, (B, S + 1), generator=gen(7))
    ids, labels = tokens[:, :-1], tokens[:, 1:].clone()  # shifted before the split
    labels[0, 20:90] = -100  # mostly in the first chunks: counts differ per rank
    labels[1, 250:] = -100
    return ids, labels


def _loss_and_grads(cfg, par, ids, labels, cp_group=None):
    model = SpecSequential(layer_specs(cfg, par), base_seed=SEED)
    loss = GPTLoss(cfg, par.tp_group, cp_group=cp_group)(model(ids), labels)
    loss.backward()
    return model, loss.detach()


def _compare(preset, algorithm, tp_group, cp_group, sp):
    cfg = _config(preset)
    ids, labels = _batch(cfg.vocab_size)
    ref, ref_loss = _loss_and_grads(cfg, ParallelOptions(), ids, labels)

    cp_rank, cp = dist.get_rank(cp_group), dist.get_world_size(cp_group)
    tp = dist.get_world_size(tp_group)
    mine = lambda t, how=algorithm: split_sequence(t, 1, cp_rank, cp, how)
    par = ParallelOptions(sp, tp_group, cp_group=cp_group, cp_algorithm=algorithm)
    model, loss = _loss_and_grads(cfg, par, mine(ids), mine(labels), cp_group)

    what = f"{preset} {algorithm} cp={cp} tp={tp} sp={sp}"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0, msg=lambda m: f"{what}: loss: {m}")
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=cp_group)
        grad /= cp  # the average over CP that a dp x cp trainer takes
        if getattr(p, "tensor_model_parallel", False):
            grad = full_tensor(grad, p.partition_dim, p.partition_stride, tp_group)
        expected = ref_grads[name].grad
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item(),
                                   msg=lambda m: f"{what}: {name} grad: {m}")

    with torch.no_grad():  # the same tokens at the other layout's positions: the loss must move
        other = "ring" if algorithm == "ulysses" else "ulysses"
        wrong = GPTLoss(cfg, tp_group, cp_group=cp_group)(model(mine(ids, other)), mine(labels, other))
    return abs(wrong.item() - ref_loss.item())


def layout_case(cp: int, tp: int, sp: bool):
    tp_group, cp_group, made = _groups(cp, tp)
    try:
        return [_compare(preset, algorithm, tp_group, cp_group, sp) for preset, algorithm in CASES]
    finally:
        for group in made:
            dist.destroy_process_group(group)


@pytest.mark.parametrize("cp, tp, sp", [(2, 1, False), (4, 1, False), (2, 2, False), (2, 2, True)],
                         ids=["cp2", "cp4", "cp2xtp2", "cp2xtp2-sp"])
def test_context_parallel_equals_one_process(dist_run, cp, tp, sp):
    for moved in dist_run(WORLD, layout_case, cp, tp, sp):
        assert min(moved) > 1e-3, moved  # positions matter: the comparison above could fail


def refusals_case():
    tp_group, cp_group, made = _groups(4, 1)
    try:
        messages = []

        def refused(fn, match):
            with pytest.raises(ValueError, match=match) as err:
                fn()
            messages.append(str(err.value))

        two_heads = GPTConfig.from_preset("tiny", num_attention_heads=2)
        par = ParallelOptions(tp_group=tp_group, cp_group=cp_group)
        init = scaled_init_method_normal(0.02, 4)
        refused(lambda: GPTAttention(two_heads, par, init), "Ulysses splits the 2 query heads")
        cfg = _config("tiny-llama")
        attention = GPTAttention(cfg, par, init)
        cache = KVCache(1, cfg.num_key_value_heads, 8, cfg.head_dim, dtype=torch.float32, device="cpu")
        refused(lambda: attention(torch.randn(1, 2, cfg.hidden_size), cache), "without context parallelism")
        embedding = GPTEmbedding(cfg, par)
        refused(lambda: embedding(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)), "without sequence or context")
        dropout = GPTConfig.from_preset("tiny-llama", attention_dropout=0.1)
        ring = GPTAttention(dropout, ParallelOptions(tp_group=tp_group, cp_group=cp_group, cp_algorithm="ring"), init)
        refused(lambda: ring(torch.randn(1, 8, cfg.hidden_size)), "ring attention has no attention dropout")
        return messages
    finally:
        for group in made:
            dist.destroy_process_group(group)


def test_refusals_are_one_line(dist_run):
    for messages in dist_run(WORLD, refusals_case):
        assert len(messages) == 4 and all("\n" not in m for m in messages), messages


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="cp_algorithm must be one of"):
        ParallelOptions(cp_algorithm="zigzag")

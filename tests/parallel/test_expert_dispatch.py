"""Expert parallelism on gloo: the ``all_to_all`` primitive against the arithmetic of who sends what, and GPTMoE at
ep = 2, 4 and ep=2 x tp=2 (with and without sequence parallelism) against the one-process layer.

Every EP rank holds its own tokens. The reference is the ep=1, tp=1 layer built from the same seed, called once on
each EP rank's tokens (the router losses are those of a rank's layer call, so they differ from one call on all
tokens; the outputs do not, which is checked too): outputs, input grads and router grads must equal those of the
rank's own call, expert grads those summed over all calls, sliced to the rank's experts.

Workers build their groups with ``new_group`` and destroy them before returning (the pools are long-lived).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.models.test_moe import BASE
from tests.parallel.helpers import assert_close, chunk, gen
from zoo.models.gpt import GPTConfig, ParallelOptions
from zoo.models.moe import GPTMoE
from zoo.parallel.mappings import all_to_all

H = BASE["hidden_size"]


def _groups(tp: int, ep: int):
    """TP groups of adjacent ranks, EP groups of the ranks with the same TP rank (as Megatron lays them out), and
    this rank's group of one (for the reference). -> (tp_group, ep_group, single, every group made)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world == tp * ep
    made, mine = [], {}

    def new(kind, ranks):
        group = dist.new_group(ranks)
        made.append(group)
        if rank in ranks:
            mine[kind] = group

    for r in range(world):
        new("single", [r])
    for i in range(ep):
        new("tp", list(range(i * tp, (i + 1) * tp)))
    for j in range(tp):
        new("ep", list(range(j, world, tp)))
    return mine["tp"], mine["ep"], mine["single"], made


def _destroy(groups) -> None:
    for group in groups:
        dist.destroy_process_group(group)


# ---------------------------------------------------------------------------------------------------------------
# The primitive
# ---------------------------------------------------------------------------------------------------------------


def all_to_all_case():
    rank, world = dist.get_rank(), dist.get_world_size()
    sends = lambda src, dst: (src + 2 * dst) % 3  # rows from src to dst: uneven, some zero
    send = [sends(rank, j) for j in range(world)]
    recv = [sends(j, rank) for j in range(world)]
    # Each row names itself: (source, destination, index), then a value.
    x = torch.tensor([[rank, j, i, 0.5 * i - rank] for j in range(world) for i in range(send[j])]).reshape(-1, 4)
    x.requires_grad_()
    y = all_to_all(x, recv, send, dist.group.WORLD)
    expected = torch.tensor([[j, rank, i, 0.5 * i - j] for j in range(world) for i in range(recv[j])]).reshape(-1, 4)
    assert torch.equal(y, expected), (y, expected)
    # Backward: a gradient that names the receiving row comes back to the row that was sent.
    label = lambda rows: 1000 * rows[:, :1] + 100 * rows[:, 1:2] + 10 * rows[:, 2:3] + torch.arange(4.0)
    y.backward(label(y.detach()))
    assert torch.equal(x.grad, label(x.detach())), (x.grad, label(x.detach()))
    return sum(send), sum(recv)


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_uneven_splits(dist_run, world):
    counts = dist_run(world, all_to_all_case)
    assert sum(s for s, _ in counts) == sum(r for _, r in counts) > 0


def test_all_to_all_group_of_one_is_identity():
    x = torch.randn(3, 2)
    assert all_to_all(x, [3], [3], None) is x


# ---------------------------------------------------------------------------------------------------------------
# GPTMoE
# ---------------------------------------------------------------------------------------------------------------


def ep_case(tp: int, ep: int, sp: bool, overrides: dict, shape: tuple[int, int]):
    tp_group, ep_group, single, made = _groups(tp, ep)
    try:
        return _compare(tp_group, ep_group, single, sp, GPTConfig(**{**BASE, **overrides}), shape)
    finally:
        _destroy(made)


def _compare(tp_group, ep_group, single, sp, cfg, shape):
    tp_rank, tp = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    ep_rank, ep = dist.get_rank(ep_group), dist.get_world_size(ep_group)
    layers = {}
    for name, par in (("moe", ParallelOptions(sp, tp_group, ep_group)), ("ref", ParallelOptions(False, single))):
        torch.manual_seed(0)
        layers[name] = layer = GPTMoE(cfg, par)
        layer.aux_loss_scale = 0.5
        if layer.router.expert_bias is not None:
            layer.router.expert_bias.copy_(torch.randn(cfg.num_experts, generator=gen(5)) * 0.3)
    moe, ref = layers["moe"], layers["ref"]
    assert moe.ep_world_size == ep and moe.tp_world_size == tp and ref.ep_world_size == ref.tp_world_size == 1
    E_l = cfg.num_experts // ep
    mine = slice(ep_rank * E_l, (ep_rank + 1) * E_l)
    expert_params = [n for n, _ in ref.experts.named_parameters()]
    for n in expert_params:  # ep=N holds the ep=1 layer's experts, sliced
        assert torch.equal(getattr(moe.experts, n), getattr(ref.experts, n)[mine])

    b, s = shape
    xs = torch.randn(ep, b, s, H, generator=gen(1))  # one batch per EP rank
    dys = 0.1 * torch.randn(ep, b, s, H, generator=gen(2))
    share = (lambda t: chunk(t, 1, tp_rank, tp)) if sp else (lambda t: t)  # what this rank holds of its batch
    x = share(xs[ep_rank]).clone().requires_grad_()
    y = moe(x)
    (y * share(dys[ep_rank])).sum().backward()

    # The reference: one call per EP rank's batch. Router (and shared) grads per call, expert grads summed.
    outs, per_call, expert_grads, counts = [], [], None, 0
    for g in range(ep):
        ref.zero_grad()
        xr = xs[g].clone().requires_grad_()
        yr = ref(xr)
        (yr * dys[g]).sum().backward()
        outs.append(yr.detach())
        counts = counts + ref.last_stats["tokens_per_expert"]
        others = {n: p.grad.clone() for n, p in ref.named_parameters() if not n.startswith("experts.")}
        per_call.append((xr.grad, others, dict(ref.last_stats)))
        grads = [getattr(ref.experts, n).grad[mine] for n in expert_params]
        expert_grads = grads if expert_grads is None else [a + g_ for a, g_ in zip(expert_grads, grads)]
    x_grad, own_grads, own_stats = per_call[ep_rank]

    assert_close(y, share(outs[ep_rank]), "output")
    assert_close(x.grad, share(x_grad), "input grad")
    for n, p in moe.named_parameters():
        if not n.startswith("experts."):
            assert_close(p.grad, own_grads[n], f"{n} grad")
    for n, expected in zip(expert_params, expert_grads):
        assert_close(getattr(moe.experts, n).grad, expected, f"experts.{n} grad")
    stats = moe.last_stats
    assert torch.equal(stats["tokens_per_expert"], counts)  # summed over EP (and TP)
    assert_close(stats["aux_loss"], own_stats["aux_loss"], "aux loss")
    assert_close(stats["z_loss"], own_stats["z_loss"], "z loss")
    if cfg.capacity_factor is None:  # dropless: one call on all the batches gives the same outputs
        with torch.no_grad():
            assert_close(ref(xs.flatten(0, 1)), torch.cat(outs), "one call on every batch")
    else:
        assert stats["dropped_fraction"] > 0
    return stats["tokens_per_expert"].tolist()


SHARED = dict(num_shared_experts=1, shared_expert_intermediate_size=20, shared_expert_gate=True, norm_topk_prob=False)
V3 = dict(scoring_func="sigmoid", n_group=4, topk_group=2, num_experts_per_tok=3, moe_expert_bias=True,
          routed_scaling_factor=2.5, num_shared_experts=2, router_aux_loss_type="seq")


@pytest.mark.parametrize("case, overrides", [("mixtral", {}), ("qwen2-shared", SHARED),
                                             ("capacity", dict(capacity_factor=1.0))])
def test_ep2_equals_one_process(dist_run, case, overrides):
    loads = dist_run(2, ep_case, 1, 2, False, overrides, (2, 6))
    assert loads[0] == loads[1]  # every rank reports the load of the whole EP group


def test_ep4_equals_one_process(dist_run):
    dist_run(4, ep_case, 1, 4, False, V3, (2, 6))


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_ep2_tp2_equals_one_process(dist_run, sp):
    dist_run(4, ep_case, 2, 2, sp, SHARED | dict(router_aux_loss_type="seq"), (2, 6))


def test_ep2_tp2_tokens_not_divisible_by_tp(dist_run):
    """One sequence of 5 tokens (as in decoding one token at a time): each TP rank runs the whole call."""
    dist_run(4, ep_case, 2, 2, False, SHARED, (1, 5))

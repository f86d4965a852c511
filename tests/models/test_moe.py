"""zoo's mixture-of-experts layer against references written here from the formulas of zoo/models/moe.py's
docstring: one token at a time, one ``nn.Linear`` per projection built from the layer's weights, fp32, one process.
Also the config (which layers are sparse, refusals, dicts), the parameter counts against transformers' models
built on the meta device, and the whole tiny-moe model (training step, generation with and without the KV cache).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from tests.parallel.helpers import assert_close, gen
from zoo.models.generate import Generator
from zoo.models.gpt import _ADDED_FIELDS, PRESETS, GPTConfig, GPTLoss, ParallelOptions, layer_specs
from zoo.models.moe import GPTMoE, GroupedExperts, capacity_keep
from zoo.models.specs import SpecSequential

B, S, H = 2, 6, 16
BASE = dict(vocab_size=64, hidden_size=H, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
            normalization="rmsnorm", activation="swiglu", add_bias=False, position_embedding_type="rope",
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, initializer_range=0.3,
            router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
CASES = {
    "mixtral": {},  # softmax, renormalised
    "qwen2-shared-gate": dict(norm_topk_prob=False, num_shared_experts=1, shared_expert_intermediate_size=20,
                              shared_expert_gate=True),
    "deepseek-v3": dict(scoring_func="sigmoid", n_group=4, topk_group=2, moe_expert_bias=True,
                        routed_scaling_factor=2.5, num_experts_per_tok=3, num_shared_experts=2,
                        router_aux_loss_type="seq"),
    "deepseek-v2": dict(n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.5,
                        num_experts_per_tok=3),
    "sigmoid-not-normalised": dict(scoring_func="sigmoid", norm_topk_prob=False, router_aux_loss_type="seq"),
    "gelu-top1": dict(activation="gelu", num_experts_per_tok=1),
    "capacity": dict(capacity_factor=1.0),
    "capacity-ties": dict(capacity_factor=1.0, num_experts_per_tok=1),  # weights all 1: drops go by token order
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def moe_config(**overrides) -> GPTConfig:
    return GPTConfig(**{**BASE, **overrides})


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return layer


class Reference(nn.Module):
    """The layer as the formulas read: a loop over tokens, a sorted() for every choice, a plain MLP per expert."""

    def __init__(self, cfg: GPTConfig, moe: GPTMoE):
        super().__init__()
        self.cfg, self.swiglu = cfg, cfg.activation == "swiglu"
        self.router = _linear(moe.router.weight)
        self.bias = None if moe.router.expert_bias is None else moe.router.expert_bias.clone()
        w1 = moe.experts.gate_up_proj if self.swiglu else moe.experts.up_proj
        self.experts = nn.ModuleList(self._mlp(w1[e], moe.experts.down_proj[e]) for e in range(cfg.num_experts))
        self.shared = self.shared_gate = None
        if moe.shared_expert is not None:
            self.shared = self._mlp(moe.shared_expert.gate_up_proj, moe.shared_expert.down_proj)
        if moe.shared_expert_gate is not None:
            self.shared_gate = _linear(moe.shared_expert_gate.weight)

    def _mlp(self, w1, w2) -> nn.ModuleDict:
        if self.swiglu:
            gate, up = w1.chunk(2, dim=0)
            return nn.ModuleDict(dict(gate=_linear(gate), up=_linear(up), down=_linear(w2)))
        return nn.ModuleDict(dict(fc1=_linear(w1), fc2=_linear(w2)))

    def run_mlp(self, m, x):
        if self.swiglu:
            return m["down"](F.silu(m["gate"](x)) * m["up"](x))
        return m["fc2"](F.gelu(m["fc1"](x), approximate="tanh"))

    def choose(self, scores, bias=True, groups=True) -> list[int]:
        c = self.cfg
        choice = scores.detach() + (self.bias if bias and self.bias is not None else 0)
        candidates = range(c.num_experts)
        if groups and c.n_group > 1:
            per = c.num_experts // c.n_group

            def group_score(g):
                members = sorted(choice[g * per:(g + 1) * per].tolist(), reverse=True)
                return sum(members[:2]) if c.scoring_func == "sigmoid" else members[0]

            best = sorted(range(c.n_group), key=lambda g: -group_score(g))[: c.topk_group]
            candidates = [e for g in best for e in range(g * per, (g + 1) * per)]
        return sorted(candidates, key=lambda e: -choice[e].item())[: c.num_experts_per_tok]

    def route(self, x_t):
        """One token [h] -> (chosen experts, their weights [k], logits [E], probabilities for the aux loss [E])."""
        logits = self.router(x_t)
        scores = logits.sigmoid() if self.cfg.scoring_func == "sigmoid" else logits.softmax(-1)
        chosen = self.choose(scores)
        w = scores[chosen]
        if self.cfg.norm_topk_prob:
            w = w / w.sum()
        return chosen, w * self.cfg.routed_scaling_factor, logits, scores / scores.sum()

    def forward(self, x):
        c, E, k = self.cfg, self.cfg.num_experts, self.cfg.num_experts_per_tok
        b, s, h = x.shape
        xs = x.reshape(b * s, h)
        T = b * s
        routes = [self.route(xs[t]) for t in range(T)]
        assignments = [(t, e, routes[t][1][j]) for t in range(T) for j, e in enumerate(routes[t][0])]
        kept = assignments
        if c.capacity_factor is not None:
            capacity = math.ceil(c.capacity_factor * T * k / E)
            kept = []
            for e in range(E):
                mine = sorted((a for a in assignments if a[1] == e), key=lambda a: (-a[2].item(), a[0]))
                kept += mine[:capacity]
        outs = [torch.zeros(h) for _ in range(T)]
        for t, e, w in kept:
            outs[t] = outs[t] + w * self.run_mlp(self.experts[e], xs[t])
        for t in range(T):
            if self.shared is not None:
                shared = self.run_mlp(self.shared, xs[t])
                if self.shared_gate is not None:
                    shared = torch.sigmoid(self.shared_gate(xs[t])) * shared
                outs[t] = outs[t] + shared
        counts = torch.zeros(E)
        for _t, e, _ in assignments:
            counts[e] += 1

        def balance(tokens):  # E * sum_e f_e P_e over these tokens
            f = torch.zeros(E)
            for t in tokens:
                for e in routes[t][0]:
                    f[e] += 1.0 / (len(tokens) * k)
            p = torch.stack([routes[t][3] for t in tokens]).mean(0)
            return E * (f * p).sum()

        if c.router_aux_loss_type == "global":
            aux = balance(range(T))
        else:
            aux = torch.stack([balance(range(i * s, (i + 1) * s)) for i in range(b)]).mean()
        z = torch.stack([torch.logsumexp(routes[t][2], 0) ** 2 for t in range(T)]).mean()
        return torch.stack(outs).view(b, s, h), aux, z, counts, 1 - len(kept) / len(assignments), routes


def _ref_grads(ref: Reference, moe: GPTMoE):
    """The reference's gradients in zoo's layout: (zoo parameter, expected gradient) pairs. An expert no token
    chose has no gradient in the reference, zero in zoo (which runs every expert, on no rows)."""
    g = lambda lin: torch.zeros_like(lin.weight) if lin.weight.grad is None else lin.weight.grad
    cat = lambda m: torch.cat([g(m["gate"]), g(m["up"])]) if ref.swiglu else g(m["fc1"])
    down = lambda m: g(m["down"]) if ref.swiglu else g(m["fc2"])
    pairs = [(moe.router.weight, ref.router.weight.grad),
             (getattr(moe.experts, moe.experts.w1_name), torch.stack([cat(m) for m in ref.experts])),
             (moe.experts.down_proj, torch.stack([down(m) for m in ref.experts]))]
    if ref.shared is not None:
        pairs += [(moe.shared_expert.gate_up_proj, cat(ref.shared)), (moe.shared_expert.down_proj, down(ref.shared))]
    if ref.shared_gate is not None:
        pairs.append((moe.shared_expert_gate.weight, ref.shared_gate.weight.grad))
    return pairs


def build(cfg: GPTConfig, seed: int = 0) -> GPTMoE:
    torch.manual_seed(seed)
    moe = GPTMoE(cfg, ParallelOptions())
    if moe.router.expert_bias is not None:  # as if balanced for a while: it changes some tokens' choices
        moe.router.expert_bias.copy_(torch.randn(cfg.num_experts, generator=gen(5)) * 0.3)
    return moe


@pytest.mark.parametrize("case", list(CASES))
def test_layer_equals_reference(case):
    cfg = moe_config(**CASES[case])
    moe = build(cfg)
    ref = Reference(cfg, moe)
    x = torch.randn(B, S, H, generator=gen(1))
    dy = 0.1 * torch.randn(B, S, H, generator=gen(2))  # keeps every gradient O(1), where 1e-6 is fp32 noise
    x_zoo, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()

    moe.aux_loss_scale = 0.5  # e.g. 1 / gradient-accumulation steps
    y = moe(x_zoo)
    (y * dy).sum().backward()  # the router losses are not in this loss: the autograd Function injects them

    y_ref, aux, z, counts, dropped, routes = ref(x_ref)
    router_loss = 0.5 * (cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z)
    loss_grad = torch.autograd.grad(router_loss, ref.router.weight, retain_graph=True)[0]
    assert loss_grad.abs().max() > 1e-4  # the router losses move the router: their gradient is checked below
    ((y_ref * dy).sum() + router_loss).backward()

    assert_close(y, y_ref, "output")
    assert y_ref.abs().max() > 0.1
    assert_close(x_zoo.grad, x_ref.grad, "input grad")
    for param, expected in _ref_grads(ref, moe):
        assert_close(param.grad, expected, "weight grad")
    stats = moe.last_stats
    assert_close(stats["aux_loss"], aux.detach(), "aux loss")
    assert_close(stats["z_loss"], z.detach(), "z loss")
    assert torch.equal(stats["tokens_per_expert"], counts)
    assert abs(stats["dropped_fraction"].item() - dropped) < 1e-7

    # Each case's feature changes the result, so a layer that skipped it would have failed above.
    scores = [r[2].sigmoid() if cfg.scoring_func == "sigmoid" else r[2].softmax(-1) for r in routes]
    if cfg.capacity_factor is not None:
        assert dropped > 0
    if cfg.n_group > 1:
        assert any(ref.choose(sc, groups=False) != r[0] for sc, r in zip(scores, routes))
    if cfg.moe_expert_bias:
        assert any(ref.choose(sc, bias=False) != r[0] for sc, r in zip(scores, routes))


def test_expert_bias_chooses_but_does_not_weigh():
    cfg = moe_config(scoring_func="sigmoid", moe_expert_bias=True)
    moe = build(cfg)
    with torch.no_grad():
        moe.router.expert_bias.zero_()
        moe.router.expert_bias[3] = 10.0
    tokens = torch.randn(12, H, generator=gen(3))
    route = moe.router(tokens, torch.zeros(12, dtype=torch.long), 1)
    assert (route.indices == 3).any(-1).all()  # the bias picks expert 3 for every token ...
    scores = torch.sigmoid(tokens @ moe.router.weight.detach().T)
    chosen = scores.gather(1, route.indices)
    assert_close(route.weights, chosen / chosen.sum(-1, keepdim=True), "weights")  # ... but weighs it by its score


def test_update_expert_bias_and_buffer():
    cfg = moe_config(moe_expert_bias=True, expert_bias_update_rate=0.01)
    moe = build(cfg)
    before = moe.router.expert_bias.clone()
    load = torch.tensor([5, 1, 3, 3, 0, 9, 2, 1])
    moe.update_expert_bias(load)
    expected = 0.01 * torch.sign(load.float().mean() - load.float())  # mean 3: experts 2, 3 unchanged
    assert_close(moe.router.expert_bias - before, expected, "bias step")
    assert expected[2] == 0 and expected[5] < 0 and expected[4] > 0
    assert "router.expert_bias" in moe.state_dict()  # persistent: a checkpoint carries it
    moe.to(torch.bfloat16)
    assert moe.router.weight.dtype == torch.bfloat16 and moe.router.expert_bias.dtype == torch.float32
    with pytest.raises(ValueError, match="moe_expert_bias=True"):
        build(moe_config()).update_expert_bias(load)


def test_capacity_keeps_highest_weights_ties_by_token():
    experts = torch.tensor([0, 1, 0, 2, 0, 1, 1, 0])  # 4 tokens x k=2, token-major
    weights = torch.tensor([0.5, 0.5, 0.9, 0.1, 0.5, 0.5, 0.7, 0.3])
    keep = capacity_keep(experts, weights, 3, capacity=2)
    expected = set()
    for e in range(3):
        mine = sorted((i for i in range(8) if experts[i] == e), key=lambda i: (-weights[i].item(), i // 2))
        expected |= set(mine[:2])
    assert keep.nonzero().flatten().tolist() == sorted(expected)
    assert keep[0] and not keep[4]  # expert 0: 0.9 (token 1), then 0.5 of token 0 before 0.5 of token 2


def test_parameters_are_marked_and_ep_slices_the_master():
    cfg = moe_config()
    full = build(cfg)
    for p in (full.experts.gate_up_proj, full.experts.down_proj):
        assert p.expert_parallel and p.partition_dim == 0 and p.num_experts == 8
    assert not hasattr(full.router.weight, "expert_parallel")
    assert full.experts.gate_up_proj.shape == (8, 24, H) and full.experts.down_proj.shape == (8, H, 12)
    std = cfg.initializer_range
    assert abs(full.experts.gate_up_proj.std().item() - std) < 0.02
    assert abs(full.experts.down_proj.std().item() - std / math.sqrt(2 * cfg.num_hidden_layers)) < 0.02
    # at ep=2 with the same seed, rank 1 holds experts 4..7 of the ep=1 layer, in storage of their own: a view
    # into the [E, ...] master would keep all E experts' memory alive on every rank
    make = dict(swiglu=True, init_method=nn.init.normal_, output_init_method=nn.init.normal_)
    torch.manual_seed(0)
    one = GroupedExperts(8, H, 12, **make)
    torch.manual_seed(0)
    half = GroupedExperts(8, H, 12, ep_rank=1, ep_size=2, **make)
    for name in ("gate_up_proj", "down_proj"):
        p, master = getattr(half, name), getattr(one, name)
        assert torch.equal(p, master[4:]) and p.untyped_storage().nbytes() == p.numel() * p.element_size()


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------


def test_which_layers_are_sparse():
    cfg = GPTConfig.from_preset("tiny-moe", num_hidden_layers=8, first_k_dense_replace=2, decoder_sparse_step=2,
                                mlp_only_layers=[5])
    assert [i for i in range(8) if cfg.is_moe_layer(i)] == [3, 7]  # odd layers, from 2 on, not 5
    assert [i for i in range(4) if GPTConfig.from_preset("tiny-moe-shared").is_moe_layer(i)] == [1, 3]
    assert not any(GPTConfig.from_preset("tiny-llama").is_moe_layer(i) for i in range(4))
    model = SpecSequential(layer_specs(GPTConfig.from_preset("tiny-moe-shared")))
    assert [type(model._funcs[i + 1].mlp).__name__ for i in range(4)] == ["GPTMLP", "GPTMoE", "GPTMLP", "GPTMoE"]


@pytest.mark.parametrize("overrides, match", [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok \(top-k\) 9 must be between 1 and num_experts 8"),
    (dict(n_group=3), "n_group 3 does not divide num_experts 8"),
    (dict(n_group=4, topk_group=5), "topk_group 5 must be between 1 and n_group 4"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3),
     "topk_group 1 groups of 2 experts hold fewer than num_experts_per_tok 3"),
    (dict(scoring_func="relu"), "scoring_func must be 'softmax' or 'sigmoid', got 'relu'"),
    (dict(add_bias=True), r"MoE layers have no biases .* set add_bias=False"),
    (dict(router_aux_loss_type="batch"), "router_aux_loss_type must be 'global' or 'seq'"),
    (dict(shared_expert_gate=True), "need num_shared_experts > 0"),
    (dict(capacity_factor=0.0), "capacity_factor must be > 0 or null"),
    (dict(qk_norm="rms"), "qk_norm must be null, 'head' or 'full'"),
    (dict(hidden_size=18, num_attention_heads=4), r"not divisible by num_attention_heads 4 \(or set head_dim\)"),
])
def test_config_refusals(overrides, match):
    with pytest.raises(ValueError, match=match):
        moe_config(**overrides)


def test_layout_refusals():
    with pytest.raises(ValueError, match="num_experts 8 is not divisible by ep 3"):
        moe_config().check_layout(1, ep=3)
    with pytest.raises(ValueError, match="ep 2 needs a mixture-of-experts model"):
        GPTConfig.from_preset("tiny").check_layout(1, ep=2)
    moe_config(intermediate_size=25, num_hidden_layers=2).check_layout(2)  # no dense MLP: its width may be odd
    with pytest.raises(ValueError, match="intermediate_size 25 is not divisible by tp 2"):
        moe_config(intermediate_size=25, decoder_sparse_step=2).check_layout(2)


def test_config_dicts():
    """Dense configs keep exactly their old keys (no MoE, head_dim or qk_norm keys); every preset round-trips."""
    new = set(_ADDED_FIELDS) | {"head_dim"}
    for name in PRESETS:
        cfg = GPTConfig.from_preset(name)
        d = cfg.to_dict()
        assert GPTConfig.from_dict(d) == cfg
        if cfg.num_experts == 0 and cfg.qk_norm is None:
            assert not set(d) & new, name
    d = GPTConfig.from_preset("qwen3-30b-a3b").to_dict()
    assert d["head_dim"] == 128 and d["qk_norm"] == "head" and d["num_experts"] == 128 and "n_group" not in d


# ---------------------------------------------------------------------------------------------------------------
# Parameter counts: zoo's formula, zoo's built model and transformers' model on the meta device
# ---------------------------------------------------------------------------------------------------------------


def _hf_common(cfg: GPTConfig) -> dict:
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
                num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
                tie_word_embeddings=cfg.tie_word_embeddings, num_experts_per_tok=cfg.num_experts_per_tok,
                rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta})


def hf_mixtral(cfg):
    return MixtralForCausalLM, MixtralConfig(**_hf_common(cfg), intermediate_size=cfg.expert_intermediate_size,
                                             num_local_experts=cfg.num_experts, router_jitter_noise=0.0)


def hf_qwen2_moe(cfg):
    return Qwen2MoeForCausalLM, Qwen2MoeConfig(
        **_hf_common(cfg), intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.expert_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_intermediate_size, num_experts=cfg.num_experts,
        decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
        norm_topk_prob=cfg.norm_topk_prob, qkv_bias=cfg.use_qkv_bias, use_sliding_window=False)


def hf_qwen3_moe(cfg):
    return Qwen3MoeForCausalLM, Qwen3MoeConfig(
        **_hf_common(cfg), intermediate_size=cfg.intermediate_size, moe_intermediate_size=cfg.expert_intermediate_size,
        num_experts=cfg.num_experts, head_dim=cfg.head_dim, decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=list(cfg.mlp_only_layers), norm_topk_prob=cfg.norm_topk_prob, attention_bias=False)


def hf_olmoe(cfg):
    return OlmoeForCausalLM, OlmoeConfig(**_hf_common(cfg), intermediate_size=cfg.expert_intermediate_size,
                                         num_experts=cfg.num_experts, norm_topk_prob=cfg.norm_topk_prob,
                                         pad_token_id=None, eos_token_id=None, bos_token_id=None)


def hf_counts(build_hf, cfg: GPTConfig) -> tuple[int, int]:
    """(total, active) of the HF model: active leaves out (E - k) / E of every routed-experts tensor."""
    cls, hf_cfg = build_hf(cfg)
    with torch.device("meta"):
        model = cls(hf_cfg)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    return total, total - routed * (E - k) // E


@pytest.mark.parametrize("preset, build_hf, published", [
    ("mixtral-8x7b", hf_mixtral, (46_702_792_704, 12_879_925_248)),
    ("qwen3-30b-a3b", hf_qwen3_moe, (30.5, 3.3)),  # billions, Qwen3-30B-A3B model card
    ("olmoe-1b-7b", hf_olmoe, (6.9, 1.3)),  # billions, OLMoE paper (arXiv 2409.02060)
    ("tiny-moe", hf_mixtral, None),
    ("tiny-moe-shared", hf_qwen2_moe, None),
])
def test_parameter_counts_match_transformers(preset, build_hf, published):
    cfg = GPTConfig.from_preset(preset)
    total, active = cfg.num_parameters(), cfg.num_parameters(active=True)
    assert (total, active) == hf_counts(build_hf, cfg)
    assert active < total
    if isinstance(published, tuple) and isinstance(published[0], int):
        assert (total, active) == published
    elif published:  # to the tenth of a billion: Qwen truncates (3.35 -> 3.3), OLMoE rounds (1.28 -> 1.3)
        for count, figure in zip((total, active), published):
            assert figure in (round(count / 1e9, 1), math.floor(count / 1e8) / 10), (count, figure)


@pytest.mark.parametrize("preset, overrides", [("tiny-moe", {}), ("tiny-moe-shared", {}),
                                               ("tiny-moe", dict(qk_norm="head", head_dim=24)),
                                               ("tiny-moe", dict(qk_norm="full", activation="gelu"))])
def test_built_model_has_the_counted_parameters(preset, overrides):
    cfg = GPTConfig.from_preset(preset, **overrides)
    model = SpecSequential(layer_specs(cfg))
    padding = (cfg.padded_vocab_size() - cfg.vocab_size) * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    assert sum(p.numel() for p in model.parameters()) - padding == cfg.num_parameters()


# ---------------------------------------------------------------------------------------------------------------
# The whole model
# ---------------------------------------------------------------------------------------------------------------


def randomized_model(cfg: GPTConfig, seed: int = 0) -> SpecSequential:
    """Weights moved off their init (std 0.02 gives near-uniform routing and logits): routing and tokens vary."""
    model = SpecSequential(layer_specs(cfg)).eval()
    g = gen(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.15
            p.copy_(1.0 + noise if "norm" in name else noise)
    return model


def test_tiny_moe_trains_in_one_process():
    cfg = GPTConfig.from_preset("tiny-moe", router_aux_loss_coef=0.01, router_z_loss_coef=1e-3)
    model = SpecSequential(layer_specs(cfg))
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=gen(0))
    loss = GPTLoss(cfg)(model(ids[:, :-1]), ids[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if ".mlp." in name:
            assert p.grad.abs().max() > 0, name
    stats = model._funcs[1].mlp.last_stats
    assert stats["tokens_per_expert"].sum() == 2 * 16 * cfg.num_experts_per_tok


@pytest.mark.parametrize("overrides", [{}, dict(qk_norm="head", head_dim=24), dict(qk_norm="full")],
                         ids=["tiny-moe", "qk-norm-head", "qk-norm-full"])
def test_generation_with_cache_equals_without(overrides):
    model = randomized_model(GPTConfig.from_preset("tiny-moe", **overrides))
    generator = Generator(model)
    ids = torch.randint(0, 512, (2, 7), generator=gen(4))
    with torch.no_grad():
        full = model(ids)[..., :512]
    caches = generator.new_caches(2, ids.shape[1])
    with torch.inference_mode():
        for start, stop in [(0, 4)] + [(t, t + 1) for t in range(4, 7)]:
            got = generator.logits(ids[:, start:stop], caches)
            assert (got - full[:, stop - 1]).abs().max() < 1e-5
    cached = generator.generate(ids, max_new_tokens=10).new_tokens
    uncached = generator.generate(ids, max_new_tokens=10, use_cache=False).new_tokens
    assert torch.equal(cached, uncached)
    assert len(set(cached.flatten().tolist())) > 2

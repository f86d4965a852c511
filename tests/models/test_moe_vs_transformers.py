"""zoo's MoE GPTs compute what transformers' Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE compute, given the same
weights: small random HF models, copied into zoo through a key table written here (test_gpt_vs_transformers'
Llama table for attention and norms, plus rows for the router, the fused experts, the shared expert and its gate
and the q/k norms), logits compared. One process, tp=1.

These models exercise what the formula tests cannot: HF's own routing (softmax top-k, renormalised or not), q/k
RMSNorm per head with head_dim != hidden/heads (Qwen3) or over the whole projection (OLMoE), dense and sparse
blocks mixed (decoder_sparse_step).
"""

from __future__ import annotations

import pytest
import torch

from tests.models.test_gpt_vs_transformers import LOGITS_ATOL, VOCAB, load_from_hf, max_logit_diff, randomize_, \
    token_ids
from tests.models.test_moe import hf_mixtral, hf_olmoe, hf_qwen2_moe, hf_qwen3_moe
from zoo.convert.hf_gpt import Row, llama_table, same
from zoo.models.gpt import GPTConfig, layer_specs
from zoo.models.specs import SpecSequential

SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2)
MODELS = {
    "mixtral": (hf_mixtral, dict()),
    "qwen2-moe": (hf_qwen2_moe, dict(qkv_bias=True, moe_intermediate_size=32, num_shared_experts=1,
                                     shared_expert_intermediate_size=48, shared_expert_gate=True, norm_topk_prob=False,
                                     decoder_sparse_step=2)),
    "qwen3-moe": (hf_qwen3_moe, dict(head_dim=24, qk_norm="head", moe_intermediate_size=32, rope_theta=1e6)),
    "olmoe": (hf_olmoe, dict(qk_norm="full", num_key_value_heads=4, norm_topk_prob=False)),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def moe_table(cfg: GPTConfig) -> list[Row]:
    """Llama's rows with the MLP rows kept for dense blocks only, and the MoE and q/k-norm rows."""
    h, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.expert_intermediate_size, cfg.shared_intermediate_size
    d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    layer = "model.layers.{}."
    dense, table = [], []
    for row in llama_table(cfg):
        (dense if ".mlp." in row.zoo else table).append(row)
    table += [r.at(i) for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i) for r in dense]

    def cat(gate, up):
        return torch.cat([gate, up], dim=0)

    moe = [
        Row("{}.mlp.router.weight", (layer + "mlp.gate.weight",), ((E, h),), same, same),
        Row("{}.mlp.experts.gate_up_proj", (layer + "mlp.experts.gate_up_proj",), ((E, 2 * I, h),), same, same),
        Row("{}.mlp.experts.down_proj", (layer + "mlp.experts.down_proj",), ((E, h, I),), same, same),
    ]
    if cfg.num_shared_experts:
        shared = layer + "mlp.shared_expert."
        moe += [Row("{}.mlp.shared_expert.gate_up_proj", (shared + "gate_proj.weight", shared + "up_proj.weight"),
                    ((Is, h), (Is, h)), cat, lambda w: tuple(w.chunk(2))),
                Row("{}.mlp.shared_expert.down_proj", (shared + "down_proj.weight",), ((h, Is),), same, same)]
    if cfg.shared_expert_gate:
        moe.append(Row("{}.mlp.shared_expert_gate.weight", (layer + "mlp.shared_expert_gate.weight",), ((1, h),),
                       same, same))
    table += [r.at(i) for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i) for r in moe]
    if cfg.qk_norm is not None:
        q, k = (d, d) if cfg.qk_norm == "head" else (nq * d, nkv * d)
        table += [Row("{}.attention.q_norm.weight", (layer + "self_attn.q_norm.weight",), ((q,),), same, same),
                  Row("{}.attention.k_norm.weight", (layer + "self_attn.k_norm.weight",), ((k,),), same, same)]
    return table


def pair(name: str, seed: int = 0):
    build_hf, overrides = MODELS[name]
    cfg = GPTConfig.from_preset("tiny-llama", **{**SMALL, **overrides})
    cls, hf_cfg = build_hf(cfg)
    torch.manual_seed(seed)
    hf = cls(hf_cfg).eval()
    randomize_(hf, seed)
    model = SpecSequential(layer_specs(cfg)).eval()
    load_from_hf(model, hf, moe_table(cfg), cfg)
    return hf, model, cfg


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match(name):
    hf, model, cfg = pair(name)
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_parameters()
    assert max_logit_diff(model, hf, cfg, token_ids()) < LOGITS_ATOL


def test_routing_matters():
    """Guards the comparison: with the renormalisation flipped zoo's logits leave HF's."""
    hf, model, cfg = pair("mixtral")
    for block in model._funcs[1:-2]:
        block.mlp.router.norm_topk_prob = False
    assert max_logit_diff(model, hf, cfg, token_ids()) > 1e-2

"""zoo's MoE GPTs compute what transformers' Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE compute, given the same
weights: small random HF models, copied into zoo through the adapters' own key table (``zoo.convert.hf.moe``'s, in
the fused layout transformers holds in memory: Llama's rows for attention and norms, plus the router, the fused
experts, the shared expert and its gate and the q/k norms), logits compared. One process, tp=1.

These models exercise what the formula tests cannot: HF's own routing (softmax top-k, renormalised or not), q/k
RMSNorm per head with head_dim != hidden/heads (Qwen3) or over the whole projection (OLMoE), dense and sparse
blocks mixed (decoder_sparse_step).
"""

from __future__ import annotations

import pytest
import torch

from tests.models.test_gpt_vs_transformers import (
    LOGITS_ATOL,
    VOCAB,
    load_from_hf,
    max_logit_diff,
    randomize_,
    token_ids,
)
from tests.models.test_moe import hf_mixtral, hf_olmoe, hf_qwen2_moe, hf_qwen3_moe
from zoo.convert.hf.moe import FUSED, moe_table
from zoo.models.gpt import GPTConfig, layer_specs
from zoo.models.specs import SpecSequential

SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2)
MODELS = {
    "mixtral": (hf_mixtral, dict()),  # name: (HF builder, zoo config beyond SMALL)
    "qwen2-moe": (hf_qwen2_moe, dict(qkv_bias=True, moe_intermediate_size=32, num_shared_experts=1,
                                     shared_expert_intermediate_size=48, shared_expert_gate=True, norm_topk_prob=False,
                                     decoder_sparse_step=2)),
    "qwen3-moe": (hf_qwen3_moe, dict(head_dim=24, qk_norm="head", moe_intermediate_size=32, rope_theta=1e6)),
    "olmoe": (hf_olmoe, dict(qk_norm="full", num_key_value_heads=4, norm_topk_prob=False)),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def pair(name: str, seed: int = 0):
    build_hf, overrides = MODELS[name]
    cfg = GPTConfig.from_preset("tiny-llama", **{**SMALL, **overrides})
    cls, hf_cfg = build_hf(cfg)
    torch.manual_seed(seed)
    hf = cls(hf_cfg).eval()
    randomize_(hf, seed)
    model = SpecSequential(layer_specs(cfg)).eval()
    load_from_hf(model, hf, moe_table(cfg, type(hf).__name__, FUSED), cfg)
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
